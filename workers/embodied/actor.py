"""Embodied actor: PPO on environment trajectories for the :class:`ActorCritic` MLP.

PPO as in CleanRL's ``ppo.py`` (Huang et al., 2022): GAE over each environment's time axis,
advantages whitened over the batch, clipped policy surrogate, clipped value loss weighted by
``vf_coef``, entropy bonus ``ent_coef``, global gradient clipping, Adam with ``eps=1e-5``. The
surrogate and the value loss are the LM workflows' own functions
(:func:`~m2flow.workers.algos.grpo.grpo_loss` with one "token" per step, and
:func:`~m2flow.workers.algos.ppo.clipped_value_loss`).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from m2flow import Channel, Worker, group_method

from ..algos.grpo import grpo_loss
from ..algos.ppo import clipped_value_loss, explained_variance, gae, masked_whiten
from ..batch import row_order, split_rows
from ..checkpoint import load_state, save_state
from ..llm.placement import set_torch_threads, torch_device
from ..weight_change import snapshot, update_norm
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
            batch), torch threads (0: the CPUs of the rank's devices)).
        seed: init and shuffling.
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
        set_torch_threads(self, o.threads)
        torch.manual_seed(seed)
        self.device = torch_device(self.devices)
        self.net = ActorCritic(obs_dim, n_actions, hidden).to(self.device)
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=o.lr, eps=1e-5)
        self.grad_clip, self.gamma, self.lam = o.grad_clip, o.gamma, o.lam
        self.clip_eps, self.value_clip = o.clip_eps, o.value_clip
        self.vf_coef, self.ent_coef = o.vf_coef, o.ent_coef
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
        before = snapshot(self.net.parameters())
        sums: dict[str, float] = defaultdict(float)
        steps = 0
        for _ in range(self.epochs):
            for idx in split_rows(row_order(n, True, self.generator), self.mini):
                mb = {k: v[idx].to(self.device) for k, v in flat.items()}
                sums_step = self._step(mb)
                for k, v in sums_step.items():
                    sums[k] += v
                steps += 1
        self.weight_version += 1
        norm = update_norm(before, self.net.parameters())
        out = {k: v / steps for k, v in sums.items()}
        out["explained_variance"] = explained_variance(
            flat["values"], flat["returns"], ones.squeeze(1)
        )
        out["samples"], out["update_norm"] = n, norm
        return out

    def _step(self, mb: dict[str, torch.Tensor]) -> dict[str, float]:
        dist = self.net.dist(mb["obs"])
        logprob = dist.log_prob(mb["actions"])
        mask = torch.ones_like(logprob).unsqueeze(1)
        pg, m = grpo_loss(
            logprob.unsqueeze(1), mb["logprobs"].unsqueeze(1), mb["advantages"], mask,
            self.clip_eps, self.clip_eps,
        )  # fmt: skip
        vf, vm = clipped_value_loss(
            self.net.value(mb["obs"]).unsqueeze(1), mb["values"].unsqueeze(1),
            mb["returns"].unsqueeze(1), mask, self.value_clip,
        )  # fmt: skip
        entropy = dist.entropy().mean()
        loss = pg + self.vf_coef * vf - self.ent_coef * entropy
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.grad_clip)
        self.optimizer.step()
        with torch.no_grad():
            log_ratio = logprob - mb["logprobs"]
            approx_kl = float(((log_ratio.exp() - 1) - log_ratio).mean())
        return {
            "loss": loss.item(),
            "pg_loss": m["pg_loss"],
            "clip_frac": m["clip_frac"],
            "vf_loss": vm["vf_loss"],
            "entropy": entropy.item(),
            "approx_kl": approx_kl,
            "grad_norm": float(norm),
        }

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The network's weights, on CPU (copies)."""
        return {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()}

    @group_method
    def save_checkpoint(self, path: str) -> str:
        """Network, optimizer, shuffling RNG and weight version under ``path``."""
        return save_state(
            path,
            self.rank,
            {
                "net": self.net.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(),
                "weight_version": self.weight_version,
            },
        )

    @group_method
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        state = load_state(path, self.rank)
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.weight_version = state["weight_version"]

    def offload(self) -> None:
        if self.device.type == "cuda":
            self.net.to("cpu")
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and k != "step":
                        state[k] = v.cpu()

    def onload(self) -> None:
        if self.device.type == "cuda":
            self.net.to(self.device)
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and k != "step":
                        state[k] = v.to(self.device)
