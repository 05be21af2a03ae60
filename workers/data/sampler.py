"""Seeded per-epoch shuffling of a split: the prompts each step takes.

Step ``s`` takes the next ``n`` indices of the current epoch's permutation; a batch that
crosses the end of an epoch continues with the next epoch's permutation (a new one per epoch,
seeded by ``(seed, epoch)``). The position ``(epoch, offset)`` is what a checkpoint stores
(:meth:`PromptSampler.state_dict`), so a resumed run takes exactly the batch an uninterrupted
run would have taken next.
"""

from __future__ import annotations

import random

from m2flow.core.config import ConfigError


class PromptSampler:
    """Indices into a split of ``size`` items, epoch after epoch.

    Args:
        size: items in the split (>= 1).
        seed: the run seed; epoch ``e``'s permutation depends only on ``(seed, e)``.
        shuffle: ``False``: every epoch in file order.

    Raises:
        ValueError: ``size < 1``.
    """

    def __init__(self, size: int, seed: int = 0, shuffle: bool = True) -> None:
        if size < 1:
            raise ValueError(f"a sampler needs at least one item, got size={size}")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch = self.offset = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation), cached

    def permutation(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order of the indices ``0..size-1``."""
        if self._order is None or self._order[0] != epoch:
            order = list(range(self.size))
            if self.shuffle:
                # A string seed: Python hashes it with SHA-512 (stable across processes).
                random.Random(f"m2flow-sampler:{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def take(self, n: int) -> list[int]:
        """The next ``n`` indices (across epoch ends), advancing the position."""
        out: list[int] = []
        while len(out) < n:
            order = self.permutation(self.epoch)
            part = order[self.offset : self.offset + n - len(out)]
            out += part
            self.offset += len(part)
            if self.offset == self.size:
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch", "offset", "size"}`` (JSON; ``runner.json``)."""
        return {"epoch": self.epoch, "offset": self.offset, "size": self.size}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position :meth:`state_dict` gave.

        Raises:
            ValueError: the position is over a split of another size (the data changed).
        """
        if state.get("size", self.size) != self.size:
            raise ValueError(
                f"the checkpoint's data position is over {state['size']} prompts, this run's "
                f"training data has {self.size}: resume with the same data (data.* and task.* "
                "as before), or start a new trainer.run_dir"
            )
        if not 0 <= state["offset"] < self.size or state["epoch"] < 0:
            raise ValueError(f"bad sampler position {state}")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


def load_sampler(sampler: PromptSampler, state: dict) -> list[str]:
    """Continue ``sampler`` from a checkpoint's runner state (``state["data"]``, what the
    runners save: :meth:`PromptSampler.state_dict`). Returns lines for the run log.

    Raises:
        ConfigError: the position is over data of another size.
    """
    pos = state.get("data")
    if pos is None:
        return [
            "data: the checkpoint holds no data position (an older m2flow wrote it): the "
            "prompts start again from the first epoch"
        ]
    try:
        sampler.load_state_dict(pos)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return [f"data: resumed at epoch {sampler.epoch}, prompt {sampler.offset} of {sampler.size}"]
