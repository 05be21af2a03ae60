"""The actor's Megatron-core engine (``actor.engine=megatron``): what :class:`~..worker.ActorWorker`
runs instead of the torch trainer.

Layout. The actor's ranks (one per device) form one ``torch.distributed`` world (gloo on CPU,
NCCL on CUDA) and Megatron's model-parallel groups over it: ``tp = tensor_parallel``,
``pp = 1`` (see :func:`check_config`), ``dp = world / tp``. Each rank holds its TP shard of a
Megatron ``GPTModel`` built from the same Hugging Face config as the torch engine's model.

A GRPO step (:meth:`MegatronEngine.read_step`, :meth:`MegatronEngine.train`):

1. every rank streams its share of the step's chunks from the channel (so no rank blocks in a
   collective while it holds its device lock and a producer still needs that device), then
   one ``all_gather_object`` gives every rank all chunks;
2. the worker sorts and concatenates them (every rank alike) and computes advantages;
3. per mini-batch, DP rank ``d`` takes the ``d``-th contiguous slice of its rows; the TP ranks
   of one DP replica forward the same rows together;
4. :class:`MegatronPolicyTrainer` (the torch engine's :class:`~..trainer.PolicyTrainer` with
   Megatron logprobs) accumulates token-sum gradients, sums gradients, token counts and metric
   sums over the DP group, divides by the global token count, clips by the global gradient norm
   (over TP shards, replicated parameters counted once) and takes a plain ``torch.optim.AdamW``
   step on the local shards: the torch engine's update up to float rounding.

Megatron's ``DistributedOptimizer`` is not used: on a CPU torch it rejects non-CUDA parameters
(docs/megatron.md). Weights leave through rank 0 in Hugging Face layout
(:meth:`MegatronEngine.gather_hf`, :func:`~.convert.megatron_to_hf`) and come in the same way
(:meth:`MegatronEngine.load_hf`).
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from .. import data_parallel as dp
from ..trainer import PolicyTrainer

ENGINES = ("torch", "megatron")

#: Megatron warnings that say nothing on the CPU/gloo path (no TE/Apex, CUDA tuning hints,
#: torch's rename of the collective Megatron's TP gather calls); kept out of the run logs.
_QUIET = (
    r".*(Transformer Engine|Apex is not installed|CUDA_DEVICE_MAX_CONNECTIONS"
    r"|all_gather_into_tensor|cuda_graph_scope).*"
)


def check_config(world_size: int, kwargs: dict) -> None:
    """Refuse a Megatron actor configuration before any process starts.

    Args:
        world_size: the actor's ranks (one per device).
        kwargs: the :class:`~..worker.ActorWorker` arguments (``tensor_parallel``,
            ``pipeline_parallel``, ``kl_coef``, ``model``).

    Raises:
        ValueError: megatron-core missing, ``pipeline_parallel != 1``, a TP size that does not
            divide the ranks or the model's heads, or ``kl_coef > 0``; the message names the fix.
    """
    from ...llm import ModelConfig

    if importlib.util.find_spec("megatron") is None or (
        importlib.util.find_spec("megatron.core") is None
    ):
        raise ValueError(
            "actor.engine=megatron needs megatron-core: pip install -c constraints.txt "
            "-e '.[megatron]' (or set actor.engine=torch)"
        )
    tp, pp = int(kwargs.get("tensor_parallel", 1)), int(kwargs.get("pipeline_parallel", 1))
    if pp != 1:
        raise ValueError(
            f"actor.pipeline_parallel={pp}: the Megatron actor runs one pipeline stage "
            "(the training loop does not drive Megatron's pipeline schedule yet): set "
            "actor.pipeline_parallel=1 and use actor.tensor_parallel / more devices"
        )
    if tp < 1 or world_size % tp:
        raise ValueError(
            f"actor.tensor_parallel={tp} must divide the actor's {world_size} ranks (one per "
            "device): change actor.tensor_parallel or the devices the plan gives the actor"
        )
    model = ModelConfig(**kwargs.get("model", {}))
    for field in ("num_attention_heads", "num_key_value_heads"):
        if getattr(model, field) % tp:
            raise ValueError(
                f"model.{field}={getattr(model, field)} is not divisible by "
                f"actor.tensor_parallel={tp}: pick a tensor_parallel that divides it"
            )
    if kwargs.get("kl_coef", 0.0) > 0:
        raise ValueError(
            "the Megatron actor keeps no reference model yet: set actor.kl_coef=0 "
            "(or actor.engine=torch)"
        )


class MegatronPolicyTrainer(PolicyTrainer):
    """:class:`~..trainer.PolicyTrainer` on this rank's Megatron shard.

    Same loss code (``grpo_loss`` on per-token logprobs, token mean), same AdamW (plain
    ``torch.optim.AdamW`` on the local shards). Differences: logprobs come from
    :func:`~.model.megatron_sequence_logprobs` (``shared_prefix`` is ignored: one full forward),
    data-parallel sums run over Megatron's DP group, and :meth:`_step` clips by the norm of the
    whole (TP-gathered) gradient. Supervised steps are not supported (the warm start runs on
    the torch engine, see :class:`MegatronEngine`).

    Args:
        model: this rank's Megatron ``GPTModel`` (after :func:`~.model.init_parallel`).
        **kwargs: :class:`~..trainer.PolicyTrainer` arguments.
    """

    def __init__(self, model, **kwargs):
        from megatron.core import parallel_state as ps

        from .model import megatron_sequence_logprobs

        super().__init__(model, **kwargs)
        self.logprobs_fn = megatron_sequence_logprobs
        self.dp_group = ps.get_data_parallel_group()
        self.mp_group = ps.get_model_parallel_group()

    def _step(self) -> float:
        """Clip by the global gradient norm (TP-split parameters summed over the TP group,
        replicated ones counted once), step, zero grads; returns the pre-clip norm."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        params = [p for p in self.model.parameters() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            if param_is_not_tensor_parallel_duplicate(p):
                sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq, group=self.mp_group)
        norm = sq.sqrt().float()
        if self.grad_clip and self.grad_clip > 0:
            coef = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)  # as clip_grad_norm_
            for p in params:
                p.grad.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return float(norm)

    def sft_step(self, *args, **kwargs):
        raise NotImplementedError("the Megatron actor's warm start runs on the torch engine")


