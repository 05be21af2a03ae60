"""Critic worker: values of rollout chunks, GAE advantages and returns, clipped value training.

The critic is where a PPO step's branches join: it takes each rollout chunk, the reward
model's scores and the reference logprobs for that chunk (by its
:attr:`~m2flow.workers.chunk.RolloutChunk.key`),
computes KL-shaped token rewards and GAE, hands the chunk with its advantages to the actor,
then fits its values to the returns.
"""

from __future__ import annotations

import torch

from m2flow import Channel, Worker, group_method

from .. import parallel as dp
from ..algos.losses import make_loss, response_values
from ..algos.ppo import explained_variance, gae, token_rewards
from ..batch import concat, num_tokens
from ..checkpoint import load_state, save_state
from ..chunk import RolloutChunk
from ..engines.registry import engine_class
from ..engines.update import value_update
from ..llm import build_tokenizer
from ..llm.placement import set_torch_threads, torch_device
from .config import CriticOptions


class CriticWorker(Worker):
    """Value head on the policy's trunk, initialised from the (warm-started) policy, on the
    value variant of the engine ``engine`` names (kind ``value``, :mod:`~..engines.registry`).

    Torch engine: one rank (``data_parallel = False``); given several devices it uses them as
    one. Megatron engine (``whole_step``): one rank per device in TP x DP groups; each rank
    reads its share of the step's chunks, the ranks exchange them (mailboxes), every rank
    computes the values of all of them (TP peers forward together) and passes its own chunks
    on, then the value update runs on the whole batch, split over the DP ranks. Weights and
    checkpoints stay in the torch critic's layout (gathered to rank 0), so either engine
    resumes the other's.

    Args:
        model: :class:`~m2flow.workers.llm.ModelConfig` fields (the policy's shape).
        tokenizer: the tokenizer spec (:func:`~m2flow.workers.llm.build_tokenizer`).
        options: the workflow's ``critic`` section (:class:`~.config.CriticOptions`: AdamW,
            batch split, threads, ``nonfinite``, engine and its TP size).
        value_clip: PPO value clip around the old values (0: none).
        gamma, lam: GAE discount and lambda (per token).
        kl_coef: weight of the per-token KL penalty in the reward.
        epochs: passes over each batch.
        seed: init and shuffling.
        dist: the process group's rendezvous ``{"addr", "port"}`` (set by :meth:`launch`).

    Raises:
        ValueError: an unknown ``engine`` or a setting it cannot run (its ``check``).
    """

    data_parallel = False  # torch: one rank over all its devices

    @classmethod
    def launch(cls, cluster, placement=None, *, options: CriticOptions, **kwargs):
        """:meth:`Worker.launch`; for an engine that runs one rank per device, one rank per
        device of the placement (default: where the plan puts the group) and their process
        group's rendezvous. Refuses a bad engine setting before any process starts."""
        from m2flow.core.group import normalize_placement

        model = kwargs.get("model")
        if engine_class("value", options.engine, "critic").one_rank_per_device:
            if placement is None:
                placement = cluster.devices_for(kwargs.get("name") or cls.__name__)
            ranks = [[d] for r in normalize_placement(placement, cluster) for d in r]
            cls._check(len(ranks), options, model)
            kwargs["dist"] = dp.rendezvous(cluster, ranks)
            placement = ranks
        else:
            cls._check(1, options, model)
        return super().launch(cluster, placement, options=options, **kwargs)

    @staticmethod
    def _check(world_size: int, options: CriticOptions, model: dict) -> None:
        engine_class("value", options.engine, "critic").check(
            options.engine_check(model), world_size, "critic"
        )

    def __init__(
        self,
        model: dict,
        tokenizer: dict,
        options: CriticOptions,
        value_clip: float = 0.2,
        gamma: float = 1.0,
        lam: float = 0.95,
        kl_coef: float = 0.05,
        epochs: int = 1,
        seed: int = 0,
        dist: dict | None = None,
    ) -> None:
        self.options = options
        self._check(self.world_size, options, model)
        set_torch_threads(self, options.threads)
        self.tokenizer = build_tokenizer(tokenizer)
        self.loss = make_loss("value", "value", value_clip=value_clip)
        self.engine = engine_class("value", options.engine, "critic")(
            model, self.tokenizer, device=torch_device(self.devices), rank=self.rank,
            world_size=self.world_size, dist=dist, optim=options.optim, seed=seed,
            tensor_parallel=options.tensor_parallel,
        )  # fmt: skip
        self.value_clip, self.gamma, self.lam, self.kl_coef = value_clip, gamma, lam, kl_coef
        self.epochs = epochs
        self.mini, self.micro = options.mini_batch_size or None, options.micro_batch_size or None
        self.generator = torch.Generator().manual_seed(seed)

    def load_weights(self, weights: dict, version: int) -> None:
        """Start from the policy's transformer (``m2flow.sync_weights(actor, critic)``; every
        rank gets the whole policy; a Megatron rank keeps its shard)."""
        self.engine.load_backbone(weights)

    def _advantages(self, chunk: RolloutChunk, score: torch.Tensor, ref: torch.Tensor) -> None:
        """Values, KL-shaped rewards and GAE of one rollout chunk, added to its batch."""
        batch = chunk.batch
        values = self.engine.infer(batch, response_values, self.micro)
        rewards, dones, kl = token_rewards(
            score, batch["logprobs"], ref, batch["response_mask"], self.kl_coef
        )
        adv, ret = gae(rewards, values, dones, values.new_zeros(len(batch)), self.gamma, self.lam)
        mask = batch["response_mask"]
        batch["advantages"], batch["returns"] = adv * mask, ret * mask
        batch["old_values"], batch["kl"], batch["scores"] = values, kl, score.float()

    def _read_whole_step(self, rollouts: Channel, scores: Channel, refs: Channel, out: Channel):
        """A ``whole_step`` engine (Megatron): every rank reads its share of the chunks (with their
        scores and reference logprobs) to the end of step, then the ranks exchange them through
        their mailboxes (``send``/``recv``; a ``recv`` yields the device while it waits). Not a
        ``torch.distributed`` collective: a rank blocked in one holds its device, and a peer may
        still wait for a score whose producer needs that device (a hang found in 1 of 3 runs with
        the reward on the critic's rank-0 device). After the exchange every producer is done, so the
        TP forwards may block. Every rank computes all values (in key order); each puts its own
        chunks into ``out``. Returns all chunks, in key order."""
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

    @group_method(collect="rank0")
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
        if self.engine.whole_step:
            chunks = self._read_whole_step(rollouts, scores, refs, out)
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
        before = self.engine.snapshot()
        stats |= value_update(self.engine, data, self.loss, self.mini, self.micro, self.epochs,
                              self.generator)  # fmt: skip
        stats["update_norm"] = self.engine.update_norm(before)
        return stats

    @group_method
    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The value model's weights, on CPU (copies), in the torch critic's layout. Megatron:
        gathered on rank 0 (a collective of the group; the other ranks return ``None``)."""
        return self.engine.state_dict()

    @group_method
    def save_checkpoint(self, path: str) -> str:
        """Value model, optimizer state and the shuffling RNG under ``path`` (rank 0's file;
        Megatron: weights and AdamW moments gathered into the torch critic's format)."""
        state = self.engine.checkpoint_state()
        if state is None:
            return str(path)
        model, optimizer = state
        state = {"model": model, "optimizer": optimizer, "generator": self.generator.get_state()}
        return save_state(path, 0, state)

    @group_method
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, by either engine in any layout (every
        rank reads rank 0's file)."""
        state = load_state(path, 0)
        self.engine.load_checkpoint_state(state["model"], state["optimizer"])
        self.generator.set_state(state["generator"])

    def offload(self) -> None:
        self.engine.offload()

    def onload(self) -> None:
        self.engine.onload()
