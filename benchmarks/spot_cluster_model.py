"""The parts of the emulated RLBoost cluster shared by RLBoost's runs
(``benchmarks/spot_cluster_emu.py``) and the baselines' (``spot_cluster_baselines.py``): the
paper's prices, the training cluster's time model, a compared system's switches, the workload,
the engine model, the weight-transfer model, and the run summary. Emulated seconds;
chosen numbers are marked where defined."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import looptime
import numpy as np
from m2flow.workers.rollout.emulated import ResponseLengths, ThroughputModel

# RLBoost Table 2 (paper:283-288) and Appendix A: $ per hour
RESERVED_NODE_PER_H = 83.79  # 8 x H100 on demand
SPOT_INSTANCE_PER_H = 5.32  # 2 x H100 spot
RESERVED_GPU_PER_H = RESERVED_NODE_PER_H / 8

PROMPTS, SAMPLES, PROMPT_TOKENS = 128, 8, 200  # paper:301; modelled prompt length
CAP = 14336  # paper:301 "maximum response length of 14K tokens" (PolyRL: 14336)
START_S = 60.0  # chosen: a spot instance's start (node up, engine loaded) before its pull
FRONTEND_BPS = 200e9 / 8  # a training node's frontend NIC, bytes/s (Table 2, paper:297)


@dataclass(frozen=True)
class TrainModel:
    """The training cluster's time (seconds): ``10 P T / (G x 989.4e12 x mfu x scale_eff)`` per
    micro-batch of ``T`` tokens (actor update 6 P T, old-policy and reference log-probs 2 P T
    each); ``mfu = 0.4`` **chosen**; ``scale_eff`` 0.9 across two nodes **chosen** (paper:331).
    ``sync_s``: the reshard to the colocated engines after training, 2 s + 2P bytes at 200 GB/s
    (**chosen**)."""

    params: float
    gpus: int = 8
    mfu: float = 0.4
    scale_eff: float = 1.0

    def train_s(self, tokens: float) -> float:
        return 10.0 * self.params * tokens / (self.gpus * 989.4e12 * self.mfu * self.scale_eff)

    @property
    def sync_s(self) -> float:
        return 2.0 + 2 * self.params / 200e9


@dataclass(frozen=True)
class System:
    """One compared system (section 6.2) or an ablation of RLBoost.

    ``kind``: ``rlboost`` | ``verl`` | ``disagg``. ``instances``: disagg's reserved rollout
    instances, or RLBoost's fixed pool when ``n_prem_fixed`` is set (Fig. 11). ``seeding``
    False: ``T_seed`` stays 0 (line 9 off; line 10 still sets ``N_prem``). ``weights``:
    ``pull`` (section 4.3) or ``sync`` (pushed to the instances held at the step's start, the
    training cluster waiting; an instance that comes up mid-step serves from the next step).
    ``reserved_price``: the rollout instances are priced at the on-demand per-GPU rate.
    """

    name: str
    kind: str = "rlboost"
    reserved_nodes: int = 1
    scale_eff: float = 1.0
    seeding: bool = True
    memory: bool = True
    dispatch: str = "jsq"  # jsq | round_robin (rlboost); static (verl); shared (disagg)
    rebalance: bool = True
    migration: str = "tokens"  # tokens | recompute
    weights: str = "pull"  # pull | sync
    instances: int = 0
    n_prem_fixed: int | None = None
    reserved_price: bool = False
    theta: int = 64  # chosen (the live benchmark's)
    agents: int | None = None  # transfer agents (default: one per training node, section 4.3)
    # rollout.spot.seed_share: "fair" (a seeding rank holds at most its share of the step's
    # requests) | "all" (the old rule: it leases up to max_batch); None: the manager's default
    seed_share: str | None = None
    eta: float = 3.0  # rollout.spot.eta default
    t_init: float = 60.0  # chosen T_init (seconds)
    micro_batch: int = 8  # m_b, GRPO groups
    max_batch: int = 256
    block: int = 128  # tokens per engine call (an interrupt keeps the tokens made so far)


@dataclass
class Workload:
    model: str = "qwen3-8b"
    lengths: ResponseLengths = field(default_factory=lambda: ResponseLengths(3000.0, 1.0, CAP))
    seed: int = 0


def block_seconds(model: ThroughputModel, ctx: np.ndarray, new: np.ndarray) -> float:
    """Seconds of ``max(new)`` decode iterations (``EmulatedEngine._decode_iters``, summed):
    request ``j`` takes part in the first ``new[j]``, at context ``ctx[j] + i`` in iteration
    ``i``."""
    if not len(new) or new.max() <= 0:
        return 0.0
    order = np.argsort(new, kind="stable")
    n_sorted, c_sorted = new[order], ctx[order].astype(np.float64)
    it = np.arange(int(n_sorted[-1]))
    k = np.searchsorted(n_sorted, it, side="right")
    batch = len(new) - k
    suffix = np.concatenate([np.cumsum(c_sorted[::-1])[::-1], [0.0]])
    return float(np.sum(model.decode_step_s(batch, (suffix[k] + it * batch) / batch)))


class EngineModel:
    """One TP-2 engine's time for a block of ``block`` tokens per request (the engine model of
    every system in the cluster experiments: RLBoost's instances and reserved engines, the
    baselines' engines). A block, as :class:`~m2flow.workers.rollout.emulated.EmulatedEngine`
    runs one: the requests are admitted in order while their KV cache (context + block) fits
    :attr:`ThroughputModel.kv_capacity_tokens` (at least one; the others make nothing this
    block and lose their cache); those without a cache here at their context (new, moved in,
    evicted) are prefilled; then :func:`block_seconds` of decode. The prompt is
    :data:`PROMPT_TOKENS` long. Emulated seconds."""

    def __init__(self, model: ThroughputModel) -> None:
        self.model = model
        self.cached: dict[str, int] = {}  # request id -> context held in its KV cache here

    def block(
        self, ids: list[str], have: np.ndarray, target: np.ndarray, block: int
    ) -> tuple[float, np.ndarray]:
        """Seconds of one block over requests ``ids`` with ``have`` tokens so far and
        ``target`` final lengths ``[B]``; returns them and the tokens each makes ``[B]``."""
        ctx = have + PROMPT_TOKENS
        new = np.minimum(target - have, block)
        fits = np.cumsum(ctx + new) <= self.model.kv_capacity_tokens
        fits[0] = True
        run = np.flatnonzero(np.logical_and.accumulate(fits))
        cold = [i for i in run if self.cached.get(ids[i]) != ctx[i]]
        pre = self.model.prefill_s(ctx[cold]) if cold else 0.0
        made = np.zeros(len(ids), dtype=np.int64)
        made[run] = new[run]
        end = ctx + made
        self.cached = {ids[i]: int(end[i]) for i in run if have[i] + made[i] < target[i]}
        return pre + block_seconds(self.model, ctx[run], new[run]), made


def transfer_s(model: ThroughputModel, n: int, nodes: int) -> float:
    """Weight transfer to ``n`` instances at once: each at most 50 Gb/s (its vNIC), together at
    most the training nodes' 200 Gb/s frontend NICs (Table 2; round-robin pairing spreads the
    pulls over the nodes' agents, section 4.3)."""
    per = max(1.0 / model.net_bytes_per_s, max(n, 1) / (nodes * FRONTEND_BPS))
    return model.latency_s + model.weight_bytes * per / model.net_eff


