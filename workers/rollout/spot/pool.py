"""The reserved side of the spot rollout pool: a rollout rank that seeds, then collects.

Inside ``RolloutWorker.generate`` (the runner does not change): the rank submits its share of
the step's prompts to the rollout manager, generates as a *reserved instance* for ``T_seed``
seconds (RLBoost 4.1: partial response seeding), hands its unfinished responses to the manager
once a spot instance is ready (or keeps generating when none is: colocated fallback, no stall),
and then streams finished GRPO groups to its consumers in chunks of ``micro_batch_prompts``
groups as they arrive (dynamic micro-batches), yielding its devices while it waits so that
training runs on them.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import ray
import torch

from m2flow import Channel, events
from m2flow.work import Work

from ...batch import num_tokens, to_batch
from ...chunk import RolloutChunk
from ..engines import ROLLOUT_ENGINES
from ..exact import GenRequest, to_generation_output
from .config import SpotPoolConfig
from .manager import get_manager

_COLLECT_POLL_S = 1.0  # how often a waiting rank checks that spot capacity exists


class ReservedSeeder:
    """The spot-pool side of one rollout rank (see the module docstring)."""

    def __init__(self, worker, cfg: dict, model: dict, tokenizer: dict) -> None:
        self.w = worker
        self.cfg = SpotPoolConfig(**cfg)
        self.cfg.check()
        args = {
            "model": model, "tokenizer": tokenizer, "temperature": worker.temperature,
            "top_p": worker.top_p, "seed": worker.seed, "batch_rows": self.cfg.batch_rows,
            "threads": self.cfg.threads, "min_new_tokens": self.cfg.min_new_tokens,
            "decode_delay_s": self.cfg.decode_delay_s,
            "engine": "vllm" if worker.vllm is not None else self.cfg.engine,
            "emulated": asdict(self.cfg.emulated),
            "eos_id": worker.tokenizer.eos_token_id, "filler_id": len(worker.tokenizer) - 1,
        }  # fmt: skip
        self.manager = get_manager(asdict(self.cfg), worker.world_size, args)
        # instances start now (during a warm start): ready when the first weights are staged
        ray.get(self.manager.start.remote(), timeout=120)
        if worker.vllm is not None:  # rollout.engine=vllm: block-wise on the role's own engine
            self.engine = worker.vllm
        else:  # the spot instances' chain (exact, or emulated: same loop, modelled time)
            build = ROLLOUT_ENGINES.get(self.cfg.engine, "rollout.spot")
            self.engine = build(args, worker.model, worker.tokenizer)

    def stage(self, weights: dict, version: int) -> None:
        """Stage new weights once for every spot instance to pull (RLBoost 4.3)."""
        ray.get(self.manager.stage.remote(version, [ray.put(weights)]), timeout=120)

    def generate(self, items: list[dict], out: Channel, step_samples: int = 0) -> dict:
        """Rollout of this rank's prompts through the pool; puts chunks of whole GRPO groups
        into ``out`` as they finish (the layout of :meth:`RolloutWorker.generate`;
        ``step_samples``: the step's responses on all ranks). Returns its metrics plus the
        pool's counters of the step (``spot``)."""
        w, c, mgr = self.w, self.cfg, self.manager
        if not items:
            return {"samples": 0, "tokens": 0, "response_length": 0.0}
        step = items[0].get("step", 0)
        reqs = [
            GenRequest(f"{step}:{it['group']}:{j}", it["prompt_ids"], (step, it["group"], j),
                       w.max_new_tokens, owner=w.rank)
            for it in items
            for j in range(w.n_samples)
        ]  # fmt: skip
        t_seed = ray.get(mgr.submit.remote(step, w.rank, reqs), timeout=120)
        seeded = self._seed(t_seed)
        entries = {it["group"]: it["entry"] for it in items}
        samples = tokens = resp_tokens = 0
        versions: set[int] = set()
        got, deadline = 0, time.monotonic() + c.timeout_s
        while got < len(items):
            ref = mgr.collect.remote(w.rank, c.micro_batch_prompts, _COLLECT_POLL_S)
            with events.span("spot", "collect"):  # devices free meanwhile
                groups = Work(ref, yields=True).wait(_COLLECT_POLL_S + 30)
            if not groups:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{w.worker_key}: {len(items) - got} of its {len(items)} prompts not "
                        f"done after {c.timeout_s:.0f} s (rollout.spot.timeout_s)"
                    )
                # No spot instance ready (all preempted, or starting): this rank generates
                # again until one is (colocated fallback, RLBoost 4.1).
                if ray.get(mgr.spot_ready.remote(), timeout=120) == 0:
                    seeded += self._seed(0.0)
                continue
            got += len(groups)
            for i in range(0, len(groups), c.micro_batch_prompts):
                part = [r for g in groups[i : i + c.micro_batch_prompts] for r in g]
                batch = to_batch(to_generation_output(part, w.tokenizer.pad_token_id,
                                                      w.n_samples))  # fmt: skip
                versions |= {r.weight_version for r in part}
                n_tok = num_tokens(batch)
                chunk = RolloutChunk(
                    batch,
                    entries={g: entries[g] for g in batch["group_index"].unique().tolist()},
                    weight_version=min(r.weight_version for r in part),
                    step=step,
                    step_samples=step_samples,
                )
                out.put(chunk, weight=n_tok)
                samples += len(batch)
                tokens += n_tok
                resp_tokens += int(batch["response_mask"].sum())
        pool = ray.get(mgr.metrics.remote(), timeout=120)
        keep = ("reserved_tokens", "spot_tokens", "preemptions", "preempted_requests",
                "preempted_tokens", "migrated_samples", "migrated_tokens", "rebalanced_samples",
                "released", "t_seed", "n_prem")  # fmt: skip
        return {
            "samples": samples,
            "tokens": tokens,
            "response_length": resp_tokens / max(samples, 1),
            "seeded_s": seeded,
            "weight_versions": sorted(versions),
            "spot": {k: pool[k] for k in keep},
        }

    def _seed(self, t_seed: float) -> float:
        """Generate as a reserved instance for ``t_seed`` seconds, then hand over (see the
        module docstring). Returns the seconds it generated."""
        w = self.w
        return seed(self.manager, self.engine, f"reserved:{w.rank}", w.weight_version, t_seed,
                    self.cfg.max_batch, self.cfg.block_tokens)  # fmt: skip


