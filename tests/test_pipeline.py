"""Bounded staleness at run time (issue 32 item 1): ``StepPipeline`` runs a runner's unchanged
step with up to K + 1 steps in flight; what the step threads issue reaches each group and
channel in step order (so channel epochs stay steps); partial rollouts load weights beside the
running generate call.

The workers below force the overlap by order, not by timing: the trainer of step m does not
return before the rollout of step m + 1 has *started* (it waits for that step's "started"
item), which only a pipeline can give; with partial rollouts the rollout of a later step does
not return before a weight update has reached it mid-call.
"""

from __future__ import annotations

import threading

import pytest
import torch

from m2flow import Channel, Worker, group_method, sync_weights
from m2flow.core import ordering
from m2flow.core.ordering import StepOrderError
from m2flow.run.pipeline import StepPipeline

pytestmark = pytest.mark.e2e
PROMPTS = 3  # items per step
FIRST = 1


class Rollout(Worker):
    """Tags every item with the weight version it was "sampled" with."""

    def __init__(self) -> None:
        self.weight_version, self.live_loads = 0, []
        self._loaded = threading.Condition()

    @group_method(collect="rank0")
    def generate(self, prompts: Channel, out: Channel, started: Channel, wait_update: bool):
        items = prompts.get_batch(PROMPTS, max_items=PROMPTS)
        step = items[0]["step"]
        with self._loaded:
            seen = len(self.live_loads)
        started.put({"step": step})
        first_version = self.weight_version
        if wait_update and step >= FIRST + 2:  # partial rollouts: step - 1's update arrives
            with self._loaded:  # mid-call (its trainer waits for this call to start)
                ok = self._loaded.wait_for(lambda: len(self.live_loads) > seen, timeout=60)
            assert ok, f"step {step}: no weight update reached the running generate call"
        for it in items:
            out.put({"step": it["step"], "version": first_version, "last": self.weight_version})
        return {"step": step, "steps": [it["step"] for it in items], "version": first_version}

    def load_weights(self, weights: dict, version: int) -> None:
        with self._loaded:
            if self._m2flow_in_call:
                self.live_loads.append(version)
                self._loaded.notify_all()

    @group_method(collect="rank0")
    def loads(self) -> list:
        return list(self.live_loads)


class Trainer(Worker):
    def __init__(self) -> None:
        self.weight_version = 0

    @group_method(collect="rank0")
    def train(self, inp: Channel, started: Channel, last: int) -> dict:
        got = [it for batch in inp.stream() for it in batch]
        step = got[0]["step"]
        while FIRST < step < last:  # the next step's rollout starts before this update ends
            if started.get(timeout=60)["step"] > step:
                break
        trained_at = self.weight_version
        self.weight_version += 1
        return {
            "steps": sorted({it["step"] for it in got}),
            "lags": [trained_at - it["version"] for it in got],
            "trained_at": trained_at,
            "updated_mid_call": all(it["last"] > it["version"] for it in got),
        }

    def get_weights(self) -> dict:
        return {"w": torch.full((2,), float(self.weight_version))}


@pytest.fixture(scope="module")
def groups(cluster):
    return Rollout.launch(cluster, [0], name="prollout"), Trainer.launch(
        cluster, [1], name="ptrain"
    )


def runner(groups, last: int, wait_update: bool = False):
    """A runner's step, as workflows/grpo.py writes one (and what each step returned)."""
    rollout, trainer = groups
    prompts, rollouts, started = (Channel.create(f"p-{n}") for n in ("prompts", "out", "go"))
    results, order = {}, []

    def step(n: int) -> dict:
        prompts.put_many([{"step": n, "i": i} for i in range(PROMPTS)])
        gen = rollout.generate(prompts, rollouts, started, wait_update)
        upd = trainer.train(rollouts, started, last)
        g, a = gen.wait(), upd.wait()
        return {"gen": g, "train": a, "version": sync_weights(trainer, rollout)}

    def done(n: int, out: dict) -> None:
        order.append(n)
        results[n] = out

    return step, done, results, order, (prompts, rollouts, started)


def close(channels) -> None:
    for ch in channels:
        ch.close()


