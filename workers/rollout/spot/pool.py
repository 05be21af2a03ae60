"""The spot rollout pool as a rollout engine: ``rollout.spot.enabled`` composes it over the
engine it continues blocks with (:func:`~..engines.build_rollout_engine`).

:class:`SpotPoolEngine` is the reserved side of the pool on one rollout rank. For a step's
share of prompts (:meth:`~SpotPoolEngine.stream`, the role's runner does not change) it submits
the requests to the rollout manager, generates as a *reserved instance* for ``T_seed``
seconds (RLBoost 4.1: partial response seeding), hands its unfinished responses to the manager
once a spot instance is ready (or keeps generating when none is: colocated fallback, no stall),
and then yields finished GRPO groups in chunks of ``micro_batch_prompts`` groups as they arrive
(dynamic micro-batches), yielding its devices while it waits so that training runs on them.

Weights: :meth:`~SpotPoolEngine.update_weights` loads them into the inner engine and (rank 0)
stages them once for the spot instances to pull (RLBoost 4.3). Pause and resume: the inner
engine stops at its next decode step; the manager holds the spot instances (no lease, and
their requests come back with their tokens, logprobs and per-token versions at their next
report, at most ``block_tokens`` decode steps later) until the resume.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import ray
import torch

from m2flow.core import events
from m2flow.core.work import Work

from ...engines.registry import engine_class
from ..exact import GenRequest, to_generation_output
from .config import SpotPoolConfig
from .manager import get_manager

_COLLECT_POLL_S = 1.0  # how often a waiting rank checks that spot capacity exists
#: the counters of the pool a step's result reports (RolloutWorker.generate's ``spot``)
STEP_COUNTERS = (
    "reserved_tokens", "spot_tokens", "preemptions", "preempted_requests", "preempted_tokens",
    "migrated_samples", "migrated_tokens", "rebalanced_samples", "released", "t_seed", "n_prem",
)  # fmt: skip


class SpotPoolEngine:
    """The spot-pool side of one rollout rank (see the module docstring).

    Args:
        args: the rollout role's engine arguments: ``engine`` (the configured kind), ``spot``
            (:class:`~.config.SpotPoolConfig` fields), ``model`` and ``tokenizer`` (specs, for
            the spot instances), ``temperature``, ``top_p``, ``seed``, ``rank``,
            ``world_size``, ``name`` (the rank's, for messages).
        model, tokenizer: the host's Hugging Face model and tokenizer.

    Raises:
        ValueError: a bad ``rollout.spot`` value.
    """

    whole_share = True  # it balances the rank's whole share of a step itself
    needs_model, generates, block_steps = True, True, False

    @classmethod
    def build(cls, args: dict, model, tokenizer) -> SpotPoolEngine:
        """Backend ``spot`` of kind ``rollout`` (:mod:`~m2flow.workers.engines.registry`):
        ``args`` are the role's engine arguments plus ``engine`` (the configured backend) and
        ``spot`` (``rollout.spot`` fields)."""
        return cls(args, model, tokenizer)

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "rollout") -> None:
        """``rollout.spot`` (``config["spot"]``): :meth:`~.config.SpotPoolConfig.check`."""
        SpotPoolConfig(**(config.get("spot") or {})).check()

    def __init__(self, args: dict, model, tokenizer) -> None:
        self.cfg = SpotPoolConfig(**args["spot"])
        self.cfg.check()
        kind = args["engine"]
        # the configured engine when it continues blocks (vllm), else the pool's own
        inner = kind if engine_class("rollout", kind).block_steps else None
        self.rank, self.name = args.get("rank", 0), args.get("name", "rollout")
        self.tokenizer = tokenizer
        inner_args = {
            **args, "batch_rows": self.cfg.batch_rows, "threads": self.cfg.threads,
            "min_new_tokens": self.cfg.min_new_tokens, "decode_delay_s": self.cfg.decode_delay_s,
            "engine": inner or self.cfg.engine, "emulated": asdict(self.cfg.emulated),
            "eos_id": tokenizer.eos_token_id, "filler_id": len(tokenizer) - 1,
        }  # fmt: skip
        instance_args = {k: inner_args[k] for k in (
            "model", "tokenizer", "temperature", "top_p", "seed", "batch_rows", "threads",
            "min_new_tokens", "decode_delay_s", "engine", "emulated", "eos_id", "filler_id",
        )}  # fmt: skip
        self.manager = get_manager(asdict(self.cfg), args.get("world_size", 1), instance_args)
        # instances start now (during a warm start): ready when the first weights are staged
        ray.get(self.manager.start.remote(), timeout=120)
        inner_cls = engine_class("rollout", inner_args["engine"], "rollout.spot")
        self.inner = inner_cls.build(inner_args, model, tokenizer)
        self.model = self.inner.model
        self._last: dict = {}

    # -- the RolloutEngine protocol ----------------------------------------------------------

    @property
    def version(self) -> int:
        return self.inner.version

    def update_weights(self, version: int, weights) -> None:
        """Load ``weights`` into the inner engine at its next decode-step boundary and, on rank
        0, stage them once for every spot instance to pull (RLBoost 4.3)."""
        self.inner.update_weights(version, weights)
        if self.rank == 0 and weights is not None:
            # Host copies of their own: cuda_ipc delivers views into the source's packed
            # buffers (pickling a view writes its whole storage), and spot nodes may lack CUDA.
            host = {k: v.detach().cpu() for k, v in weights.items()}
            ray.get(self.manager.stage.remote(version, [ray.put(host)]), timeout=120)

    def pause(self) -> None:
        """The inner engine stops at its next decode step; the spot instances are held (their
        requests come back with their tokens at their next report)."""
        ray.get(self.manager.pause.remote(), timeout=120)
        self.inner.pause()

    def resume(self) -> None:
        self.inner.resume()
        ray.get(self.manager.resume.remote(), timeout=120)

    def sleep(self) -> bool:
        return self.inner.sleep()

    def wake_up(self) -> bool:
        return self.inner.wake_up()

    def last_metrics(self) -> dict:
        """The last :meth:`stream`'s ``seeded_s`` (seconds this rank generated),
        ``weight_versions`` (of its responses) and ``spot`` (the pool's step counters)."""
        return dict(self._last)

    def generate(self, prompt_ids, n_samples, max_new_tokens, sample_keys) -> dict:
        """Every response of the prompts through the pool, in one generation output."""
        groups = [g for part in self._groups(prompt_ids, n_samples, max_new_tokens, sample_keys)
                  for g in part]  # fmt: skip
        return self._output([r for g in groups for r in g], n_samples, sample_keys)

    def stream(self, prompt_ids, n_samples, max_new_tokens, sample_keys):
        """Generation outputs of ``micro_batch_prompts`` whole groups at a time, as they
        finish (``group_index``: the prompt's index in ``prompt_ids``)."""
        c = self.cfg
        for groups in self._groups(prompt_ids, n_samples, max_new_tokens, sample_keys):
            for i in range(0, len(groups), c.micro_batch_prompts):
                part = [r for g in groups[i : i + c.micro_batch_prompts] for r in g]
                yield self._output(part, n_samples, sample_keys)

    # -- the step ----------------------------------------------------------------------------

    def _output(self, requests: list[GenRequest], n_samples: int, sample_keys) -> dict:
        out = to_generation_output(requests, self.tokenizer.pad_token_id, n_samples)
        index = {group: i for i, (_, group) in enumerate(sample_keys)}
        out["group_index"] = torch.tensor(
            [index[int(g)] for g in out["group_index"]], device="cpu"
        )  # fmt: skip
        return out

    def _groups(self, prompt_ids, n_samples, max_new_tokens, sample_keys):
        """Finished GRPO groups (lists of requests, sample order) as the manager hands them
        out, in batches; records :meth:`last_metrics` at the end."""
        c, mgr = self.cfg, self.manager
        self._last = {}
        if not prompt_ids:
            return
        step = sample_keys[0][0]
        reqs = [
            GenRequest(f"{s}:{group}:{j}", list(p), (s, group, j), max_new_tokens,
                       owner=self.rank)
            for p, (s, group) in zip(prompt_ids, sample_keys)
            for j in range(n_samples)
        ]  # fmt: skip
        t_seed = ray.get(mgr.submit.remote(step, self.rank, reqs), timeout=120)
        seeded = self._seed(t_seed)
        versions: set[int] = set()
        got, deadline = 0, time.monotonic() + c.timeout_s
        while got < len(prompt_ids):
            ref = mgr.collect.remote(self.rank, c.micro_batch_prompts, _COLLECT_POLL_S)
            with events.span("spot", "collect"):  # devices free meanwhile
                groups = Work(ref, yields=True).wait(_COLLECT_POLL_S + 30)
            if not groups:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.name}: {len(prompt_ids) - got} of its {len(prompt_ids)} prompts "
                        f"not done after {c.timeout_s:.0f} s (rollout.spot.timeout_s)"
                    )
                # No spot instance ready (all preempted, or starting): this rank generates
                # again until one is (colocated fallback, RLBoost 4.1).
                if ray.get(mgr.spot_ready.remote(), timeout=120) == 0:
                    seeded += self._seed(0.0)
                continue
            got += len(groups)
            versions |= {v for g in groups for r in g for v in _versions(r)}
            yield groups
        pool = ray.get(mgr.metrics.remote(), timeout=120)
        self._last = {
            "seeded_s": seeded,
            "weight_versions": sorted(versions),
            "spot": {k: pool[k] for k in STEP_COUNTERS},
        }

    def _seed(self, t_seed: float) -> float:
        """Generate as a reserved instance for ``t_seed`` seconds, then hand over (see the
        module docstring). Returns the seconds it generated."""
        c = self.cfg
        return seed(self.manager, self.inner, f"reserved:{self.rank}", t_seed, c.max_batch,
                    c.block_tokens)  # fmt: skip


