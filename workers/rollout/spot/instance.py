"""A spot rollout instance: one engine on a preemptible node, driven by pulls.

Its loop (RLBoost 4.2-4.3): pull the staged weights when the manager has a newer version
(pull-based, versioned: an instance that joins mid-step loads them, then takes work; the
engine's ``update_weights``), lease its pending requests up to its batch room, generate one
block of tokens, report the block, drop what the manager revokes (a rebalancing move, or the
pool paused: the requests go back with their tokens and per-token versions). The engine is
``args["engine"]``, a backend of kind ``rollout`` (:mod:`~m2flow.workers.engines.registry`):
``exact`` (:class:`~m2flow.workers.rollout.exact.ExactEngine`), ``vllm`` (block-wise
continuation) or ``emulated`` (no model is built; a weight pull sleeps its modelled transfer
time).

Instances are the ranks of one :class:`~m2flow.core.elastic.ElasticGroup` (``rollout.spot``),
m2flow workers under the runtime's liveness watch as *preemptible* members: if its node
disappears, the process dies mid-block and the lock service records a preemption (a crash if
the node lives on), published as the run event ``WORKER_LOST``; the manager still holds every
response up to the last reported block and moves it to another instance.
"""

from __future__ import annotations

import time

import ray

from m2flow.core.worker import Worker

from .names import MANAGER_NAME

#: the elastic group of the spot instances (a death names it with the instance's rank)
GROUP = "rollout.spot"
#: the instances' own Ray concurrency group: :meth:`SpotInstance.run`, for the process's life
LOOP_GROUP = "loop"


class SpotInstance(Worker):
    """One spot instance: a rank of the elastic group :data:`GROUP` (started by the manager's
    pool loop with :meth:`~m2flow.core.elastic.ElasticGroup.add`), driven by :meth:`run`.

    Args:
    instance_id: its name at the manager.
    block_tokens: tokens generated between reports.
    max_batch: requests executing at once.
    args: ``{"model", "tokenizer", "temperature", "top_p", "seed", "batch_rows", "threads"}``
        plus ``"engine"``: a rollout engine's name (vllm: ``max_batch`` is vLLM's
        ``max_num_seqs``); for an emulated engine ``{"engine": "emulated", "emulated",
        "eos_id", "filler_id", "seed"}`` (:class:`~m2flow.workers.rollout.spot.config.
        EmulatedEngineConfig` fields).
    """

    def __init__(self, instance_id: str, block_tokens: int, max_batch: int, args: dict) -> None:
        from ...engines.registry import engine_class

        self.id, self.block, self.max_batch = instance_id, block_tokens, max_batch
        self.version = -1
        cls = engine_class("rollout", args.get("engine", "exact"), "rollout.spot")
        tok = self.model = None  # emulated: no model is built
        if cls.needs_model:
            import torch

            from ...llm import build_tokenizer, load_model

            torch.set_num_threads(args.get("threads", 1))
            tok = build_tokenizer(args["tokenizer"])
            self.model = load_model(args["model"], tok)  # the host; weights come by pull
        # vllm: max_batch is its max_num_seqs
        self.engine = cls.build({**args, "max_num_seqs": max_batch}, self.model, tok)

    @ray.method(concurrency_group=LOOP_GROUP)
    def run(self) -> None:
        """The pull loop (module docstring), for the life of the process; an exception ends it
        (the manager names the error and retires the instance)."""
        from m2flow.core.cluster import NAMESPACE

        mgr = ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)
        executing = []
        while True:
            version, refs = ray.get(mgr.current_weights.remote())
            if version != self.version and refs:
                # emulated (no model): the modelled pull of the weights' bytes
                weights = None if self.model is None else ray.get(refs[0])
                self.engine.update_weights(version, weights)
                self.version = version
                executing = []  # leases of an older version are void (the manager requeued)
            room = self.max_batch - len(executing)
            if room > 0:
                executing += ray.get(mgr.lease.remote(self.id, self.version, room))
            if not executing:
                time.sleep(0.01)
                continue
            t0 = time.perf_counter()
            context = sum(r.length for r in executing) / len(executing)
            made = self.engine.step(executing, self.block, label=self.id)
            busy = time.perf_counter() - t0
            drop = set(
                ray.get(mgr.report.remote(self.id, executing, busy, len(executing), made, context))
            )
            executing = [r for r in executing if not r.done and r.id not in drop]
