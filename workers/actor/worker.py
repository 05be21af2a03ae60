"""Actor worker: supervised warm start, GRPO training, weight sync, checkpoints.

The role composes a :class:`~..engines.train.TrainEngine` (``engine``: ``torch``, ``megatron``,
or any registered backend of kind ``train``, :mod:`~..engines.registry`) with the GRPO algorithm:
advantages (:mod:`~..algos.grpo`) and the policy loss it names (``loss``,
:data:`~..algos.losses.LOSSES`), which it hands the engine; it never branches on the engine
kind.
"""

from __future__ import annotations

import contextlib

import torch
import transformers
from m2flow.scheduler.runtime.balance import all_queued

from m2flow import Channel, Worker, group_method
from m2flow.core import events

from .. import parallel as dp
from ..algos.grpo import grpo_advantages
from ..algos.losses import loss_mask, make_loss
from ..algos.off_policy import OffPolicyStats
from ..batch import concat
from ..chunk import step_batch, timed
from ..engines.base import NonFiniteError
from ..engines.registry import engine_class
from ..engines.train_role import OnTrainEngine
from ..engines.update import StreamedStep, minibatch_update
from ..llm import build_tokenizer, compute_dtype
from ..llm.placement import set_torch_threads, torch_device
from .config import ActorOptions
from .sft import warm_start


