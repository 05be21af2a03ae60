"""Checkpoint files of the workers: written as tensors and plain values, read without running
code, and checked before a run resumes.

- ``save_state(path, rank, state)`` writes ``<path>/rank<rank>.pt`` for workers whose state is
  not a Hugging Face model directory; ``load_state`` reads it back. The run's
  :class:`~m2flow.run.recipe.Checkpoints` gives each group its own ``path``.
- Every state file holds tensors and plain values only (``None``, bools, numbers, strings,
  and tuples, lists and dicts of them): optimizer state dicts, ``torch`` RNG states and
  ``random.getstate()`` are such values as they are; numpy arrays, numpy scalars and numpy
  RNGs go through :func:`to_plain` / :func:`from_plain`. Every file is read with
  ``torch.load(weights_only=True)`` (:func:`load_file`): a file holding any other object is
  refused unloaded, since unpickling it could run code.
- :func:`group_check` builds the per-group content check a workflow hands to
  :func:`m2flow.run.recipe.validate_trainer`, so that a damaged checkpoint is named before Ray
  starts (the runtime calls it without importing this package).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: numpy bit generators a saved numpy RNG may name (numpy's own)
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")
_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes)  # and torch.Tensor, torch.dtype
_NOT_OURS = "this file was not written by m2flow, or was changed since"


class StateFileError(ValueError):
    """A state file that cannot be read safely: damaged, or holding objects other than tensors
    and plain values. The message is one line naming the file."""


def save_state(path: str | Path, rank: int, state: dict[str, Any]) -> str:
    """Write ``state`` for ``rank`` under ``path`` (created). Returns the file path.

    Raises:
        TypeError: ``state`` holds something other than tensors and plain values (the message
            names where; convert numpy values with :func:`to_plain`).
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return str(save_file(out / f"rank{rank}.pt", state))


def save_file(f: str | Path, state: Any) -> Path:
    """``torch.save(state, f)`` after checking ``state`` is tensors and plain values only
    (what :func:`load_file` reads back). Returns ``f`` as a path.

    Raises:
        TypeError: anything else in ``state`` (the message names where).
    """
    import torch  # heavy (~2 s): imported when a file is written or read

    check_plain(state, Path(f).name)
    torch.save(state, f)
    return Path(f)


def load_state(path: str | Path, rank: int) -> dict[str, Any]:
    """Read what :func:`save_state` wrote for ``rank``.

    Raises:
        FileNotFoundError: no state for that rank under ``path`` (a checkpoint written with
            another number of ranks).
        StateFileError: a damaged file, or one holding other objects (not loaded).
    """
    f = Path(path) / f"rank{rank}.pt"
    if not f.is_file():
        raise FileNotFoundError(
            f"{f} does not exist: the checkpoint was written with fewer ranks of this group"
        )
    return load_file(f)


def load_file(f: str | Path, *, mmap: bool = False) -> Any:
    """``torch.load(f, weights_only=True)``: tensors and plain values, nothing else unpickled.

    Args:
        mmap: map tensor data instead of reading it (a check of a large file; CPU tensors).

    Raises:
        StateFileError: not a regular file, damaged, or holding other objects (one line
            naming the file; the file's objects are never constructed).
    """
    import torch  # heavy: as in save_file

    f = Path(f)
    if not f.is_file():  # a FIFO or device would block or never end
        raise StateFileError(f"{f} is not a regular file")
    try:
        if mmap:
            return torch.load(f, weights_only=True, mmap=True, map_location="cpu")
        return torch.load(f, weights_only=True)
    except Exception as e:  # noqa: BLE001 (unpickling errors have many types: one line each)
        raise StateFileError(f"{f}: {_load_problem(e)}") from None


def _load_problem(e: Exception, hint: str = _NOT_OURS) -> str:
    """One line for a failed weights-only load (torch's own message advises loading the file
    unsafely: never passed on)."""
    if isinstance(e, pickle.UnpicklingError):
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"an object of {found.group(1)}" if found else "objects"
        return (
            f"holds {what} besides tensors and plain values; refused unloaded (unpickling "
            f"it could run code): {hint}"
        )
    return "damaged (not a complete torch state file; truncated or overwritten?)"


@contextmanager
def unpickling_refused(where: str) -> Iterator[None]:
    """Around a loader that reads pickled weights with ``weights_only=True`` (transformers'
    ``from_pretrained`` of a ``pytorch_model.bin``): its refusal of a file holding other
    objects becomes one line naming ``where``, without torch's advice to load it unsafely.

    Raises:
        ValueError: the loader refused such a file.
    """
    try:
        yield
    except pickle.UnpicklingError as e:
        hint = "save the model as safetensors (save_pretrained) from a copy you trust"
        raise ValueError(f"{where}: a weights file {_load_problem(e, hint)}") from None


