"""What the reward service shows of its state: a batch's status and the service's metrics.

A tenant sees only its own tasks; pool-level numbers and the queue's total are shared (they
name no tenant). The in-process operator (``tenant=None``) sees every task, keyed
``<tenant>/<task>`` (task names are per tenant).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core import RewardService
    from .state import Batch


def batch_status(service: RewardService, b: Batch) -> dict:
    """``size, submitted, settled, done, complete, stages{queued, running}, reward_mean,
    failed, elapsed_s`` of batch ``b`` (seconds)."""
    per_stage = {
        p.stage: {
            "queued": sum(1 for r in b.live.values() if r.stage == p.index and not r.running),
            "running": sum(1 for r in b.live.values() if r.stage == p.index and r.running),
        }
        for p in service.pools[b.task.pipeline]
    }
    rewards = [r["reward"] for r in b.results]
    return {
        "task": b.task.name,
        "batch": b.id,
        "size": b.size,
        "submitted": b.submitted,
        "settled": len(b.settled),
        "done": len(b.results),
        "complete": b.done,
        "stages": per_stage,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "failed": sum(r["status"] not in ("ok", "settled") for r in b.results),
        "elapsed_s": (b.completed_at or time.monotonic()) - b.start,
    }


def service_metrics(service: RewardService, tenant: str | None = None) -> dict:
    """Pool-level numbers (shared by all tenants), the bytes queued requests hold (the
    tenant's and the service's), and ``tenant``'s own tasks only (``None``: every task, for
    the operator in-process; the HTTP API always passes the caller)."""
    pools = {}
    for name, ps in service.pools.items():
        for p in ps:
            p.account()
            pools[f"{name}.{p.stage}"] = {
                "target": p.target,
                "alive": p.alive,
                "idle": len(p.idle),
                "busy": len(p.busy),
                "starting": p.starting,
                "queued": len(p.queue),
                "worker_s": p.worker_s,
                "busy_s": p.busy_s,
            }
    tasks = {
        (t.name if tenant is not None else f"{t.tenant}/{t.name}"): {
            "tenant": t.tenant,
            "batches": len(t.batches),
        }
        for t in service.tasks.values()
        if tenant is None or t.tenant == tenant
    }
    return {
        "instance": service.instance,
        "uptime_s": time.monotonic() - service.t0,
        "requests_done": service.requests_done,
        "pools": pools,
        "queued_bytes": service.budget.view(tenant),
        "decisions": service.n_decisions,
        "decision_s_max": service.decision_s_max,
        "last_decisions": list(service.decisions)[-10:],
        "tasks": tasks,
    }
