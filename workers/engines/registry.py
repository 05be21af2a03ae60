"""The engine registry: every engine kind's backends by name, each checked against its protocol.

An engine is chosen from config by its **kind** (what it does for a role) and its **backend**
(the ``engine`` key of that role's section):

============ ============================================ ==================================
kind         protocol                                     roles
============ ============================================ ==================================
train        :class:`~.train.TrainEngine`                 GRPO and PPO actors
value        :class:`~.value.ValueEngine`                 critic, reward model
logprob      :class:`~.logprob.LogprobEngine`             reference
rollout      :class:`~.rollout.RolloutEngine`             rollout, spot instances
actor_critic :class:`~.actor_critic.ActorCriticEngine`    embodied actor
============ ============================================ ==================================

A built-in backend is listed here as ``"module:Class"`` and imported on first use (so choosing
``torch`` never imports megatron-core or vLLM). A new backend registers itself
(:func:`register`) or is named by its import path, ``"package.module:Class"``: the form to use
across processes, because a Ray worker imports that module itself, whereas a registration made
in the driver stays in the driver.

Every class is checked against its kind's protocol when it is registered and when it is looked
up (a built-in or an import path, on first use): a missing method raises
:class:`EngineProtocolError` naming the class, the kind and the methods. Rollout engines need
``generate`` only if they say they sample whole groups (``generates``) and ``step`` only if they
continue blocks (``block_steps``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

#: kind -> its protocol's import path
PROTOCOLS = {
    "train": "m2flow.workers.engines.train:TrainEngine",
    "value": "m2flow.workers.engines.value:ValueEngine",
    "logprob": "m2flow.workers.engines.logprob:LogprobEngine",
    "rollout": "m2flow.workers.engines.rollout:RolloutEngine",
    "actor_critic": "m2flow.workers.engines.actor_critic:ActorCriticEngine",
}

#: members a kind requires only of classes whose flag (the value) is true
CAPABILITIES = {"rollout": {"generate": "generates", "step": "block_steps"}}

_BUILTINS: dict[str, dict[str, str]] = {
    "train": {
        "torch": "m2flow.workers.engines.torch_engine:TorchEngine",
        "megatron": "m2flow.workers.engines.megatron.policy:MegatronPolicyEngine",
    },
    "value": {
        "torch": "m2flow.workers.engines.torch_engine:TorchValueEngine",
        "megatron": "m2flow.workers.engines.megatron.critic:MegatronValueEngine",
    },
    "logprob": {"torch": "m2flow.workers.engines.logprob:TorchLogprobEngine"},
    "rollout": {
        "hf": "m2flow.workers.rollout.engines:HfEngine",
        "vllm": "m2flow.workers.rollout.vllm_engine:VllmEngine",
        "exact": "m2flow.workers.rollout.engines:HostExactEngine",
        "emulated": "m2flow.workers.rollout.emulated:EmulatedEngine",
        "spot": "m2flow.workers.rollout.spot.pool:SpotPoolEngine",
    },
    "actor_critic": {"torch": "m2flow.workers.engines.actor_critic:TorchActorCriticEngine"},
}

_paths: dict[str, dict[str, str]] = {k: dict(v) for k, v in _BUILTINS.items()}
_classes: dict[str, dict[str, type]] = {k: {} for k in _BUILTINS}
_imported: dict[tuple[str, str], type] = {}  # (kind, import path) -> class, checked


class EngineProtocolError(TypeError):
    """An engine class lacks members its kind's protocol requires; the message names the class,
    the kind and the missing members."""


def _kind(kind: str) -> str:
    if kind not in PROTOCOLS:
        raise ValueError(f"engine kind {kind!r}: pick one of {', '.join(PROTOCOLS)}")
    return kind


def _import(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def protocol(kind: str) -> type:
    """The protocol class of ``kind`` (a key of :data:`PROTOCOLS`)."""
    return _import(PROTOCOLS[_kind(kind)])


def required_members(kind: str, cls: type | None = None) -> list[str]:
    """The methods (and class methods) ``kind``'s protocol requires of ``cls``: every callable
    its body defines (dunders and properties aside: properties may be instance attributes),
    less the capability-bound ones ``cls`` does not claim (:data:`CAPABILITIES`)."""
    proto = protocol(kind)
    names = [
        n
        for n, v in vars(proto).items()
        if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, classmethod))
    ]
    flags = CAPABILITIES.get(kind, {})
    return [n for n in names if n not in flags or cls is None or getattr(cls, flags[n], False)]


def required_class_attributes(kind: str) -> list[str]:
    """The class attributes (``ClassVar`` annotations) ``kind``'s protocol requires: what the
    roles read before an engine exists (``one_rank_per_device``, ``generates``, ...)."""
    notes = vars(protocol(kind)).get("__annotations__", {})
    return [n for n, t in notes.items() if str(t).startswith(("ClassVar", "typing.ClassVar"))]


def missing_members(kind: str, cls: type) -> list[str]:
    """The members of :func:`required_members` ``cls`` lacks (or has but cannot call), then
    the class attributes of :func:`required_class_attributes` it lacks."""
    methods = [n for n in required_members(kind, cls) if not callable(getattr(cls, n, None))]
    return methods + [n for n in required_class_attributes(kind) if not hasattr(cls, n)]


def conform(kind: str, cls: type) -> type:
    """``cls`` if it has every member of ``kind``'s protocol.

    Raises:
        EngineProtocolError: ``cls`` is not a class, or misses members (named in the message).
    """
    if not inspect.isclass(cls):
        raise EngineProtocolError(
            f"{kind} engine {cls!r} is not a class: register a class implementing "
            f"{PROTOCOLS[_kind(kind)]}"
        )
    missing = missing_members(kind, cls)
    if missing:
        raise EngineProtocolError(
            f"{cls.__module__}.{cls.__qualname__} is not a {kind} engine: it lacks "
            f"{', '.join(missing)} (the {PROTOCOLS[kind].rpartition(':')[2]} protocol, "
            f"{PROTOCOLS[kind]})"
        )
    return cls


def register(kind: str, name: str, cls: type | None = None) -> Callable | type:
    """Register ``cls`` as ``kind``'s backend ``name`` (also a class decorator,
    ``@register("train", "fsdp")``), replacing an earlier registration of ``name``.

    Raises:
        EngineProtocolError: ``cls`` misses members of the kind's protocol (:func:`conform`).
        ValueError: an unknown kind.
    """
    if cls is None:
        return lambda c: register(kind, name, c)
    _classes[_kind(kind)][name] = conform(kind, cls)
    _paths[kind].pop(name, None)
    return cls


def names(kind: str) -> list[str]:
    """``kind``'s registered backends, built-ins first (import paths are accepted besides)."""
    return list(dict.fromkeys([*_BUILTINS[_kind(kind)], *_paths[kind], *_classes[kind]]))


