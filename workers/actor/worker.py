"""Actor worker: supervised warm start, GRPO training, weight sync, checkpoints."""

from __future__ import annotations

import copy
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
from ..data.reasoning_gym import task_split
from ..llm import build_tokenizer, compute_dtype, load_model
from ..llm.placement import set_torch_threads, torch_device
from ..reward.functions import RewardFunction
from .sft import run_sft
from .trainer import PolicyTrainer


class ActorWorker(Worker):
    """The policy being trained (plain torch, or Megatron-core with ``engine="megatron"``).

    By default one rank: given several devices by a plan, it uses them as one (``data_parallel
    = False``): all their CPU threads on virtual devices. With ``data_parallel=True`` it runs
    one rank per device, each with the whole model, reading its share of the step's chunks
    from the channel; one gradient all-reduce per step (:mod:`~m2flow.workers.parallel`, gloo
    on CPU, NCCL on CUDA) makes every rank take the optimizer step one rank would on all the
    chunks.
    The warm start runs on rank 0 and its weights are broadcast; rank 0 is the weight source
    and writes the checkpoints (every rank loads them).

    With ``engine="megatron"`` (:mod:`.megatron.engine`) the actor runs one rank per device, the
    ranks forming Megatron's tensor-, pipeline- and data-parallel groups; GRPO steps train a
    Megatron ``GPTModel`` shard per rank on the whole step's batch (mini-batches allowed; with
    ``kl_coef > 0`` against a frozen reference shard of the same layout). The warm
    start runs on rank 0's Hugging Face copy (torch engine) and is scattered into the shards;
    after each step the shards are gathered into that copy, so rank 0's :meth:`get_weights` and
    checkpoints stay in Hugging Face layout (optimizer state: one file per rank).

    Args:
        model: :class:`~m2flow.workers.llm.ModelConfig` fields: a Hugging Face directory
            (``path``) or a shape; ``dtype`` (mixed precision over float32 weights),
            ``gradient_checkpointing``.
        tokenizer: the tokenizer spec, ``{"name": "char", "alphabet": str}`` or
            ``{"name": "qwen2"}`` (:func:`~m2flow.workers.llm.build_tokenizer`).
        lr, betas, weight_decay, grad_clip: AdamW for GRPO.
        temperature: the rollout's sampling temperature (logprobs are recomputed under it).
        clip_eps_low, clip_eps_high: PPO ratio clip range.
        kl_coef: k3 KL weight to the reference (the warm-started policy, frozen); 0 = off.
        mini_batch_size, micro_batch_size: responses per optimizer step / per forward
            (0: the whole global batch / the whole mini-batch).
        drop_flat_groups: leave out groups whose samples all got the same reward: their
            advantage is 0, so they only dilute the token mean and cost compute (the filter
            of DAPO's dynamic sampling, without resampling).
        recompute_old_logprobs: recompute behaviour logprobs with a forward pass instead of
            using the rollout's (the weights are identical; the rollout's differ only by
            kernel rounding).
        shared_prefix: forward each GRPO group's prompt once in logprob and training
            forwards (:func:`~m2flow.workers.algos.logprobs.shared_prefix_logprobs`); same math
            as the full forward.
        threads: torch intra-op threads; 0 = this rank's share of its node's CPUs.
        seed: model init seed.
        data_parallel: one rank per device (launch) and a gradient all-reduce (see above);
            streaming updates only (``mini_batch_size`` 0).
        dist: the process group's rendezvous ``{"addr", "port"}`` (set by :meth:`launch`).
        engine: ``"torch"`` or ``"megatron"`` (needs the ``megatron`` extra).
        tensor_parallel, pipeline_parallel: Megatron TP and PP sizes (TP x PP divides the
            ranks; DP = ranks / (TP x PP); PP divides the model's layers).

    Raises:
        ValueError: several ranks without ``data_parallel``, ``data_parallel`` with a
            ``mini_batch_size``, an unknown ``engine``, or a Megatron setting it cannot run
            (:func:`.megatron.engine.check_config`).
    """

    @classmethod
    def launch(cls, cluster, placement=None, **kwargs):
        """:meth:`Worker.launch`; with ``data_parallel=True`` one rank per device of the
        placement (default: where the plan puts the group) and, for several ranks, the
        rendezvous of their process group, drawn here."""
        from m2flow.group import normalize_placement

        megatron = kwargs.get("engine", "torch") == "megatron"
        if (kwargs.get("data_parallel") or megatron) and placement is None:
            placement = cluster.devices_for(kwargs.get("name") or cls.__name__)
        if placement is not None:  # refuse here, before any process starts
            ranks = normalize_placement(placement, cluster)
            cls._check_ranks(len(ranks), kwargs)
            if len(ranks) > 1 or megatron:
                kwargs["dist"] = dp.rendezvous(cluster, ranks)
        return super().launch(cluster, placement, **kwargs)

    @staticmethod
    def _check_ranks(world_size: int, kwargs: dict) -> None:
        from .megatron.engine import ENGINES, check_config

        engine = kwargs.get("engine", "torch")
        if engine not in ENGINES:
            raise ValueError(f"actor.engine={engine!r}: pick one of {', '.join(ENGINES)}")
        if engine == "megatron":
            return check_config(world_size, kwargs)
        if kwargs.get("tensor_parallel", 1) != 1 or kwargs.get("pipeline_parallel", 1) != 1:
            raise ValueError(
                "actor.tensor_parallel / actor.pipeline_parallel need actor.engine=megatron"
            )
        if world_size == 1:
            return
        if not kwargs.get("data_parallel"):
            raise ValueError(
                f"the actor got {world_size} ranks: launch it with data_parallel=True "
                "(actor.data_parallel=true) for data-parallel training, or give it one rank"
            )
        if kwargs.get("mini_batch_size"):
            raise ValueError(
                f"data-parallel training takes one optimizer step per step (streaming); "
                f"mini_batch_size={kwargs['mini_batch_size']} would need the ranks to agree "
                "on every mini-batch: set actor.mini_batch_size=0"
            )

    data_parallel = False  # one rank over all its devices (see the class docstring)

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
        megatron = engine == "megatron"
        self._check_ranks(
            self.world_size,
            {"data_parallel": data_parallel and dist, "mini_batch_size": mini_batch_size,
             "engine": engine, "tensor_parallel": tensor_parallel, "model": model,
             "pipeline_parallel": pipeline_parallel, "kl_coef": kl_coef},
        )  # fmt: skip
        if megatron and dist is None:
            raise ValueError("engine='megatron' needs the rendezvous: start with launch()")
        set_torch_threads(self, threads)
        transformers.utils.logging.disable_progress_bar()  # no shard bars in run logs
        self.device = torch_device(self.devices)
        if self.world_size != 1 and not megatron:
            dp.init(self.rank, self.world_size, dist["addr"], dist["port"], self.device)
        self.tokenizer = build_tokenizer(tokenizer)
        # float32 master weights; forward/backward under autocast to model.dtype
        self.model = load_model(model, self.tokenizer, self.device, trainable=True, seed=seed)
        self.lr = lr
        optim = dict(
            lr=lr,
            betas=tuple(betas),
            weight_decay=weight_decay,
            grad_clip=grad_clip,
            temperature=temperature,
            clip_eps_low=clip_eps_low,
            clip_eps_high=clip_eps_high,
            kl_coef=kl_coef,
            shared_prefix=shared_prefix,
            compute_dtype=compute_dtype(model.get("dtype", "auto"), self.device),
        )
        # The torch engine's trainer; with Megatron, rank 0's warm-start trainer of the HF copy.
        self.trainer = self.sft_trainer = PolicyTrainer(self.model, **optim)
        self.megatron = None
        if megatron:
            from .megatron.engine import MegatronEngine

            self.megatron = MegatronEngine(
                self.model.config,
                self.model.state_dict() if self.rank == 0 else None,
                self.rank,
                self.world_size,
                dist,
                self.device,
                tensor_parallel,
                optim,
                pipeline_parallel=pipeline_parallel,
            )
            self.trainer = self.megatron.trainer
            if self.rank != 0:  # only rank 0 keeps a Hugging Face copy (the weight source)
                self.model = self.sft_trainer = None
        self.kl_coef = kl_coef
        self.ref_model: torch.nn.Module | None = None
        self._freeze_reference()  # refreshed after the warm start
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
        """Supervised warm start on the task's training split (answer tokens only), stopping
        at ``steps``, ``time_budget_s`` seconds, or ``target_accuracy`` on the validation split
        (``task["val_seed"]``, ``task["val_size"]``; never the held-out split), scored by the
        run's reward function (``reward``: :class:`~..reward.functions.RewardFunction`
        arguments; default ``auto``). ``task=None`` (data files: no targets) or ``steps=0``:
        no supervised steps; the rest (the reference, the ranks' weights) is done all the same.

        Returns:
            ``steps``, ``seconds``, ``loss`` (last), ``val_accuracy`` (greedy, last check).
        """
        if dp.active() and self.rank != 0:  # rank 0 warm-starts; the others take its weights
            if self.megatron is not None:
                self.megatron.load_hf(None)
            else:
                dp.broadcast_model(self.model)
            self.trainer.set_lr(self.lr)
            self._freeze_reference()
            out = [None]
            torch.distributed.broadcast_object_list(out, 0)
            return out[0]
        if task is None or steps == 0:
            train = val = []
            steps = 0
        else:
            train, val = (task_split(task, s, self.tokenizer)[0] for s in ("train", "val"))
        self.sft_trainer.set_lr(lr)
        res = run_sft(
            self.sft_trainer,
            self.tokenizer,
            train,
            steps=steps,
            batch_size=batch_size,
            seed=seed,
            val=val,
            reward=RewardFunction(**(reward or {})),
            target_accuracy=target_accuracy,
            eval_every=eval_every,
            time_budget_s=time_budget_s,
            log=None,
        )
        self.sft_trainer.set_lr(self.lr)
        # Fresh AdamW moments for RL: the supervised ones point elsewhere.
        self.sft_trainer.optimizer.state.clear()
        out = {
            "steps": res.steps,
            "seconds": res.seconds,
            "loss": res.last_loss,
            "val_accuracy": res.val_accuracy,
        }
        if self.megatron is not None:
            self.megatron.load_hf(self.model.state_dict())
        elif dp.active():
            dp.broadcast_model(self.model)
        self._freeze_reference()  # Megatron: after the shards took the warm-started weights
        if dp.active():
            torch.distributed.broadcast_object_list([out], 0)
        return out

    def _freeze_reference(self) -> None:
        """The reference policy: a frozen copy of the current weights (KL on only; Megatron:
        the engine's reference shard, whose logprobs the engine computes)."""
        if self.kl_coef <= 0:
            return
        if self.megatron is not None:
            self.megatron.freeze_reference()
        else:
            ref = copy.deepcopy(self.model).eval().requires_grad_(False)
            self.ref_model = ref.to(self.trainer.compute_dtype)  # inference: compute dtype

    def train(self, inp: Channel) -> dict:
        """One GRPO update from the step's scored rollout chunks, read from ``inp`` until the
        producer's end of step.

        Advantages are group-normalised rewards (DeepSeekMath GRPO, section 4.1.2); the loss
        is the PPO clipped surrogate with an optional k3 KL to the reference.

        Returns:
            trainer metrics (``loss``, ``clip_frac``, ``grad_norm``, ...), ``samples``,
            ``stale`` (samples generated with an older weight version than the actor's);
            streaming (no ``mini_batch_size``): ``parts``, the forward/backward passes over
            arrived chunks (chunks queued together are one part); ``input_waits``: the
            ``[t0, t1]`` wall-clock (``time.time()``) seconds it waited for chunks (the
            trainer's idle time that the spot pool's Algorithm 1 reads, RLBoost 4.1).
        """
        if self.mini_batch_size is None and self.megatron is None:
            return self._train_streaming(inp)
        waits: list[list[float]] = []
        parts = _timed(inp.stream(balance=all_queued, target_weight=1), waits)
        if self.megatron is not None:  # every rank: the whole step (see .megatron.engine)
            parts = [self.megatron.read_step(parts)]
        # A fixed order (by first prompt id), whichever rank or chunk arrived first: the
        # mini-batches, hence the update, do not depend on the plan.
        chunks = sorted((c for part in parts for c in part), key=lambda c: c.key)
        batch = concat([c.batch for c in chunks], self.tokenizer.pad_token_id)
        stale = sum(c.stale_samples(self.weight_version) for c in chunks)
        data = self._training_data(batch)
        trained = len(data["advantages"])
        metrics = {}
        if self.megatron is not None:
            if trained:  # every rank decides alike: they hold the same batch
                metrics = self.megatron.train(data, self.mini_batch_size, self.micro_batch_size)
            hf = self.megatron.gather_hf()  # rank 0's HF copy: the weight source
            if hf is not None:
                self.model.load_state_dict(hf)
        elif trained:
            metrics = self.trainer.train_on_batch(data, self.mini_batch_size, self.micro_batch_size)
        return {**self._finish(metrics, len(batch), trained, stale), "input_waits": waits}

    def _train_streaming(self, inp: Channel) -> dict:
        """One optimizer step over the whole batch, training on chunks as they arrive
        (gradients accumulate; :meth:`PolicyTrainer.accumulate`): with a pipelined rollout the
        actor works while later chunks are still being generated. Chunks that are already
        queued when the actor comes for more are trained on together (one part instead of
        several: the same update, one part's fixed cost), so a coalesced edge fed by several
        rollout ranks costs one part, and a lagging actor coarsens its own granularity."""
        samples = trained = stale = parts = 0
        waits: list[list[float]] = []
        for chunks in _timed(inp.stream(balance=all_queued, target_weight=1), waits):
            batches = [c.batch for c in chunks]
            batch = (
                batches[0] if len(batches) == 1 else concat(batches, self.tokenizer.pad_token_id)
            )
            samples += len(batch)
            stale += sum(c.stale_samples(self.weight_version) for c in chunks)
            data = self._training_data(batch)  # whole GRPO groups: a chunk is whole prompts
            if len(data["advantages"]):
                trained += self.trainer.accumulate(data, self.micro_batch_size)
                parts += 1
        metrics = self.trainer.finish_accumulation()  # data parallel: the global step's
        # A data-parallel rank that got no chunk still took the global step: report it.
        out = self._finish(metrics if metrics.get("steps") else {}, samples, trained, stale)
        out["parts"] = parts
        out["input_waits"] = waits
        return out

    def _training_data(self, batch) -> dict:
        """Training tensors of a scored batch: group-normalised advantages, behaviour (and
        reference) logprobs; flat groups dropped if configured."""
        data = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
        data["advantages"] = grpo_advantages(batch["rewards"], batch["group_index"])
        if not self.recompute_old_logprobs:
            data["old_logprobs"] = batch["logprobs"]
        if self.drop_flat_groups:
            keep = data["advantages"] != 0
            data = {k: v[keep] for k, v in data.items()}
        if len(data["advantages"]) and self.ref_model is not None:
            data["ref_logprobs"] = self._ref_logprobs(data)
        return data

    def _finish(self, metrics: dict, samples: int, trained: int, stale: int) -> dict:
        self.weight_version += 1
        return {
            "loss": 0.0,
            "clip_frac": 0.0,
            "grad_norm": 0.0,
            **metrics,
            "samples": samples,
            "trained_samples": trained,
            "stale": stale,
        }

    @torch.no_grad()
    def _ref_logprobs(self, data: dict) -> torch.Tensor:
        policy, self.trainer.model = self.trainer.model, self.ref_model
        try:
            return self.trainer.compute_logprobs(data, self.micro_batch_size)
        finally:
            self.trainer.model = policy

    # -- weights and checkpoints ------------------------------------------------------------

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights, on CPU (detached copies): the source of
        ``m2flow.sync_weights(actor, ...)``. Megatron: the gathered TP shards, in Hugging Face
        layout, on rank 0 only.

        Raises:
            RuntimeError: a Megatron rank other than 0 (it holds no gathered copy).
        """
        if self.model is None:
            raise RuntimeError(
                "the Megatron actor's weights are gathered on rank 0: call get_weights there "
                "(actor.on(0).get_weights(); sync_weights does)"
            )
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, path: str) -> str:
        """Model, tokenizer, optimizer state, version and RNG state under ``path`` (rank 0
        only: data-parallel ranks hold the same state; Megatron: the model in Hugging Face
        layout, each rank's optimizer shard in its own file, the reference shard gathered to
        Hugging Face layout in ``actor_state.pt``; a collective of all ranks)."""
        reference = None if self.ref_model is None else self.ref_model.state_dict()
        if self.megatron is not None:
            self.megatron.save_optimizer(path)
            if self.megatron.ref_model is not None:  # a collective: the reference in HF layout
                reference = self.megatron.gather_hf(reference=True)
        if self.rank != 0:
            return str(path)
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        torch.save(
            {
                "optimizer": None if self.megatron else self.trainer.optimizer.state_dict(),
                "weight_version": self.weight_version,
                "trainer_steps": self.trainer.steps,
                "torch_rng": torch.get_rng_state(),
                "py_rng": random.getstate(),
                "reference": reference,
            },
            out / "actor_state.pt",
        )
        return str(out)

    def load_checkpoint(self, path: str) -> int:
        """Restore what :meth:`save_checkpoint` wrote. Returns the weight version."""
        from safetensors.torch import load_file

        src = Path(path)
        if self.model is not None:  # Megatron: rank 0's HF copy, scattered below
            missing, unexpected = self.model.load_state_dict(
                load_file(src / "model.safetensors"), strict=False
            )
            # save_pretrained drops the LM head when it is tied to the embeddings.
            if unexpected or set(missing) - {"lm_head.weight"}:
                raise ValueError(
                    f"checkpoint {src} does not match the model: missing {missing}, "
                    f"unexpected {unexpected}"
                )
            self.model.tie_weights()
        state = torch.load(src / "actor_state.pt", weights_only=False)
        if self.megatron is not None:
            self.megatron.load_hf(None if self.model is None else self.model.state_dict())
            self.megatron.load_optimizer(src)
        else:
            self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.trainer.steps = state["trainer_steps"]
        self.weight_version = state["weight_version"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["py_rng"])
        if self.megatron is not None:
            if self.megatron.ref_model is not None and state["reference"] is not None:
                self.megatron.load_hf(state["reference"] if self.rank == 0 else None, True)
        elif state["reference"] is not None:
            self._freeze_reference()
            self.ref_model.load_state_dict(state["reference"])
        return self.weight_version

    # -- memory -----------------------------------------------------------------------------

    def offload(self) -> None:
        """Release parameters and optimizer state (another worker takes the device).

        On CUDA they move to pinned host memory. On a virtual device they are serialised into
        one buffer and the tensors freed: the switch runs for real and restores bit-exactly, but
        host RAM is not saved (the state lives in host memory either way).
        """
        (self.megatron or self.trainer).offload()  # Megatron: shard, AdamW, reference shard
        if self.sft_trainer is not None and self.sft_trainer is not self.trainer:
            self.sft_trainer.offload()  # Megatron rank 0's HF copy
        if self.ref_model is not None and self.device.type == "cuda":
            self.ref_model.to("cpu")

    def onload(self) -> None:
        (self.megatron or self.trainer).onload()
        if self.sft_trainer is not None and self.sft_trainer is not self.trainer:
            self.sft_trainer.onload()
        if self.ref_model is not None and self.device.type == "cuda":
            self.ref_model.to(self.device)


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
