"""RLBoost's three baselines (section 6.2, paper:317-322) in emulated time: what
``benchmarks/spot_cluster.py`` runs for ``System.kind`` ``verl`` and ``disagg``, next to RLBoost
driven through the live manager (``benchmarks/spot_cluster_emu.py``).

The clock is a ``looptime`` event loop's (virtual time: every ``asyncio.sleep`` takes no real
time), the same clock style as the RLBoost runs: one coroutine per TP-2 engine (decode blocks of
``System.block`` tokens), one for the trainer, one driving the steps. Deterministic: no
randomness beyond the workload's response lengths (``Workload.seed``).

The same models as RLBoost's runs (``benchmarks/spot_cluster_model.py``), so the comparison
uses one engine model and one trainer model:

- engine time: :class:`~spot_cluster_model.EngineModel` per TP-2 engine (the old simulator's
  block: :class:`~m2flow.workers.rollout.emulated.EmulatedEngine`'s KV admission, prefill of
  requests without a cache there, :func:`~spot_cluster_model.block_seconds` of decode over the
  Qwen3 TP-2 H100 :class:`~m2flow.workers.rollout.emulated.ThroughputModel` preset);
- response lengths: :class:`~m2flow.workers.rollout.emulated.ResponseLengths`, keyed by
  ``(seed, step, prompt, sample)`` (the same response has the same length in every system);
- training: :class:`~spot_cluster_model.TrainModel` (``train_s`` per micro-batch, ``sync_s``
  the reshard after training);
- weight push: :func:`~spot_cluster_model.transfer_s`; prices: Table 2.

The systems (section 6.2):

- ``verl`` (veRL; veRL.2x is ``reserved_nodes`` 2 with ``scale_eff`` 0.9, paper:320, 339):
  colocated. The step's ``PROMPTS x SAMPLES`` requests are partitioned statically over the
  training cluster's ``4 x reserved_nodes`` TP-2 engines (contiguous shares in request order;
  no queue, no load balancing, no migration); when the last response is done the whole batch
  trains (one micro-batch: everything is ready), then the reshard (``sync_s``).
- ``disagg`` (Disagg.BAL, StreamRL's techniques on-policy, paper:322): the training cluster
  only trains. ``System.instances`` always-on 2xH100 rollout instances, priced at the reserved
  per-GPU rate, take requests from one shared queue as they have batch room (at most
  ``ceil(N / instances)`` per pull, the simulator's cap); before rollout the step's weights
  are pushed to all of them at once through the training nodes' frontend NICs
  (``transfer_s``, synchronized: no instance starts before the push ends); finished GRPO
  groups train in dynamic micro-batches of at least ``System.micro_batch`` groups (StreamRL's
  pipelining, RLBoost section 4.1), then ``sync_s``. The instance count is StreamRL's
  resource optimizer's (:func:`disagg_size`).

These reproduce the old discrete-event simulator's (``spot_cluster_sim.Sim``) runs of the two
kinds; differences, all deliberate:

- veRL's ``n_prem`` is recorded as 0 (it has no instances; the simulator recorded its unused
  seeding policy's initial value, ``N_resv``);
- a remainder of requests over engines (none at 1,024 requests on 4 or 8 engines) goes to
  the first engines (the simulator dropped it);
- Disagg.BAL's instances are reserved: a ``trace`` does not preempt them (for veRL it only
  sets the recorded ``available``); ``events`` (preempt/add/restart) are refused;
- responses one engine call finishes together reach the trainer together: if they complete
  ``m_b`` groups or more, they form one micro-batch ("if more than m_b responses arrive at
  once, they are gathered in a single microbatch", paper:148); the simulator started training
  at the first group that completed ``m_b`` and left the rest of that call's groups for the
  next micro-batch (Disagg.BAL only: throughput within 0.06 % of the simulator's over 2 h for
  8B / 14B / 32B; with the simulator's rule the records are equal);
- times are ``looptime``'s, integers of 1 ns: block ends differ from the simulator's float sums
  by well under a microsecond.

Disagg.BAL keeps the simulator's ``sync_s`` at the end of its step (the gather of the trained
weights before the next push; the paper does not itemise it). Times are emulated seconds.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from m2flow.workers.rollout.emulated import ThroughputModel, throughput_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spot_cluster_model import (  # noqa: E402
    PROMPT_TOKENS,
    PROMPTS,
    RESERVED_GPU_PER_H,
    RESERVED_NODE_PER_H,
    SAMPLES,
    EngineModel,
    System,
    TrainModel,
    Workload,
    run_virtual,
    summarise,
    transfer_s,
)

KINDS = ("verl", "disagg")
RESOLUTION_S = 1e-9  # looptime's clock tick (its default, 1e-6, would round every block end)
# looptime idles this many loop cycles before it moves the clock (its default 42 lets
# timeout-guarded awaits register first; here there are none, and the cycles cost 3x the run)
NOOP_CYCLES = 1
ROLLOUT_PER_H = 2 * RESERVED_GPU_PER_H  # a 2xH100 rollout instance at the on-demand GPU rate


@dataclass(slots=True, eq=False)
class Request:
    """One response of the step: ``target`` tokens to generate, ``have`` made so far."""

    index: int  # position in the step's batch: prompt * SAMPLES + sample
    group: int  # its prompt (GRPO group)
    target: int
    have: int = 0
    done_by: int = -1  # id of the engine that finished it
    done_count: int = 0  # times it was finished (an invariant: 1)
    key: str = ""  # "step/index": its id at the engine model


class Engine:
    """A TP-2 engine: one of the training cluster's (``reserved``) or a 2xH100 rollout
    instance (``rollout``)."""

    def __init__(self, eid: int, kind: str, model: ThroughputModel) -> None:
        self.id, self.kind = eid, kind
        self.time = EngineModel(model)  # block seconds; holds the KV cache it keeps
        self.running: list[Request] = []
        self.pending: deque[Request] = deque()  # verl: its static share
        self.busy_s = 0.0  # seconds in blocks this step
        self.last_done: float | None = None  # when it last finished a response
        self.blocks: list[tuple[float, float, int]] = []  # (t0, t1, tokens) this step


class BaselineCluster:
    """One run of a baseline ``system`` on ``workload``; :meth:`run` (a coroutine, on a
    ``looptime`` loop) appends one record per step to :attr:`records`.

    Attributes: ``engines`` (verl: the training cluster's; disagg: the rollout instances),
    ``requests`` (the last step's, for invariant checks), ``timeline`` (``(t0, t1, tokens)`` of
    every rollout-instance block, absolute seconds; the old simulator's spot timeline).

    Raises:
        ValueError: ``system.kind`` not a baseline kind, disagg without instances, or events.
    """

    def __init__(self, system: System, workload: Workload, trace=None, events=()) -> None:
        if system.kind not in KINDS:
            raise ValueError(f"not a baseline kind: {system.kind!r} (expected one of {KINDS})")
        if system.kind == "disagg" and system.instances < 1:
            raise ValueError(f"disagg needs instances >= 1, got {system.instances}")
        if tuple(events):
            raise ValueError("baselines hold no preemptible instances: events are refused")
        self.sy, self.wl = system, workload
        self.model: ThroughputModel = throughput_preset(workload.model)
        self.trainer = TrainModel(
            self.model.params, 8 * system.reserved_nodes, scale_eff=system.scale_eff
        )
        self.agents = system.agents or system.reserved_nodes  # weight senders
        self.trace = sorted(trace or [])
        if system.kind == "verl":
            n, kind = 4 * system.reserved_nodes, "reserved"
        else:
            n, kind = system.instances, "rollout"
        self.engines = [Engine(i, kind, self.model) for i in range(n)]
        self.records: list[dict] = []
        self.timeline: list[tuple[float, float, int]] = []
        self.requests: list[Request] = []

    # -- clock ---------------------------------------------------------------------------------

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    # -- engines -------------------------------------------------------------------------------

    async def roll(self, e: Engine, take: Callable[[Engine, int], None]) -> None:
        """Decode blocks on ``e`` until it has nothing to run; ``take(e, room)`` moves up to
        ``room`` new requests into ``e.running`` before each block."""
        while True:
            take(e, self.sy.max_batch - len(e.running))
            if not e.running:
                return
            t0, live = self.now(), e.running
            dt, new = e.time.block(
                [r.key for r in live],
                np.fromiter((r.have for r in live), np.int64, len(live)),
                np.fromiter((r.target for r in live), np.int64, len(live)),
                self.sy.block,
            )
            await asyncio.sleep(dt)
            t1 = self.now()
            for r, n in zip(live, new.tolist()):
                r.have += n
            made = int(new.sum())
            e.busy_s += t1 - t0
            e.blocks.append((t0, t1, made))
            self.st["spot_tokens" if e.kind == "rollout" else "reserved_tokens"] += made
            if e.kind == "rollout":
                self.timeline.append((t0, t1, made))
            done = [r for r in e.running if r.have >= r.target]
            if done:
                e.last_done = t1
                e.running = [r for r in e.running if r.have < r.target]
                for r in done:
                    self.response_done(r, e)

    @staticmethod
    def take_pending(e: Engine, room: int) -> None:
        while e.pending and room > 0:
            e.running.append(e.pending.popleft())
            room -= 1

    def take_shared(self, e: Engine, room: int) -> None:
        for _ in range(min(room, self.pull_cap)):
            if not self.queue:
                return
            e.running.append(self.queue.popleft())

    def response_done(self, r: Request, e: Engine) -> None:
        r.done_by, r.done_count = e.id, r.done_count + 1
        self.st["last_response"] = self.now() - self.step_t0
        self.left[r.group] -= 1
        if self.left[r.group] == 0:
            self.ready.append(sum(PROMPT_TOKENS + q.have for q in self.groups[r.group]))
            self.group_done.set()

    # -- the trainer ---------------------------------------------------------------------------

    async def train(self) -> None:
        """Dynamic micro-batches (section 4.1): wait for ``min(m_b, groups left)`` finished
        groups, train all that are ready, repeat; then the reshard (``sync_s``)."""
        trained = 0
        while trained < PROMPTS:
            need = min(self.sy.micro_batch, PROMPTS - trained)
            if len(self.ready) < need:
                t0 = self.now()
                while len(self.ready) < need:
                    self.group_done.clear()
                    await self.group_done.wait()
                self.st["t_train_wait"] += self.now() - t0
            n, tokens = len(self.ready), sum(self.ready)
            self.ready = []
            dt = self.trainer.train_s(tokens)
            self.st["t_train"] += dt
            await asyncio.sleep(dt)
            trained += n
        await asyncio.sleep(self.trainer.sync_s)

    # -- steps ---------------------------------------------------------------------------------

    async def run(self, duration_s: float, max_steps: int = 10**6) -> list[dict]:
        """Steps until ``duration_s`` emulated seconds have passed or ``max_steps`` ran."""
        step = 0
        while self.now() < duration_s and step < max_steps:
            await self.step(step)
            step += 1
        return self.records

    async def step(self, step: int) -> None:
        sy, wl = self.sy, self.wl
        self.step_t0 = t_start = self.now()
        self.st = dict.fromkeys(
            ("t_train_wait", "t_train", "spot_tokens", "reserved_tokens", "push_s"), 0.0
        )
        self.st["last_response"] = 0.0
        keys = [(step, p, j) for p in range(PROMPTS) for j in range(SAMPLES)]
        targets = wl.lengths.lengths(wl.seed, keys)
        reqs = [
            Request(i, k[1], int(t), key=f"{step}/{i}")
            for i, (k, t) in enumerate(zip(keys, targets))
        ]
        self.requests = reqs
        self.groups = [reqs[p * SAMPLES : (p + 1) * SAMPLES] for p in range(PROMPTS)]
        self.left = [SAMPLES] * PROMPTS
        self.ready: list[int] = []
        self.group_done = asyncio.Event()
        for e in self.engines:
            e.busy_s, e.blocks = 0.0, []
        if sy.kind == "verl":
            for e, share in zip(self.engines, static_shares(len(reqs), len(self.engines))):
                e.pending.extend(reqs[share])
            await asyncio.gather(*(self.roll(e, self.take_pending) for e in self.engines))
            await self.train()
        else:
            push = transfer_s(self.model, len(self.engines), self.agents)
            self.st["push_s"] = push
            await asyncio.sleep(push)  # synchronized: every instance waits for the push
            self.queue = deque(reqs)
            self.pull_cap = -(-len(reqs) // len(self.engines))
            trainer = asyncio.create_task(self.train())  # waits from the rollout's start
            rollers = [asyncio.create_task(self.roll(e, self.take_shared)) for e in self.engines]
            await asyncio.gather(trainer, *rollers)  # an engine's error ends the run, not hangs
        self.records.append(self.record(step, t_start, reqs))

    def record(self, step: int, t_start: float, reqs: list[Request]) -> dict:
        """The step's record, with the old simulator's keys."""
        sy, now = self.sy, self.now()
        dur = now - t_start
        rollout = self.sy.kind == "disagg"
        n_inst = len(self.engines) if rollout else 0
        inst_s = n_inst * dur
        worked = [e for e in self.engines if rollout and e.last_done is not None]
        worked = [e for e in worked if e.last_done >= t_start]
        busy = sum(e.busy_s for e in self.engines) if rollout else 0.0
        return {
            "step": step,
            "t_start": t_start,
            "step_s": dur,
            "tokens": sum(PROMPT_TOKENS + r.have for r in reqs),
            "reserved_cost": dur / 3600 * sy.reserved_nodes * RESERVED_NODE_PER_H,
            "instance_s": inst_s,
            "spot_cost": inst_s / 3600 * ROLLOUT_PER_H,
            "t_seed": None,
            "n_prem": n_inst,
            "n_bar": float(n_inst),
            "n_hat": n_inst,
            "available": n_inst if rollout else self.available(now),
            "memory_hit": None,
            "t_train_wait": self.st["t_train_wait"],
            "t_remote_wait": sum(now - e.last_done for e in worked) / max(len(worked), 1),
            "t_train": max(self.st["t_train"], 1e-6),
            "t_remote": busy / n_inst if n_inst else 0.0,
            "spot_tokens": self.st["spot_tokens"],
            "reserved_tokens": self.st["reserved_tokens"],
            "migrated": 0.0,
            "preemptions": 0.0,
            "rebalanced": 0.0,
            "seed_end": 0.0,
            "push_s": self.st["push_s"],
            "last_response": self.st["last_response"],
        }

    def available(self, t: float) -> int:
        """Instances the trace offers at ``t`` (veRL uses none; recorded for the figures)."""
        n = 0
        for t_i, c in self.trace:
            if t_i > t:
                break
            n = c
        return n


def static_shares(n: int, engines: int) -> list[slice]:
    """veRL's partition: contiguous shares of ``n`` requests over ``engines``, the first
    ``n % engines`` one larger."""
    base, extra = divmod(n, engines)
    out, i = [], 0
    for k in range(engines):
        size = base + (k < extra)
        out.append(slice(i, i + size))
        i += size
    return out


def run_loop(coro):
    """Run ``coro`` on a fresh virtual-time loop (:func:`run_virtual` at this module's tick)."""
    return run_virtual(coro, resolution=RESOLUTION_S, noop_cycles=NOOP_CYCLES, on_grid=False)


def run_baseline(
    system: System,
    wl: Workload,
    duration: float,
    trace=None,
    events=(),
    max_steps: int = 10**6,
    warmup: int = 0,
    seed: int = 0,
) -> dict:
    """Run baseline ``system`` (kind ``verl`` | ``disagg``) for ``duration`` emulated seconds
    (whole steps; ``math.inf`` with ``max_steps``). ``seed`` is accepted for the common
    signature: the baselines draw nothing at random (response lengths follow ``wl.seed``).

    Returns ``{"system", "records", "timeline", **summarise(records, warmup)}``, as the old
    ``spot_cluster.run``.

    Raises:
        ValueError: see :class:`BaselineCluster`.
    """
    del seed
    cl = BaselineCluster(system, wl, trace, events)
    rec = run_loop(cl.run(duration, max_steps))
    return {
        "system": asdict(system),
        "records": rec,
        "timeline": cl.timeline,
        **summarise(rec, warmup),
    }


def disagg_size(wl: Workload, reserved_nodes: int = 1, steps: int = 2) -> dict:
    """Disagg.BAL's instance count as StreamRL's resource optimizer balances the stages
    (paper:322): rollout time taken to scale as ``1 / k`` over ``k`` reserved 2xH100 instances
    (its linear model), ``k = ceil(R_1 / T_train)`` with ``R_1`` one instance's rollout of the
    step (push excluded) and ``T_train`` the step's training + reshard (means over ``steps``
    emulated steps of Disagg.BAL with one instance). As the old ``spot_cluster.disagg_size``."""
    one = System(
        "Disagg.BAL", "disagg", reserved_nodes, seeding=False, rebalance=False,
        dispatch="shared", weights="sync", instances=1,
    )  # fmt: skip
    rec = run_baseline(one, wl, math.inf, max_steps=steps)["records"]
    sync = TrainModel(throughput_preset(wl.model).params, 8 * reserved_nodes).sync_s
    train = float(np.mean([r["t_train"] for r in rec])) + sync
    r1 = float(np.mean([r["last_response"] - r["push_s"] for r in rec]))
    return {
        "k": max(1, math.ceil(r1 / train)),
        "rollout_1_s": r1,
        "train_s": train,
        "rule": "ceil(R_1 / T_train)",
    }


def _main() -> None:  # pragma: no cover - a quick look: python spot_cluster_baselines.py
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--instances", type=int, default=3)
    a = ap.parse_args()
    nodes = 2 if a.model == "qwen3-32b" else 1
    wl = Workload(a.model)
    for sy in (
        System("veRL", "verl", nodes, seeding=False, rebalance=False, dispatch="static"),
        System("Disagg.BAL", "disagg", nodes, instances=a.instances, weights="sync"),
    ):
        r = run_baseline(sy, wl, math.inf, max_steps=a.steps)
        print(f"{sy.name}: {r['throughput']:,.1f} tok/s {r['tokens_per_dollar']:,.1f} tok/$")


if __name__ == "__main__":
    _main()
