"""The PPO critic on Megatron-core (``critic.engine=megatron``): a ``GPTModel`` trunk and a
scalar value head, tensor and data parallel over the critic's ranks (one per device).

The model is the actor's (:func:`~.model.build_gpt_model`: a Qwen2, Llama or
Mistral trunk as :mod:`~.arch` maps it, untied) whose ``output_layer`` is
replaced by :class:`ValueHead`, a replicated ``Linear(H, 1)`` (how veRL's Megatron critic does
it: ``LinearForLastLayer``): Megatron's ``GPTModel`` then runs its own final norm and hands the
head ``[S, B, H]`` hidden states, which are whole on every TP rank (no sequence parallel), so
the head's values and gradients are the same on every TP rank; like the norms it counts once in
the gradient norm. No vocabulary output layer is kept.

Training is the shared mechanics (:class:`~..base.ModelEngine`) with the critic's loss
(:func:`~m2flow.workers.algos.losses.value_loss`: clipped value loss, mini-batches and epochs
driven by the critic role), DP rank ``d`` taking the ``d``-th contiguous slice of every
mini-batch, gradients and metric sums summed over Megatron's DP group, and the Megatron actor's
global-norm clip (:func:`~.engine.clip_global_norm`) before a plain ``torch.optim.AdamW`` step on
the shards.

Checkpoints are in the torch critic's format (``ValueModel`` state dict names, a
``torch.optim.AdamW`` state dict over ``ValueModel.parameters()``): the AdamW moments have the
shapes of their parameters, so they are gathered and split like the weights
(:func:`optimizer_to_torch`, :func:`optimizer_from_torch`). A critic saved by either engine, in
any TP/DP layout, resumes in the other with its moments.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ... import parallel as dp
from ...batch import row_index
from ..base import RESPONSE_KEYS, ModelEngine
from .engine import _QUIET, clip_global_norm

_HEAD = ("output_layer.weight", "output_layer.bias")
_MOMENTS = ("exp_avg", "exp_avg_sq")


def check_config(world_size: int | None, kwargs: dict) -> None:
    """Refuse a Megatron critic configuration before any process starts: the actor's checks
    (:func:`~.engine.check_config`) under ``critic.*`` names (the critic runs
    one pipeline stage: its config has no ``pipeline_parallel``).

    Raises:
        ValueError: megatron-core missing, or a TP size that does not divide the ranks or the
            model's heads; the message names the fix. ``UnsupportedModel`` (a ``ValueError``):
            a trunk the engine does not map (the message names ``critic.engine=torch``).
    """
    from .engine import check_config as check

    check(world_size, {**kwargs, "pipeline_parallel": 1}, role="critic")


class ValueHead(nn.Linear):
    """``Linear(hidden, 1)`` called the way ``GPTModel`` calls its ``output_layer``
    (``(hidden [S, B, H], weight=None, runtime_gather_output=None) -> (out [S, B, 1], None)``).
    Replicated on every TP rank (no ``tensor_model_parallel`` attribute)."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size, 1)
        self.sequence_parallel = False  # GPTModel reads it in inference mode
        nn.init.zeros_(self.weight)  # V = 0 before the first load, as the torch critic
        nn.init.zeros_(self.bias)

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return super().forward(hidden), None


def build_value_model(hf_config):
    """This rank's Megatron value model (after :func:`~.model.init_parallel`,
    PP = 1): the trunk of :func:`~.model.build_gpt_model` (Qwen2, Llama or
    Mistral; untied: the embedding is not shared with anything) and a :class:`ValueHead` as
    ``output_layer``. ``model(tokens, position_ids, attention_mask=...)`` returns
    ``[B, S, 1]``.

    Raises:
        UnsupportedModel: a trunk the engine does not map (names ``critic.engine=torch``).
    """
    from .arch import architecture
    from .model import build_gpt_model

    architecture(hf_config, role="critic")  # refused before anything is built
    untied = copy.deepcopy(hf_config)
    untied.tie_word_embeddings = False
    model = build_gpt_model(untied)
    model.output_layer = ValueHead(hf_config.hidden_size)
    return model


