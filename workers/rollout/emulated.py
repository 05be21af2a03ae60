"""An emulated rollout engine: :class:`~.exact.ExactEngine`'s interface, but a block of tokens
costs the time a GPU engine would take (a throughput model) and that time is slept, not
computed. So the spot pool's manager, policies and Ray actors run unchanged at cluster scale
(RLBoost section 6: Qwen3-8B/14B/32B, responses capped at 14K = 14,336 tokens, 128 prompts x 8
per step) with many instances sharing one CPU. Model, calibration and limits:
``docs/results/emulation.md``.

Three small pieces, each usable alone:

- :class:`ThroughputModel`: seconds of a decode iteration ``(batch, context)``, of a prefill, of
  a weight transfer, for one engine of ``tp`` GPUs (presets: :data:`PRESETS`); it lives in
  :mod:`.emulated_throughput` and is re-exported here;
- :class:`ResponseLengths`: a capped lognormal response length drawn from a counter keyed by
  ``(seed, step, prompt, sample)``, so a response's length is fixed up front and does not
  depend on which engine finishes it (migration keeps it);
- :class:`EmulatedEngine`: advances :class:`~.exact.GenRequest` s block by block with
  placeholder tokens (the filler id, then EOS at the drawn length unless the cap cut it),
  logprobs 0.0, and sleeps ``modelled seconds / time_scale``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np

from ..llm.gate import PAUSE_TIMEOUT_S, DecodeGate
from .emulated_throughput import (  # noqa: F401 (public paths: m2flow.workers.rollout.emulated.*)
    GB,
    H100_SXM,
    LLAMA31_8B,
    LLAMA33_70B,
    PRESETS,
    QWEN3_8B,
    QWEN3_14B,
    QWEN3_32B,
    Hardware,
    ModelShape,
    ThroughputModel,
    throughput_preset,
)

if TYPE_CHECKING:
    from .exact import GenRequest

# -- response lengths ------------------------------------------------------------------------

_LENGTH_SALT = 0x1E46_7115  # a 4th key column: the length draw never equals a token's draw


@dataclass(frozen=True)
class ResponseLengths:
    """Response lengths in tokens: ``min(max(round(exp(N(ln median, sigma^2))), low), cap)``.

    Defaults (median 3000, sigma 1.0, cap 16384): a choice, not a fit (docs/results/emulation.md):
    mean ~4.5K tokens, p90 ~10.8K, ~4.5 % of responses cut at the 16K cap, the long tail
    of reasoning RL on OpenR1-Math-like prompts.

    A length is a function of ``(seed, step, prompt, sample)`` alone (a counter, like the
    sampling of :mod:`~..llm.sampling`), so it is decided before the first token and survives
    migration.
    """

    median: float = 3000.0
    sigma: float = 1.0
    cap: int = 16384
    low: int = 1

    def lengths(self, seed: int, keys) -> np.ndarray:
        """Lengths for ``keys`` ``[B, 3]`` (step, prompt, sample) -> ``[B]`` int64."""
        from ..llm.sampling import counter_uniforms_at  # here: that module imports torch

        k = np.asarray(keys, dtype=np.int64).reshape(-1, 3)
        salted = np.concatenate([k, np.full((len(k), 1), _LENGTH_SALT, dtype=np.int64)], axis=1)
        u = counter_uniforms_at(seed, salted, np.zeros(len(k), dtype=np.int64))
        z = np.array([NormalDist().inv_cdf(x) for x in u])
        n = np.rint(self.median * np.exp(self.sigma * z))
        return np.clip(n, self.low, self.cap).astype(np.int64)

    def length(self, seed: int, key: tuple[int, int, int]) -> int:
        return int(self.lengths(seed, [key])[0])

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (before rounding), capped."""
        return min(max(self.median * np.exp(self.sigma * NormalDist().inv_cdf(q)), self.low),
                   self.cap)  # fmt: skip


# -- the engine ------------------------------------------------------------------------------


class TokenRuns(list):
    """A list whose pickle is run-length encoded: an emulated response is one filler token
    repeated (and EOS), its logprobs one 0.0 repeated, so shipping a 16K-token partial
    response between instance and manager costs a few bytes instead of ~150 KB.

    The engine appends through :meth:`add` (which keeps the runs); a list changed any other
    way is encoded from its items when pickled (correct, slower).
    """

    __slots__ = ("_runs", "_n")

    def __init__(self, items=()) -> None:
        super().__init__(items)
        self._runs: list[list] = []
        self._n = 0
        if len(self):
            self._runs, self._n = _encode(self), len(self)

    def add(self, value, count: int) -> None:
        count = int(count)
        if count <= 0:
            return
        if self._n != len(self):  # changed behind our back: re-encode
            self._runs, self._n = _encode(self), len(self)
        self.extend([value] * count)
        if self._runs and self._runs[-1][0] == value:
            self._runs[-1][1] += count
        else:
            self._runs.append([value, count])
        self._n += count

    def __reduce_ex__(self, protocol):
        runs = self._runs if self._n == len(self) else _encode(self)
        return (_decode, (tuple(map(tuple, runs)),))