def check_plain(value: Any, where: str = "value") -> None:
    """Raise ``TypeError`` naming the first part of ``value`` that is not a tensor or a plain
    value (what ``torch.load(weights_only=True)`` reads back)."""
    import torch  # heavy: as in save_file

    if isinstance(value, (*_PLAIN_LEAVES, torch.Tensor, torch.dtype)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                raise TypeError(f"{where} has a key of type {type(k).__name__}")
            check_plain(v, f"{where}[{k!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__name__}: a checkpoint holds "
        "tensors and plain values only (numpy values: m2flow.workers.checkpoint.to_plain)"
    )


# -- numpy values as tensors and plain values -------------------------------------------------


def to_plain(value: Any) -> Any:
    """``value`` with every numpy array or scalar as ``{"numpy": tensor}`` and every numpy
    ``Generator`` as ``{"numpy_rng": bit_generator.state}`` (inside lists, tuples and dicts);
    :func:`from_plain` inverts it exactly (dtype, shape and RNG stream).

    Raises:
        TypeError: an array torch cannot hold (strings, objects).
    """
    import numpy as np  # heavy, as in save_file
    import torch

    if isinstance(value, np.random.Generator):
        return {"numpy_rng": to_plain(value.bit_generator.state)}
    if isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
        if arr.dtype.kind not in "biufc":
            raise TypeError(f"a numpy array of dtype {arr.dtype} cannot be held as a tensor")
        tag = "numpy" if isinstance(value, np.ndarray) else "numpy_scalar"
        return {tag: torch.from_numpy(np.array(arr, order="C", copy=True))}  # keeps 0-d
    if isinstance(value, (list, tuple)):
        return type(value)(to_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def from_plain(value: Any) -> Any:
    """Invert :func:`to_plain`.

    Raises:
        ValueError: a numpy RNG state of a bit generator numpy does not have.
    """
    import numpy as np  # heavy, as in save_file
    import torch

    if isinstance(value, dict) and len(value) == 1:
        key, inner = next(iter(value.items()))
        if key == "numpy" and isinstance(inner, torch.Tensor):
            return inner.numpy().copy()
        if key == "numpy_scalar" and isinstance(inner, torch.Tensor):
            return inner.numpy()[()]
        if key == "numpy_rng" and isinstance(inner, dict):
            state = from_plain(inner)
            name = state.get("bit_generator")
            if name not in _BIT_GENERATORS:
                raise ValueError(f"numpy RNG state of an unknown bit generator {name!r}")
            bits = getattr(np.random, name)()
            bits.state = state
            return np.random.Generator(bits)
    if isinstance(value, (list, tuple)):
        return type(value)(from_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: from_plain(v) for k, v in value.items()}
    return value


# -- checks before a resume -------------------------------------------------------------------


def check_safetensors(f: str | Path) -> None:
    """Check a safetensors file's header parses and its data length matches the file's size
    (the header only: nothing is loaded).

    Raises:
        StateFileError: not a regular file, or a damaged or truncated one.
    """
    from safetensors import SafetensorError, safe_open

    f = Path(f)
    if not f.is_file():
        raise StateFileError(f"{f} is not a regular file")
    try:
        with safe_open(f, "pt"):
            pass
    except (SafetensorError, OSError) as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StateFileError(f"{f}: damaged or truncated safetensors file ({detail})") from None


def check_directory(path: str | Path, required: tuple[str, ...] = ()) -> None:
    """Check a group's checkpoint directory: each ``required`` glob pattern matches a file,
    every ``*.safetensors`` has a sound header (:func:`check_safetensors`) and every ``*.pt``
    loads with ``weights_only=True`` (tensor data mapped, not read).

    Raises:
        StateFileError: the first missing or damaged file (one line naming it).
    """
    path = Path(path)
    for pattern in required:
        if not any(path.glob(pattern)):
            raise StateFileError(f"{path} has no {pattern}")
    for f in sorted(path.iterdir()):
        if f.suffix == ".safetensors":
            check_safetensors(f)
        elif f.suffix == ".pt":
            load_file(f, mmap=True)


def group_check(*required: str) -> Callable[[Path], None]:
    """The content check of one group's checkpoint directory, for
    :func:`m2flow.run.recipe.validate_trainer`: :func:`check_directory` with ``required``.

    The roles' files: a train-engine role (the GRPO actor) ``"<role>_state.pt"``,
    ``"*.safetensors"`` and ``"config.json"`` (its Hugging Face directory); a :func:`save_state`
    group ``"rank0.pt"``; the PPO actor both.
    """

    def check(path: Path) -> None:
        check_directory(path, required)

    return check


def train_role_check(path: Path) -> None:
    """A train-engine role's directory: its state file, and a Hugging Face directory
    (``config.json``, ``*.safetensors``) or a PEFT adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors``; a LoRA policy's), each file sound (:func:`check_directory`).

    Raises:
        StateFileError: the first missing or damaged file.
    """
    path = Path(path)
    adapter = (path / "adapter_config.json").exists()
    files = ("adapter_config.json", "adapter_model.safetensors") if adapter else ("config.json",)
    check_directory(path, ("actor_state.pt", *files, "*.safetensors"))
    if (path / "base").is_dir():  # a LoRA policy's base built from a shape
        check_directory(path / "base", ("config.json", "model.safetensors"))


#: the content checks of the roles' checkpoint directories (their files, above)
TRAIN_ROLE = train_role_check
PPO_ACTOR = group_check("actor_state.pt", "config.json", "*.safetensors", "rank0.pt")
RANK_STATE = group_check("rank0.pt")
