"""Workflow configuration: typed defaults in the workflow, overrides from the command line.

A workflow declares its configuration as (nested) dataclasses; the user overrides any field
with ``section.key=value`` (OmegaConf dotlist syntax) and optionally a YAML file. Unknown keys
and values of the wrong type are a :class:`ConfigError` naming the key and what is allowed
(fields typed as plain dicts, such as ``task.config``, take any key);
the CLI turns it into exit code 2.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A bad configuration value or key; the message says which and how to fix it."""


def load_config(
    schema: Any, overrides: list[str] | None = None, files: list[str | Path] | None = None
) -> DictConfig:
    """Defaults from ``schema`` (a dataclass type or instance), then each YAML file, then the
    ``key=value`` overrides, in that order.

    Returns:
        a read-only, struct-mode ``DictConfig`` (typos raise instead of adding keys).

    Raises:
        ConfigError: an override without ``=``, an unknown key, a value of the wrong type, or
            a missing/invalid YAML file (or a directory given as one).
    """
    if not (dataclasses.is_dataclass(schema)):
        raise TypeError(f"config schema must be a dataclass, got {type(schema).__name__}")
    cfg = OmegaConf.structured(schema)
    OmegaConf.set_struct(cfg, True)
    _free_form_dicts(cfg)
    for f in files or []:
        path = Path(f)
        if path.is_dir():
            raise ConfigError(
                f"config file {str(path)!r} is a directory: give a YAML file (-c {path}/x.yaml)"
            )
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
        except OmegaConfBaseException as e:
            raise ConfigError(f"{path}: {_explain(e)}") from None
        except yaml.YAMLError as e:  # malformed YAML: the line and what the parser expected
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{path}:{where}: not valid YAML ({what})") from None
    bad = [o for o in overrides or [] if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(
            f"override {bad[0]!r} is not of the form key=value (e.g. trainer.steps=50)"
        )
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides or [])))
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e)) from None
    _refuse_reserved(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


#: keys that attribute access would read as a DictConfig method (``cfg.task.config.items``)
RESERVED = frozenset(n for n in dir(DictConfig) if not n.startswith("_"))


def _refuse_reserved(node: DictConfig, prefix: str = "") -> None:
    """A key named like a DictConfig method (``items``, ``keys``, ``values``, ``get``, ...)
    would read as the method, not the value: refuse it, in schemas, files and overrides.

    Raises:
        ConfigError: the first such key, with its full name.
    """
    for key in node.keys():
        name = f"{prefix}{key}"
        if key in RESERVED:
            raise ConfigError(
                f"config key '{name}' is a reserved name (cfg.{name} would read a method of "
                "the config, not the value): rename it"
            )
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _refuse_reserved(child, f"{name}.")


def _free_form_dicts(node: DictConfig) -> None:
    """Fields typed as plain dicts (``task.config``: a generator's keyword arguments) take any
    key; dataclass sections stay strict (a typo there is still an error)."""
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            if child._metadata.object_type in (dict, None):
                OmegaConf.set_struct(child, False)
            else:
                _free_form_dicts(child)


def _explain(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or getattr(e, "key", None)
    msg = str(e).splitlines()[0]
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        parent = key.rsplit(".", 1)[0] if key and "." in key else None
        return f"unknown config key '{key}'" + (
            f" (see the keys of '{parent}' with --show-config)"
            if parent
            else " (run with --show-config to list the keys)"
        )
    if key:
        return f"bad value for '{key}': {msg}"
    return msg


def to_yaml(cfg: DictConfig) -> str:
    """The resolved configuration as YAML (logged with every run)."""
    return OmegaConf.to_yaml(cfg, resolve=True)
