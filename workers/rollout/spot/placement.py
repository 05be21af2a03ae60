"""Where the rollout manager's requests go (RLBoost Algorithm 2): **dispatch** of queued
requests to the instance with the fewest pending ones below Θ (SELECTINSTANCE; round robin as
the ablation), bounded for a seeding reserved rank by its share of the step's requests
(:func:`~m2flow.scheduler.spot.seeding_share`), and **rebalancing** (CONTINUOUSLB): pending
requests move to idle instances, executing ones beyond the batching plateau ``B`` are revoked,
with ``B`` calibrated to the running requests' mean context. The rules are the pure policies of
:mod:`m2flow.scheduler.spot`; the behaviour is stated in :mod:`.manager`'s docstring.
"""

from __future__ import annotations

import asyncio
import math

from m2flow.scheduler.spot import rebalance, seeding_share, select_instance

from .records import InstanceRecord, now

# the plateau B is recomputed when the running requests' mean context moves by this fraction
_CONTEXT_STEP = 0.02


class RequestPlacement:
    """The rollout manager's dispatch and rebalancing loops (a mixin of
    :class:`~.manager.RolloutManager`, whose instances, queue, policy, profile and config it
    uses)."""

    def _eligible(self) -> list[InstanceRecord]:
        return [
            i
            for i in self.instances.values()
            if i.accepting and i.version == self.version and self.version >= 0
        ]

    def _window_end(self, inst: InstanceRecord) -> float:
        """When reserved rank ``inst``'s seeding window of this step ends (the clock's s)."""
        return self.cur.seed_from.get(inst.id, inst.since) + self.cur.t_seed

    def _room(self, inst: InstanceRecord) -> int | None:
        """Requests instance ``inst`` may still be given: a seeding reserved rank's share of
        the step's requests less what it holds (:func:`~m2flow.scheduler.spot.seeding_share`;
        ``seed_share="fair"``), ``None`` (no bound) for a spot instance, with the ablation
        ``seed_share="all"``, or in the colocated fallback."""
        if inst.kind != "reserved" or self.cfg.seed_share == "all":
            return None
        spot = [i for i in self.instances.values() if i.kind == "spot" and i.accepting]
        share = seeding_share(
            self.cur.requests, self.policy.n_resv, min(self.policy.n_prem, len(spot)),
            ready=sum(1 for i in spot if i.version == self.version >= 0),
            window_over=now() >= self._window_end(inst),
        )  # fmt: skip
        return None if share is None else max(share - len(inst.pending) - len(inst.executing), 0)

    async def _dispatch_loop(self) -> None:
        while True:
            if not self.queue or self.paused:
                await self._wait_change(1.0)
                continue
            eligible = self._eligible()
            full = [i for i in eligible if self._room(i) == 0]  # reserved ranks at their share
            eligible = [i for i in eligible if all(i is not f for f in full)]
            pick = None
            if eligible and self.cfg.dispatch == "round_robin":
                pick = eligible[self._rr % len(eligible)].id
                self._rr += 1
            elif eligible:
                pick = select_instance({i.id: len(i.pending) for i in eligible}, self.cfg.theta)
            if pick is None:  # none ready, or every one holds theta pending: delayed dispatch
                # (or until a full reserved rank's window ends: its share may grow then)
                ends = [self._window_end(i) - now() for i in full]
                await self._wait_change(min([e for e in ends if e > 0] + [1.0]))
                continue
            self.instances[pick].pending.append(self.queue.popleft())
            self._changed()

    async def _rebalance_loop(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            if not self.cfg.rebalance or self.paused:
                continue
            live = {i.id: i for i in self._eligible()}
            self._calibrate(list(live.values()))
            if len(live) < 2:
                continue
            moves = rebalance(
                {k: len(i.pending) for k, i in live.items()},
                {k: len(i.executing - i.revoke.keys()) for k, i in live.items()},
                self.plateau,
                {k: self._room(i) for k, i in live.items()},
            )
            for m in moves:
                src, dst = live[m.src], live[m.dst]
                if not m.executing:
                    for _ in range(min(m.count, len(src.pending))):
                        dst.pending.append(src.pending.pop())
                else:
                    for rid in sorted(src.executing - src.revoke.keys())[: m.count]:
                        src.revoke[rid] = dst.id  # given back at src's next report, to dst
                self.stats["rebalanced_samples"] += m.count
            if moves:
                self._changed()

    def _calibrate(self, live: list[InstanceRecord]) -> None:
        """``B`` (Algorithm 2 line 24) at the mean length (prompt + tokens) of the requests
        executing on ``live``, as each instance last reported it with a block: ``P`` "is online
        captured ... during the previous step's rollout, and is continuously calibrated to
        account for the current average context length" (paper:251). Recomputed when that
        context moves by ``_CONTEXT_STEP`` or a step closes, on ``P`` frozen at the step's
        start (a rescale, no refit). None before a closed step (paper:251: executing requests
        migrate from the second step on)."""
        if self._profiled is None:
            return
        # the instances' last reported mean context, weighted by what they run (O(instances))
        held = [(len(i.executing), i.context) for i in live if i.executing and i.context]
        if not held:
            return
        context = sum(n * c for n, c in held) / sum(n for n, _ in held)
        bucket = round(math.log(max(context, 1.0)) / math.log1p(_CONTEXT_STEP))
        key = (self.profile.closed_steps, bucket)
        if key != self._plateau_key:
            self._plateau_key = key
            b = self._profiled.plateau(context_len=context)
            self.plateau = b if b is not None else self.plateau
