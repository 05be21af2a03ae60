"""The run skeleton the LLM runners share (``workflows/grpo.py``, ``workflows/ppo.py``).

A runner's ``main()`` is its algorithm: which roles it launches, what one step does, what it
logs. Everything around that is here, once: the data and prompt sampler set-up (every prompt
read and checked before any worker starts), the cluster, the supervised warm start of the actor
and the first evaluation, resuming from a checkpoint, and each step's tail (evaluate every
``trainer.eval_every`` steps, save every ``trainer.save_every``, log, advance the bar)::

    run = LLMRun(cfg)                        # data, rewards, sampler, cluster
    rollout = RolloutWorker.launch(run.cluster, ..., options=run.rollout, heldout=...)
    ...
    def step(n: int) -> StepRecord:          # the algorithm's step
        ...
        return StepRecord(metrics, f"reward {metrics['reward_mean']:.3f}")
    return run.train("GRPO steps", actor, rollout, {"actor": actor}, step)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from m2flow import sync_weights
from m2flow.core import ordering
from m2flow.run.pipeline import StepPipeline, staleness_of
from m2flow.run.recipe import Checkpoints, plain, start_cluster
from m2flow.run.runlog import RunLog

from .data.item import prompt_items
from .data.reasoning_gym import task_section
from .data.sampler import PromptSampler, load_sampler
from .data.splits import run_data
from .llm import build_tokenizer, tokenizer_spec
from .recipe import model_section, rollout_options, warm_start_args
from .reward.config import reward_spec


@dataclass
class StepRecord:
    """What one training step of a runner gives the skeleton.

    Attributes:
        metrics: the step's record (numbers by name; the skeleton adds the evaluation's on an
            evaluation step), logged in this order.
        progress: the progress bar's note for the step (e.g. ``"reward 0.312"``).
    """

    metrics: dict[str, Any]
    progress: str


class LLMRun:
    """One LLM run's shared parts (see the module docstring).

    Attributes:
        cfg: the workflow's configuration; ``tr``: its ``trainer`` section.
        lm: the roles' ``model`` (``model.path`` made absolute) and ``tokenizer`` spec.
        task: the reasoning-gym task section (the warm start's; ``None`` once skipped).
        data: the run's prompts (:func:`~.data.splits.run_data`); ``rewards``: the reward
            function's spec; ``sampler``: the training prompts' order.
        rollout: the ``rollout`` section as the role's
            :class:`~.rollout.config.RolloutOptions` (``max_new_tokens`` resolved).
        cluster: the started cluster; ``checkpoints``: the run directory's checkpoints.
        log: the run's :class:`~m2flow.run.runlog.RunLog` while :meth:`train` runs.

    Raises:
        ConfigError, ValueError: bad data or model settings (before any worker starts).
    """

    def __init__(self, cfg) -> None:
        self.cfg, self.tr = cfg, cfg.trainer
        model, self.task = model_section(cfg), task_section(cfg)
        self.lm = {"model": model, "tokenizer": tokenizer_spec(model)}
        tokenizer = build_tokenizer(self.lm["tokenizer"])
        self.data = run_data(cfg, tokenizer)  # every prompt read and checked first
        self.rewards = reward_spec(cfg.reward, self.data.data_sources())
        self.sampler = PromptSampler(len(self.data.train), self.tr.seed, cfg.data.shuffle)
        self.cluster = start_cluster(cfg.cluster, self.tr.run_dir)
        self.rollout, self._length_note = rollout_options(cfg)  # max_new_tokens resolved
        # trainer.max_staleness (auto: the plan's K) and rollout.partial (unset: on when K >= 1)
        self.max_staleness, self._staleness_note = staleness_of(self.tr, self.cluster)
        if self.rollout.partial is None:
            self.rollout.partial = self.max_staleness >= 1
        self.partial = bool(self.rollout.partial)
        self.drop = self.max_staleness >= 1 and self.tr.staleness_policy == "drop"
        self.checkpoints = Checkpoints(self.tr.run_dir)
        self.log: RunLog | None = None
        self._rollout = None

    def prompts(self, n: int, step: int) -> list:
        """The next ``n`` training prompts as channel items of ``step`` (pipelined steps draw
        in step order: :mod:`m2flow.core.ordering`)."""
        with ordering.turn("sampler"):
            return prompt_items(self.data.train, self.sampler.take(n), step)

    def evaluate(self) -> dict:
        """``heldout_accuracy`` (share of held-out prompts with reward 1) and, with
        ``reward.on_error=penalty``, ``heldout_reward_errors``; none without held-out
        prompts."""
        if not self.data.heldout:
            return {}
        outs = self.log.wait("evaluation", self._rollout.evaluate())
        scores = [s for o in outs for s in o["scores"]]
        out = {"heldout_accuracy": sum(s == 1.0 for s in scores) / len(scores)}
        if self.cfg.reward.on_error == "penalty":
            out["heldout_reward_errors"] = sum(o["reward_errors"] for o in outs)
        return out

    def train(
        self,
        title: str,
        actor,
        rollout,
        trained: Mapping[str, Any],
        step: Callable[[int], StepRecord],
        after_warm_start: Callable[[], dict] | None = None,
        warm_start: Callable[[dict], dict] | None = None,
    ) -> dict:
        """Run the whole job: resume or warm-start the actor (then ``after_warm_start``,
        default: the actor's weights to the rollout; what it returns joins step 0's record),
        evaluate, then ``trainer.steps`` calls of ``step`` with the evaluate/save/log tail;
        shut the cluster down.

        Args:
            title: the progress bar's name (``"GRPO steps"``).
            actor, rollout: the actor and rollout groups (warm start, evaluation, weights).
            trained: the groups checkpointed and restored, by name.
            step: the algorithm's step ``n`` (``1..trainer.steps``).
            warm_start: the runner's own supervised warm start, given the ``warm_start``
                section's arguments (``steps``, ``lr``, ``batch_size``, ``time_budget_s``, ...)
                and returning its call (whose result is its metrics); default: the actor's
                on the task's targets.

        Returns:
            the summary: ``accuracy_after_warm_start`` and ``final_accuracy`` when measured.
        """
        cfg, tr = self.cfg, self.tr
        self._rollout = rollout
        start = 0
        if cfg.resume:
            start, state = self.checkpoints.restore(trained)
            self.data.notes += load_sampler(self.sampler, state)
        summary = {}
        resumed = start if cfg.resume else None  # later records are dropped, time continues
        with RunLog(
            tr.run_dir, tr.steps, tr.logger, resumed, tr.log_every, plain(cfg), title
        ) as self.log:
            log = self.log
            log.print(self.cluster.describe())
            notes = [*self.data.notes, self._length_note, self._staleness_note]
            for note in filter(None, notes):
                log.print(note)
            if start == 0:
                ws_args, skipped = warm_start_args(cfg, self.data.source)
                if warm_start is not None and not skipped:
                    call = warm_start(ws_args)
                else:
                    task = None if skipped else self.task
                    call = actor.warm_start(task, seed=tr.seed, reward=self.rewards, **ws_args)
                ws = log.wait("warm start", call, None if skipped else ws_args["time_budget_s"])
                if skipped:
                    log.print(f"warm start: skipped ({skipped})")
                extra = {}
                if after_warm_start is None:
                    sync_weights(actor, rollout)
                else:
                    extra = after_warm_start()
                ev = self.evaluate()
                if ev:
                    summary["accuracy_after_warm_start"] = ev["heldout_accuracy"]
                log.log(0, {"phase": "start" if skipped else "warm_start", **ws, **extra, **ev})
            else:
                sync_weights(actor, rollout)
            log.advance(start)

            def evaluates(n: int) -> bool:
                return n % tr.eval_every == 0 or n == tr.steps

            def saves(n: int) -> bool:
                return n % tr.save_every == 0 or n == tr.steps

            def done(n: int, record: StepRecord) -> None:
                metrics = record.metrics
                if pipe.k:  # steps overlap: the time between two steps' ends is the period
                    now = time.time()
                    metrics["step_interval_s"] = now - last_end[0]
                    last_end[0] = now
                if evaluates(n):
                    metrics |= self.evaluate()
                    if "heldout_accuracy" in metrics:
                        summary["final_accuracy"] = metrics["heldout_accuracy"]
                # the record before the checkpoint: a kill between them resumes from the one
                # before (whose later records a resume drops), never a checkpoint without record;
                # a run stopped at this step (StopRun: profiling, max_steps) still saves it
                try:
                    log.log(n, metrics, echo="heldout_accuracy" in metrics or None)
                finally:
                    if saves(n):
                        self.checkpoints.save(n, trained, {"data": self.sampler.state_dict()})
                log.advance(n, record.progress)

            if self.drop:  # the trainer drops what broke the bound (admitted a step early)
                actor.drop_stale_beyond(self.max_staleness).wait()
            # K >= 1: rollout of later steps runs while the actor trains (m2flow.run.pipeline);
            # evaluation and checkpoint steps flush it (nothing in flight at a checkpoint)
            pipe = StepPipeline(
                self.max_staleness, self.partial, lambda n: evaluates(n) or saves(n),
                ahead=int(self.drop),
            )  # fmt: skip
            last_end = [time.time()]  # the previous step's end (or the pipeline's start)
            pipe.run(range(start + 1, tr.steps + 1), step, done)
            log.print(f"summary: {summary}")
        self.cluster.shutdown()
        return summary
