"""The import contracts of pyproject.toml's ``[tool.importlinter]`` (docs/concepts/design.md,
"Layers"): kept by this checkout, and each broken by an import planted in a copy of it.

``scripts/lint_imports.py`` runs import-linter on the tree as it installs (workers/, scheduler/,
workflows/ and reward_service/ inside m2flow/); CI runs it too (.ci/run). A run takes well under
a second.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "lint_imports.py"
PACKAGES = ("m2flow", "workers", "scheduler", "workflows", "reward_service")


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), "--no-logo"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_checkout_keeps_every_contract():
    res = lint(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout
    assert "Layers: workflows > workers" in res.stdout  # the contracts were read


@pytest.fixture
def copy(tmp_path) -> Path:
    """A copy of the checkout's packages and pyproject.toml to plant imports in."""
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def plant(root: Path, path: str, code: str) -> None:
    f = root / path
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text((f.read_text() if f.exists() else "") + "\n" + code + "\n")


# (file, planted code, a line the broken contract's report must hold)
PLANTS = {
    "planner imports the runtime": (
        "scheduler/plan/cost.py",
        "from m2flow.core.cluster import GiB  # noqa",
        "m2flow.scheduler is not allowed to import m2flow.core:",
    ),
    "runtime imports a worker": (
        "m2flow/core/channel_codec.py",
        "def f():\n    import m2flow.workers.batch  # noqa",
        "m2flow.core is not allowed to import m2flow.workers: - m2flow.core.channel_codec",
    ),
    "core imports the run layer": (
        "m2flow/core/group.py",
        "def f():\n    from m2flow.run.workflow import run_workflow  # noqa",
        "m2flow.core is not allowed to import m2flow.run: - m2flow.core.group",
    ),
    "process context imports the core": (
        "m2flow/_context.py",
        "def f():\n    from m2flow.core.worker import Worker  # noqa",
        "m2flow._context is not allowed to import m2flow.core: "
        "- m2flow._context -> m2flow.core.worker",
    ),
    "loop inside the core": (
        "m2flow/core/liveness.py",
        "def f():\n    from m2flow.core.lock import get_lock_service  # noqa",
        "No cycles are allowed in m2flow.",
    ),
    "loop between the planner's subpackages": (
        "scheduler/spot/plan.py",
        "def f():\n    from m2flow.scheduler.plan.profile import load_profile  # noqa",
        "No cycles are allowed in m2flow.scheduler.",
    ),
    "planner imports torch": (
        "scheduler/plan/cost.py",
        "import torch  # noqa",
        "m2flow.scheduler is not allowed to import torch",
    ),
    "an engine imports a role": (
        "workers/engines/__init__.py",
        "from m2flow.workers.actor import losses  # noqa",
        "m2flow.workers.engines is not allowed to import m2flow.workers.actor",
    ),
    "a role imports another role": (
        "workers/actor/sft.py",
        "def f():\n    from m2flow.workers.rollout import engines  # noqa",
        "m2flow.workers.actor is not allowed to import m2flow.workers.rollout",
    ),
    "a package cycle in workers": (
        "workers/llm/config.py",
        "def f():\n    from m2flow.workers.data import item  # noqa",
        "No cycles are allowed in m2flow.workers.",
    ),
    "the reward service imports a worker": (
        "reward_service/pipelines.py",
        "def f():\n    from m2flow.workers.scoring import functions  # noqa",
        "m2flow.reward_service is not allowed to import m2flow.workers",
    ),
    "the reward service imports the runtime": (
        "reward_service/app.py",
        "def f():\n    from m2flow.core.channel import Channel  # noqa",
        "m2flow.reward_service is not allowed to import m2flow.core:",
    ),
    "a worker imports the reward service's server": (
        "workers/reward/worker.py",
        "def f():\n    from m2flow.reward_service.app import BackgroundServer  # noqa",
        "m2flow.workers is not allowed to import m2flow.reward_service.app",
    ),
    "the reward service imports Ray": (
        "reward_service/pools.py",
        "def f():\n    import ray  # noqa",
        "m2flow.reward_service is not allowed to import ray",
    ),
    "a module outside every layer": (
        "m2flow/newcomer.py",
        "X = 1",
        "m2flow.newcomer",
    ),
}


@pytest.mark.parametrize("case", sorted(PLANTS))
def test_planted_violation_breaks_a_contract(copy, case):
    path, code, expected = PLANTS[case]
    assert lint(copy).returncode == 0  # the copy is clean before the plant
    plant(copy, path, code)
    res = lint(copy)
    out = " ".join((res.stdout + res.stderr).split())  # rich wraps long lines
    assert res.returncode == 1, out
    assert expected in out, out
