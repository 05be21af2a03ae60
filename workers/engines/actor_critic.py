"""The ``actor_critic`` engines: a small policy-and-value network trained by one optimizer on a
combined loss (the embodied actor's CleanRL PPO, :mod:`~m2flow.workers.embodied.actor`).

:class:`ActorCriticEngine` is the protocol; :class:`TorchActorCriticEngine` its ``torch``
backend (kind ``actor_critic`` in :mod:`.registry`). Mechanics only, as for every engine: the
role builds the network (any module with ``dist(obs)`` and ``value(obs)``, e.g.
:class:`~m2flow.workers.embodied.policy.ActorCritic`) and gives the loss
(:func:`~m2flow.workers.algos.actor_critic.actor_critic_loss`); the engine holds the network
and its optimizer, backpropagates, clips and steps.

**Same numbers as the role's own loop had**: the engine takes the network as the role built it
(seeded by the role), moves it to the device and builds ``torch.optim.Adam(params, lr=lr,
eps=eps)`` (CleanRL's Adam, ``eps=1e-5``; not the LLM engines' AdamW); each optimizer step is
the loss called on the network (the forward inside the loss, in the loss's order), gradients
zeroed, ``backward``, ``clip_grad_norm_`` over all parameters by ``grad_clip``, ``step``: the
operations and their order of the embodied actor before it had an engine, so its golden
metrics stay byte-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol

import torch


class ActorCriticEngine(Protocol):
    """One rank's policy-and-value network and its optimizer.

    Constructed as ``cls(model, *, device, lr, grad_clip, eps)``: ``model`` the network (the
    role builds and seeds it), ``lr``/``eps`` the optimizer's, ``grad_clip`` the max global
    gradient norm.
    """

    #: launch one rank per device and a process group
    one_rank_per_device: ClassVar[bool]

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "algorithm") -> None:
        """Refuse a configuration before any process starts; ``ValueError`` naming the
        setting and the fix."""

    def forward_backward(self, mb: dict, loss: Callable) -> dict[str, float]:
        """``loss(model, mb) -> (value, metrics)`` on the mini-batch ``mb`` (tensors on the
        device, ``[N, ...]``); gradients of ``value`` replace the previous ones. Returns
        ``loss`` (the value) and the loss's metrics."""

    def optimizer_step(self) -> dict[str, float]:
        """Clip by the global gradient norm and step; returns ``grad_norm`` (pre-clip)."""

    def get_weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of the network's weights (what the policy workers load)."""

    def snapshot(self) -> list[torch.Tensor]: ...

    def update_norm(self, before: list[torch.Tensor]) -> float:
        """L2 norm of the weight change since :meth:`snapshot`."""

    def checkpoint_state(self) -> tuple[dict, dict]:
        """``(network, optimizer)`` state dicts."""

    def load_checkpoint_state(self, model: dict, optimizer: dict) -> None: ...

    def offload(self) -> None:
        """Network and optimizer state to host memory (CUDA; nothing on CPU)."""

    def onload(self) -> None: ...


class TorchActorCriticEngine:
    """The network on one device with ``torch.optim.Adam`` (see the module docstring).

    Args:
        model: the network (``dist(obs)``, ``value(obs)``), as the role built it.
        device: where it trains.
        lr, eps: Adam's learning rate and epsilon.
        grad_clip: max global gradient norm.
    """

    one_rank_per_device = False

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "algorithm") -> None:
        """One rank (no gradient all-reduce)."""
        if world_size not in (None, 1):
            raise ValueError(
                f"the actor got {world_size} ranks; {role}.engine=torch trains the "
                "actor-critic on one rank: give the actor one device"
            )

    def __init__(
        self, model: torch.nn.Module, *, device: torch.device, lr: float, grad_clip: float,
        eps: float = 1e-5,
    ) -> None:  # fmt: skip
        self.device = device
        self.model = model.to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr, eps=eps)
        self.grad_clip = grad_clip

    def forward_backward(self, mb: dict, loss: Callable) -> dict[str, float]:
        value, metrics = loss(self.model, mb)
        self.optimizer.zero_grad(set_to_none=True)
        value.backward()
        return {"loss": value.item(), **metrics}

    def optimizer_step(self) -> dict[str, float]:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        return {"grad_norm": float(norm)}

    def get_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def snapshot(self) -> list[torch.Tensor]:
        from ..weight_change import snapshot

        return snapshot(self.model.parameters())

    def update_norm(self, before: list[torch.Tensor]) -> float:
        from ..weight_change import update_norm

        return update_norm(before, self.model.parameters())

    def checkpoint_state(self) -> tuple[dict, dict]:
        return self.model.state_dict(), self.optimizer.state_dict()

    def load_checkpoint_state(self, model: dict, optimizer: dict) -> None:
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)

    def offload(self) -> None:
        if self.device.type == "cuda":
            self.model.to("cpu")
            self._move_optimizer("cpu")

    def onload(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)
            self._move_optimizer(self.device)

    def _move_optimizer(self, device) -> None:
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(device)