def _encode(items: list) -> list[list]:
    runs: list[list] = []
    for x in items:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return runs


def _decode(runs: tuple) -> TokenRuns:
    out = TokenRuns()
    for value, count in runs:
        out.add(value, count)
    return out


class EmulatedEngine:
    """Advances :class:`~.exact.GenRequest` s like :class:`~.exact.ExactEngine` (same
    ``step``), in modelled time.

    Each call: the requests are admitted in order while their KV cache (context + this block)
    fits :attr:`ThroughputModel.kv_capacity_tokens` (at least one; the others wait this block
    and lose their cache, as a vLLM preemption by recompute); those without a cache here
    (new, migrated, resumed, or evicted) are prefilled; then ``tokens`` decode iterations run,
    each over the requests still short of their length. The call sleeps the modelled seconds
    divided by ``time_scale`` (``time_scale = 10``: ten emulated seconds per real second).

    A request's length is ``min(max(lengths(seed, key), min_new_tokens), max_new_tokens)``;
    its tokens are ``filler_id`` then ``eos_id`` when it ends before ``max_new_tokens`` (else
    it is cut there, no EOS); logprobs are 0.0; ``versions`` the weight version of each token.

    Pause, resume and weight updates act between decode iterations, as on a real engine
    (:class:`~..llm.gate.DecodeGate`): in real time (the default ``sleep=None``) a pause asked
    while a block's modelled time is being slept cuts the block after the iteration in flight
    (the one the elapsed time falls in); the call then waits, and after a resume continues the
    block's remaining iterations, with a prefill of every request if the weights changed (their
    KV cache is **recomputed**, as on the ``hf`` engine) and the tokens labelled with the new
    version. With an injected ``sleep`` (no real time) a pause takes effect at the end of the
    block.

    Args:
        model: the engine's throughput model.
        lengths: the response length distribution (its ``cap`` and the request's
            ``max_new_tokens`` both cap).
        eos_id, filler_id: placeholder token ids.
        seed: the run seed (the length counter's).
        time_scale: emulated seconds per real second.
        prompt_tokens: modelled prompt length (0: the real prompt's length).
        min_new_tokens: floor on a length (as ExactEngine's ``min_new_tokens``).
        sleep: called with the real seconds of each block instead of sleeping them (tests
            pass a recorder); ``None``: sleep them, interruptibly by a pause.
        version: the weight version it starts with.
        pause_timeout_s: longest wait of a paused :meth:`step` for :meth:`resume`.
        prefix_cache: keep the KV cache of a request that leaves the batch (finished, or
            between an agent episode's turns) under its id, as vLLM's automatic prefix caching
            or SGLang's radix cache do: a later request with that id whose context extends the
            cached one prefills only the new tokens. Kept caches are dropped oldest first when
            they and the running requests' exceed :attr:`ThroughputModel.kv_capacity_tokens`.
            Off by default (a request that leaves loses its cache).

    Attributes:
        emulated_s: modelled seconds so far (decode + prefill + weight transfers).
        steps, tokens: calls to :meth:`step` that generated, and tokens generated.
    """

    needs_model, generates, block_steps = False, False, True

    @classmethod
    def build(cls, args: dict, model, tokenizer) -> EmulatedEngine:
        """From the spot pool's arguments (``emulated``: ``rollout.spot.emulated``, ``eos_id``,
        ``filler_id``, ``seed``, ``min_new_tokens``); no model, no tokenizer."""
        return cls.from_config(
            args["emulated"], args["eos_id"], args["filler_id"], args["seed"],
            args.get("min_new_tokens", 0),
        )  # fmt: skip

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "rollout") -> None:
        """Its settings are ``rollout.spot.emulated``'s, checked by the spot pool's config."""

    def __init__(
        self,
        model: ThroughputModel,
        lengths: ResponseLengths,
        eos_id: int,
        filler_id: int,
        seed: int = 0,
        time_scale: float = 1.0,
        prompt_tokens: int = 0,
        min_new_tokens: int = 0,
        sleep: Callable[[float], None] | None = None,
        version: int = -1,
        pause_timeout_s: float = PAUSE_TIMEOUT_S,
        prefix_cache: bool = False,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.model, self.lengths = model, lengths
        self.eos_id, self.filler_id, self.seed = eos_id, filler_id, seed
        self.time_scale, self.prompt_tokens = time_scale, prompt_tokens
        self.min_new_tokens = min_new_tokens
        self.prefix_cache = prefix_cache
        self.pace = sleep
        self.gate = DecodeGate(version, pause_timeout_s)
        self.cached: dict[str, int] = {}  # request id -> context tokens in its KV cache here
        self._cache_version = version  # the weights the cached keys were computed with
        self.emulated_s = 0.0
        self.steps = self.tokens = 0

    @classmethod
    def from_config(cls, cfg: dict, eos_id: int, filler_id: int, seed: int = 0,
                    min_new_tokens: int = 0, version: int = -1) -> EmulatedEngine:  # fmt: skip
        """From ``rollout.spot.emulated`` (:class:`~m2flow.workers.rollout.spot.config.
        EmulatedEngineConfig` fields); ``version``: the weights it starts with."""
        over = {"mem_util": cfg["mem_util"]} if cfg.get("mem_util") else {}
        model = throughput_preset(cfg.get("model", "qwen3-8b"), **over)
        lengths = ResponseLengths(
            median=cfg.get("length_median", 3000.0), sigma=cfg.get("length_sigma", 1.0),
            cap=cfg.get("length_cap", 16384),
        )  # fmt: skip
        return cls(model, lengths, eos_id, filler_id, seed, cfg.get("time_scale", 1.0),
                   cfg.get("prompt_tokens", 0), min_new_tokens, version=version)  # fmt: skip

    def targets(self, requests: list[GenRequest]) -> np.ndarray:
        """The response lengths of ``requests`` (their keys' draws, floored and capped)."""
        n = self.lengths.lengths(self.seed, [r.key for r in requests])
        n = np.maximum(n, max(self.min_new_tokens, 1))
        return np.minimum(n, [r.max_new_tokens for r in requests])

    def _context(self, r: GenRequest) -> int:
        return (self.prompt_tokens or len(r.prompt_ids)) + len(r.tokens)

    # -- the RolloutEngine protocol ----------------------------------------------------------

    @property
    def version(self) -> int:
        return self.gate.version

    def pause(self) -> None:
        """Stop :meth:`step` after the decode iteration in flight (returns once there)."""
        self.gate.pause()

    def resume(self) -> None:
        self.gate.resume()

    def sleep(self) -> bool:
        return False  # nothing on a device

    def wake_up(self) -> bool:
        return False

    def update_weights(self, version: int, weights=None, nbytes: float | None = None) -> float:
        """Take weights of ``version`` between decode iterations. ``weights=None``: a pull over
        the network (a spot instance), the modelled transfer of ``nbytes`` (default: the
        model's) is slept; given (the reserved rank, whose weights arrive by the run's own
        sync): no transfer is modelled. Either way every KV cache is dropped (recomputed by the
        next block's prefill). Returns the modelled seconds."""
        seconds = self.model.weight_transfer_s(nbytes) if weights is None else 0.0

        def pull() -> None:
            self.emulated_s += seconds
            self._sleep(seconds / self.time_scale)
            self.cached.clear()

        self.gate.update(version, pull)
        return seconds

    # -- generation --------------------------------------------------------------------------

    def step(
        self, requests: list[GenRequest], tokens: int, version: int | None = None, label: str = ""
    ) -> int:
        """Generate up to ``tokens`` more tokens for every unfinished request (its length or
        ``max_new_tokens`` ends one early), sleeping the modelled time. ``version``: the
        weights' version, declared (``None``: the engine's). Returns the tokens generated.

        Raises:
            TimeoutError: paused longer than ``pause_timeout_s``.
        """
        if version is not None and version != self.gate.version:
            self.gate.update(version)
        made, left, generated = 0, tokens, False
        while left > 0:
            with self.gate.step() as current:
                if current != self._cache_version:  # new weights: the caches are stale
                    self.cached.clear()
                    self._cache_version = current
                done_iters, n, cut = self._segment(requests, left, current, label)
            made += n
            generated |= done_iters > 0
            left -= done_iters
            if not cut:  # the block ran whole (a pause cut it: the rest after the resume)
                break
        if generated:
            self.steps += 1
            self.tokens += made
        return made

    def _segment(self, requests, tokens: int, version: int, label: str) -> tuple[int, int, bool]:
        """Up to ``tokens`` decode iterations (see the class docstring). Returns the iterations
        run, the tokens made, and whether a pause cut it short."""
        live = [r for r in requests if not r.done]
        if not live or tokens <= 0:
            return 0, 0, False
        targets = self.targets(live)
        have = np.array([len(r.tokens) for r in live], dtype=np.int64)
        ctx = np.array([self._context(r) for r in live], dtype=np.int64)
        new = np.minimum(np.maximum(targets - have, 0), tokens)
        # KV capacity: admit in order while context + block fits (at least one)
        fits = np.cumsum(ctx + new) <= self.model.kv_capacity_tokens
        fits[0] = True
        run = np.flatnonzero(np.logical_and.accumulate(fits))
        cold = [i for i in run if self.cached.get(live[i].id) != ctx[i]]
        prefill = self.model.prefill_s(ctx[cold]) if cold else 0.0
        if self.prefix_cache and cold:  # a kept cache no longer than the context is its prefix
            hit = np.array([self.cached.get(live[i].id, 0) for i in cold], dtype=np.int64)
            hit = np.where(hit <= ctx[cold], hit, 0)
            prefill = self.model.prefill_s(ctx[cold] - hit, hit)
        iters = self._decode_iters(ctx[run], new[run])
        k = self._run(prefill, iters)
        self.emulated_s += prefill + (float(np.sum(iters[:k])) if len(iters) else 0.0)
        cached: dict[str, int] = {}
        ended: dict[str, int] = {}  # finished here: kept with a prefix cache
        made = 0
        for i in run:
            r, n = live[i], int(min(new[i], k))
            for name in ("tokens", "logprobs", "versions"):
                if not isinstance(getattr(r, name), TokenRuns):
                    setattr(r, name, TokenRuns(getattr(r, name)))
            end = bool(have[i] + n >= targets[i])
            eos = int(end and targets[i] < r.max_new_tokens)
            r.tokens.add(self.filler_id, n - eos)
            r.tokens.add(self.eos_id, eos)
            r.logprobs.add(0.0, n)
            r.versions.add(version, n)
            if n:
                r.weight_version = version
                r.by[label] = r.by.get(label, 0) + n
            r.done = end
            made += n
            if not r.done:
                cached[r.id] = int(ctx[i]) + n
            else:
                ended[r.id] = int(ctx[i]) + n
        if self.prefix_cache:
            cached = self._keep(cached, ended, {r.id for r in live})
        self.cached = cached  # the others left, finished, or were evicted
        return k, made, k < len(iters)

    def _keep(self, running: dict, ended: dict, live: set) -> dict:
        """The prefix cache after a block: ``running`` plus the kept caches (older ones not
        live in this call, then ``ended``), the oldest dropped while they exceed the KV cache
        left by the running ones (a live request that was not admitted lost its cache)."""
        kept = {k: v for k, v in self.cached.items() if k not in live}
        kept.update(ended)
        room = self.model.kv_capacity_tokens - sum(running.values())
        total = sum(kept.values())
        for key in list(kept):
            if total <= room:
                break
            total -= kept.pop(key)
        return {**kept, **running}

    def _run(self, prefill: float, iters: np.ndarray) -> int:
        """Sleep the modelled ``prefill`` then ``iters`` (seconds per decode iteration);
        returns the iterations done: all, or (real time, a pause asked meanwhile) those up to
        and including the one the pause fell in."""
        total = prefill + float(np.sum(iters))
        if self.pace is not None:
            self.pace(total / self.time_scale)
            return len(iters)
        waited = self.gate.sleep(total / self.time_scale)
        if not self.gate.paused or not len(iters):
            self._sleep(total / self.time_scale - waited)  # (woke early for nothing)
            return len(iters)
        ends = prefill + np.cumsum(iters)  # modelled end of each iteration
        k = min(int(np.searchsorted(ends, waited * self.time_scale, side="right")) + 1, len(iters))
        self._sleep(float(ends[k - 1]) / self.time_scale - waited)  # the iteration in flight
        return k

    def _sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.pace is not None:
            self.pace(seconds)
        else:
            time.sleep(seconds)

    def _decode_iters(self, ctx: np.ndarray, new: np.ndarray) -> np.ndarray:
        """Seconds of each of ``max(new)`` decode iterations; request ``j`` takes part in the
        first ``new[j]`` of them, at context ``ctx[j] + i`` in iteration ``i``."""
        if not len(new) or new.max() <= 0:
            return np.zeros(0)
        order = np.argsort(new, kind="stable")
        n_sorted, c_sorted = new[order], ctx[order].astype(np.float64)
        it = np.arange(int(n_sorted[-1]))
        k = np.searchsorted(n_sorted, it, side="right")  # requests already done at iteration i
        batch = len(new) - k
        suffix = np.concatenate([np.cumsum(c_sorted[::-1])[::-1], [0.0]])
        mean_ctx = (suffix[k] + it * batch) / batch
        return np.atleast_1d(self.model.decode_step_s(batch, mean_ctx))
