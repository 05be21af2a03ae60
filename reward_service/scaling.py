"""The scaling half of the reward service engine (DistRS section 5.2).

At each batch announcement and completion, :meth:`Scaling.rescale` schedules a decision of
every stage's worker count (:class:`~m2flow.scheduler.reward.scaling.DistRSPolicy`,
Algorithm 2 + 1) from the active batches and their tasks' histories; the floor (>= 1 worker
per stage while a batch is active) is applied at once. One decision runs at a time per
pipeline, outside the event loop, on a snapshot of the state; events that arrive meanwhile
are coalesced into one follow-up decision, so no tenant can stall another's scaling.
:class:`~.core.RewardService` mixes it in (it owns the state these methods read).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from m2flow.scheduler.reward.scaling import BatchView, DistRSPolicy

if TYPE_CHECKING:
    from .pools import Pool
    from .schemas import PipelineConfig
    from .state import Batch


class Scaling:
    """Worker-count decisions of :class:`~.core.RewardService` (a mixin: it uses the
    service's ``config``, ``tasks``, ``pools``, ``policies``, ``closing``, decision records,
    ``_spawn`` and ``_ensure``)."""

    def _policy(self, p: PipelineConfig) -> DistRSPolicy | None:
        if self.config.policy == "static":
            return None
        stages = list(p.stages.values())
        return DistRSPolicy(
            [s.timeout_s for s in stages],
            ebf=self.config.policy != "fcfs",
            timeout_check=self.config.policy != "history-only",
            caps=[s.max_workers for s in stages],
            cold_workers=[
                s.initial_workers if s.initial_workers is not None else s.max_workers
                for s in stages
            ],
            max_jobs=self.config.max_decision_jobs,
        )

    def _active(self, pipeline: str) -> list[Batch]:
        """The batches of ``pipeline`` not yet complete, every tenant's."""
        return [
            b
            for t in self.tasks.values()
            if t.pipeline == pipeline
            for b in t.batches.values()
            if not b.done
        ]

    def _floor(self, pool: Pool) -> int:
        pipe = next(n for n, ps in self.pools.items() if pool in ps)
        cfg = list(self.config.pipelines[pipe].stages.values())[pool.index]
        return max(cfg.min_workers, 1 if self._active(pipe) else 0)

    def rescale(self, pipeline: str, why: str) -> None:
        """Schedule a decision of the worker counts of ``pipeline``'s stages (Algorithm 2 +
        1); returns at once. The floor (>= 1 worker per stage while a batch is active) is
        applied now. One decision runs at a time per pipeline; a call while one runs is
        coalesced into a single follow-up decision on the newer state."""
        for pool in self.pools[pipeline]:
            if pool.target < self._floor(pool):
                pool.target = self._floor(pool)
                self._ensure(pool)
        if pipeline in self._deciding:
            self._deciding[pipeline] = why
            return
        self._deciding[pipeline] = None
        self._spawn(self._decide_until_current(pipeline, why))

    async def _decide_until_current(self, pipeline: str, why: str | None) -> None:
        try:
            while why is not None and not self.closing:
                await self._decide(pipeline, why)
                why, self._deciding[pipeline] = self._deciding[pipeline], None
        finally:
            del self._deciding[pipeline]

    async def _decide(self, pipeline: str, why: str) -> None:
        pools = self.pools[pipeline]
        cfgs = list(self.config.pipelines[pipeline].stages.values())
        active = self._active(pipeline)
        now = time.monotonic()
        policy = self.policies[pipeline]
        if policy is None:
            counts, secs, probes = [c.max_workers if active else 0 for c in cfgs], 0.0, 0
        else:
            views = [self._view(b, now) for b in active]  # a snapshot, taken on the loop
            dec = await asyncio.to_thread(policy.decide, views, now)
            counts, secs, probes = dec.workers, dec.seconds, dec.probes
        if self.closing:
            return
        for pool, c, cfg in zip(pools, counts, cfgs):
            pool.target = min(max(c, self._floor(pool)), cfg.max_workers)
            self._ensure(pool)
        self.n_decisions += 1
        self.decision_s_max = max(self.decision_s_max, secs)
        self.decisions.append(
            {
                "t_s": now - self.t0,
                "pipeline": pipeline,
                "why": why,
                "batches": len(active),
                "workers": [p.target for p in pools],
                "seconds": secs,
                "probes": probes,
            }
        )

    def _view(self, b: Batch, now: float) -> BatchView:
        queued, running = [], []
        for i, r in enumerate(b.live.values()):
            if r.running:
                running.append((r.stage, now - r.since, i))
            else:
                queued.append((r.stage, i, r.since))
        arrived = b.accounted  # settled requests will not come: not Future, not overdue
        return BatchView(
            (b.task.tenant, b.task.name, b.id),
            b.start,
            b.size,
            b.history,
            b.task.delay_bound_s,
            arrived,
            queued,
            running,
        )
