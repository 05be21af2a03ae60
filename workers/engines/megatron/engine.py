"""The actor's Megatron-core engine (``actor.engine=megatron``): the shards a
:class:`~.policy.MegatronPolicyEngine` trains instead of the torch engine's model.

Layout. The actor's ranks (one per device) form one ``torch.distributed`` world (gloo on CPU,
NCCL on CUDA) and Megatron's model-parallel groups over it: ``tp = tensor_parallel``,
``pp = pipeline_parallel``, ``dp = world / (tp * pp)``. Each rank holds its TP shard of its
pipeline stage (``num_layers / pp`` layers; the first stage the embedding, the last the final
norm and output layer) of a Megatron ``GPTModel`` built from the same Hugging Face config as the
torch engine's model; with ``kl_coef > 0`` also a frozen reference shard of the same layout.

A GRPO step (:meth:`MegatronEngine.read_step`, then the role's mini-batches through
:meth:`MegatronEngine.forward_backward` and :meth:`MegatronEngine.optimizer_step`):

1. every rank streams its share of the step's chunks from the channel (so no rank blocks in a
   collective while it holds its device lock and a producer still needs that device), then
   one ``all_gather_object`` gives every rank all chunks;
2. the worker sorts and concatenates them (every rank alike) and computes advantages;
3. per mini-batch, DP rank ``d`` takes the ``d``-th contiguous slice of its rows; the TP ranks
   and pipeline stages of one DP replica forward the same rows together (PP > 1: all of the
   slice's micro-batches in one call of Megatron's 1F1B schedule, :mod:`.pipeline`); reference
   logprobs (KL) come from the reference shard the same way, before any update;
4. the shared mechanics (:class:`~..base.ModelEngine`, with Megatron logprobs) backpropagate
   the role's loss (each micro-batch's a share of the whole mini-batch's token mean), sum
   gradients and metric sums over the DP group (PP: loss and metrics from the last stage,
   tied-embedding gradients summed over the first and last stage), clip by the global
   gradient norm (over TP shards and stages, replicated parameters and the tied output copy
   counted once) and take a plain ``torch.optim.AdamW`` step on the local shards: the torch
   engine's update up to float rounding.

Megatron's ``DistributedOptimizer`` is not used: on a CPU torch it rejects non-CUDA parameters
(docs/results/megatron.md). Weights leave through rank 0 in Hugging Face layout
(:meth:`MegatronEngine.gather_hf`: stages merged, TP shards gathered) and come in the same way
(:meth:`MegatronEngine.load_hf`).
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ... import parallel as dp
from ...batch import row_index, split_rows
from ...checkpoint import load_file
from ..base import RESPONSE_KEYS, ModelEngine

#: Megatron warnings that say nothing on the CPU/gloo path (no TE/Apex, CUDA tuning hints,
#: torch's rename of the collective Megatron's TP gather calls); kept out of the run logs.
_QUIET = (
    r".*(Transformer Engine|Apex is not installed|CUDA_DEVICE_MAX_CONNECTIONS"
    r"|all_gather_into_tensor|cuda_graph_scope).*"
)


def check_config(world_size: int | None, kwargs: dict, role: str = "actor") -> None:
    """Refuse a Megatron configuration before any process starts.

    Args:
        world_size: the group's ranks (one per device); ``None``: not placed yet (config
            validation), the ranks' checks skipped.
        kwargs: the worker's arguments (``tensor_parallel``, ``pipeline_parallel``, ``model``:
            the built-in preset's fields, or ``path`` to a Hugging Face directory whose
            ``config.json`` is read here, see :func:`~.arch.hf_config_of`).
        role: the config section the messages name (``actor``; ``critic`` for
            :func:`~.critic.check_config`).

    Raises:
        ValueError: megatron-core missing, ``tensor_parallel * pipeline_parallel`` not dividing
            the ranks, a TP size that does not divide the model's heads or MLP width, or a PP
            size that does not divide its layers; the message names the fix.
        UnsupportedModel: (a ``ValueError``) an architecture or setting the engine does not map
            exactly (:func:`~.arch.architecture`): the message names the supported
            architectures and ``<role>.engine=torch``.
    """
    from .arch import architecture, hf_config_of

    if importlib.util.find_spec("megatron") is None or (
        importlib.util.find_spec("megatron.core") is None
    ):
        raise ValueError(
            f"{role}.engine=megatron needs megatron-core: pip install -c constraints.txt "
            f"-e '.[megatron]' (or set {role}.engine=torch)"
        )
    tp, pp = int(kwargs.get("tensor_parallel", 1)), int(kwargs.get("pipeline_parallel", 1))
    if tp < 1 or pp < 1 or (world_size is not None and world_size % (tp * pp)):
        knobs = [f"{role}.tensor_parallel={tp}"] + [f"{role}.pipeline_parallel={pp}"] * (pp != 1)
        raise ValueError(
            f"{' x '.join(knobs)} must divide the {role}'s {world_size} ranks (one per device; "
            f"DP = ranks / (TP x PP)): change {' / '.join(k.split('=')[0] for k in knobs)} or "
            f"the devices the plan gives the {role}"
        )
    model = hf_config_of(kwargs.get("model", {}))
    architecture(model, role)
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(model, field)
        if value % tp:
            raise ValueError(
                f"model.{field}={value} is not divisible by {role}.tensor_parallel={tp}: pick "
                "a tensor_parallel that divides it"
            )
    if model.num_hidden_layers % pp:
        raise ValueError(
            f"model.num_hidden_layers={model.num_hidden_layers} is not divisible by "
            f"{role}.pipeline_parallel={pp} (each stage takes the same number of layers): pick "
            "a pipeline_parallel that divides it"
        )


def clip_global_norm(model, grad_clip: float | None, mp_group) -> float:
    """Clip this rank's shard's gradients by the norm of the whole (TP- and PP-gathered)
    gradient: TP-split parameters summed over the model-parallel group, replicated ones and the
    last stage's copy of tied embeddings counted once (``clip_grad_norm_``'s coefficient).
    Returns the pre-clip norm. A collective of ``mp_group``."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    params = [p for p in model.parameters() if p.grad is not None]
    device = next(model.parameters()).device
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p):
            sq += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(sq, group=mp_group)
    norm = sq.sqrt().float()
    if grad_clip and grad_clip > 0:
        coef = torch.clamp(grad_clip / (norm + 1e-6), max=1.0)  # as clip_grad_norm_
        for p in params:
            p.grad.mul_(coef)
    return float(norm)


