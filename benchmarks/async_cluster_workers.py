"""The emulated workers of ``benchmarks/async_cluster.py``: a rollout group whose ranks run
:class:`~m2flow.workers.rollout.emulated.EmulatedEngine` s, and a trainer that sleeps a modelled
training time. Real m2flow :class:`~m2flow.Worker` s: they run as Ray actors in WorkerGroups,
read and write real :class:`~m2flow.Channel` s and exchange (tiny) weights by
:func:`~m2flow.sync_weights`; only the GPU work is replaced by sleeping its modelled seconds
divided by ``time_scale`` (modelled seconds per real second).

**One rank stands for a DP group.** A rollout rank runs one engine (one TP-2 Qwen3 engine on
2 x H100) on that engine's share of the step: ``share`` responses (``share / 8`` prompts x 8
samples). The other ``scale - 1`` engines of its DP group get shares of the same size whose
lengths are other draws of the same distribution; they are not run, and the rank reports its
samples and tokens times ``scale``. That stands for them as long as every engine's share takes
about the same time: with >= 256 responses an engine and the 16K cap reached by ~4.5 % of
responses, every share has several responses at the cap, which set its end (``RLBoost``'s
spread of per-instance times comes from preemptions, absent here).

**Continuous batching and partial rollouts.** A rank keeps the first ``max_batch`` unfinished
requests of its queue running (as :func:`~m2flow.workers.rollout.emulated_rollout.
rollout_finish_times`, which builds the planner's profile: the same loop), one engine call of
``block`` tokens at a time. ``generate(step)`` returns once every response of ``step`` ended.
With ``partial=True``, slots the step's own requests leave free are filled with later steps'
requests: those already started (carried over from an earlier call) and, when the prompts of
the next step are already in the prompts channel (the pipeline put them: the step has started,
so its staleness bound admits it), new ones. They continue in later calls, across weight
updates (each token keeps the version that sampled it; the engine recomputes the KV cache of
the running requests after an update, as the ``hf`` engine does). Without it, a call runs its
own step's requests only.
"""

from __future__ import annotations

import time

import numpy as np
from m2flow.workers.rollout.emulated import EmulatedEngine, ResponseLengths, throughput_preset
from m2flow.workers.rollout.exact import GenRequest

from m2flow import Worker, group_method
from m2flow.core.methods import control_method

SAMPLES = 8  # responses per prompt (RLBoost section 6.1: 128 prompts x 8)


class EmuRollout(Worker):
    """A rollout rank (see the module docstring). Times in modelled seconds.

    Launched once and :meth:`configure` d per run (a launch costs tens of seconds here).

    Args (of :meth:`configure`):
        run: the run's name, the prefix of its channel keys.
        preset: :data:`~m2flow.workers.rollout.emulated.PRESETS` key.
        lengths: ``(median, sigma, cap)`` of the capped lognormal response length (tokens).
        share: prompts of each step this rank's engine takes (``share * 8`` responses).
        scale: engines this rank stands for (its DP group; may be fractional).
        partial: fill free slots with later steps' requests (module docstring).
        time_scale: modelled seconds per real second.
        max_batch, block, prompt_tokens: the engine's running requests, tokens per engine call,
            modelled prompt length.
    """

    def __init__(self) -> None:
        self.engine = None
        self.weight_version = 0

    @group_method
    def configure(self, run: str, preset: str, lengths: tuple, share: int, scale: float,
                  partial: bool, time_scale: float, seed: int = 0, max_batch: int = 256,
                  block: int = 256, prompt_tokens: int = 200) -> None:  # fmt: skip
        """Start run ``run`` (the channel keys' prefix) with a fresh engine at version 0."""
        median, sigma, cap = lengths
        self.run, self.cap, self.share, self.scale = run, int(cap), share, scale
        self.partial, self.max_batch, self.block = partial, max_batch, block
        self.prompt_tokens = prompt_tokens
        self.engine = EmulatedEngine(
            throughput_preset(preset), ResponseLengths(median, sigma, int(cap)), 1, 2, seed,
            time_scale, prompt_tokens=prompt_tokens, sleep=self._pace, version=0,
        )  # fmt: skip
        self._mark: float | None = None  # end of the last block's sleep (in a generate call)
        self._debt = 0.0  # real seconds of CPU the sleeps still owe
        self.weight_version = 0
        self.queued: dict[int, list[GenRequest]] = {}  # step -> its requests (started or not)

    def _pace(self, seconds: float) -> None:
        """Sleep a block's real seconds less the CPU spent since the last block (the engine's
        bookkeeping, this loop), so that a call's real time tracks its modelled time."""
        now = time.perf_counter()
        if self._mark is not None:
            self._debt += now - self._mark
        wait = seconds - self._debt
        self._debt = max(-wait, 0.0)
        if wait > 0:
            time.sleep(wait)
        self._mark = time.perf_counter()

    def _requests(self, step: int, prompts: list[int]) -> list[GenRequest]:
        base = self.rank * self.share
        return [GenRequest(f"{step}:{base + p}:{s}", [0], (step, base + p, s), self.cap)
                for p in prompts for s in range(SAMPLES)]  # fmt: skip

    def _fetch(self, prompts, step: int) -> bool:
        """Take ``step``'s prompts if they are in the channel (without waiting)."""
        key = (self.run, step, self.rank)
        if prompts.qsize(key) < self.share:
            return False
        got = prompts.get_batch(self.share, key=key)
        self.queued[step] = self._requests(step, got)
        return True

    @group_method
    def generate(self, prompts, out, step: int) -> dict:
        """Run ``step``'s responses to the end (with ``partial``, later steps' too, in free
        slots); put one summary item under key ``step`` on ``out``. Returns modelled seconds
        and counts."""
        t0, e0 = time.time(), self.engine.emulated_s
        self._mark, self._debt = time.perf_counter(), 0.0
        if step not in self.queued:
            got = prompts.get_batch(self.share, key=(self.run, step, self.rank))
            self.queued[step] = self._requests(step, got)
        mine = self.queued[step]
        ahead = step + 1  # the next step whose prompts may be fetched
        while ahead in self.queued:
            ahead += 1
        blocks = carried_in = 0
        carried_in = sum(len(r.tokens) > 0 for r in mine)
        while True:
            live = [r for r in mine if not r.done]
            if not live:
                break
            run = live[: self.max_batch]
            if self.partial and len(run) < self.max_batch:
                for s in sorted(k for k in self.queued if k > step):
                    run += [r for r in self.queued[s] if not r.done][: self.max_batch - len(run)]
                while len(run) < self.max_batch and self._fetch(prompts, ahead):
                    run += self.queued[ahead][: self.max_batch - len(run)]
                    ahead += 1
            self.engine.step(run, self.block)
            blocks += 1
        self._mark = None
        del self.queued[step]
        tokens, by_version = 0, {}
        for r in mine:
            tokens += len(r.tokens) + self.prompt_tokens
            for v, n in getattr(r.versions, "_runs", None) or [(r.weight_version, len(r.tokens))]:
                by_version[v] = by_version.get(v, 0) + n * self.scale
        out.put({"samples": len(mine) * self.scale, "tokens": tokens * self.scale,
                 "by_version": by_version}, key=(self.run, step))  # fmt: skip
        return {"modelled_s": self.engine.emulated_s - e0, "wall_s": time.time() - t0,
                "t0": t0, "t1": time.time(),
                "blocks": blocks, "carried_in": carried_in,
                "ahead": sum(len(v) for v in self.queued.values())}  # fmt: skip

    def load_weights(self, weights: dict, version: int) -> None:
        # between decode iterations; the running requests' KV caches are recomputed
        self.engine.update_weights(version, weights=weights)

    @control_method
    def pause(self) -> None:
        self.engine.pause()

    @control_method
    def resume(self) -> None:
        self.engine.resume()


