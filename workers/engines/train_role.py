"""What a role on a train engine gets from the engine alone: its ranks and their process group
at launch, its weights, checkpoints and memory.

:class:`OnTrainEngine` is a mixin for a :class:`m2flow.Worker` whose ``engine`` argument names
a :mod:`.registry` backend of kind ``train`` (the GRPO and PPO actors): the role keeps the
algorithm,
this keeps the plumbing every such role shares, written once against
:class:`~.train.TrainEngine`.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from m2flow import group_method

from .. import parallel as dp
from ..checkpoint import load_file, save_file
from .lora import check_lora
from .registry import engine_class
from .train import TrainEngine


class OnTrainEngine:
    """Mixin (before :class:`m2flow.Worker`) for a role on a train engine.

    The role sets ``self.engine`` (its :class:`~.train.TrainEngine`), ``self.tokenizer`` and
    ``self.weight_version``; ``role`` names it in the engine's errors (``"actor"``:
    ``actor.tensor_parallel ...``) and its checkpoint file (``actor_state.pt``).
    """

    role = "actor"
    engine: TrainEngine
    weight_version: int

    @classmethod
    def launch(cls, cluster, placement=None, *, options, **kwargs):
        """:meth:`Worker.launch`; one rank per device of the placement (default: where the plan
        puts the group) and their process group's rendezvous with ``data_parallel=True`` or an
        engine that runs one rank per device.

        Raises:
            ValueError: an unknown ``engine``, or a setting it cannot run (its ``check``),
                before any process starts.
        """
        from m2flow.core.group import normalize_placement

        per_device = engine_class("train", options.engine, cls.role).one_rank_per_device
        if (options.data_parallel or per_device) and placement is None:
            placement = cluster.devices_for(kwargs.get("name") or cls.__name__)
        if placement is not None:
            ranks = normalize_placement(placement, cluster)
            # no process group yet: data_parallel as asked
            config = options.engine_check(None, kwargs.get("model"))
            cls._check(len(ranks), {**config, "data_parallel": options.data_parallel})
            if len(ranks) > 1 or per_device:
                kwargs["dist"] = dp.rendezvous(cluster, ranks)
        return super().launch(cluster, placement, options=options, **kwargs)

    @classmethod
    def _check(cls, world_size: int, kwargs: dict) -> None:
        """The engine's ``check`` of ``kwargs`` (what the role's options give the engine's
        ``check``: ``ActorOptions.engine_check``) for ``world_size`` ranks,
        and LoRA refused on an engine without it (:func:`.lora.check_lora`)."""
        engine = kwargs.get("engine", "torch")
        check_lora(engine, kwargs.get("lora"), cls.role)
        engine_class("train", engine, cls.role).check(kwargs, world_size, cls.role)

    # -- weights, checkpoints, memory -------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights, on CPU (copies), in Hugging Face layout: the source of
        ``m2flow.sync_weights(actor, ...)``. ``RuntimeError`` on a rank holding none (Megatron:
        rank 0 holds them)."""
        return self.engine.get_weights()

    def weights_for(self, dst_group: str) -> dict[str, torch.Tensor]:
        """What a weight sync sends ``dst_group``: the engine's ``weight_payload`` (a LoRA
        policy: the adapter alone, with the frozen base on that group's first sync), else
        :meth:`get_weights`."""
        payload = getattr(self.engine, "weight_payload", None)
        if payload is None:
            return self.get_weights()
        sent = self.__dict__.setdefault("_base_sent", set())
        out = payload(base=dst_group not in sent)
        sent.add(dst_group)
        return out

    @group_method
    def save_checkpoint(self, path: str) -> str:
        """Model, tokenizer, optimizer state, version and RNG state under ``path`` (the
        engine's files; rank 0 writes ``<role>_state.pt``; a collective of all ranks)."""
        out = Path(path)
        state = self.engine.save(out)
        if state is None:
            return str(path)
        self.tokenizer.save_pretrained(out)
        state |= {"weight_version": self.weight_version, "torch_rng": torch.get_rng_state(),
                  "py_rng": random.getstate()}  # fmt: skip
        save_file(out / f"{self.role}_state.pt", state)  # tensors and plain values only
        return str(out)

    @group_method
    def load_checkpoint(self, path: str) -> int:
        """Restore what :meth:`save_checkpoint` wrote. Returns the weight version.

        Raises:
            StateFileError: a damaged state file, or one holding other objects (not loaded).
        """
        src = Path(path)
        state = load_file(src / f"{self.role}_state.pt")  # weights_only: runs no code
        self.engine.load(src, state)
        self.weight_version = state["weight_version"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["py_rng"])
        return self.weight_version

    def offload(self) -> None:
        """Release parameters and optimizer state (another worker takes the device): on CUDA
        to pinned host memory; on a virtual device packed into one buffer, restored
        bit-exactly by :meth:`onload`."""
        self.engine.offload()

    def onload(self) -> None:
        self.engine.onload()