class MegatronEngine(ModelEngine):
    """This rank's part of a Megatron actor: process groups, model shard and its AdamW (the
    shared mechanics, :class:`~..base.ModelEngine`, with Megatron's forward, pipeline schedule
    and global-norm clip), reference shard.

    Args:
        hf_config: the Hugging Face config of the policy (the torch engine's model: Qwen2,
            Llama or Mistral, see :mod:`.arch`; others raise ``UnsupportedModel``).
        hf_state: rank 0: the initial weights (HF state dict); other ranks: ``None``.
        rank, world_size: this rank in the actor group (one rank per device).
        rendezvous: ``{"addr", "port"}`` of the group's process group.
        device: this rank's torch device (gloo on CPU, NCCL on CUDA).
        tensor_parallel: TP size.
        trainer: the mechanics' settings (:meth:`~..base.ModelEngine._setup`: lr, betas, grad
            clip, temperature, ``nonfinite``, ...); ``kl_coef > 0`` also builds a frozen
            reference shard (:meth:`freeze_reference`).
        pipeline_parallel: PP size (divides the model's layers; TP x PP divides
            ``world_size``; DP = world / (TP x PP)).

    Every rank is given the whole batch (:attr:`whole_step`) and trains its data-parallel
    share: DP rank ``d`` the ``d``-th contiguous slice of the rows, the TP ranks and pipeline
    stages of one replica the same rows together. Every collective of Megatron's groups waits
    at most ``M2FLOW_WAIT_TIMEOUT`` (rounded up to minutes), the world's as long.

    Raises:
        RuntimeError: the rendezvous failed (:func:`~m2flow.workers.parallel.init`).
    """

    whole_step = True
    data_parallel = True  # gradients and metric sums over Megatron's DP group

    def __init__(
        self,
        hf_config,
        hf_state: dict | None,
        rank: int,
        world_size: int,
        rendezvous: dict,
        device: torch.device,
        tensor_parallel: int,
        trainer: dict,
        pipeline_parallel: int = 1,
    ) -> None:
        warnings.filterwarnings("ignore", message=_QUIET)
        from megatron.core import parallel_state as ps

        from m2flow._env import wait_timeout

        from .model import build_gpt_model, init_parallel

        if not dist.is_initialized():
            dp.init(rank, world_size, rendezvous["addr"], rendezvous["port"], device)
        init_parallel(tp=tensor_parallel, pp=pipeline_parallel, timeout_s=wait_timeout())
        self.rank = rank
        self.tp, self.pp = tensor_parallel, pipeline_parallel
        self.dp = world_size // (tensor_parallel * pipeline_parallel)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.model = build_gpt_model(hf_config).to(device)
        self.shape = self.model.m2flow_shape
        self.layers = self.shape.num_layers // self.pp  # per stage
        # The frozen reference (KL): same layout, no optimizer, no gradients. Built here, with
        # the policy, because building a stage is a collective (tied embeddings, PP > 1).
        self.ref_model = None
        if trainer.get("kl_coef", 0.0) > 0:
            self.ref_model = build_gpt_model(hf_config).to(device).eval().requires_grad_(False)
        self._ref_packed = None
        trainer = {k: v for k, v in trainer.items() if k != "shared_prefix"}
        self._setup(self.model, **trainer)
        self.dp_group = ps.get_data_parallel_group()
        self.mp_group = ps.get_model_parallel_group()  # TP x PP
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_last = ps.get_pipeline_model_parallel_last_rank()  # global rank
        self.load_hf(hf_state)
        self.freeze_reference()

    def freeze_reference(self) -> None:
        """The reference shard := the policy shard now (no collective). The worker calls it at
        start and after the warm start (the torch engine's ``copy.deepcopy`` of the policy)."""
        from .convert import load_megatron_state, megatron_state

        if self.ref_model is not None:
            load_megatron_state(self.ref_model, megatron_state(self.model))

    # -- data ------------------------------------------------------------------------------

    def read_step(self, stream) -> list:
        """All of the step's items, on every rank: this rank's share of ``stream`` (an
        iterator of item lists, read to the producers' end of step) gathered over the world."""
        mine = [item for part in stream for item in part]
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return [item for items in every for item in items]

    # -- mechanics (ModelEngine hooks) -------------------------------------------------------

    def _forward(self, model, mb: dict, loss=None) -> torch.Tensor:
        """Per-token logprobs ``[b, R]`` of one stage-complete model (PP = 1; one full forward,
        :func:`~.model.megatron_sequence_logprobs`)."""
        from .model import megatron_sequence_logprobs

        temperature = self.temperature
        if loss is not None and loss.temperature is not None:
            temperature = loss.temperature
        return megatron_sequence_logprobs(
            model, *(mb[k] for k in RESPONSE_KEYS), temperature=temperature
        )

    def _rows(self, n: int) -> torch.Tensor:
        """This DP rank's contiguous share of ``n`` rows."""
        return torch.tensor_split(row_index(n), self.dp)[self.dp_rank]

    def _clip_grads(self) -> float:
        return clip_global_norm(self.model, self.grad_clip, self.mp_group)

    def _micro_batches(self, batch, keys, micro_batch_size) -> tuple[list, list[int]]:
        """``batch``'s rows in micro-batches of one size (the last padded, see
        :func:`~.pipeline.pad_rows`) on the device, and each one's real row count."""
        from .pipeline import pad_rows

        chunks = split_rows(row_index(len(batch["response_ids"])), micro_batch_size)
        size = len(chunks[0])
        mbs = [pad_rows({k: batch[k][i].to(self.device) for k in keys}, size) for i in chunks]
        return mbs, [len(i) for i in chunks]

    def forward_backward(self, batch, loss, micro_batch_size=None, normalizer=None) -> list:
        """:meth:`~..base.ModelEngine.forward_backward` on this DP rank's share; with pipeline
        stages all its micro-batches go through one schedule call (1F1B, :mod:`.pipeline`) and
        the records (loss and metrics) come from the last stage (the others return none:
        :meth:`reduce_metrics` sums the stages)."""
        if self.pp == 1:
            return super().forward_backward(batch, loss, micro_batch_size, normalizer)
        from .pipeline import run_schedule

        self._check_output(loss)
        rows = self._rows(len(batch["response_ids"]))
        if not len(rows):
            return []
        denom = 1.0 if normalizer is None else float(normalizer)
        keys = [k for k in (*RESPONSE_KEYS, *loss.keys) if k in batch]
        mbs, sizes = self._micro_batches({k: batch[k][rows] for k in keys}, keys,
                                         micro_batch_size)  # fmt: skip
        real, records = iter(sizes), []

        def on_last_stage(lp, mb):
            value, metrics = loss(lp, mb, denom)
            n = next(real)  # rows past it are padding (mask 0)
            v = value.item()
            if not math.isfinite(v):
                self._nonfinite(f"loss {v}")
            records.append({"loss": v, "weight": loss.units({k: t[:n] for k, t in mb.items()}),
                            **metrics})  # fmt: skip
            return value

        self.model.train()
        temperature = self.temperature if loss.temperature is None else loss.temperature
        run_schedule(self.model, mbs, temperature, on_last_stage)
        return records

    def optimizer_step(self, normalizer: float | None = None) -> dict[str, float]:
        """:meth:`~..base.ModelEngine.optimizer_step` over Megatron's DP group; with pipeline
        stages and tied embeddings, the first stage's embedding and the last stage's
        output-layer copy get their gradients summed first (Megatron's
        ``finalize_model_grads``) so both take the same step. A collective of every rank."""
        if self.pp > 1:
            self._sum_tied_embedding_grads()
        return super().optimizer_step(normalizer)

    def _sum_tied_embedding_grads(self) -> None:
        from megatron.core import parallel_state as ps

        if not (self.model.share_embeddings_and_output_weights and ps.is_rank_in_embedding_group()):
            return
        weight = self.model.shared_embedding_or_output_weight()
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=ps.get_embedding_group())

    def reduce_metrics(self, sums: dict[str, float], keys: tuple[str, ...]) -> dict[str, float]:
        """Sums over the pipeline (the last stage holds them, the others zeros), then over the
        DP group. A collective of every rank."""
        if self.pp > 1:
            sums = {**sums, **dp.all_reduce_sums(sums, keys, self.pp_group)}
        return super().reduce_metrics(sums, keys)

    @torch.no_grad()
    def infer(self, batch, fn=None, micro_batch_size=None, reference: bool = False):
        """``[B, R]`` logprobs of every row on every rank (the policy's, or with ``reference``
        the reference shard's): the TP ranks forward together; with pipeline stages through the
        schedule (forward only), computed on the last stage and broadcast to the others. A
        collective of the rank's TP/PP groups."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise ValueError("this engine keeps no reference (kl_coef is 0)")
        if self.pp == 1:
            return super().infer(batch, fn, micro_batch_size, model=model)
        if fn is not None:
            raise ValueError("infer(fn=...) with pipeline stages: only logprobs")
        from .pipeline import run_schedule

        was_training = model.training
        model.eval()
        mbs, sizes = self._micro_batches(batch, RESPONSE_KEYS, micro_batch_size)
        outs = run_schedule(model, mbs, self.temperature)
        model.train(was_training)
        if outs:  # the last stage
            lp = torch.cat([o[:n] for o, n in zip(outs, sizes)])
        else:
            lp = torch.zeros(batch["response_ids"].shape, device=self.device)
        dist.broadcast(lp, src=self.pp_last, group=self.pp_group)
        return lp.cpu()

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, 0)
        return box[0]

    # -- weights ---------------------------------------------------------------------------

    def load_hf(self, hf_state: dict[str, torch.Tensor] | None, reference: bool = False) -> None:
        """Every rank loads its shard (its TP slice of its pipeline stage's layers) of rank
        0's ``hf_state`` (HF layout of the model's family; the other ranks pass ``None``) into
        the policy, or with ``reference`` into the reference shard. A collective of the whole
        actor group.

        Raises:
            KeyError: the state does not fit the model (:func:`~.convert.load_megatron_state`).
        """
        from .convert import hf_to_megatron, load_megatron_state

        state = self.broadcast_object(
            None if hf_state is None else {k: v.detach().cpu() for k, v in hf_state.items()}
        )
        model = self.ref_model if reference else self.model
        shard = hf_to_megatron(
            state,
            self.shape,
            tp_rank=self.tp_rank,
            tp_size=self.tp,
            layer_offset=self.pp_rank * self.layers,
            num_layers=self.layers,
            pre_process=model.pre_process,
            post_process=model.post_process,
        )
        load_megatron_state(model, shard)

    def gather_hf(self, reference: bool = False) -> dict[str, torch.Tensor] | None:
        """The policy (or with ``reference`` the reference) in HF layout on rank 0 (the keys of
        the original class's ``state_dict()``: it loads with ``strict=True``): the
        shards of DP replica 0 gathered, stages merged (:func:`~.convert.merge_pipeline_stages`),
        TP shards concatenated, vocabulary padding dropped; ``None`` on the other ranks. A
        collective of the whole actor group."""
        from .convert import megatron_state, megatron_to_hf, merge_pipeline_stages

        mine = None
        if self.dp_rank == 0:
            model = self.ref_model if reference else self.model
            state = {k: v.cpu() for k, v in megatron_state(model).items()}
            mine = (self.tp_rank, self.pp_rank, state)
        every: list = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        if self.rank != 0:
            return None
        stages = {(t, p): s for t, p, s in (x for x in every if x is not None)}
        shards = [
            merge_pipeline_stages([stages[t, p] for p in range(self.pp)], [self.layers] * self.pp)
            for t in range(self.tp)
        ]
        return megatron_to_hf(shards, self.shape)

    # -- memory ----------------------------------------------------------------------------

    def offload(self) -> None:
        """Release the policy shard, its AdamW state (:func:`~..memory.offload`) and the
        reference shard: on CUDA to host memory; on CPU packed into one flat buffer and the
        tensors freed, as the policy is (restored bit-exactly by :meth:`onload`)."""
        from ..memory import pack

        super().offload()
        if self.ref_model is None or self._ref_packed is not None:
            return
        params = list(self.ref_model.parameters())
        if self.device.type != "cpu":
            self.ref_model.to("cpu")
            self._ref_packed = "moved"
            return
        self._ref_packed = pack([p.data for p in params])
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device="cpu")

    def onload(self) -> None:
        """Undo :meth:`offload`."""
        from ..memory import unpack

        super().onload()
        packed, self._ref_packed = self._ref_packed, None
        if packed is None:
            return
        if packed == "moved":
            self.ref_model.to(self.device)
            return
        for p, t in zip(self.ref_model.parameters(), unpack(*packed)):
            p.data = t

    # -- optimizer checkpoints -------------------------------------------------------------

    def _optimizer_file(self, path: str | Path) -> Path:
        return Path(path) / f"megatron_optimizer_rank{self.rank}.pt"

    def save_optimizer(self, path: str | Path) -> None:
        """This rank's AdamW state (of its shard) under ``path``, with the layout it fits."""
        Path(path).mkdir(parents=True, exist_ok=True)
        layout = {"tp": self.tp, "pp": self.pp, "dp": self.dp}
        state = {"optimizer": self.optimizer.state_dict(), "layout": layout}
        torch.save(state, self._optimizer_file(path))

    def load_optimizer(self, path: str | Path) -> None:
        """Restore what :meth:`save_optimizer` wrote for this rank.

        Raises:
            ValueError: the checkpoint was written with another TP/PP/DP layout (its weights, in
                HF layout, load anywhere; its optimizer shards do not).
            StateFileError: a damaged file, or one holding other objects (not loaded).
        """
        f = self._optimizer_file(path)
        layout = {"tp": self.tp, "pp": self.pp, "dp": self.dp}
        state = load_file(f) if f.is_file() else None  # weights_only: runs no code
        if state is not None:  # files written before PP existed hold no "pp": one stage
            state["layout"] = {"pp": 1, **state["layout"]}
        if state is None or state["layout"] != layout:
            found = None if state is None else state["layout"]
            raise ValueError(
                f"{path}: Megatron optimizer state for layout {layout} not found (found "
                f"{found}): resume with the actor.tensor_parallel, actor.pipeline_parallel "
                "and devices it was saved with"
            )
        self.optimizer.load_state_dict(state["optimizer"])

    def shutdown(self) -> None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dp.shutdown()
