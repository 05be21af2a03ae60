"""Engine registries: an engine kind's name -> its class, chosen from config.

A built-in kind is listed here as ``"module:Class"`` and imported on first use (so choosing
``torch`` never imports megatron-core or vLLM). A new kind registers itself
(:meth:`Registry.register`) or is named by its import path, ``"package.module:Class"``: the
form to use across processes, because a Ray worker imports that module itself, whereas a
registration made in the driver stays in the driver.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


class Registry:
    """Engine classes of one kind (``train``, ``value``, ``logprob`` or ``rollout``) by name.

    Args:
        kind: what the engines do, for messages (``"train"``).
        builtins: name -> ``"module:Class"``, imported lazily.
    """

    def __init__(self, kind: str, builtins: dict[str, str]) -> None:
        self.kind = kind
        self._builtins = list(builtins)
        self._paths = dict(builtins)
        self._classes: dict[str, type] = {}

    def register(self, name: str, cls: type | None = None) -> Callable | type:
        """Register ``cls`` under ``name`` (also usable as a class decorator,
        ``@TRAIN_ENGINES.register("fsdp")``). Replaces an earlier registration of ``name``."""
        if cls is None:
            return lambda c: self.register(name, c)
        self._classes[name] = cls
        self._paths.pop(name, None)
        return cls

    def names(self) -> list[str]:
        """The registered names, built-ins first (import paths are accepted besides)."""
        return list(dict.fromkeys([*self._builtins, *self._paths, *self._classes]))

    def knows(self, name: str) -> bool:
        """Whether ``name`` is registered or has the form of an import path (checked without
        importing anything: config validation runs before any worker starts)."""
        module, _, attr = name.partition(":")
        return name in self.names() or bool(module and attr)

    def choices(self) -> str:
        """``"torch or megatron (or an import path, module:Class)"``: for messages."""
        return f"{' or '.join(self.names())} (or an import path, module:Class)"

    def get(self, name: str, role: str = "actor") -> type:
        """The engine class called ``name`` (a registered name or ``"module:Class"``).

        Raises:
            ValueError: an unknown name, or an import path that does not import; the message
                names ``<role>.engine`` and the registered kinds.
        """
        if name in self._classes:
            return self._classes[name]
        path = self._paths.get(name, name)
        module, _, attr = path.partition(":")
        if not attr:
            raise ValueError(
                f"{role}.engine={name!r}: pick one of {', '.join(self.names())} "
                f"(or a {self.kind} engine's import path, 'package.module:Class')"
            )
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(
                f"{role}.engine={name!r}: cannot import {path} ({e}); pick one of "
                f"{', '.join(self.names())}"
            ) from e
        self._classes[name] = cls
        return cls


#: :class:`~.train.TrainEngine` kinds (the actor's, the PPO actor's)
TRAIN_ENGINES = Registry(
    "train",
    {
        "torch": "m2flow.workers.engines.torch_engine:TorchEngine",
        "megatron": "m2flow.workers.engines.megatron.policy:MegatronPolicyEngine",
    },
)

#: value-head variants of the same engines (the critic's)
VALUE_ENGINES = Registry(
    "value",
    {
        "torch": "m2flow.workers.engines.torch_engine:TorchValueEngine",
        "megatron": "m2flow.workers.engines.megatron.critic:MegatronValueEngine",
    },
)

#: :class:`~.logprob.LogprobEngine` kinds (the reference's: a frozen model that only scores)
LOGPROB_ENGINES = Registry(
    "logprob",
    {"torch": "m2flow.workers.engines.logprob:TorchLogprobEngine"},
)