def megatron_positions(model, prompt_ids, prompt_mask, response_ids, response_mask):
    """``[B, P + R]`` head outputs of a Megatron value model at every position of
    ``prompt | response`` (the torch value model's layout; :func:`~m2flow.workers.algos.losses.
    response_values` reads the response's). Rows are rotated left by their prompt padding as
    for the actor's logprobs (:func:`~.model.rolled_inputs`) and back."""
    from .model import rolled_inputs

    tokens, position_ids, causal, back = rolled_inputs(prompt_ids, prompt_mask, response_ids)
    out = model(tokens, position_ids, attention_mask=causal).squeeze(-1).float()  # [B, S]
    return out.gather(1, back)


# -- checkpoint layout ---------------------------------------------------------------------


def critic_to_megatron(
    state: dict[str, torch.Tensor], shape, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, torch.Tensor]:
    """TP rank ``tp_rank``'s Megatron state from a torch critic's (``ValueModel``) state dict
    (``backbone.*`` = the family's trunk, e.g. ``Qwen2Model`` / ``LlamaModel``,
    ``head.{weight,bias}``). Without ``head.*`` keys (a policy's
    transformer, see :func:`lm_to_critic`) no ``output_layer`` entries are made."""
    from .convert import hf_to_megatron

    lm = {"model." + k[9:]: v for k, v in state.items() if k.startswith("backbone.")}
    out = hf_to_megatron(lm, shape, tp_rank=tp_rank, tp_size=tp_size, post_process=False)
    out["decoder.final_layernorm.weight"] = lm["model.norm.weight"].clone()
    if "head.weight" in state:
        out["output_layer.weight"] = state["head.weight"].clone()
        out["output_layer.bias"] = state["head.bias"].clone()
    return out


def megatron_to_critic(shards: list[dict[str, torch.Tensor]], shape) -> dict[str, torch.Tensor]:
    """The torch critic's state dict from the TP shards (``shards[r]``: rank ``r``'s)."""
    from .convert import megatron_to_hf

    trunk = [{k: v for k, v in s.items() if k not in _HEAD} for s in shards]
    # "tied": megatron_to_hf then wants no output_layer; its lm_head copy is dropped.
    hf = megatron_to_hf(trunk, dataclasses.replace(shape, tie_word_embeddings=True))
    out = {"backbone." + k[6:]: v for k, v in hf.items() if k.startswith("model.")}
    out["head.weight"] = shards[0]["output_layer.weight"].clone()
    out["head.bias"] = shards[0]["output_layer.bias"].clone()
    return out


def lm_to_critic(lm_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A causal LM's ``model.*`` weights under the critic's ``backbone.*`` names (LM head and
    anything else dropped)."""
    return {"backbone." + k[6:]: v for k, v in lm_state.items() if k.startswith("model.")}


def optimizer_to_torch(shards: list[dict], param_groups: list[dict], names: list[str], shape):
    """A ``torch.optim.AdamW`` state dict over the torch critic's parameters (``names``, in
    ``ValueModel.parameters()`` order) from the TP ranks' AdamW states, each
    ``{megatron name: {"step", "exp_avg", "exp_avg_sq"}}`` (``{}`` before the first step).
    ``param_groups``: the Megatron optimizer's (hyper-parameters; ``params`` renumbered)."""
    groups = [dict(g, params=list(range(len(names)))) for g in param_groups]
    if not shards[0]:
        return {"state": {}, "param_groups": groups}
    step = next(iter(shards[0].values()))["step"]
    moments = {
        m: megatron_to_critic([{k: st[m] for k, st in s.items()} for s in shards], shape)
        for m in _MOMENTS
    }
    state = {
        i: {"step": step.clone(), **{m: moments[m][n] for m in _MOMENTS}}
        for i, n in enumerate(names)
    }
    return {"state": state, "param_groups": groups}


def optimizer_from_torch(torch_state: dict, names: list[str], shape, tp_rank: int, tp: int):
    """This TP rank's ``{megatron name: {"step", "exp_avg", "exp_avg_sq"}}`` from a torch
    critic's AdamW state dict (inverse of :func:`optimizer_to_torch`)."""
    st = torch_state["state"]
    if not st:
        return {}
    by_name = {names[i]: s for i, s in st.items()}
    step = next(iter(st.values()))["step"]
    moments = {
        m: critic_to_megatron({n: s[m] for n, s in by_name.items()}, shape, tp_rank, tp)
        for m in _MOMENTS
    }
    return {
        k: {"step": step.clone(), **{m: moments[m][k] for m in _MOMENTS}}
        for k in moments[_MOMENTS[0]]
    }