@pytest.mark.parametrize("k", [1, 2])
def test_steps_overlap_within_the_bound_and_epochs_stay_steps(groups, k):
    steps = range(FIRST, FIRST + 7)
    rollout, trainer = groups
    base = trainer.get_weights().wait()[0]["w"][0].item()  # versions continue across tests
    step, done, results, order, chans = runner(groups, steps[-1])
    pipe = StepPipeline(k)
    try:
        pipe.run(steps, step, done)
    finally:
        close(chans)
    assert order == list(steps)  # records in step order
    for n in steps:
        out = results[n]
        assert not out["train"]["updated_mid_call"]  # no partial rollouts: queued behind
        assert out["gen"]["steps"] == [n] * PROMPTS  # the rollout took its own step's prompts
        assert out["train"]["steps"] == [n]  # the update read exactly its step's epoch
        assert max(out["train"]["lags"]) <= k, (n, out["train"]["lags"])
    lags = [max(results[n]["train"]["lags"]) for n in steps]
    assert lags[0] == 0  # the first step runs alone
    assert max(lags) >= 1  # the trainer waited for the next rollout to start: it overlapped
    assert results[steps[-1]]["version"] == base + len(steps)


def test_k0_is_one_step_at_a_time(groups):
    steps = range(FIRST, FIRST + 3)
    calls = []

    def step(n):
        calls.append(("step", n))
        return n * 10

    StepPipeline(0).run(steps, step, lambda n, r: calls.append(("done", n, r)))
    assert calls == [("step", 1), ("done", 1, 10), ("step", 2), ("done", 2, 20),
                     ("step", 3), ("done", 3, 30)]  # fmt: skip


def test_partial_rollouts_load_weights_into_the_running_generate(groups):
    rollout, trainer = groups
    before = len(rollout.loads().wait())
    steps = range(FIRST, FIRST + 4)
    step, done, results, order, chans = runner(groups, steps[-1], wait_update=True)
    try:
        StepPipeline(1, partial=True).run(steps, step, done)
    finally:
        close(chans)
    live = rollout.loads().wait()[before:]
    assert len(live) >= len(steps) - 2  # steps 3.. each waited for one mid-call
    for n in steps[2:]:  # the update landed mid-call: the rollout's last items saw it
        assert results[n]["train"]["updated_mid_call"], n
        assert max(results[n]["train"]["lags"]) <= 1


def test_a_failing_step_is_raised_and_stops_the_others(groups):
    started = []

    def step(n):
        started.append(n)
        if n == 2:
            raise ValueError("step-two-broke")
        return n

    with pytest.raises(ValueError, match="step-two-broke"):
        StepPipeline(2).run(range(1, 10), step, lambda n, r: None)
    assert max(started) <= 1 + 2 + 1  # nothing admitted beyond the bound after the failure


def test_admission_waits_for_the_bound_and_flushes():
    """Step m starts only after step m - K - 1's record; nothing passes a flush step."""
    k, events, lock = 1, [], threading.Lock()

    def step(n):
        with lock:
            events.append(("start", n))
        return n

    def done(n, _):
        with lock:
            events.append(("done", n))

    StepPipeline(k, flush_at=lambda n: n == 4).run(range(1, 9), step, done)
    pos = {e: i for i, e in enumerate(events)}
    for n in range(2, 9):
        assert pos["done", 1] < pos["start", n]  # the first step runs alone
        if n - k - 1 >= 1:
            assert pos["done", n - k - 1] < pos["start", n]
    for n in range(5, 9):
        assert pos["done", 4] < pos["start", n]  # the flush


def test_a_step_issuing_more_than_the_first_is_an_error(groups):
    rollout, trainer = groups

    def step(n):
        for _ in range(1 if n == 1 else 2):  # irregular: more calls than the profiled step
            rollout.loads().wait()
        return n

    with pytest.raises(StepOrderError, match="the same number of times every step"):
        StepPipeline(1).run(range(1, 4), step, lambda n, r: None)
    assert ordering._active is None  # the run's order is cleared after a failure


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_bad_bounds_are_refused(value):
    with pytest.raises(ValueError, match="max_staleness"):
        StepPipeline(value)