class MegatronEngine:
    """This rank's part of a Megatron actor: process groups, model shard, trainer.

    Args:
        hf_config: the Hugging Face ``Qwen2Config`` of the policy (the torch engine's model).
        hf_state: rank 0: the initial weights (HF state dict); other ranks: ``None``.
        rank, world_size: this rank in the actor group (one rank per device).
        rendezvous: ``{"addr", "port"}`` of the group's process group.
        device: this rank's torch device (gloo on CPU, NCCL on CUDA).
        tensor_parallel: TP size (divides ``world_size``; DP = world / TP).
        trainer: :class:`MegatronPolicyTrainer` arguments (lr, betas, clip range, ...).

    Raises:
        RuntimeError: the rendezvous failed (:func:`~..data_parallel.init`).
    """

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
    ) -> None:
        warnings.filterwarnings("ignore", message=_QUIET)
        from megatron.core import parallel_state as ps

        from .model import build_gpt_model, init_parallel

        if not dist.is_initialized():
            dp.init(rank, world_size, rendezvous["addr"], rendezvous["port"], device)
        init_parallel(tp=tensor_parallel, pp=1)
        self.rank = rank
        self.tp, self.dp = tensor_parallel, world_size // tensor_parallel
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.model = build_gpt_model(hf_config).to(device)
        self.shape = self.model.m2flow_shape
        trainer = {k: v for k, v in trainer.items() if k != "shared_prefix"}
        self.trainer = MegatronPolicyTrainer(self.model, **trainer)
        self.load_hf(hf_state)

    # -- data ------------------------------------------------------------------------------

    def read_step(self, stream) -> list:
        """All of the step's items, on every rank: this rank's share of ``stream`` (an
        iterator of item lists, read to the producers' end of step) gathered over the world."""
        mine = [item for part in stream for item in part]
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return [item for items in every for item in items]

    def train(
        self, data: dict, mini_batch_size: int | None, micro_batch_size: int | None
    ) -> dict[str, float]:
        """GRPO update on the step's whole batch (the same ``data`` on every rank).

        Args:
            data: ``[B, ...]`` training tensors as :meth:`PolicyTrainer.train_on_batch` takes
                them (``old_logprobs`` recomputed here before any update if absent).
            mini_batch_size: responses per optimizer step (``None``: the whole batch).
            micro_batch_size: responses per forward on one DP rank (``None``: its share).

        Returns:
            the torch engine's metrics (``loss``, ``pg_loss``, ``clip_frac``, ``ratio_mean``,
            ``grad_norm``; means over the optimizer steps) and ``steps``.
        """
        n = len(data["response_ids"])
        minis = list(torch.split(torch.arange(n), mini_batch_size or n))
        mine = [torch.tensor_split(m, self.dp)[self.dp_rank] for m in minis]
        if "old_logprobs" not in data:  # behaviour logprobs of this rank's rows, before updates
            rows = torch.cat(mine)
            old = torch.zeros(data["response_ids"].shape)
            if len(rows):
                local = {k: v[rows] for k, v in data.items()}
                old[rows] = self.trainer.compute_logprobs(local, micro_batch_size)
            data = dict(data, old_logprobs=old)
        sums: dict[str, float] = {}
        for rows in mine:
            if len(rows):
                self.trainer.accumulate({k: v[rows] for k, v in data.items()}, micro_batch_size)
            for k, v in self.trainer.finish_accumulation().items():  # DP collective
                sums[k] = sums.get(k, 0.0) + v
        metrics = {k: v / len(minis) for k, v in sums.items() if k != "steps"}
        metrics["steps"] = int(sums.get("steps", 0))
        return metrics

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, 0)
        return box[0]

    # -- weights ---------------------------------------------------------------------------

    def load_hf(self, hf_state: dict[str, torch.Tensor] | None) -> None:
        """Every rank loads its TP shard of rank 0's ``hf_state`` (HF Qwen2 layout; the other
        ranks pass ``None``). A collective of the whole actor group.

        Raises:
            KeyError: the state does not fit the model (:func:`~.convert.load_megatron_state`).
        """
        from .convert import hf_to_megatron, load_megatron_state

        state = self.broadcast_object(
            None if hf_state is None else {k: v.detach().cpu() for k, v in hf_state.items()}
        )
        shard = hf_to_megatron(state, self.shape, tp_rank=self.tp_rank, tp_size=self.tp)
        load_megatron_state(self.model, shard)

    def gather_hf(self) -> dict[str, torch.Tensor] | None:
        """The model in HF Qwen2 layout (TP shards of DP replica 0 gathered, vocabulary
        padding dropped) on rank 0, ``None`` on the other ranks. A collective of the whole
        actor group."""
        from .convert import megatron_state, megatron_to_hf

        mine = None
        if self.dp_rank == 0:
            mine = (self.tp_rank, {k: v.cpu() for k, v in megatron_state(self.model).items()})
        every: list = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        if self.rank != 0:
            return None
        shards = dict(s for s in every if s is not None)
        return megatron_to_hf([shards[r] for r in range(self.tp)], self.shape)

    # -- optimizer checkpoints -------------------------------------------------------------

    def _optimizer_file(self, path: str | Path) -> Path:
        return Path(path) / f"megatron_optimizer_rank{self.rank}.pt"

    def save_optimizer(self, path: str | Path) -> None:
        """This rank's AdamW state (of its shard) under ``path``, with the layout it fits."""
        Path(path).mkdir(parents=True, exist_ok=True)
        layout = {"tp": self.tp, "dp": self.dp}
        state = {"optimizer": self.trainer.optimizer.state_dict(), "layout": layout}
        torch.save(state, self._optimizer_file(path))

    def load_optimizer(self, path: str | Path) -> None:
        """Restore what :meth:`save_optimizer` wrote for this rank.

        Raises:
            ValueError: the checkpoint was written with another TP/DP layout (its weights, in
                HF layout, load anywhere; its optimizer shards do not).
        """
        f = self._optimizer_file(path)
        layout = {"tp": self.tp, "dp": self.dp}
        state = torch.load(f, weights_only=False) if f.is_file() else None
        if state is None or state["layout"] != layout:
            found = None if state is None else state["layout"]
            raise ValueError(
                f"{path}: Megatron optimizer state for layout {layout} not found (found "
                f"{found}): resume with the actor.tensor_parallel and devices it was saved with"
            )
        self.trainer.optimizer.load_state_dict(state["optimizer"])

    def shutdown(self) -> None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dp.shutdown()
