"""Actor worker: supervised warm start, GRPO training, weight sync, checkpoints.

The role composes a :class:`~..engines.train.TrainEngine` (``engine``: ``torch``, ``megatron``,
or any registered kind, :data:`~..engines.registry.TRAIN_ENGINES`) with the GRPO algorithm
(:mod:`~..algos.grpo`); it never branches on the engine kind.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
import transformers
from m2flow.scheduler.balance import all_queued

from m2flow import Channel, Worker

from .. import parallel as dp
from ..algos.grpo import grpo_advantages
from ..batch import concat
from ..engines.train import train_engine
from ..llm import build_tokenizer, compute_dtype
from ..llm.placement import set_torch_threads, torch_device
from .sft import warm_start


class ActorWorker(Worker):
    """The policy being trained, on the engine ``engine`` names.

    Torch engine: one rank by default (given several devices by a plan it uses them as one,
    ``data_parallel = False``); with ``data_parallel=True`` one rank per device, each reading
    its share of the step's chunks, one gradient all-reduce per step. Megatron engine
    (docs/results/megatron.md): one rank per device in TP x PP x DP groups, every rank training on
    the whole step. The warm start runs on rank 0's Hugging Face model and reaches the other ranks
    through :meth:`TrainEngine.publish`; rank 0 is the weight source and writes the
    checkpoints (every rank loads them).

    Args:
        model: :class:`~m2flow.workers.llm.ModelConfig` fields (``path`` or a shape, ``dtype``:
            mixed precision over float32 weights, ``gradient_checkpointing``).
        tokenizer: the tokenizer spec (:func:`~m2flow.workers.llm.build_tokenizer`).
        lr, betas, weight_decay, grad_clip: AdamW for GRPO.
        temperature: the rollout's sampling temperature (logprobs are recomputed under it).
        clip_eps_low, clip_eps_high: PPO ratio clip range.
        kl_coef: k3 KL weight to the reference (the warm-started policy, frozen); 0 = off.
        mini_batch_size, micro_batch_size: responses per optimizer step / per forward
            (0: the whole global batch / the whole mini-batch).
        recompute_old_logprobs: recompute behaviour logprobs instead of using the rollout's.
        drop_flat_groups: leave out groups whose samples all got the same reward (advantage 0;
            DAPO's dynamic-sampling filter without resampling).
        shared_prefix: forward each GRPO group's prompt once
            (:func:`~m2flow.workers.algos.logprobs.shared_prefix_logprobs`; same math).
        threads: torch intra-op threads; 0 = this rank's share of its node's CPUs.
        seed: model init seed.
        data_parallel: one rank per device and a gradient all-reduce (streaming updates only).
        dist: the process group's rendezvous ``{"addr", "port"}`` (set by :meth:`launch`).
        engine: a :data:`~..engines.registry.TRAIN_ENGINES` name or ``"module:Class"``.
        tensor_parallel, pipeline_parallel: the Megatron engine's TP and PP sizes.

    Raises:
        ValueError: an unknown ``engine`` or a setting it cannot run (its ``check``).
    """

    data_parallel = False  # one rank over all its devices (see the class docstring)

    @classmethod
    def launch(cls, cluster, placement=None, **kwargs):
        """:meth:`Worker.launch`; one rank per device of the placement (default: where the plan
        puts the group) and their process group's rendezvous with ``data_parallel=True`` or an
        engine that runs one rank per device. Refuses a bad setting before any process starts."""
        from m2flow.group import normalize_placement

        per_device = train_engine(kwargs.get("engine", "torch")).one_rank_per_device
        if (kwargs.get("data_parallel") or per_device) and placement is None:
            placement = cluster.devices_for(kwargs.get("name") or cls.__name__)
        if placement is not None:
            ranks = normalize_placement(placement, cluster)
            cls._check(len(ranks), kwargs)
            if len(ranks) > 1 or per_device:
                kwargs["dist"] = dp.rendezvous(cluster, ranks)
        return super().launch(cluster, placement, **kwargs)

    @staticmethod
    def _check(world_size: int, kwargs: dict) -> None:
        train_engine(kwargs.get("engine", "torch")).check(world_size, kwargs, "actor")

    def __init__(
        self,
        model: dict,
        tokenizer: dict,
        lr: float = 1e-4,
        betas: tuple = (0.9, 0.99),
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        temperature: float = 1.0,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.28,
        kl_coef: float = 0.0,
        mini_batch_size: int = 0,
        micro_batch_size: int = 0,
        recompute_old_logprobs: bool = False,
        drop_flat_groups: bool = True,
        shared_prefix: bool = True,
        threads: int = 0,
        seed: int = 0,
        data_parallel: bool = False,
        dist: dict | None = None,
        engine: str = "torch",
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
    ) -> None:
        parallel = {"tensor_parallel": tensor_parallel, "pipeline_parallel": pipeline_parallel}
        self._check(
            self.world_size,
            {"data_parallel": data_parallel and dist, "mini_batch_size": mini_batch_size,
             "engine": engine, "model": model, "kl_coef": kl_coef, **parallel},
        )  # fmt: skip
        set_torch_threads(self, threads)
        transformers.utils.logging.disable_progress_bar()  # no shard bars in run logs
        device = torch_device(self.devices)
        self.tokenizer = build_tokenizer(tokenizer)
        self.lr = lr
        optim = dict(
            lr=lr, betas=tuple(betas), weight_decay=weight_decay, grad_clip=grad_clip,
            temperature=temperature, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high,
            kl_coef=kl_coef, shared_prefix=shared_prefix,
            compute_dtype=compute_dtype(model.get("dtype", "auto"), device),
        )  # fmt: skip
        self.engine = train_engine(engine)(
            model, self.tokenizer, device=device, rank=self.rank, world_size=self.world_size,
            dist=dist, optim=optim, seed=seed, **parallel,
        )  # fmt: skip
        self.mini_batch_size = mini_batch_size or None
        self.micro_batch_size = micro_batch_size or None
        self.drop_flat_groups = drop_flat_groups
        self.recompute_old_logprobs = recompute_old_logprobs
        self.weight_version = 0

    # -- phases -----------------------------------------------------------------------------

    def warm_start(
        self,
        task: dict | None,
        steps: int,
        batch_size: int,
        lr: float,
        target_accuracy: float | None,
        eval_every: int,
        time_budget_s: float | None,
        seed: int = 0,
        reward: dict | None = None,
    ) -> dict:
        """Supervised warm start (:func:`.sft.warm_start`: answer tokens of the task's training
        split, stopped by ``steps``, ``time_budget_s`` or ``target_accuracy`` on its validation
        split) on rank 0; then every rank takes rank 0's weights and the reference is refrozen.

        Returns:
            ``steps``, ``seconds``, ``loss`` (last), ``val_accuracy`` (greedy, last check).
        """
        if dp.active() and self.rank != 0:  # rank 0 warm-starts; the others take its weights
            self.engine.publish()
            out = [None]
            torch.distributed.broadcast_object_list(out, 0)
            return out[0]
        out = warm_start(
            self.engine.sft_trainer, self.tokenizer, task, steps, lr, self.lr, reward,
            batch_size=batch_size, seed=seed, target_accuracy=target_accuracy,
            eval_every=eval_every, time_budget_s=time_budget_s,
        )  # fmt: skip
        self.engine.publish()
        if dp.active():
            torch.distributed.broadcast_object_list([out], 0)
        return out

    def train(self, inp: Channel) -> dict:
        """One GRPO update from the step's scored rollout chunks, read from ``inp`` until the
        producer's end of step. Advantages are group-normalised rewards (DeepSeekMath GRPO,
        section 4.1.2); the loss is the PPO clipped surrogate with an optional k3 KL.

        Returns:
            engine metrics (``loss``, ``clip_frac``, ``grad_norm``, ...), ``samples``,
            ``stale`` (samples generated with an older weight version than the actor's);
            streaming (no ``mini_batch_size``): ``parts``, the forward/backward passes over
            arrived chunks (chunks queued together are one part); ``input_waits``: the
            ``[t0, t1]`` wall-clock (``time.time()``) seconds it waited for chunks (the
            trainer's idle time that the spot pool's Algorithm 1 reads, RLBoost 4.1).
        """
        if self.mini_batch_size is None and not self.engine.whole_step:
            return self._train_streaming(inp)
        # A fixed order (by first prompt id), whichever rank or chunk arrived first: the
        # mini-batches, hence the update, do not depend on the plan.
        waits: list[list[float]] = []
        parts = _timed(inp.stream(balance=all_queued, target_weight=1), waits)
        chunks = sorted(self.engine.read_step(parts), key=lambda c: c.key)
        batch = concat([c.batch for c in chunks], self.tokenizer.pad_token_id)
        stale = sum(c.stale_samples(self.weight_version) for c in chunks)
        data = self._training_data(batch)
        metrics = self.engine.train(data, self.mini_batch_size, self.micro_batch_size)
        trained = len(data["advantages"])
        return {**self._finish(metrics, len(batch), trained, stale), "input_waits": waits}

    def _train_streaming(self, inp: Channel) -> dict:
        """One optimizer step over the whole batch, training on chunks as they arrive
        (gradients accumulate): with a pipelined rollout the actor works while later chunks
        are still being generated. Chunks already queued are trained on together (one part)."""
        samples = trained = stale = parts = 0
        waits: list[list[float]] = []
        for chunks in _timed(inp.stream(balance=all_queued, target_weight=1), waits):
            batches = [c.batch for c in chunks]
            pad = self.tokenizer.pad_token_id
            batch = batches[0] if len(batches) == 1 else concat(batches, pad)
            samples += len(batch)
            stale += sum(c.stale_samples(self.weight_version) for c in chunks)
            data = self._training_data(batch)  # whole GRPO groups: a chunk is whole prompts
            if len(data["advantages"]):
                trained += self.engine.accumulate(data, self.micro_batch_size)
                parts += 1
        metrics = self.engine.finish_accumulation()  # data parallel: the global step's
        # A data-parallel rank that got no chunk still took the global step: report it.
        out = self._finish(metrics if metrics.get("steps") else {}, samples, trained, stale)
        out["parts"] = parts
        out["input_waits"] = waits
        return out

    def _training_data(self, batch) -> dict:
        """Training tensors of a scored batch: group-normalised advantages and behaviour
        logprobs (the engine adds the reference's); flat groups dropped if configured."""
        data = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
        data["advantages"] = grpo_advantages(batch["rewards"], batch["group_index"])
        if not self.recompute_old_logprobs:
            data["old_logprobs"] = batch["logprobs"]
        if self.drop_flat_groups:
            keep = data["advantages"] != 0
            data = {k: v[keep] for k, v in data.items()}
        return data

    def _finish(self, metrics: dict, samples: int, trained: int, stale: int) -> dict:
        self.weight_version += 1
        return {"loss": 0.0, "clip_frac": 0.0, "grad_norm": 0.0, **metrics, "samples": samples,
                "trained_samples": trained, "stale": stale}  # fmt: skip

    # -- weights, checkpoints, memory -------------------------------------------------------

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights, on CPU (copies), in Hugging Face layout: the source of
        ``m2flow.sync_weights(actor, ...)``. ``RuntimeError`` on a rank holding none (Megatron:
        rank 0 holds them)."""
        return self.engine.get_weights()

    def save_checkpoint(self, path: str) -> str:
        """Model, tokenizer, optimizer state, version and RNG state under ``path`` (the
        engine's files; rank 0 writes ``actor_state.pt``; a collective of all ranks)."""
        out = Path(path)
        state = self.engine.save(out)
        if state is None:
            return str(path)
        self.tokenizer.save_pretrained(out)
        state |= {"weight_version": self.weight_version, "torch_rng": torch.get_rng_state(),
                  "py_rng": random.getstate()}  # fmt: skip
        torch.save(state, out / "actor_state.pt")
        return str(out)

    def load_checkpoint(self, path: str) -> int:
        """Restore what :meth:`save_checkpoint` wrote. Returns the weight version."""
        src = Path(path)
        state = torch.load(src / "actor_state.pt", weights_only=False)
        self.engine.load(src, state)
        self.weight_version = state["weight_version"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["py_rng"])
        return self.weight_version

    def offload(self) -> None:
        """Release parameters and optimizer state (another worker takes the device): on CUDA
        to pinned host memory; on a virtual device packed into one buffer, restored
        bit-exactly by :meth:`onload`."""
        self.engine.offload()

    def onload(self) -> None:
        self.engine.onload()


def _timed(stream, waits: list):
    """``stream``'s items; appends to ``waits`` the ``[t0, t1]`` wall-clock seconds each
    ``next`` blocked (waiting for data, the end of the step included)."""
    it = iter(stream)
    while True:
        t0 = time.time()
        try:
            item = next(it)
        except StopIteration:
            waits.append([t0, time.time()])
            return
        waits.append([t0, time.time()])
        yield item