class MegatronCritic(ModelEngine):
    """This rank's part of a Megatron critic: process groups, model shard and its AdamW (the
    shared mechanics, :class:`~..base.ModelEngine`), weights in the torch critic's layout.
    Every rank is given the whole batch and trains its DP share (:meth:`_rows`).

    Args:
        hf_config: the Hugging Face config of the critic's trunk (the policy's: Qwen2, Llama or
            Mistral).
        torch_state: the torch critic's initial state dict (``ValueModel(..., seed)``: every
            rank builds the same one, so no collective is needed).
        names: ``ValueModel.parameters()`` names, in order (its optimizer's indices).
        rank, world_size, rendezvous, device: as :class:`~.engine.MegatronEngine`.
        tensor_parallel: TP size (divides ``world_size``; DP = world / TP).
        trainer: the mechanics' settings (``lr``, ``betas``, ``grad_clip``, ``nonfinite``,
            ...; :meth:`~..base.ModelEngine._setup`).

    Raises:
        RuntimeError: the rendezvous failed.
    """

    output = "values"
    whole_step = True
    data_parallel = True  # gradients and metric sums over Megatron's DP group

    def __init__(
        self,
        hf_config,
        torch_state: dict[str, torch.Tensor],
        names: list[str],
        rank: int,
        world_size: int,
        rendezvous: dict | None,
        device: torch.device,
        tensor_parallel: int,
        trainer: dict,
    ) -> None:
        warnings.filterwarnings("ignore", message=_QUIET)
        from megatron.core import parallel_state as ps

        from m2flow._env import wait_timeout

        from .model import init_parallel

        if not dist.is_initialized():
            dp.init(rank, world_size, rendezvous["addr"], rendezvous["port"], device)
        init_parallel(tp=tensor_parallel, pp=1, timeout_s=wait_timeout())  # as the actor's
        self.rank, self.names = rank, names
        self.tp, self.dp = tensor_parallel, world_size // tensor_parallel
        self.tp_rank, self.dp_rank = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank(),
        )
        self.mp_group = ps.get_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.model = build_value_model(hf_config).to(device)
        self.shape = self.model.m2flow_shape
        self._setup(self.model, **trainer)
        self.load(torch_state)

    # -- mechanics (ModelEngine hooks) -------------------------------------------------------

    def _forward(self, model, mb: dict, loss=None) -> torch.Tensor:
        return megatron_positions(model, *(mb[k] for k in RESPONSE_KEYS))

    def _rows(self, n: int) -> torch.Tensor:
        """This DP rank's contiguous share of ``n`` rows."""
        return torch.tensor_split(row_index(n), self.dp)[self.dp_rank]

    def _clip_grads(self) -> float:
        return clip_global_norm(self.model, self.grad_clip, self.mp_group)

    # -- weights ---------------------------------------------------------------------------

    def load(self, state: dict[str, torch.Tensor], head: bool = True) -> None:
        """Load this rank's shard of a torch critic state dict (every rank holds ``state``;
        no collective). ``head=False``: the trunk only (``backbone.*``), the head kept.

        Raises:
            KeyError: the state does not fit the model.
        """
        shard = critic_to_megatron(state, self.shape, self.tp_rank, self.tp)
        missing, unexpected = self.model.load_state_dict(shard, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if not head:
            missing = [k for k in missing if k not in _HEAD]
        if missing or unexpected:
            raise KeyError(f"critic state mismatch: missing {missing}, unexpected {unexpected}")

    def _gather_tp(self, mine):
        """``[mine of TP rank 0, 1, ...]`` of DP replica 0 on rank 0, ``None`` elsewhere."""
        every: list = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object((self.tp_rank, mine) if self.dp_rank == 0 else None, every, dst=0)
        if self.rank != 0:
            return None
        got = dict(s for s in every if s is not None)
        return [got[r] for r in range(self.tp)]

    def gather(self) -> dict[str, torch.Tensor] | None:
        """The torch critic's state dict on rank 0 (TP shards of DP replica 0 gathered),
        ``None`` on the other ranks. A collective of the critic's ranks."""
        from .convert import megatron_state

        shards = self._gather_tp({k: v.cpu() for k, v in megatron_state(self.model).items()})
        return None if shards is None else megatron_to_critic(shards, self.shape)

    def gather_optimizer(self) -> dict | None:
        """The AdamW state in the torch critic's format on rank 0 (:func:`optimizer_to_torch`),
        ``None`` elsewhere. A collective."""
        opt = self.optimizer
        names = {p: n for n, p in self.model.named_parameters()}
        mine = {
            names[p]: {k: v.detach().cpu().clone() for k, v in st.items()}
            for p, st in opt.state.items()
            if st
        }
        shards = self._gather_tp(mine)
        if shards is None:
            return None
        groups = opt.state_dict()["param_groups"]
        return optimizer_to_torch(shards, groups, self.names, self.shape)

    def load_optimizer(self, torch_state: dict) -> None:
        """This rank's shard of a torch critic's AdamW state dict (no collective)."""
        opt = self.optimizer
        local = optimizer_from_torch(torch_state, self.names, self.shape, self.tp_rank, self.tp)
        params = dict(self.model.named_parameters())
        opt.state.clear()
        for name, st in local.items():
            opt.state[params[name]] = {k: v.to(params[name].device) if k != "step" else v
                                       for k, v in st.items()}  # fmt: skip
        for group, saved in zip(opt.param_groups, torch_state["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})

    @torch.no_grad()
    def change_norm(self, before: list[torch.Tensor]) -> float:
        """L2 norm of the whole model's weight change since ``before`` (this rank's parameters,
        in order): TP-split parameters summed over the model-parallel group, replicated ones
        counted once. A collective of one DP replica's ranks (every rank calls it)."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        sq = torch.zeros((), dtype=torch.float64, device=dp.comm_device(self.mp_group))
        for p, b in zip(self.model.parameters(), before):
            if param_is_not_tensor_parallel_duplicate(p):
                sq += (p.detach().double() - b.to(p.device).double()).pow(2).sum()
        dist.all_reduce(sq, group=self.mp_group)
        return float(sq.sqrt())

    def shutdown(self) -> None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dp.shutdown()


class MegatronValueEngine(MegatronCritic):
    """The ``megatron`` value engine (the critic's): :class:`MegatronCritic` shards, TP x DP,
    one rank per device; weights and optimizer state leave and enter in the torch critic's
    layout (so either engine resumes the other's checkpoints). Every rank needs every chunk of
    the step (the role exchanges them first) and is given the whole batch.
    """

    one_rank_per_device = True

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "critic") -> None:
        """:func:`check_config`."""
        check_config(world_size, config)

    def __init__(
        self, model: dict, tokenizer, *, device: torch.device, rank: int, world_size: int,
        dist: dict | None, optim: dict, seed: int = 0, tensor_parallel: int = 1, **_,
    ) -> None:  # fmt: skip
        from ..value_model import ValueModel

        if dist is None:
            raise ValueError("critic.engine=megatron needs the rendezvous: start with launch()")
        value_model = ValueModel(model, tokenizer, seed=seed)
        super().__init__(
            value_model.backbone.config,
            value_model.state_dict(),
            [n for n, _ in value_model.named_parameters()],
            rank,
            world_size,
            dist,
            device,
            tensor_parallel,
            optim,
        )

    def load_backbone(self, lm_state: dict[str, torch.Tensor]) -> None:
        """Every rank gets the whole policy and keeps its shard of the trunk."""
        self.load(lm_to_critic(lm_state), head=False)

    def snapshot(self) -> list[torch.Tensor]:
        from ...weight_change import snapshot

        return snapshot(self.model.parameters())

    def update_norm(self, before: list[torch.Tensor]) -> float:
        return self.change_norm(before)

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        return self.gather()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Weights in the torch critic's layout (every rank the whole; keeps its shard)."""
        self.load(state)

    def checkpoint_state(self) -> tuple[dict, dict] | None:
        """Gathered on rank 0 (a collective); ``None`` on the other ranks."""
        from ..torch_engine import refuse_nonfinite

        refuse_nonfinite(self, "critic")
        model, optimizer = self.gather(), self.gather_optimizer()
        return None if model is None else (model, optimizer)

    def load_checkpoint_state(self, model: dict, optimizer: dict) -> None:
        self.load(model)
        self.load_optimizer(optimizer)
