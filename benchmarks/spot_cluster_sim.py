"""A discrete-event emulation of RLBoost's cluster (section 6), in emulated time, deterministic
given a seed: what ``benchmarks/spot_cluster.py`` runs for every figure.

No Ray and no sleeping: an event heap advances a clock. What is the project's own code:

- engine time: :class:`~m2flow.workers.rollout.emulated.ThroughputModel` (decode iteration,
  prefill, weight transfer; the Qwen3 TP-2 H100 presets) and the KV admission of
  :class:`~m2flow.workers.rollout.emulated.EmulatedEngine` (block by block, a request that
  does not fit waits and loses its cache);
- response lengths: :class:`~m2flow.workers.rollout.emulated.ResponseLengths` (keyed by
  ``(seed, step, prompt, sample)``: the same response has the same length in every system);
- Algorithm 1: :class:`~m2flow.scheduler.spot.seeding.SeedingPolicy` (``T_seed``, ``N_prem``,
  memory) fed the step's measured waits and compute times;
- Algorithm 2: :func:`~m2flow.scheduler.spot.balance.select_instance` (JSQ with Θ, delayed
  dispatch) and :func:`~m2flow.scheduler.spot.balance.rebalance` (continuous rebalancing;
  executing moves go to ``Move.dst``);
- availability: :func:`~m2flow.scheduler.spot.trace.generate_segment` (Table 5's segments).

What this module models (the manager's mechanisms, as the paper describes them): the step
(seeding window on the reserved engines, then dynamic micro-batch training of finished GRPO
groups, then the weight reshard), token-level collection (a preempted or seeding-stopped
request keeps the tokens made up to that instant; ``migration="recompute"`` drops them),
instance starts, pull-based or synchronized weight transfer, the trace replayer of Appendix C
(a preemption hits a random offered instance; a replacement starts at once when one is
offered and ``N_prem`` allows), and the three baselines of section 6.2:

- ``verl``: colocated; the batch is partitioned statically over the training cluster's TP-2
  engines (contiguous shares, no JSQ, no Θ, no rebalancing, no migration), then training.
- ``disagg``: the training cluster only trains; ``instances`` always-on (reserved-priced)
  2xH100 rollout instances take requests from one shared queue as they have batch room (no
  seeding, no migration, no rebalancing); weights are pushed to all of them before rollout
  (synchronized), through the training nodes' frontend NICs; finished groups train in dynamic
  micro-batches (StreamRL's pipelining).
- ``rlboost``: the paper's system, with switches for the ablations.

Times are emulated seconds. Chosen numbers are marked where defined.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import deque
from pathlib import Path

import numpy as np
from m2flow.scheduler.spot.balance import rebalance, select_instance
from m2flow.scheduler.spot.seeding import SeedingPolicy, StepStats
from m2flow.workers.rollout.emulated import throughput_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spot_cluster_model import (  # noqa: E402, F401  (re-exported for the benchmark)
    CAP,
    PROMPT_TOKENS,
    PROMPTS,
    RESERVED_GPU_PER_H,
    RESERVED_NODE_PER_H,
    SAMPLES,
    SPOT_INSTANCE_PER_H,
    START_S,
    Eng,
    Req,
    System,
    TrainModel,
    Workload,
    block_seconds,
    summarise,
    transfer_s,
    with_cap,
)


class Sim:
    """One run of ``system`` on ``workload`` under an availability ``trace`` (``[(t, count)]``,
    absolute seconds) and step-relative ``events`` (``(step, t_rel, action, n)``, action
    ``preempt`` | ``add`` | ``restart``). :meth:`run` returns per-step records."""

    def __init__(
        self, system: System, workload: Workload, trace=None, events=(), rng_seed: int = 0
    ) -> None:
        self.sy, self.wl = system, workload
        self.model = throughput_preset(workload.model)
        self.trainer = TrainModel(
            self.model.params, 8 * system.reserved_nodes, scale_eff=system.scale_eff
        )
        self.rng = np.random.default_rng(rng_seed + 7919)
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.trace = list(trace or [])
        self.events = list(events)
        n_resv = 4 * system.reserved_nodes
        self.reserved = [Eng("reserved", self.model) for _ in range(n_resv)]
        self.policy = SeedingPolicy(
            n_resv,
            system.eta,
            system.t_init if system.seeding else 0.0,
            use_memory=system.memory,
            n_prem_min=1,
        )
        if system.n_prem_fixed is not None:
            self.policy.n_prem = system.n_prem_fixed
        self.held: list[Eng] = []
        self.agents = system.agents or system.reserved_nodes  # weight senders (section 4.3)
        self.available = 0
        self.version = -1
        self.records: list[dict] = []
        self.timeline: list[tuple[float, float, int]] = []  # (t0, t1, spot tokens) per block

    # -- events ------------------------------------------------------------------------------

    def push(self, t: float, kind: str, *args) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, args))

    def n_prem(self) -> int:
        if self.sy.kind == "disagg":
            return self.sy.instances
        if self.sy.n_prem_fixed is not None:
            return self.sy.n_prem_fixed
        return self.policy.n_prem

    def fill_pool(self) -> None:
        if self.sy.kind == "verl":
            return
        while len(self.held) < min(self.n_prem(), self.available):
            e = Eng("spot", self.model)
            e.alloc_t = self.now
            self.held.append(e)
            self.push(self.now + START_S, "up", e)

    def kill(self, e: Eng, preempted: bool) -> None:
        self.cut(e)
        e.alive = False
        self.held.remove(e)
        back = [*e.running, *e.pending]
        for r in back:
            if r.have and preempted:
                r.moves += 1
                self.st["migrated"] += 1
                if self.sy.migration == "recompute":
                    r.have = 0
            r.cached = -1
        e.running, e.pending, e.revoke = [], deque(), {}
        self.queue.extendleft(reversed(back))
        if preempted:
            self.st["preemptions"] += 1

    def trace_change(self, count: int) -> None:
        while self.available > count:
            if self.held and self.rng.random() < len(self.held) / self.available:
                self.kill(self.held[int(self.rng.integers(len(self.held)))], True)
            self.available -= 1
        self.available = max(self.available, count)
        self.fill_pool()

    # -- engines -----------------------------------------------------------------------------

    def eligible(self) -> list[Eng]:
        out = [e for e in self.reserved if self.seeding] if self.sy.kind != "disagg" else []
        return out + [e for e in self.held if e.up and e.version == self.version]

    def start_block(self, e: Eng) -> None:
        if e.block is not None or not e.alive:
            return
        room = self.sy.max_batch - len(e.running)
        if self.sy.dispatch == "shared":
            share = -(-PROMPTS * SAMPLES // max(len(self.held), 1))
            for _ in range(min(room, share)):
                if not self.queue:
                    break
                e.running.append(self.queue.popleft())
        else:
            while e.pending and room > 0:
                e.running.append(e.pending.popleft())
                room -= 1
        if not e.running:
            return
        live = e.running
        tgt = np.fromiter((r.target for r in live), np.int64, len(live))
        have = np.fromiter((r.have for r in live), np.int64, len(live))
        ctx = have + PROMPT_TOKENS
        new = np.minimum(tgt - have, self.sy.block)
        fits = np.cumsum(ctx + new) <= self.model.kv_capacity_tokens
        fits[0] = True
        run = np.flatnonzero(np.logical_and.accumulate(fits))
        cold = [i for i in run if live[i].cached != e.id]
        pre = self.model.prefill_s(ctx[cold]) if cold else 0.0
        for i in range(len(run), len(live)):
            live[i].cached = -1
        dt = pre + block_seconds(self.model, ctx[run], new[run])
        e.block = (self.now, self.now + dt, pre, [live[i] for i in run], new[run])
        self.push(self.now + dt, "block", e, e.gen)

    def finish_block(self, e: Eng, frac: float = 1.0) -> None:
        """Apply the block in flight, whole (``frac`` 1) or cut at ``frac`` of its decode."""
        t0, t1, pre, reqs, new = e.block
        e.block = None
        k = math.floor(frac * int(new.max())) if frac < 1 else None
        made = 0
        for r, n in zip(reqs, new):
            n = int(n) if k is None else min(int(n), k)
            r.have += n
            r.cached = e.id
            made += n
            if e.kind == "spot":
                r.spot_tokens += n
        e.busy_s += self.now - t0
        if e.kind == "spot":
            self.timeline.append((t0, self.now, made))
        self.st["spot_tokens" if e.kind == "spot" else "reserved_tokens"] += made
        done = [r for r in e.running if r.have >= r.target]
        if done:
            e.last_done = self.now
            keep = [r for r in e.running if r.have < r.target]
            e.running = keep
            for r in done:
                self.response_done(r)
        if e.revoke:
            moved = [r for r in e.running if id(r) in e.revoke]
            e.running = [r for r in e.running if id(r) not in e.revoke]
            for r in moved:
                dst = e.revoke[id(r)]
                r.moves += 1
                (dst.pending if dst.alive else self.queue).appendleft(r)
                self.st["rebalanced"] += 1
            e.revoke = {}

    def cut(self, e: Eng) -> None:
        """Stop ``e``'s block now, keeping the tokens made so far (token-level collection)."""
        if e.block is None:
            return
        t0, t1, pre, _, _ = e.block
        span = t1 - t0 - pre
        frac = min(max((self.now - t0 - pre) / span, 0.0), 1.0) if span > 0 else 1.0
        e.gen += 1
        self.finish_block(e, frac)

    # -- manager -----------------------------------------------------------------------------

    def dispatch(self) -> None:
        elig = self.eligible()
        if self.sy.dispatch == "static" or self.sy.dispatch == "shared":
            pass
        elif self.sy.dispatch == "round_robin":
            while self.queue and elig:
                elig[self.rr % len(elig)].pending.append(self.queue.popleft())
                self.rr += 1
        else:
            by_id = {e.id: e for e in elig}
            fair = self.sy.seed_share == "fair" and self.held  # a reserved engine: its share
            if fair:
                by_id = {k: e for k, e in by_id.items() if e.kind == "spot" or e.got < self.share}
            while self.queue and by_id:
                pick = select_instance({k: len(e.pending) for k, e in by_id.items()}, self.sy.theta)
                if pick is None:
                    break  # delayed dispatch: wait for a completion
                e = by_id[pick]
                e.pending.append(self.queue.popleft())
                e.got += 1
                if fair and e.kind == "reserved" and e.got >= self.share:
                    del by_id[pick]
        if self.sy.rebalance and self.step > 0 and self.sy.dispatch in ("jsq", "round_robin"):
            self.rebalance(elig)
        for e in elig if self.sy.dispatch != "shared" else self.held:
            if e.up and e.version == self.version:
                self.start_block(e)

    def rebalance(self, elig: list[Eng]) -> None:
        if len(elig) < 2:
            return
        by_id = {e.id: e for e in elig}
        ctxs = [PROMPT_TOKENS + r.have for e in elig for r in e.running]
        plateau = self.model.plateau(float(np.mean(ctxs))) if ctxs else None
        for _ in range(256):
            moves = rebalance(
                {e.id: len(e.pending) for e in elig},
                {e.id: len(e.running) - len(e.revoke) for e in elig},
                plateau,
            )
            if not moves:
                return
            m = moves[0]
            src, dst = by_id[m.src], by_id[m.dst]
            if not m.executing:
                dst.pending.append(src.pending.pop())
            else:
                cand = [r for r in src.running if id(r) not in src.revoke]
                for r in cand[-m.count :]:
                    src.revoke[id(r)] = dst
            self.st["rebalance_moves"] += 1

    def response_done(self, r: Req) -> None:
        self.st["last_response"] = self.now - self.step_t0
        self.left[r.group] -= 1
        if self.left[r.group] == 0:
            self.ready.append(sum(PROMPT_TOKENS + q.have for q in self.groups[r.group]))
            self.try_train()

    # -- the trainer ---------------------------------------------------------------------------

    def try_train(self) -> None:
        if self.phase != "train" or self.train_busy:
            return
        remaining = PROMPTS - self.trained
        if not self.ready or len(self.ready) < min(self.sy.micro_batch, remaining):
            if self.wait_since is None:
                self.wait_since = self.now
            return
        if self.wait_since is not None:
            self.st["t_train_wait"] += self.now - self.wait_since
            self.wait_since = None
        n, tokens = len(self.ready), sum(self.ready)
        self.ready = []
        dt = self.trainer.train_s(tokens)
        self.st["t_train"] += dt
        self.train_busy = True
        self.push(self.now + dt, "trained", n)

    def end_seeding(self) -> None:
        self.seeding = False
        for e in self.reserved:
            self.cut(e)
            back = [*e.running, *e.pending]
            for r in back:
                r.cached = -1
            e.running, e.pending, e.revoke = [], deque(), {}
            self.queue.extendleft(reversed(back))
        self.st["seed_end"] = self.now - self.step_t0
        self.phase = "train"
        self.try_train()
        self.dispatch()

    def maybe_end_seeding(self) -> None:
        """At ``T_seed`` once an instance serves the current weights (else the colocated
        fallback goes on), or as soon as the training cluster has nothing left to roll out."""
        if not self.seeding or self.phase != "seed" or self.sy.kind != "rlboost":
            return
        rollout_left = bool(self.queue) or any(e.running or e.pending for e in self.reserved)
        spot_ready = any(e.up and e.version == self.version for e in self.held)
        if not rollout_left or (self.now >= self.seed_deadline and spot_ready):
            self.end_seeding()

    # -- a step --------------------------------------------------------------------------------

    def run(self, duration_s: float, max_steps: int = 10**6) -> list[dict]:
        if self.trace:
            self.available = 0
            self.trace_change(self.trace[0][1])
            for e in self.held:  # present at t = 0: started and on the first weights
                e.up, e.version = True, 0
            for t, c in self.trace[1:]:
                self.push(t, "trace", c)
        if self.sy.kind == "disagg":
            self.available = self.sy.instances
            self.fill_pool()
            for e in self.held:
                e.up = True
        step = 0
        while self.now < duration_s and step < max_steps:
            self.run_step(step)
            step += 1
        return self.records

    def run_step(self, step: int) -> None:
        sy, wl = self.sy, self.wl
        self.step, self.step_t0, self.version = step, self.now, step
        self.st = {
            k: 0.0
            for k in (
                "t_train_wait",
                "t_train",
                "spot_tokens",
                "reserved_tokens",
                "migrated",
                "preemptions",
                "rebalanced",
                "rebalance_moves",
                "seed_end",
                "push_s",
                "last_response",
            )
        }
        self.rr = 0
        keys = [(step, p, j) for p in range(PROMPTS) for j in range(SAMPLES)]
        targets = wl.lengths.lengths(wl.seed, keys)
        reqs = [Req(k[1], int(t), 0, -1, 0, 0) for k, t in zip(keys, targets)]
        self.groups = [reqs[p * SAMPLES : (p + 1) * SAMPLES] for p in range(PROMPTS)]
        self.left = [SAMPLES] * PROMPTS
        self.ready, self.trained, self.train_busy, self.wait_since = [], 0, False, None
        self.queue: deque[Req] = deque()
        for e in self.reserved:  # resharded in place after training (TrainModel.sync_s)
            e.up, e.version = True, step
        for e in [*self.reserved, *self.held]:
            e.got = 0
        # Algorithm 1's N_prem takes effect: release what is over it (idle at a step's start)
        while sy.kind == "rlboost" and len(self.held) > self.n_prem():
            e = sorted(self.held, key=lambda x: (x.up, -x.alloc_t))[0]
            self.kill(e, preempted=False)
        self.fill_pool()
        self.share = -(-PROMPTS * SAMPLES // (len(self.reserved) + len(self.held)))
        self.n_track = [self.now, 0.0]
        # weights of version ``step``
        t_roll = self.now
        if sy.kind == "disagg" or sy.weights == "sync":
            up = [e for e in self.held if e.up]
            dt = transfer_s(self.model, len(up), self.agents) if up else 0.0
            self.st["push_s"] = dt
            t_roll = self.now + dt
            for e in up:
                e.version = step
        else:
            up = [e for e in self.held if e.up]
            for e in up:
                e.version = -1
                self.push(self.now + transfer_s(self.model, len(up), self.agents), "ready", e, step)
        if sy.kind == "verl" or sy.dispatch == "static":
            share = len(reqs) // len(self.reserved)
            for i, e in enumerate(self.reserved):
                e.pending.extend(reqs[i * share : (i + 1) * share])
            self.seeding, self.seed_deadline = True, math.inf
            self.phase = "seed"
        elif sy.kind == "disagg":
            self.queue.extend(reqs)
            self.seeding, self.seed_deadline, self.phase = False, 0.0, "wait_push"
        else:
            self.queue.extend(reqs)
            self.seeding, self.phase = True, "wait_push"
            self.seed_deadline = t_roll + (self.policy.t_seed if sy.seeding else 0.0)
        t_seed_used = self.seed_deadline - t_roll if sy.kind == "rlboost" else None
        self.push(t_roll, "roll", step)
        end = None
        while end is None:
            t, _, kind, args = heapq.heappop(self.heap)
            self.track_n(t)
            self.now = t
            if kind == "block":
                e, gen = args
                if gen != e.gen or not e.alive or e.block is None:
                    continue
                self.finish_block(e)
                if self.sy.kind == "verl" and self.all_done():
                    self.seeding = False
                    self.phase = "train"
                    self.try_train()
                self.maybe_end_seeding()
                self.dispatch()
            elif kind == "roll":
                if self.phase == "wait_push":
                    self.phase = "seed" if self.seeding else "train"
                if self.phase == "train":
                    self.try_train()
                self.dispatch()
                self.push(max(self.seed_deadline, self.now), "deadline")
            elif kind == "deadline":
                self.maybe_end_seeding()
            elif kind == "trace":
                self.trace_change(args[0])
                self.dispatch()
            elif kind == "up":
                e = args[0]
                if not e.alive:
                    continue
                e.up = True
                if sy.weights == "pull" and sy.kind == "rlboost":
                    self.push(
                        self.now + transfer_s(self.model, 1, self.agents),
                        "ready",
                        e,
                        self.version,
                    )
            elif kind == "ready":
                e, version = args
                if e.alive and version == self.version:  # else a pull of older weights
                    e.version = self.version
                    self.maybe_end_seeding()
                    self.dispatch()
            elif kind == "trained":
                self.trained += args[0]
                self.train_busy = False
                if self.trained == PROMPTS:
                    self.push(self.now + self.trainer.sync_s, "end")
                else:
                    self.try_train()
            elif kind == "end":
                end = self.now
            elif kind == "event":
                self.step_event(*args)
            if kind in ("roll",) and step >= 0:
                for s, t_rel, action, n in self.events:
                    if s == step:
                        self.push(t_roll + t_rel, "event", action, n)
        self.finish_step(reqs, t_seed_used)

    def all_done(self) -> bool:
        return all(n == 0 for n in self.left)

    def step_event(self, action: str, n: int) -> None:
        for _ in range(n):
            if action == "add":
                self.available += 1
                self.fill_pool()
            elif action == "preempt" and self.held:
                self.kill(self.held[int(self.rng.integers(len(self.held)))], True)
                self.available -= 1
            elif action == "restart" and self.held:
                self.kill(self.held[int(self.rng.integers(len(self.held)))], True)
                self.fill_pool()
        self.dispatch()

    def track_n(self, t: float) -> None:
        self.n_track[1] += len(self.held) * (t - self.n_track[0])
        self.n_track[0] = t

    def finish_step(self, reqs: list[Req], t_seed_used) -> None:
        sy = self.sy
        dur = self.now - self.step_t0
        n_bar = self.n_track[1] / dur if dur > 0 else 0.0
        n_hat = len(self.held)
        inst_s = self.n_track[1]
        tokens = sum(PROMPT_TOKENS + r.have for r in reqs)
        worked = [e for e in self.held if e.last_done is not None and e.last_done >= self.step_t0]
        stats = StepStats(
            n_bar=round(n_bar, 9),
            n_hat=n_hat,
            t_train_wait=self.st["t_train_wait"],
            t_remote_wait=sum(self.now - e.last_done for e in worked) / max(len(worked), 1),
            t_train=max(self.st["t_train"], 1e-6),
            t_remote=sum(e.busy_s for e in self.held) / n_bar if n_bar > 0 else 0.0,
        )
        n_prem_used = self.n_prem()
        mem_hit = None
        if sy.kind == "rlboost":
            before = dict(self.policy.memory)
            if sy.seeding:
                self.policy.update(stats)
                mem_hit = n_hat in before
            else:  # no seeding: line 9 off, line 10 still bounds the pool
                self.policy.t_seed = 0.0
                raw = stats.t_remote * stats.n_bar / stats.t_train
                self.policy.n_prem = max(1, math.ceil(raw - 1e-9))
        for e in self.held:
            e.busy_s = 0.0
        spot_price = (
            2 * RESERVED_GPU_PER_H
            if sy.reserved_price or sy.kind == "disagg"
            else SPOT_INSTANCE_PER_H
        )
        reserved_cost = dur / 3600 * sy.reserved_nodes * RESERVED_NODE_PER_H
        self.records.append(
            {
                "step": self.step,
                "t_start": self.step_t0,
                "step_s": dur,
                "tokens": tokens,
                "reserved_cost": reserved_cost,
                "instance_s": inst_s,
                "spot_cost": inst_s / 3600 * spot_price,
                "t_seed": t_seed_used,
                "n_prem": n_prem_used,
                "n_bar": n_bar,
                "n_hat": n_hat,
                "available": self.available,
                "memory_hit": mem_hit,
                "t_train_wait": stats.t_train_wait,
                "t_remote_wait": stats.t_remote_wait,
                "t_train": stats.t_train,
                "t_remote": stats.t_remote,
                **{
                    k: self.st[k]
                    for k in (
                        "spot_tokens",
                        "reserved_tokens",
                        "migrated",
                        "preemptions",
                        "rebalanced",
                        "seed_end",
                        "push_s",
                        "last_response",
                    )
                },
            }
        )
