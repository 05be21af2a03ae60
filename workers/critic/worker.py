"""Critic worker: values of rollout chunks, GAE advantages and returns, clipped value training.

The critic is where a PPO step's branches join: it takes each rollout chunk, the reward
model's scores and the reference logprobs for that chunk (by its
:attr:`~m2flow.workers.chunk.RolloutChunk.key`),
computes KL-shaped token rewards and GAE, hands the chunk with its advantages to the actor,
then fits its values to the returns.
"""

from __future__ import annotations

import torch

from m2flow import Channel, Worker

from .. import parallel as dp
from ..algos.ppo import explained_variance, gae, token_rewards
from ..batch import concat, num_tokens
from ..checkpoint import load_state, save_state
from ..chunk import RolloutChunk
from ..llm import build_tokenizer, compute_dtype
from ..llm.placement import set_torch_threads, torch_device
from ..weight_change import snapshot, update_norm
from .megatron_engine import lm_to_critic
from .model import ValueModel
from .trainer import ValueTrainer


class CriticWorker(Worker):
    """Value head on a tiny Qwen2, initialised from the (warm-started) policy.

    Torch engine: one rank (``data_parallel = False``); given several devices it uses them as
    one. ``engine="megatron"`` (:mod:`.megatron_engine`): one rank per device, the ranks forming
    Megatron's tensor- and data-parallel groups (DP = ranks / TP); each rank reads its share of
    the step's chunks, the ranks exchange them (mailboxes), every rank computes the
    values of all of them (TP peers forward together) and passes its own chunks on, then the
    value update runs on the whole batch, split over the DP ranks. Weights and checkpoints stay
    in the torch critic's layout (gathered to rank 0), so either engine resumes the other's.

    Args:
        model: :class:`~m2flow.workers.llm.ModelConfig` fields (the policy's shape).
        tokenizer: the tokenizer spec, ``{"name": "char", "alphabet": str}`` or
            ``{"name": "qwen2"}`` (:func:`~m2flow.workers.llm.build_tokenizer`).
        lr, betas, weight_decay, grad_clip: AdamW.
        value_clip: PPO value clip around the old values (0: none).
        gamma, lam: GAE discount and lambda (per token).
        kl_coef: weight of the per-token KL penalty in the reward.
        epochs: passes over each batch; mini_batch_size, micro_batch_size: responses per
            optimizer step / per forward (0: the whole batch / mini-batch).
        threads: torch threads (0: the CPUs of the rank's devices); seed: init and shuffling.
        engine: ``"torch"`` or ``"megatron"`` (needs the ``megatron`` extra).
        tensor_parallel: Megatron TP size (divides the ranks and the model's heads).
        dist: the process group's rendezvous ``{"addr", "port"}`` (set by :meth:`launch`).

    Raises:
        ValueError: an unknown ``engine``, a ``tensor_parallel`` without Megatron, or a
            Megatron setting it cannot run (:func:`.megatron_engine.check_config`).
    """

    data_parallel = False  # torch: one rank over all its devices

    @classmethod
    def launch(cls, cluster, placement=None, **kwargs):
        """:meth:`Worker.launch`; with ``engine="megatron"`` one rank per device of the
        placement (default: where the plan puts the group) and their process group's
        rendezvous. Refuses a bad engine setting before any process starts."""
        from m2flow.group import normalize_placement

        if kwargs.get("engine", "torch") == "megatron":
            if placement is None:
                placement = cluster.devices_for(kwargs.get("name") or cls.__name__)
            ranks = [[d] for r in normalize_placement(placement, cluster) for d in r]
            cls._check(len(ranks), kwargs)
            kwargs["dist"] = dp.rendezvous(cluster, ranks)
            placement = ranks
        else:
            cls._check(1, kwargs)
        return super().launch(cluster, placement, **kwargs)

    @staticmethod
    def _check(world_size: int, kwargs: dict) -> None:
        engine = kwargs.get("engine", "torch")
        if engine not in ("torch", "megatron"):
            raise ValueError(f"critic.engine={engine!r}: pick torch or megatron")
        if engine == "megatron":
            from .megatron_engine import check_config

            return check_config(world_size, kwargs)
        if kwargs.get("tensor_parallel", 1) != 1:
            raise ValueError("critic.tensor_parallel needs critic.engine=megatron")

    def __init__(
        self,
        model: dict,
        tokenizer: dict,
        lr: float = 1e-4,
        betas: tuple = (0.9, 0.99),
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        value_clip: float = 0.2,
        gamma: float = 1.0,
        lam: float = 0.95,
        kl_coef: float = 0.05,
        epochs: int = 1,
        mini_batch_size: int = 0,
        micro_batch_size: int = 0,
        threads: int = 0,
        seed: int = 0,
        engine: str = "torch",
        tensor_parallel: int = 1,
        dist: dict | None = None,
    ) -> None:
        kw = {"engine": engine, "tensor_parallel": tensor_parallel, "model": model}
        self._check(self.world_size, kw)
        if engine == "megatron" and dist is None:
            raise ValueError("critic.engine=megatron needs the rendezvous: start with launch()")
        set_torch_threads(self, threads)
        self.tokenizer = build_tokenizer(tokenizer)
        device = torch_device(self.devices)
        value_model = ValueModel(model, self.tokenizer, seed=seed)
        optim = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, grad_clip=grad_clip)
        self.megatron = None
        if engine == "megatron":
            from .megatron_engine import MegatronCritic

            self.megatron = MegatronCritic(
                value_model.backbone.config,
                value_model.state_dict(),
                [n for n, _ in value_model.named_parameters()],
                self.rank,
                self.world_size,
                dist,
                device,
                tensor_parallel,
                optim,
            )
            self.trainer = self.megatron.trainer
        else:
            dtype = compute_dtype(model.get("dtype", "auto"), device)
            self.trainer = ValueTrainer(value_model.to(device), **optim, compute_dtype=dtype)
        self.value_clip, self.gamma, self.lam, self.kl_coef = value_clip, gamma, lam, kl_coef
        self.epochs = epochs
        self.mini, self.micro = mini_batch_size or None, micro_batch_size or None
        self.generator = torch.Generator().manual_seed(seed)

    def load_weights(self, weights: dict, version: int) -> None:
        """Start from the policy's transformer (``m2flow.sync_weights(actor, critic)``; every
        rank gets the whole policy; a Megatron rank keeps its shard)."""
        if self.megatron is not None:
            self.megatron.load(lm_to_critic(weights), head=False)
        else:
            self.trainer.model.load_backbone(weights)

    def _advantages(self, chunk: RolloutChunk, score: torch.Tensor, ref: torch.Tensor) -> None:
        """Values, KL-shaped rewards and GAE of one rollout chunk, added to its batch."""
        batch = chunk.batch
        values = self.trainer.values(batch, self.micro)
        rewards, dones, kl = token_rewards(
            score, batch["logprobs"], ref, batch["response_mask"], self.kl_coef
        )
        adv, ret = gae(rewards, values, dones, values.new_zeros(len(batch)), self.gamma, self.lam)
        mask = batch["response_mask"]
        batch["advantages"], batch["returns"] = adv * mask, ret * mask
        batch["old_values"], batch["kl"], batch["scores"] = values, kl, score.float()

    def _read_megatron(self, rollouts: Channel, scores: Channel, refs: Channel, out: Channel):
        """Megatron: every rank reads its share of the chunks (with their scores and reference
        logprobs) to the end of step, then the ranks exchange them through their mailboxes
        (``send``/``recv``; a ``recv`` yields the device while it waits). Not a
        ``torch.distributed`` collective: a rank blocked in one holds its device, and a peer may
        still wait for a score whose producer needs that device (a hang found in 1 of 3 runs
        with the reward on the critic's rank-0 device). After the exchange every producer is
        done, so the TP forwards may block. Every rank computes all values (in key order);
        each puts its own chunks into ``out``. Returns all chunks, in key order."""
        mine = []
        for (chunk,) in rollouts.stream():
            key = chunk.key
            mine.append((chunk, scores.get(key=key)["scores"], refs.get(key=key)["ref_logprobs"]))
        own = {c.key for c, _, _ in mine}
        chunks = []
        for chunk, score, ref in sorted(self._exchange(mine), key=lambda t: t[0].key):
            self._advantages(chunk, score, ref)
            chunks.append(chunk)
            if chunk.key in own:
                out.put(chunk, weight=num_tokens(chunk.batch))
        return chunks

    def _exchange(self, mine: list) -> list:
        """Every rank's ``mine``, on every rank (rank order), through the mailboxes."""
        for r in range(self.world_size):
            if r != self.rank:
                self.send(mine, self.group_name, r)
        parts = [mine if r == self.rank else self.recv(self.group_name, r)
                 for r in range(self.world_size)]  # fmt: skip
        return [item for part in parts for item in part]

    def step(self, rollouts: Channel, scores: Channel, refs: Channel, out: Channel) -> dict:
        """Advantages for the step's rollout chunks (until the rollout's end of step), then one
        value update on them (chunks in a fixed order: by their first prompt id).

        Each chunk from ``rollouts`` is joined with the ``{"scores": [B]}`` item from
        ``scores`` and the ``{"ref_logprobs": [B, R]}`` item from ``refs`` put under its key.
        The chunk goes on into ``out`` with ``advantages`` and ``returns`` ``[B, R]`` (GAE over
        tokens, not whitened) added to its batch.

        Returns:
            ``kl`` (mean per-token ``log pi - log pi_ref``), ``score_mean``, ``return_mean``,
            ``explained_variance`` (of the old values), value-training metrics (``vf_loss``,
            ``vf_clip_frac``, ``value_mean``, ``grad_norm``), ``update_norm`` (L2 norm of the
            weight change).
        """
        if self.megatron is not None:
            chunks = self._read_megatron(rollouts, scores, refs, out)
        else:
            chunks = []
            for (chunk,) in rollouts.stream():
                score = scores.get(key=chunk.key)["scores"]
                ref = refs.get(key=chunk.key)["ref_logprobs"]
                self._advantages(chunk, score, ref)
                out.put(chunk, weight=num_tokens(chunk.batch))
                chunks.append(chunk)
        chunks.sort(key=lambda c: c.key)
        data = concat([c.batch for c in chunks], self.tokenizer.pad_token_id)
        mask = data["response_mask"]
        n_tok = float(mask.sum().clamp(min=1))
        stats = {
            "kl": float(data["kl"].sum() / n_tok),
            "score_mean": float(data["scores"].mean()),
            "return_mean": float((data["returns"] * mask).sum() / n_tok),
            "explained_variance": explained_variance(data["old_values"], data["returns"], mask),
        }
        before = snapshot(self.trainer.model.parameters())
        stats |= self.trainer.train_values(
            data, self.value_clip, self.mini, self.micro, self.epochs, self.generator
        )
        if self.megatron is not None:
            stats["update_norm"] = self.megatron.change_norm(before)
        else:
            stats["update_norm"] = update_norm(before, self.trainer.model.parameters())
        return stats

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The value model's weights, on CPU (copies), in the torch critic's layout. Megatron:
        gathered on rank 0 (a collective of the group; the other ranks return ``None``)."""
        if self.megatron is not None:
            return self.megatron.gather()
        return {k: v.detach().cpu().clone() for k, v in self.trainer.model.state_dict().items()}

    def save_checkpoint(self, path: str) -> str:
        """Value model, optimizer state and the shuffling RNG under ``path`` (rank 0's file;
        Megatron: weights and AdamW moments gathered into the torch critic's format)."""
        if self.megatron is not None:
            model, optimizer = self.megatron.gather(), self.megatron.gather_optimizer()
            if self.rank != 0:
                return str(path)
        else:
            model, optimizer = self.trainer.model.state_dict(), self.trainer.optimizer.state_dict()
        state = {"model": model, "optimizer": optimizer, "generator": self.generator.get_state()}
        return save_state(path, 0, state)

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, by either engine in any layout (every
        rank reads rank 0's file)."""
        state = load_state(path, 0)
        if self.megatron is not None:
            self.megatron.load(state["model"])
            self.megatron.load_optimizer(state["optimizer"])
        else:
            self.trainer.model.load_state_dict(state["model"])
            self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])

    def offload(self) -> None:
        self.trainer.offload()

    def onload(self) -> None:
        self.trainer.onload()