def summarise(records: list[dict], warmup: int = 0, spot_per_h: float | None = None) -> dict:
    """Throughput (tokens / emulated s) and tokens per $ over the records after ``warmup``;
    ``spot_per_h`` re-prices instance-seconds (Fig. 16)."""
    rec = records[warmup:] or records
    time_s = sum(r["step_s"] for r in rec)
    tokens = sum(r["tokens"] for r in rec)
    spot = sum(
        r["spot_cost"] if spot_per_h is None else r["instance_s"] / 3600 * spot_per_h for r in rec
    )
    cost = sum(r["reserved_cost"] for r in rec) + spot
    gen = sum(r["spot_tokens"] + r["reserved_tokens"] for r in rec)
    return {
        "steps": len(rec),
        "time_s": time_s,
        "throughput": tokens / time_s,
        "tokens_per_dollar": tokens / cost,
        "step_s": time_s / len(rec),
        "avg_held": sum(r["n_bar"] * r["step_s"] for r in rec) / time_s,
        "spot_share": sum(r["spot_tokens"] for r in rec) / max(gen, 1),
        "preemptions": sum(r["preemptions"] for r in rec),
    }


def with_cap(wl: Workload, cap: int) -> Workload:
    return replace(wl, lengths=replace(wl.lengths, cap=cap))


def run_virtual(coro, resolution: float = 1e-6, noop_cycles: int = 0, on_grid: bool = True):
    """Run ``coro`` to its end on a fresh ``looptime`` loop: emulated time from 0, its clock
    moving in steps of ``resolution`` seconds, ``loop.wall()`` = 1e9 + that time (the manager's
    wall clock, :func:`m2flow.workers.rollout.spot.records.wall`). ``on_grid``: timers rounded
    up to the clock's grid. asyncio fires a timer within 1e-9 s of its time, so a timer off the
    grid could fire before the clock reaches it, and a ``while now() < deadline:
    wait(deadline - now())`` loop (the manager's ``lease``) would spin at one instant; on the
    grid, the clock reaches the timer's time exactly. Returns what ``coro`` returns."""
    loop = looptime.new_event_loop(start=0.0, resolution=resolution, noop_cycles=noop_cycles)
    loop.wall = lambda: 1e9 + loop.time()
    if on_grid:
        tick, call_at = round(1 / resolution), loop.call_at

        def at(when, callback, *args, context=None):
            k = math.ceil(when * tick)
            if k / tick < when:
                k += 1
            return call_at(k / tick, callback, *args, context=context)

        loop.call_at = at
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