class EmuTrainer(Worker):
    """The trainer: ``train(step)`` takes the step's summaries from the rollout and sleeps
    :func:`train_seconds` of their tokens; :meth:`get_weights` sleeps the modelled weight
    transfer ``sync_s`` (the sender's side; the receivers load a tiny array).

    Args (of :meth:`configure`):
        run: the run's name, the prefix of its channel keys.
        params: model parameters (P).
        gpus: the trainer's GPUs (G).
        sync_s: modelled seconds of one weight update.
        time_scale: modelled seconds per real second.
        mfu: model FLOP utilisation of training.
    """

    def __init__(self) -> None:
        self.weight_version = 0

    @group_method
    def configure(self, run: str, params: float, gpus: int, sync_s: float, time_scale: float,
                  mfu: float = 0.4) -> None:  # fmt: skip
        """Start run ``run`` at weight version 0."""
        self.run, self.params, self.gpus, self.sync_s = run, params, gpus, sync_s
        self.ts, self.mfu = time_scale, mfu
        self.weight_version = 0

    @group_method(collect="rank0")
    def train(self, results, step: int, parts: int) -> dict:
        """Train on ``step``'s ``parts`` summaries (one per rollout rank). Returns tokens, the
        modelled seconds and the staleness of the tokens (versions behind this update's)."""
        items = results.get_batch(parts, key=(self.run, step))
        t0 = time.time()
        tokens = sum(i["tokens"] for i in items)
        seconds = train_seconds(self.params, tokens, self.gpus, self.mfu)
        time.sleep(seconds / self.ts)
        lag: dict[int, float] = {}
        for i in items:
            for v, n in i["by_version"].items():
                lag[self.weight_version - v] = lag.get(self.weight_version - v, 0.0) + n
        total = sum(lag.values()) or 1.0
        self.weight_version += 1
        return {"tokens": tokens, "samples": sum(i["samples"] for i in items),
                "t0": t0, "t1": time.time(),
                "train_s": seconds, "staleness_max": max(lag, default=0),
                "staleness_mean": sum(k * n for k, n in lag.items()) / total}  # fmt: skip

    def get_weights(self) -> dict:
        time.sleep(self.sync_s / self.ts)
        return {"w": np.zeros(4, dtype=np.float32)}


def train_seconds(params: float, tokens: float, gpus: int, mfu: float = 0.4) -> float:
    """Modelled training seconds of one step of ``tokens`` (prompt + response) tokens on
    ``gpus`` H100s: ``10 P T / (G x 989.4e12 x mfu)`` (actor update 6 P T, old-policy and
    reference log-probs 2 P T each; mfu 0.4 chosen): ``benchmarks/spot_cluster_model.py``'s
    ``TrainModel``, the one the RLBoost emulation uses."""
    return 10.0 * params * tokens / (gpus * 989.4e12 * mfu)


def sync_seconds(params: float) -> float:
    """Modelled seconds of one weight update: 2 s + 2P bytes at 200 GB/s (chosen;
    ``TrainModel.sync_s``)."""
    return 2.0 + 2 * params / 200e9