def choices(kind: str, among: list[str] | None = None) -> str:
    """``"torch or megatron (or an import path, package.module:Class)"``: for messages."""
    return f"{' or '.join(among or names(kind))} (or an import path, package.module:Class)"


def knows(kind: str, name: str) -> bool:
    """Whether ``name`` is registered for ``kind`` or has the form of an import path (imports
    nothing)."""
    module, _, attr = name.partition(":")
    return name in names(kind) or bool(module and attr)


def engine_class(kind: str, name: str, role: str | None = None) -> type:
    """``kind``'s engine class called ``name`` (a registered backend or ``"module:Class"``),
    checked against the kind's protocol (:func:`conform`) on first use.

    Args:
        role: the config section whose ``engine`` key named it, for messages (default: kind).

    Raises:
        ValueError: an unknown name, or an import path that does not import; the message names
            ``<role>.engine`` and the registered backends.
        EngineProtocolError: the class misses members of the protocol.
    """
    role = role or kind
    if name in _classes[_kind(kind)]:
        return _classes[kind][name]
    if (kind, name) in _imported:
        return _imported[kind, name]
    path = _paths[kind].get(name, name)
    if ":" not in path:
        raise ValueError(f"{role}.engine={name!r}: {role}.engine must be {choices(kind)}")
    try:
        cls = _import(path)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"{role}.engine={name!r}: cannot import {path} ({e}); {role}.engine must be "
            f"{choices(kind)}"
        ) from e
    conform(kind, cls)
    if name in _paths[kind]:
        _classes[kind][name] = cls
    else:
        _imported[kind, name] = cls
    return cls


def check_engine(
    kind: str, name: str, config: dict, world_size: int | None = None, role: str | None = None
) -> type:
    """Look ``name`` up (:func:`engine_class`) and ask it whether it runs ``config`` (the role's
    options as a dict, ``model`` included) on ``world_size`` ranks (``None``: not known yet,
    before a plan places the role): its ``check`` classmethod. Returns the class.

    Raises:
        ValueError: an unknown engine or a configuration it refuses (the message names the
            setting and the fix).
        EngineProtocolError: the class misses members of the protocol.
    """
    cls = engine_class(kind, name, role)
    cls.check(config, world_size, role or kind)
    return cls
