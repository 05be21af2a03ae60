"""pyproject.toml lists every package: a wheel holds only what ``[tool.setuptools] packages``
names (an editable install imports unlisted ones, so nothing else would notice)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {pkg: ROOT / d for pkg, d in cfg["package-dir"].items()}
    found = set()
    for pkg, d in dirs.items():
        for init in d.rglob("__init__.py"):
            rel = init.parent.relative_to(d).parts
            found.add(".".join((pkg, *rel)))
    assert found == set(cfg["packages"]), (
        f"unlisted: {sorted(found - set(cfg['packages']))}, "
        f"listed but missing: {sorted(set(cfg['packages']) - found)}"
    )