def _versions(r: GenRequest) -> set[int]:
    return set(r.versions) if len(r.versions) == len(r.tokens) else {r.weight_version}


@torch.no_grad()
def seed(mgr, engine, iid: str, t_seed: float, max_batch: int, block: int) -> float:
    """A reserved instance's seeding loop (RLBoost section 4.1; the module docstring): register
    as ``iid`` at the manager ``mgr``, lease up to ``max_batch`` requests of the weight version
    ``engine`` holds (:attr:`~m2flow.workers.engines.rollout.RolloutEngine.version`; the
    manager grants at most its seeding share, ``scheduler/spot/seeding.py``), generate
    ``block`` tokens per report with ``engine`` (exact, emulated or vllm), until ``t_seed``
    seconds have passed and a spot instance is ready to take the seeds (or nothing is left),
    then leave. Returns the seconds it generated."""
    ray.get(mgr.register.remote(iid), timeout=120)
    t0 = time.monotonic()
    executing: list[GenRequest] = []
    try:
        while True:
            if time.monotonic() - t0 >= t_seed and ray.get(mgr.spot_ready.remote()) > 0:
                break  # hand the seeds over
            version = engine.version  # (an update between blocks: lease for the new one)
            room = max_batch - len(executing)
            leased = ray.get(mgr.lease.remote(iid, version, room)) if room else []
            executing += leased
            if not executing:
                break  # nothing for this rank: the rest is on spot instances
            t1 = time.perf_counter()
            context = sum(r.length for r in executing) / len(executing)
            made = engine.step(executing, block, label=iid)
            busy = time.perf_counter() - t1
            drop = set(ray.get(mgr.report.remote(iid, executing, busy, len(executing), made,
                                                 context)))  # fmt: skip
            executing = [r for r in executing if not r.done and r.id not in drop]
    finally:
        ray.get(mgr.leave.remote(iid), timeout=120)
    return time.monotonic() - t0
