"""How channel items travel: inline values, or object-store frames read without copies.

An item that holds tensors or arrays (:func:`needs_object_store`) is pickled with its tensor
storages and arrays as out-of-band buffers (pickle protocol 5), and ``ray.put`` as a *frame*
``(pickle bytes, [uint8 arrays])``: the object store copies the buffers once and a reader on the
same node maps them instead of copying. Torch's own pickling copies a tensor's bytes three
times (``torch.save`` into a buffer, that buffer into the store, and out again at the reader).

What a reader gets: tensors and arrays whose memory is the object store's copy of the item,
which only this reader was handed (a channel gives each item to one consumer, and a ``Fanout``
puts a copy per channel), so writing to them in place is safe. Their memory stays pinned in the
object store until the last of them is freed. Everything else about a tensor (dtype, shape,
strides, ``requires_grad``, parameters) comes back as torch's pickling restores it; tensors off
the CPU take torch's own (copying) path.
"""

from __future__ import annotations

import io
import pickle
import sys
import warnings
from typing import Any

import ray
from ray.cloudpickle import Pickler


def needs_object_store(item: Any) -> bool:
    """True if ``item`` holds tensors/arrays (shallowly): those go by reference."""
    kind = type(item).__module__.split(".")[0]
    if kind in ("torch", "numpy", "tensordict"):
        return True
    if isinstance(item, dict):
        return any(needs_object_store(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return any(needs_object_store(v) for v in item[:8])
    return False


class _FramePickler(Pickler):
    """Cloudpickle, with CPU tensor storages as out-of-band byte buffers (no copy)."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if (
            torch is not None
            and type(obj) is torch.storage.TypedStorage
            and obj._untyped_storage.device.type == "cpu"
        ):
            raw = torch.empty(0, dtype=torch.uint8).set_(obj._untyped_storage).numpy()
            return _storage_from_bytes, (raw, str(obj.dtype).removeprefix("torch."))
        return super().reducer_override(obj)


def _storage_from_bytes(raw, dtype: str):
    import torch

    # Arrays mapped from the object store are read-only to numpy, and torch warns when it
    # wraps one; the item is this reader's alone (module docstring), so writes are fine.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        untyped = torch.from_numpy(raw).untyped_storage()
    return torch.storage.TypedStorage(
        wrap_storage=untyped, dtype=getattr(torch, dtype), _internal=True
    )


def pack(item: Any) -> tuple[bytes, list]:
    """``item`` as a frame ``(pickle bytes, [uint8 arrays])`` whose arrays view the item's
    own memory (``ray.put`` copies them once into the object store)."""
    import numpy as np

    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _FramePickler(out, protocol=5, buffer_callback=buffers.append).dump(item)
    return out.getvalue(), [np.frombuffer(b.raw(), dtype=np.uint8) for b in buffers]


def unpack(frame: tuple[bytes, list]) -> Any:
    """The item of a :func:`pack` frame, its buffers used in place."""
    data, buffers = frame
    return pickle.loads(data, buffers=buffers)


def payload(item: Any) -> tuple:
    """What a put queues for ``item``: ``("ref", [ObjectRef of its frame])`` for items with
    tensors or arrays, else ``("value", item)`` (inline: cheaper than an object-store trip)."""
    if needs_object_store(item):
        return ("ref", [ray.put(pack(item))])
    return ("value", item)


def resolve(payloads: list[tuple]) -> list[Any]:
    """The items of ``payloads`` (one ``ray.get`` for all the object-store ones)."""
    refs = [p[1][0] for p in payloads if p[0] == "ref"]
    fetched = iter(ray.get(refs)) if refs else iter(())
    return [unpack(next(fetched)) if p[0] == "ref" else p[1] for p in payloads]
