"""Per-rank checkpoint files for workers whose state is not a Hugging Face model directory.

``save_state(path, rank, state)`` writes ``<path>/rank<rank>.pt`` (``torch.save``: tensors,
optimizer and RNG states, numpy arrays, picklable objects such as a Gymnasium vector env);
``load_state`` reads it back. The run's :class:`~m2flow.recipe.Checkpoints` gives each group
its own ``path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_state(path: str | Path, rank: int, state: dict[str, Any]) -> str:
    """Write ``state`` for ``rank`` under ``path`` (created). Returns the file path."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    f = out / f"rank{rank}.pt"
    torch.save(state, f)
    return str(f)


def load_state(path: str | Path, rank: int) -> dict[str, Any]:
    """Read what :func:`save_state` wrote for ``rank``.

    Raises:
        FileNotFoundError: no state for that rank under ``path`` (a checkpoint written with
            another number of ranks).
    """
    f = Path(path) / f"rank{rank}.pt"
    if not f.is_file():
        raise FileNotFoundError(
            f"{f} does not exist: the checkpoint was written with fewer ranks of this group"
        )
    return torch.load(f, weights_only=False)
