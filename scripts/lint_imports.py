"""Check the import contracts of ``[tool.importlinter]`` (pyproject.toml) on the m2flow package
as it installs: ``m2flow/`` with ``workers/``, ``scheduler/`` and ``workflows/`` inside it.

import-linter's graph builder (grimp) walks the root package's folder, but those three folders
sit at the top level of the checkout and install as ``m2flow.workers`` / ``m2flow.scheduler`` /
``m2flow.workflows`` (``[tool.setuptools] package-dir``). This script lays out the installed
tree in a temporary folder (symlinks, from ``package-dir``, so it follows the packaging) and
runs ``lint-imports`` there.

    python scripts/lint_imports.py                 # CI (.ci/run)
    python scripts/lint_imports.py --root DIR --verbose   # options of lint-imports pass on

Exit status: ``lint-imports``'s (0: every contract kept; 1: one broken or a bad config).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stage(root: Path, dest: Path) -> Path:
    """Lay out the installed ``m2flow`` package under ``dest`` (symlinks into ``root``).

    Raises:
        ValueError: ``package-dir`` maps a subpackage onto a name its parent already has.
    """
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = cfg["package-dir"]
    top = root / package_dir["m2flow"]
    pkg = dest / "m2flow"
    pkg.mkdir(parents=True)
    for entry in top.iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry.resolve())
    for name, folder in sorted(package_dir.items()):
        if name == "m2flow":
            continue
        parent, _, leaf = name.rpartition(".")
        if parent != "m2flow":
            raise ValueError(f"package-dir entry {name!r}: only m2flow.<name> is laid out")
        link = pkg / leaf
        if link.exists():
            raise ValueError(f"package-dir maps {name!r} onto m2flow/{leaf}, which exists")
        link.symlink_to((root / folder).resolve())
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="checkout (default: this one)")
    args, lint_args = ap.parse_known_args(argv)  # the rest goes to lint-imports
    root = args.root.resolve()
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which(
        "lint-imports"
    )
    if exe is None:
        print("lint-imports not found: pip install -e '.[test]'", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="m2flow-lint-imports-") as tmp:
        stage(root, Path(tmp))
        # lint-imports puts its working folder first on sys.path: the staged m2flow wins over
        # an editable install's finder.
        cmd = [exe, "--config", str(root / "pyproject.toml"), "--no-cache", *lint_args]
        env = {**os.environ, "PYTHONPATH": tmp}
        return subprocess.run(cmd, cwd=tmp, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
