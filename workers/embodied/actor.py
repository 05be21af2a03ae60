"""Embodied actor: PPO on environment trajectories for the :class:`ActorCritic` MLP.

PPO as in CleanRL's ``ppo.py`` (Huang et al., 2022): GAE over each environment's time axis,
advantages whitened over the batch, clipped policy surrogate, clipped value loss weighted by
``vf_coef``, entropy bonus ``ent_coef``, global gradient clipping, Adam with ``eps=1e-5``. The
surrogate and the value loss are the LM workflows' own functions
(:func:`~m2flow.workers.algos.grpo.grpo_loss` with one "token" per step, and
:func:`~m2flow.workers.algos.ppo.clipped_value_loss`), combined in
:func:`~m2flow.workers.algos.actor_critic.actor_critic_loss`.

The network and its optimizer live in an engine of kind ``actor_critic`` (``engine``, from the
engine registry, :mod:`~m2flow.workers.engines.registry`): the role seeds and builds the
:class:`ActorCritic` MLP, the ``torch`` engine hosts it with ``torch.optim.Adam(lr, eps=1e-5)``
and runs each step as the role's loop did (loss, zero grads, backward, global-norm clip, step;
:mod:`~m2flow.workers.engines.actor_critic`), so the numbers are the same as before.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from m2flow import Channel, Worker, group_method

from ..algos.actor_critic import actor_critic_loss
from ..algos.ppo import explained_variance, gae, masked_whiten
from ..batch import row_order, split_rows
from ..checkpoint import load_state, save_state
from ..engines.registry import engine_class
from ..llm.placement import set_torch_threads, torch_device
from .config import PPOOptions
from .policy import ActorCritic


class EmbodiedActorWorker(Worker):
    """Trains the policy from trajectories; sends weights to the policy group.

    One rank (``data_parallel = False``: no gradient all-reduce yet).

    Args:
        obs_dim, n_actions, hidden: the :class:`ActorCritic` shape.
        options: the workflow's ``algorithm`` section (:class:`~.config.PPOOptions`: Adam
            (``eps=1e-5``) learning rate and max global grad norm, GAE discount and lambda,
            ratio and value clips, loss weights, epochs and mini-batch size (0: the whole
            batch), torch threads (0: the CPUs of the rank's devices), and ``engine``, an
            ``actor_critic`` engine (:mod:`~..engines.registry`): ``torch`` or an import path).
        seed: init and shuffling.

    Raises:
        ValueError: an unknown ``engine`` or a setting it refuses (its ``check``).
    """

    data_parallel = False

    def __init__(
        self,
        obs_dim: int,
        n_actions: int,
        hidden: int,
        options: PPOOptions,
        seed: int = 0,
    ) -> None:
        o = self.options = options
        cls = engine_class("actor_critic", o.engine, "algorithm")  # algorithm.engine
        cls.check({"engine": o.engine}, self.world_size, "algorithm")
        set_torch_threads(self, o.threads)
        torch.manual_seed(seed)
        self.engine = cls(
            ActorCritic(obs_dim, n_actions, hidden), device=torch_device(self.devices),
            lr=o.lr, grad_clip=o.grad_clip, eps=1e-5,
        )  # fmt: skip
        self.gamma, self.lam = o.gamma, o.lam
        self.loss = dict(clip_eps=o.clip_eps, value_clip=o.value_clip, vf_coef=o.vf_coef,
                         ent_coef=o.ent_coef)  # fmt: skip
        self.epochs, self.mini = o.epochs, o.mini_batch_size or None
        self.generator = torch.Generator().manual_seed(seed)
        self.weight_version = 0

    @group_method(collect="rank0")
    def train(self, inp: Channel) -> dict:
        """One PPO update from the step's trajectories (one per environment rank, read from
        ``inp`` until the environments' end of step; layout: :meth:`EnvWorker.rollout`).

        Returns:
            ``loss``, ``pg_loss``, ``vf_loss``, ``entropy``, ``clip_frac``, ``approx_kl``
            (``E[(r - 1) - log r]``), ``grad_norm`` (pre-clip), means over optimizer steps;
            ``explained_variance`` of the old values; ``samples`` (environment steps);
            ``update_norm`` (L2 norm of the weight change).
        """
        trajs = sorted((t for (t,) in inp.stream()), key=lambda t: t["rank"])
        # [T, N] per rank -> [N_total, T]: GAE runs along each simulator's time axis.
        cat = {
            k: torch.cat([t[k] for t in trajs], dim=1)
            for k in trajs[0]
            if k not in ("last_value", "rank")
        }
        last = torch.cat([t["last_value"] for t in trajs])
        adv, ret = gae(
            cat["rewards"].T, cat["values"].T, cat["dones"].T, last, self.gamma, self.lam
        )
        flat = {
            "obs": cat["obs"].transpose(0, 1).reshape(-1, cat["obs"].shape[-1]),
            "actions": cat["actions"].T.reshape(-1),
            "logprobs": cat["logprobs"].T.reshape(-1),
            "values": cat["values"].T.reshape(-1),
            "advantages": adv.reshape(-1),
            "returns": ret.reshape(-1),
        }
        n = len(flat["actions"])
        ones = flat["advantages"].new_ones(n, 1)
        flat["advantages"] = masked_whiten(flat["advantages"].unsqueeze(1), ones).squeeze(1)
        before = self.engine.snapshot()
        sums: dict[str, float] = defaultdict(float)
        steps = 0
        for _ in range(self.epochs):
            for idx in split_rows(row_order(n, True, self.generator), self.mini):
                mb = {k: v[idx].to(self.engine.device) for k, v in flat.items()}
                sums_step = self._step(mb)
                for k, v in sums_step.items():
                    sums[k] += v
                steps += 1
        self.weight_version += 1
        norm = self.engine.update_norm(before)
        out = {k: v / steps for k, v in sums.items()}
        out["explained_variance"] = explained_variance(
            flat["values"], flat["returns"], ones.squeeze(1)
        )
        out["samples"], out["update_norm"] = n, norm
        return out

    def _step(self, mb: dict[str, torch.Tensor]) -> dict[str, float]:
        out = self.engine.forward_backward(
            mb, lambda model, b: actor_critic_loss(model, b, **self.loss)
        )
        return out | self.engine.optimizer_step()

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The network's weights, on CPU (copies)."""
        return self.engine.get_weights()

    @group_method
    def save_checkpoint(self, path: str) -> str:
        """Network, optimizer, shuffling RNG and weight version under ``path``."""
        net, optimizer = self.engine.checkpoint_state()
        return save_state(
            path,
            self.rank,
            {
                "net": net,
                "optimizer": optimizer,
                "generator": self.generator.get_state(),
                "weight_version": self.weight_version,
            },
        )

    @group_method
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        state = load_state(path, self.rank)
        self.engine.load_checkpoint_state(state["net"], state["optimizer"])
        self.generator.set_state(state["generator"])
        self.weight_version = state["weight_version"]

    def offload(self) -> None:
        self.engine.offload()

    def onload(self) -> None:
        self.engine.onload()
