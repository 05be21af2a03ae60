"""A small actor-critic MLP and the policy worker that turns observations into actions.

The network is CleanRL's PPO agent for classic control (Huang et al., 2022, "The 37
Implementation Details of PPO", details 2 and 3: separate 64-64 tanh MLPs for policy and value,
orthogonal init with gains sqrt(2), 0.01 for the policy head and 1 for the value head).
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from m2flow import Channel, Worker, group_method

from ..checkpoint import load_state, save_state
from ..llm.placement import offload_module, onload_module, set_torch_threads, torch_device
from .config import PolicyOptions


def _mlp(sizes: list[int], last_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        lin = nn.Linear(a, b)
        last = i == len(sizes) - 2
        nn.init.orthogonal_(lin.weight, last_gain if last else math.sqrt(2))
        nn.init.zeros_(lin.bias)
        layers += [lin] if last else [lin, nn.Tanh()]
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Categorical policy and state value over ``obs_dim``-dimensional observations.

    Args:
        obs_dim: observation size; n_actions: discrete actions; hidden: width of both layers.
    """

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64) -> None:
        super().__init__()
        self.pi = _mlp([obs_dim, hidden, hidden, n_actions], 0.01)
        self.v = _mlp([obs_dim, hidden, hidden, 1], 1.0)

    def dist(self, obs: torch.Tensor) -> torch.distributions.Categorical:
        """Action distribution for ``obs [N, obs_dim]``."""
        return torch.distributions.Categorical(logits=self.pi(obs))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """``[N]`` state values."""
        return self.v(obs).squeeze(-1)


class PolicyWorker(Worker):
    """Serves actions to environment workers through channels (inference only: data parallel).

    Args:
        obs_dim, n_actions: the :class:`ActorCritic` shape's ends (weights come from the
            actor by ``m2flow.sync_weights``).
        options: the workflow's ``policy`` section (:class:`~.config.PolicyOptions`: the
            hidden width; torch threads, 0: this rank's share of its node's CPUs).
        seed: sampling.
    """

    def __init__(self, obs_dim: int, n_actions: int, options: PolicyOptions, seed: int = 0) -> None:
        self.options = options
        set_torch_threads(self, options.threads)
        self.device = torch_device(self.devices)
        self.net = ActorCritic(obs_dim, n_actions, options.hidden).to(self.device).eval()
        self.generator = torch.Generator(self.device).manual_seed(seed + 7919 * self.rank)

    def load_weights(self, weights: dict, version: int) -> None:
        self.net.load_state_dict(weights)

    @group_method
    @torch.no_grad()
    def act(self, obs: Channel, actions: Channel) -> dict:
        """Serve observation items until the environments' end of step (ranks share them).

        An item from ``obs`` is ``{"rank": int, "obs": [N, obs_dim] float32}``; the answer,
        put into ``actions`` under key ``rank``, is ``{"action": [N] int64, "logprob": [N],
        "value": [N]}`` (a sample of the policy, its log-probability, the state value). An
        item of an environment sub-batch also holds ``"sub"``; its answer goes under key
        ``(rank, sub)``.

        Returns:
            ``items`` served, ``observations`` (rows), ``forward_s`` (seconds in the network).
        """
        rows, forward_s, served = 0, 0.0, 0
        for (item,) in obs.stream():
            served += 1
            t0 = time.perf_counter()
            x = item["obs"].to(self.device)
            dist = self.net.dist(x)
            action = torch.multinomial(dist.probs, 1, generator=self.generator).squeeze(-1)
            answer = {
                "action": action.cpu(),
                "logprob": dist.log_prob(action).cpu(),
                "value": self.net.value(x).cpu(),
            }
            forward_s += time.perf_counter() - t0
            key = item["rank"] if "sub" not in item else (item["rank"], item["sub"])
            actions.put(answer, key=key)
            rows += len(x)
        return {"items": served, "observations": rows, "forward_s": forward_s}

    @group_method
    def save_checkpoint(self, path: str) -> str:
        """This rank's action-sampling RNG (the weights come from the actor)."""
        return save_state(path, self.rank, {"generator": self.generator.get_state()})

    @group_method
    def load_checkpoint(self, path: str) -> None:
        self.generator.set_state(load_state(path, self.rank)["generator"])

    def offload(self) -> None:
        offload_module(self.net, self.device)

    def onload(self) -> None:
        onload_module(self.net, self.device)
