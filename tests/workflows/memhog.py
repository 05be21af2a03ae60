"""A tiny workflow for the out-of-memory test: a counter "trained" one step at a time,
checkpointed every step, whose worker allocates memory without bound at ``hog_at_step`` (until
Ray's memory monitor kills it), or raises at ``fail_at_step``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from m2flow import Worker, group_method
from m2flow.run.recipe import (
    Checkpoints,
    ClusterConfig,
    TrainerConfig,
    start_cluster,
    validate_trainer,
)


class Counter(Worker):
    def __init__(self) -> None:
        self.value = 0

    @group_method
    def step(self, hog: bool, fail: bool = False) -> int:
        if fail:
            raise ValueError(f"counter-broke-at-step-{self.value + 1}")
        if hog:
            blocks = []
            for _ in range(64):  # 16 GiB at most: the memory monitor acts well before
                blocks.append(bytearray(256 * 2**20))
                blocks[-1][::4096] = b"\x01" * len(blocks[-1][::4096])  # touch every page
                time.sleep(0.02)
        self.value += 1
        return self.value

    @group_method
    def save_checkpoint(self, path: str) -> None:
        from pathlib import Path

        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "value").write_text(str(self.value))

    @group_method
    def load_checkpoint(self, path: str) -> None:
        from pathlib import Path

        self.value = int((Path(path) / "value").read_text())


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(steps=4, save_every=1, run_dir="runs/memhog")
    )
    hog_at_step: int = 0  # 0: never
    fail_at_step: int = 0  # 0: never
    resume: bool = False


def validate(cfg) -> None:
    validate_trainer(cfg.trainer, cfg.resume)


def main(cfg) -> dict:
    from m2flow.run.runlog import RunLog

    tr = cfg.trainer
    cluster = start_cluster(cfg.cluster, tr.run_dir)
    counter = Counter.launch(cluster, name="counter")
    checkpoints = Checkpoints(tr.run_dir)
    start = checkpoints.restore({"counter": counter})[0] if cfg.resume else 0
    with RunLog(tr.run_dir, tr.steps) as log:
        for step in range(start + 1, tr.steps + 1):
            value = counter.step(step == cfg.hog_at_step, step == cfg.fail_at_step).wait()[0]
            checkpoints.save(step, {"counter": counter})
            log.log(step, {"value": value})
    cluster.shutdown()
    return {"value": value}
