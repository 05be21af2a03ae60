"""A complete m2flow workflow in one file: a producer group squares numbers and streams them to
a consumer group that sums them, for a few steps.

    m2flow run docs/examples/squares.py trainer.steps=3
    m2flow run docs/examples/squares.py cluster.devices_per_node=2 \
        plan=docs/examples/squares_plan.yaml trainer.steps=3
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from m2flow.core.config import ConfigError
from m2flow.run.recipe import ClusterConfig, TrainerConfig, require, start_cluster


@dataclass
class WorkConfig:
    items_per_step: int = 8  # numbers squared per step
    seconds_per_item: float = 0.01  # pretend work per item


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    work: WorkConfig = field(default_factory=WorkConfig)
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(run_dir="runs/squares"))
    resume: bool = False


def validate(cfg) -> None:
    """Value checks the types cannot express; runs before anything starts."""
    require([(cfg.work.items_per_step >= 1, "work.items_per_step must be >= 1")])
    if cfg.resume:
        raise ConfigError("resume: this example keeps no checkpoints; run without --resume")


def main(cfg) -> dict:
    # Imported here, not at the top: loading the file for --show-config or the config checks
    # then starts nothing heavy. Worker classes may also live at the file's top level.
    from m2flow import Channel, Worker, group_method
    from m2flow.run.runlog import RunLog

    class Squarer(Worker):
        # One rank over all the group's devices; the default (True) is one rank per device,
        # each rank then taking its own share of the items.
        data_parallel = False

        @group_method
        def square(self, numbers: Channel, out: Channel, n: int, pause: float) -> None:
            chunk = self.chunk_size(default=n)  # the plan's granularity, else all at once
            batch = []
            for _ in range(n):
                x = numbers.get()
                time.sleep(pause)
                batch.append(x * x)
                if len(batch) == chunk:
                    out.put(batch, weight=len(batch))
                    batch = []
            if batch:
                out.put(batch, weight=len(batch))

    class Summer(Worker):
        data_parallel = False

        @group_method(collect="sum")
        def total(self, squares: Channel) -> int:
            # one list per get; reads until every producer of this step has returned
            return sum(sum(batch) for (batch,) in squares.stream())

    cluster = start_cluster(cfg.cluster, cfg.trainer.run_dir)
    squarer = Squarer.launch(cluster, name="squarer")  # devices come from the plan
    summer = Summer.launch(cluster, name="summer")
    numbers, squares = Channel.create("numbers"), Channel.create("squares")
    n = cfg.work.items_per_step
    with RunLog(cfg.trainer.run_dir, cfg.trainer.steps) as log:
        for step in range(1, cfg.trainer.steps + 1):
            numbers.put_many(list(range(n)))
            produced = squarer.square(numbers, squares, n, cfg.work.seconds_per_item)
            summed = summer.total(squares)
            produced.wait()
            total = summed.wait()  # the ranks' totals, summed (collect="sum")
            log.log(step, {"total": total, "summer_s": summed.time(busy=True)})
            log.advance(step)
    cluster.shutdown()
    return {"total": total}
