"""Bounded staleness at run time: up to ``K + 1`` training steps in flight, the runner unchanged.

``trainer.max_staleness=K`` (issue 32 item 1). A runner's ``step(n)`` is the algorithm: put
the step's prompts, ``rollout.generate``, ``reward.score``, ``actor.train``, wait,
``sync_weights(actor, rollout)``. With ``K = 0`` :class:`StepPipeline` calls it once per step,
in order: today's on-policy run. With ``K >= 1`` each step runs on a driver thread of its own:

- **Admission** (the bound): step ``m`` starts once step ``m - K - 1`` has finished (its
  weight sync returned and its record was taken), so its rollout starts with weights of version
  ``>= m - 1 - K`` while the actor trains step ``m`` at version ``m - 1``: no token is trained
  more than K versions after the weights that sampled it (with partial rollouts a sequence's
  later tokens come from newer weights: the bound holds a fortiori). The first step runs
  alone: it profiles which groups and channels a step calls (:mod:`m2flow.core.ordering`).
  With ``trainer.staleness_policy=drop`` (``ahead=1``) a step starts one step earlier, and the
  trainer drops the samples whose oldest token broke the bound (TRL's asynchronous GRPO
  discards such samples the same way).
- **Order**: what the step threads issue reaches each group and channel in step order
  (:class:`~m2flow.core.ordering.StepOrder`), so channel epochs stay steps and step ``m + 1``'s
  update waits for step ``m``'s weight send; only a sync's receive overtakes.
- **Partial rollouts** (``partial``): a sync's receive loads into rollout ranks *during* their
  running ``generate`` call, between decode steps (the engines' ``update_weights``), so the
  sequences in flight continue with the new weights and every token keeps the version that
  sampled it. Without it the receive queues behind the rollout's running call.
- **Records in order**: ``done(n, result)`` runs in the calling thread, in step order (logs,
  evaluation, checkpoints). A step for which ``flush_at(n)`` holds is a *flush*: no later step
  starts before its ``done`` ran, so an evaluation sees exactly version ``n`` and a checkpoint
  holds no sequence in flight (resume then trains every prompt exactly once; see
  ``docs/concepts/async.md``).
- **Failure**: the first step that raises (or ``done``) stops the run: its error is raised
  here at once, the threads waiting for their turn wake with
  :class:`~m2flow.core.ordering.StepOrderError`, and steps still in flight are left to the
  cluster's shutdown (their threads are daemons: nothing waits for them).

Sources: veRL's one-step off-policy and fully asynchronous trainers, AReaL's
``max_head_offpolicyness`` (admission by version), RLinf section 3.3 (a channel epoch is a step).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from m2flow.core import ordering
from m2flow.core.ordering import StepOrderError

POLL_S = 0.5  # how often the driver looks for a failed step while it waits for the oldest


class StepPipeline:
    """Runs training steps with bounded staleness (see the module docstring).

    Args:
        max_staleness: K, in weight versions (``>= 0``; 0: one step at a time, as before).
        partial: weight syncs inside a step load into the rollout during its generation.
        flush_at: steps after which nothing runs ahead (evaluation, checkpoint steps).
        ahead: steps admitted beyond the bound (``trainer.staleness_policy=drop``: 1; the
            trainer then drops the samples that broke it, ``actor.off_policy.max_lag``).

    Raises:
        ValueError: a negative or non-integer ``max_staleness``.
    """

    def __init__(
        self,
        max_staleness: int,
        partial: bool = False,
        flush_at: Callable[[int], bool] = lambda n: False,
        ahead: int = 0,
    ) -> None:
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int):
            raise ValueError(f"max_staleness={max_staleness!r}: an integer >= 0 (versions)")
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0 (versions)")
        self.k, self.partial, self.flush_at = max_staleness, partial, flush_at
        self.ahead = ahead if max_staleness else 0

    def run(
        self,
        steps: Sequence[int],
        step: Callable[[int], Any],
        done: Callable[[int, Any], None],
    ) -> None:
        """Run ``step(n)`` for every ``n`` of ``steps`` (consecutive), calling ``done(n, result)``
        in step order in this thread.

        Raises:
            whatever a step or ``done`` raised (the earliest step's), at once.
        """
        steps = list(steps)
        if not steps:
            return
        if self.k == 0:
            for n in steps:
                done(n, step(n))
            return
        self._run_pipelined(steps, step, done)

    def _run_pipelined(self, steps: list[int], step, done) -> None:
        first, last = steps[0], steps[-1]
        order = ordering.StepOrder(first, self.partial)
        results: dict[int, tuple[bool, Any]] = {}
        finished = threading.Condition()
        threads: dict[int, threading.Thread] = {}

        def body(n: int) -> None:
            try:
                with order.step(n):
                    out = (True, step(n))
            except BaseException as e:  # handed to the driver thread
                order.fail(e)
                out = (False, e)
            with finished:
                results[n] = out
                finished.notify_all()

        def admissible(m: int, completed: int) -> bool:
            if m > last:
                return False
            if m == first:
                return True
            if completed < first or m - self.k - 1 - self.ahead > completed:
                return False
            return not any(self.flush_at(f) for f in range(completed + 1, m))

        ordering.activate(order)
        completed, upcoming = first - 1, first
        try:
            while completed < last:
                while admissible(upcoming, completed):
                    t = threading.Thread(
                        target=body, args=(upcoming,), name=f"m2flow-step-{upcoming}", daemon=True
                    )
                    threads[upcoming] = t
                    t.start()
                    upcoming += 1
                n = completed + 1
                with finished:  # the oldest step's result, or any step's failure
                    while n not in results and all(ok for ok, _ in results.values()):
                        finished.wait(POLL_S)
                    failed = sorted(m for m, (ok, _) in results.items() if not ok)
                if failed:  # the earliest real cause (later steps only saw it stop them)
                    causes = [m for m in failed if not isinstance(results[m][1], StepOrderError)]
                    raise results[(causes or failed)[0]][1]
                ok, value = results.pop(n)
                try:
                    done(n, value)
                except BaseException as e:
                    order.fail(e)
                    raise
                completed = n
        finally:
            ordering.activate(None)


def staleness_of(trainer, cluster) -> tuple[int, str]:
    """The run's K from ``trainer.max_staleness``: the integer given, or with ``auto`` the
    plan's (``cluster.placement.max_staleness``, set by ``plan=auto``; 0 without one), and a
    console note for ``auto`` (``""`` otherwise).

    Raises:
        ConfigError: a value :func:`~m2flow.run.recipe.staleness_bound` refuses.
    """
    from .recipe import staleness_bound

    k = staleness_bound(trainer.max_staleness)
    if k != "auto":
        return k, ""
    planned = getattr(cluster.placement, "max_staleness", None)
    if planned is None:
        return 0, "trainer.max_staleness=auto without plan=auto: K=0 (on-policy)"
    return planned, f"trainer.max_staleness=auto: K={planned}, the plan's"
