"""The critic's options: the PPO workflow's ``critic`` section, passed whole to
:class:`~.worker.CriticWorker` (the GAE and loss settings come from ``algorithm``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class CriticOptions:
    """The critic's optimiser, batch split and engine (checked by the workflow's ``validate``
    and, at launch, by the engine's ``check``).

    Fields:
        lr, betas, weight_decay, grad_clip: AdamW (``grad_clip``: global L2 norm per step).
            ``lr`` above the actor's: the value head starts at 0 and must catch up fast.
        mini_batch_size, micro_batch_size: responses per optimizer step / per forward
            (0: the whole batch / the whole mini-batch).
        threads: torch threads (0: the CPUs of the rank's devices).
        nonfinite: a NaN or infinite loss or gradient norm: ``stop`` the run, or ``skip`` the
            optimizer step (counted as ``nonfinite_skips``).
        engine: a backend of kind ``value`` (``torch``, ``megatron``: one rank per device,
            docs/results/megatron.md) or ``"module:Class"``.
        tensor_parallel: the Megatron engine's TP size (DP = the critic's devices / TP).
    """

    lr: float = 5e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    mini_batch_size: int = 128
    micro_batch_size: int = 0
    threads: int = 0
    nonfinite: str = "stop"
    engine: str = "torch"
    tensor_parallel: int = 1

    def engine_check(self, model: dict) -> dict:
        """What the engine's ``check`` reads: these options and the run's ``model``."""
        return {**asdict(self), "model": model}

    @property
    def optim(self) -> dict:
        """The engine's ``optim``: AdamW, clipping and ``nonfinite``."""
        return {"lr": self.lr, "betas": tuple(self.betas), "weight_decay": self.weight_decay,
                "grad_clip": self.grad_clip, "nonfinite": self.nonfinite}  # fmt: skip