@torch.no_grad()
def seed(mgr, engine, iid: str, version: int, t_seed: float, max_batch: int, block: int) -> float:
    """A reserved instance's seeding loop (RLBoost section 4.1; the module docstring): register
    as ``iid`` at the manager ``mgr``, lease up to ``max_batch`` requests of weight version
    ``version``, generate ``block`` tokens per report with ``engine`` (exact or emulated), until
    ``t_seed`` seconds have passed and a spot instance is ready to take the seeds (or nothing is
    left), then leave. Returns the seconds it generated."""
    ray.get(mgr.register.remote(iid), timeout=120)
    t0 = time.monotonic()
    executing: list[GenRequest] = []
    try:
        while True:
            if time.monotonic() - t0 >= t_seed and ray.get(mgr.spot_ready.remote()) > 0:
                break  # hand the seeds over
            room = max_batch - len(executing)
            leased = ray.get(mgr.lease.remote(iid, version, room)) if room else []
            executing += leased
            if not executing:
                break  # nothing for this rank: the rest is on spot instances
            t1 = time.perf_counter()
            context = sum(r.length for r in executing) / len(executing)
            made = engine.step(executing, block, version, iid)
            busy = time.perf_counter() - t1
            drop = set(ray.get(mgr.report.remote(iid, executing, busy, len(executing), made,
                                                 context)))  # fmt: skip
            executing = [r for r in executing if not r.done and r.id not in drop]
    finally:
        ray.get(mgr.leave.remote(iid), timeout=120)
    return time.monotonic() - t0


def trainer_waits(waits: list[list[list[float]]]) -> None:
    """Report the trainer's waits for micro-batches of this step (``[t0, t1]`` wall-clock
    seconds per trainer rank: :meth:`ActorWorker.train`'s ``input_waits``) to the run's rollout
    manager (:meth:`.manager.RolloutManager.trainer_waits`); nothing when the run has no spot
    pool. Call after the trainer's step, before the weights are synchronised (which ends the
    pool's step)."""
    from m2flow.cluster import NAMESPACE

    from .names import MANAGER_NAME

    try:
        mgr = ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)
    except ValueError:  # no spot pool in this run
        return
    ray.get(mgr.trainer_waits.remote(waits), timeout=120)
