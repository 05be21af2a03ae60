"""A tiny two-group workflow for the measured timeline: a generator feeds a trainer through a
channel, both on the same device (so they hand the device over, offloading each other), and
the trainer's weights go back to the generator after each step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from m2flow import Channel, Worker, group_method, sync_weights
from m2flow.run.recipe import ClusterConfig, TrainerConfig, start_cluster


class Gen(Worker):
    def __init__(self) -> None:
        self.w = 0.0

    @group_method
    def generate(self, out: Channel, items: int) -> None:
        for i in range(items):
            time.sleep(0.005)  # the "rollout" of one item
            out.put(float(i) + self.w)

    def load_weights(self, weights, version: int) -> None:
        self.w = weights["w"]

    def offload(self) -> None:
        time.sleep(0.002)

    def onload(self) -> None:
        time.sleep(0.002)


class Train(Worker):
    def __init__(self) -> None:
        self.w = 0.0
        self.weight_version = 0

    @group_method
    def train(self, inp: Channel, items: int) -> float:
        got = [inp.get() for _ in range(items)]
        time.sleep(0.01)  # the "update"
        self.w = sum(got) / len(got)
        self.weight_version += 1
        return self.w

    def get_weights(self) -> dict:
        return {"w": self.w}

    def offload(self) -> None:
        time.sleep(0.002)

    def onload(self) -> None:
        time.sleep(0.002)


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(steps=3, run_dir="runs/handoff")
    )
    per_step: int = 4


def main(cfg) -> dict:
    from m2flow.run.runlog import RunLog

    tr = cfg.trainer
    cluster = start_cluster(cfg.cluster, tr.run_dir)
    gen = Gen.launch(cluster, name="gen")
    train = Train.launch(cluster, name="train")
    items = Channel.create("handoff_items")
    with RunLog(tr.run_dir, tr.steps) as log:
        for step in range(1, tr.steps + 1):
            g = gen.generate(items, cfg.per_step)
            t = train.train(items, cfg.per_step)
            g.wait()
            w = t.wait()[0]
            sync_weights(train, gen)
            log.log(step, {"w": w}, echo=False)
    cluster.shutdown()
    return {"w": w}