class ActorWorker(OnTrainEngine, Worker):
    """The policy being trained, on the engine ``engine`` names.

    Torch engine: one rank by default (given several devices by a plan it uses them as one,
    ``data_parallel = False``); with ``data_parallel=True`` one rank per device, each reading
    its share of the step's chunks, one gradient all-reduce per step. Megatron engine
    (docs/results/megatron.md): one rank per device in TP x PP x DP groups, every rank training on
    the whole step. The warm start runs on rank 0's Hugging Face model and reaches the other ranks
    through :meth:`TrainEngine.publish`; rank 0 is the weight source and writes the
    checkpoints (every rank loads them). Launch, weights, checkpoints and offload follow from
    the engine alone (:class:`~..engines.train_role.OnTrainEngine`).

    Args:
        model: :class:`~m2flow.workers.llm.ModelConfig` fields (``path`` or a shape, ``dtype``:
            mixed precision over float32 weights, ``gradient_checkpointing``).
        tokenizer: the tokenizer spec (:func:`~m2flow.workers.llm.build_tokenizer`).
        options: :class:`~.config.ActorOptions` (AdamW, clip range, KL, batch split,
            ``engine`` and its parallel sizes, ...), built once by the workflow from its
            ``actor`` section.
        dist: the process group's rendezvous ``{"addr", "port"}`` (set by :meth:`launch`).

    Raises:
        ValueError: an unknown ``engine`` or a setting it cannot run (its ``check``).
    """

    data_parallel = False  # one rank over all its devices (see the class docstring)
    role = "actor"
    _skip: str | None = None  # this step's non-finite advantages, nonfinite="skip"

    def __init__(
        self, model: dict, tokenizer: dict, options: ActorOptions, dist: dict | None = None
    ) -> None:
        self.options = opt = options
        self._check(self.world_size, opt.engine_check(dist, model))
        set_torch_threads(self, opt.threads)
        transformers.utils.logging.disable_progress_bar()  # no shard bars in run logs
        device = torch_device(self.devices)
        self.tokenizer = build_tokenizer(tokenizer)
        self.loss = make_loss(opt.loss, "policy", **opt.loss_settings)
        off = opt.off_policy
        self._off_policy = OffPolicyStats(off.correction, off.clip, off.level, off.low, off.high)
        self._dropped = 0  # samples beyond off.max_lag dropped this step
        self._max_lag = off.max_lag  # or the run's K (drop_stale_beyond)
        self.engine = engine_class("train", opt.engine, self.role)(
            model, self.tokenizer, device=device, rank=self.rank, world_size=self.world_size,
            dist=dist, optim=opt.optim(compute_dtype(model.get("dtype", "auto"), device)),
            seed=opt.seed, **opt.engine_kwargs,
        )  # fmt: skip
        self.weight_version = 0

    # -- phases -----------------------------------------------------------------------------

    @group_method(collect="rank0")
    def warm_start(self, task: dict | None, steps: int, lr: float, **sft) -> dict:
        """Supervised warm start (:func:`.sft.warm_start`: answer tokens of the task's training
        split at learning rate ``lr``, stopped by ``steps``, ``time_budget_s`` or
        ``target_accuracy`` on its validation split; ``sft``: its ``batch_size``,
        ``target_accuracy``, ``eval_every``, ``time_budget_s``, ``seed``, ``reward``, and
        ``traces``: multi-turn episodes as token lists ``prompt_ids``, ``response_ids``,
        ``loss_mask`` to train on instead, the loss on their model tokens only) on rank 0;
        then every rank takes rank 0's weights and the reference is refrozen.

        Returns:
            ``steps``, ``seconds``, ``loss`` (last), ``val_accuracy`` (greedy, last check).
        """
        out = [None]
        with self.engine.solo() as alone:  # rank 0's whole model, trained alone
            if alone is not None and (not dp.active() or self.rank == 0):
                out[0] = warm_start(alone, self.tokenizer, task, steps, lr, self.options.lr, **sft)
        self.engine.publish()  # the others take rank 0's weights
        if dp.active():
            torch.distributed.broadcast_object_list(out, 0)
        return out[0]

    @group_method(collect="rank0")
    def train(self, inp: Channel) -> dict:
        """One GRPO update from the step's scored rollout chunks, read from ``inp`` until the
        producer's end of step. Advantages are group-normalised rewards (DeepSeekMath GRPO,
        section 4.1.2); the loss is the PPO clipped surrogate with an optional k3 KL.

        With an off-policy correction (``options.off_policy``) the old logprobs are
        recomputed, the rollout's are the behaviour ones, and the loss weighs each token by
        the correction (:mod:`~..algos.off_policy`).

        Returns:
            engine metrics (``loss``, ``clip_frac``, ``grad_norm``, ...), ``samples``,
            ``stale`` (samples generated with an older weight version than the actor's);
            with a correction, the off-policy metrics
            (:meth:`~..algos.off_policy.OffPolicyStats.result`: ``is_weight_mean``, ...,
            ``mismatch_kl_k3``, ``staleness_max``, ``staleness_mean``, ``staleness_lag_<k>``);
            streaming (no ``mini_batch_size``): ``parts``, the forward/backward passes over
            arrived chunks (chunks queued together are one part); ``input_waits``: the
            ``[t0, t1]`` wall-clock (``time.time()``) seconds it waited for chunks (the
            trainer's idle time that the spot pool's Algorithm 1 reads, RLBoost 4.1), also
            published as the run event :data:`m2flow.core.events.TRAINER_WAITS` before it returns.
        """
        waits: list[list[float]] = []
        parts = timed(inp.stream(balance=all_queued, target_weight=1), waits)
        if self.options.mini is None and not self.engine.whole_step:
            return self._published({**self._train_streaming(parts), "input_waits": waits})
        chunks = self.engine.read_step(parts)
        batch, stale = step_batch(chunks, self.tokenizer.pad_token_id, self.weight_version)
        data = self._training_data(batch)
        if self._skip is not None:  # non-finite advantages, actor.nonfinite=skip
            metrics, data = {"nonfinite_skips": 1}, {"advantages": []}
        else:
            metrics = self.update(data)
        trained = len(data["advantages"])
        return self._published(
            {**self._finish(metrics, len(batch), trained, stale), "input_waits": waits}
        )

    @group_method(collect="rank0")
    def drop_stale_beyond(self, max_lag: int) -> None:
        """From now on drop, before the loss, the samples whose oldest response token lags
        this actor's weight version by more than ``max_lag`` versions (``actor.off_policy.
        max_lag``; the run's ``trainer.staleness_policy=drop`` sets it to K)."""
        self._max_lag = max_lag

    def _published(self, out: dict) -> dict:
        """``out``, after its ``input_waits`` went out as a run event (read by the spot pool's
        manager, if the run has one: :func:`m2flow.core.events.publish`)."""
        wait = {"group": self.group_name, "rank": self.rank, "waits": out["input_waits"]}
        events.publish(events.TRAINER_WAITS, wait)
        return out

    def update(self, data: dict, epochs: int = 1, generator=None) -> dict:
        """The policy loss's update on a whole batch (:func:`.update.minibatch_update`: the
        options' mini- and micro-batches, ``epochs`` passes shuffled by ``generator``), after
        the behaviour logprobs (if absent) and the reference's are computed, before any
        update. ``{}`` for an empty batch (every rank of a whole-step engine alike)."""
        if not len(data["response_ids"]):
            return {}
        data = self._logprobs(data)
        self._add_off_policy(data)
        with self._named_step():
            return minibatch_update(self.engine, data, self.loss, self.options.mini,
                                    self.options.micro, epochs, generator)  # fmt: skip

    def _logprobs(self, data: dict) -> dict:
        """``data`` with the reference's ``ref_logprobs`` (KL on) and, if absent, the
        behaviour ``old_logprobs`` under the current weights (no gradients)."""
        micro = self.options.micro
        if self.options.kl_coef > 0 and "ref_logprobs" not in data:
            data = dict(data, ref_logprobs=self.engine.infer(data, None, micro, reference=True))
        if "old_logprobs" not in data:
            data = dict(data, old_logprobs=self.engine.infer(data, None, micro))
        return data

    def _add_off_policy(self, data: dict) -> None:
        """With a correction on: count ``data``'s importance weights, logprob mismatch and
        staleness (trained at this actor's weight version) into the step's metrics, over the
        trained tokens (``loss_mask`` when the batch has one: tool output is not counted)."""
        if self.options.off_policy.enabled:
            self._off_policy.add(
                data["old_logprobs"], data["behav_logprobs"], loss_mask(data),
                data.get("versions"), self.weight_version if "versions" in data else None,
            )  # fmt: skip

    @contextlib.contextmanager
    def _named_step(self):
        """A non-finite value the engine stops on, named with the training step."""
        try:
            yield
        except NonFiniteError as e:
            named = f"{self.role}, training step {self.weight_version + 1}"
            if str(e).startswith(named):  # the advantages' check names it already
                raise
            raise NonFiniteError(f"{named}: {e}") from None

    def _train_streaming(self, parts) -> dict:
        """One optimizer step over the whole batch, training on chunks as they arrive
        (gradients accumulate): with a pipelined rollout the actor works while later chunks
        are still being generated. Chunks already queued are trained on together (one part)."""
        samples = trained = stale = n_parts = 0
        step = StreamedStep(self.engine, self.loss, self.options.micro)
        with self._named_step():
            for chunks in parts:
                batches = [c.batch for c in chunks]
                pad = self.tokenizer.pad_token_id
                batch = batches[0] if len(batches) == 1 else concat(batches, pad)
                samples += len(batch)
                stale += sum(c.stale_samples(self.weight_version) for c in chunks)
                data = self._training_data(batch)  # whole GRPO groups: a chunk is whole prompts
                if len(data["advantages"]) and self._skip is None:
                    data = self._logprobs(data)
                    self._add_off_policy(data)
                    trained += step.add(data)
                    n_parts += 1
            metrics = step.finish(skip=self._skip is not None)  # data parallel: the global step
        # A data-parallel rank that got no chunk still took the global step: report it.
        skips = {"nonfinite_skips": metrics.pop("nonfinite_skips")}
        out = self._finish(metrics if metrics.get("steps") else skips, samples, trained, stale)
        return {**out, "parts": n_parts}

    def _training_data(self, batch) -> dict:
        """Training tensors of a scored batch: group-normalised advantages and behaviour
        logprobs (the engine adds the reference's), and the batch's ``loss_mask`` if it has
        one (multi-turn episodes: only the model's own tokens are trained on); flat groups
        dropped if configured."""
        data = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
        if "loss_mask" in batch.keys():
            data["loss_mask"] = batch["loss_mask"]
        data["advantages"] = grpo_advantages(batch["rewards"], batch["group_index"])
        self._check_advantages(data["advantages"], batch["rewards"])
        if self.options.off_policy.enabled:  # old: recomputed; the rollout's: behaviour
            data["behav_logprobs"] = batch["logprobs"]
            if "versions" in batch.keys():
                data["versions"] = batch["versions"]
        elif not self.options.recompute_old_logprobs:
            data["old_logprobs"] = batch["logprobs"]
        keep = data["advantages"] != 0 if self.options.drop_flat_groups else None
        if self._max_lag is not None and "versions" in batch.keys():
            fresh = self._fresh(batch)
            self._dropped += int((~fresh if keep is None else keep & ~fresh).sum())
            keep = fresh if keep is None else keep & fresh
        if keep is not None:
            data = {k: v[keep] for k, v in data.items()}
        return data

    def _fresh(self, batch) -> torch.Tensor:
        """``[batch]`` bool: the samples whose oldest trained response token (``loss_mask``
        when the batch has one, else ``response_mask``) lags this actor's weight version by
        at most ``max_lag`` (``trainer.staleness_policy=drop``: the others are dropped and
        counted in ``staleness_dropped``; their group's advantages were normalised over all
        its samples, whose rewards are valid: only the tokens are too old)."""
        mask = (
            batch["loss_mask"] if "loss_mask" in batch.keys() else batch["response_mask"]
        ).bool()
        versions = batch["versions"].masked_fill(~mask, self.weight_version)
        lag = self.weight_version - versions.min(dim=1).values
        return lag <= self._max_lag

    def _check_advantages(self, advantages: torch.Tensor, rewards: torch.Tensor) -> None:
        """Non-finite advantages (a NaN or infinite reward): stop naming the step and the
        rewards (``nonfinite="stop"``), or remember to skip this step's update."""
        bad = ~torch.isfinite(advantages)
        if advantages.dim() > 1:
            bad = bad.any(dim=1)
        if not bool(bad.any()):
            return
        odd = rewards[bad][~torch.isfinite(rewards[bad])]
        named = (f"non-finite rewards: {sorted(set(odd.tolist()), key=str)}" if len(odd)
                 else f"rewards up to {float(rewards[bad].abs().max()):.3g}")  # fmt: skip
        cause = f"non-finite advantages for {int(bad.sum())} of {len(bad)} samples ({named})"
        if self.options.nonfinite == "stop":
            raise NonFiniteError(
                f"{self.role}, training step {self.weight_version + 1}: {cause}; the weights are "
                f"those of the step before (set {self.role}.nonfinite=skip to skip such steps "
                "instead)"
            )
        self._skip = self._skip or cause

    def _finish(self, metrics: dict, samples: int, trained: int, stale: int) -> dict:
        metrics = {**metrics, **self._off_policy.result()}  # {} without a correction
        self._off_policy.reset()
        if self._max_lag is not None:
            metrics["staleness_dropped"] = self._dropped
            self._dropped = 0
        self.weight_version += 1
        self._skip = None
        skips = metrics.pop("nonfinite_skips", 0)
        return {"loss": 0.0, "clip_frac": 0.0, "grad_norm": 0.0, **metrics, "samples": samples,
                "trained_samples": trained, "stale": stale,
                **({"nonfinite_skips": skips} if skips else {})}  # fmt: skip
