"""A Gymnasium vector env's state as tensors and plain values, restored into a fresh env.

A checkpoint never pickles the env (unpickling a file can run code: ``workers/checkpoint.py``).
Instead it keeps the *values* the env's objects hold: the plain attributes (numbers, strings,
numpy arrays, numpy RNGs, and tuples, lists and dicts of them) of the vector env, of each
sub-env's wrappers (``TimeLimit``'s elapsed steps, ...) and of each base env (CartPole's
``state`` and ``_np_random``, ...). On resume the worker builds the env from its config as on a
fresh start and writes those values back, so the simulators continue mid-episode exactly.

What is not a value is configuration the fresh env rebuilds identically and is skipped: spaces,
specs, enums, functions and classes. Anything else (a live simulator handle such as a Box2D
world) has no plain form: :func:`vector_env_state` refuses it, naming the attribute.
"""

from __future__ import annotations

import enum
import types
from typing import Any

from ..checkpoint import check_plain, from_plain, to_plain

#: attributes that hold the next layer (walked, not saved)
_LAYER_LINKS = ("env", "envs")


def _static(value: Any) -> bool:
    """Configuration a fresh env rebuilds (spaces, specs, enums, callables), possibly inside
    containers mixed with plain values."""
    from gymnasium import Space
    from gymnasium.envs.registration import EnvSpec

    if isinstance(value, (Space, EnvSpec, enum.Enum, type, types.FunctionType,
                          types.BuiltinFunctionType, types.MethodType)):  # fmt: skip
        return True
    if isinstance(value, (list, tuple)):
        return all(_static(v) or _plain(v) for v in value) and any(_static(v) for v in value)
    if isinstance(value, dict):
        vals = list(value.values())
        return all(_static(v) or _plain(v) for v in vals) and any(_static(v) for v in vals)
    return False


def _plain(value: Any) -> bool:
    try:
        check_plain(to_plain(value))
    except TypeError:
        return False
    return True


def _layer_state(obj: Any) -> dict[str, Any]:
    """``{"type": class name, "attrs": {name: plain value}}`` of one object's attributes.

    Raises:
        ValueError: an attribute that is neither a value nor configuration.
    """
    attrs = {}
    for name, value in vars(obj).items():
        if name in _LAYER_LINKS:
            continue
        if _plain(value):
            attrs[name] = to_plain(value)
        elif not _static(value):
            raise ValueError(
                f"{type(obj).__name__}.{name} holds a {type(value).__name__}, which a checkpoint "
                "cannot keep as plain values: this environment cannot be checkpointed"
            )
    return {"type": type(obj).__name__, "attrs": attrs}


def _chain(env: Any) -> list[Any]:
    """A sub-env's wrappers, outermost first, then the base env."""
    out = [env]
    while "env" in vars(out[-1]):  # a wrapper: its inner env
        out.append(vars(out[-1])["env"])
    return out


def vector_env_state(envs: Any) -> dict[str, Any]:
    """The state of a ``gymnasium.vector.SyncVectorEnv`` as tensors and plain values:
    ``{"vector": layer, "envs": [[layer per wrapper and base env] per sub-env]}``, each layer
    ``{"type", "attrs"}``.

    Raises:
        ValueError: an attribute with no plain form (named).
    """
    return {
        "vector": _layer_state(envs),
        "envs": [[_layer_state(layer) for layer in _chain(e)] for e in envs.envs],
    }


def restore_vector_env(envs: Any, state: dict[str, Any]) -> None:
    """Write :func:`vector_env_state`'s values into ``envs``, a vector env freshly built from
    the same config.

    Raises:
        ValueError: ``state`` is of another env (the number of sub-envs or a wrapper or env
            class differs): the run's env config changed since the checkpoint.
    """
    layers = [envs] + [layer for e in envs.envs for layer in _chain(e)]
    saved = [state["vector"]] + [layer for e in state["envs"] for layer in e]
    found = [type(x).__name__ for x in layers]
    wanted = [s["type"] for s in saved]
    if len(state["envs"]) != len(envs.envs) or found != wanted:
        raise ValueError(
            f"the checkpoint holds {len(state['envs'])} simulators of {wanted[-1]}, this run "
            f"builds {len(envs.envs)} of {found[-1]}: resume with the env.id and env.num_envs "
            "it was saved with"
        )
    for obj, s in zip(layers, saved):
        for name, value in s["attrs"].items():
            vars(obj)[name] = from_plain(value)  # not setattr: wrappers forward some names
