"""Tests stay out of the checkout: README's two commands in order (the main
job, which writes checkpoints to ``runs/grpo``, then the tests) in one clone. The guard itself
is ``checkout_guard.py``, wired in ``conftest.py``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from checkout_guard import CHECKOUT, CHECKOUT_RUNS, CheckoutGuard

from m2flow.run.recipe import Checkpoints
from m2flow.run.workflow import prepare

WORKFLOWS = {name: CHECKOUT / "workflows" / f"{name}.py" for name in ("grpo", "ppo", "embodied")}
#: the tests that failed on README's test command after the main job (6 of 658; test_ppo's after
#: ``m2flow run workflows/ppo.py``): they validated against the default run directory (now each
#: names a tmp one), and the test of the session's defaults
DEFAULT_RUN_DIR_TESTS = [
    "tests/test_tokenizers.py::test_char_tokenizer_refuses_what_it_cannot_encode",
    "tests/test_workflow.py::test_engine_config_errors_name_the_fix",
    "tests/test_ppo.py::test_bad_value_exits_2",
    "tests/test_checkout_isolation.py::test_default_run_dirs_resolve_outside_the_checkout",
]


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_default_run_dirs_resolve_outside_the_checkout(name):
    """Each workflow's ``trainer.run_dir`` default, as a test resolves it, is not the
    checkout's (and the defaults validate: no earlier run there)."""
    cfg = prepare(str(WORKFLOWS[name]))[1]
    run_dir = Path(cfg.trainer.run_dir)
    assert not run_dir.is_absolute()  # the workflows' default: relative to the cwd
    assert not _under(Path.cwd().resolve(), CHECKOUT)
    assert not _under(run_dir.resolve(), CHECKOUT), run_dir.resolve()


def test_the_guard_records_a_touch_of_the_checkouts_runs(checkout_guard):
    """Reads and writes under ``<checkout>/runs`` and writes into the checkout are recorded
    (the audit event fires before the call: paths that do not exist suffice, nothing is
    created); reads of the checkout's sources and writes under the cwd are not."""
    missing = CHECKOUT_RUNS / f"no-such-run-{uuid.uuid4().hex}"
    with pytest.raises(FileNotFoundError):
        os.scandir(missing / "checkpoints")
    with pytest.raises(FileNotFoundError):
        (missing / "metrics.jsonl").read_text()
    with pytest.raises(FileNotFoundError):
        (CHECKOUT / f"no-such-dir-{uuid.uuid4().hex}" / "out.yaml").write_text("x")
    (CHECKOUT / "pyproject.toml").read_text()  # reading the sources is fine
    Path("scratch.txt").write_text("x")  # so is writing under the (temporary) cwd
    recorded = checkout_guard.take()
    assert [event for event, _ in recorded] == ["os.scandir", "open", "open"], recorded
    assert recorded[0][1] == str(missing / "checkpoints")
    assert recorded[1][1] == str(missing / "metrics.jsonl")
    assert recorded[2][1].startswith(str(CHECKOUT / "no-such-dir-"))


def test_the_guard_holds_for_a_checkout_under_the_temp_dir(tmp_path):
    """A clone under ``/tmp`` (CI's): the temp dir that ``conftest.py`` allows holds the
    checkout, and yet a write into the checkout and a touch of its ``runs/`` are recorded; a
    ``--basetemp`` inside the checkout stays allowed. (Before, the temp dir exempted the whole
    checkout: nothing was recorded.)"""
    clone = tmp_path / "clone"
    basetemp = clone / ".basetemp"
    guard = CheckoutGuard(clone, allowed=(Path(tempfile.gettempdir()).resolve(), basetemp))
    guard.install()  # a second hook of this process, recording only while active
    guard.active = True
    try:
        with pytest.raises(FileNotFoundError):
            (clone / "src" / "out.txt").write_text("x")
        with pytest.raises(FileNotFoundError):
            os.scandir(clone / "runs" / "grpo")
        with pytest.raises(FileNotFoundError):
            (basetemp / "t" / "out.txt").write_text("x")
    finally:
        guard.active = False
    assert guard.take() == [
        ("open", str(clone / "src" / "out.txt")),
        ("os.scandir", str(clone / "runs" / "grpo")),
    ]


def _plant_checkpoints(clone: Path) -> dict[str, float]:
    """What README's main jobs leave: ``runs/<workflow>/checkpoints/step_000100/`` (a group
    directory and ``runner.json``) and ``metrics.jsonl``. Returns path -> mtime of the tree."""
    for name in WORKFLOWS:
        step = clone / "runs" / name / "checkpoints" / "step_000100"
        (step / "actor").mkdir(parents=True)
        (step / "runner.json").write_text(json.dumps({"step": 100}))
        (clone / "runs" / name / "metrics.jsonl").write_text(json.dumps({"step": 100}) + "\n")
        assert Checkpoints(clone / "runs" / name).latest() == (100, step)
    return {str(p): p.stat().st_mtime_ns for p in (clone / "runs").rglob("*")}


def test_tests_pass_in_a_clone_where_the_main_job_left_checkpoints(tmp_path):
    """README's command 2 after command 1: in a copy of the checkout's tests and workflows
    whose ``runs/`` holds checkpoints of every workflow, the tests that used to validate
    against the default run directory pass, and ``runs/`` is as it was."""
    clone = tmp_path / "clone"
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache")
    for part in ("tests", "workflows"):
        shutil.copytree(CHECKOUT / part, clone / part, ignore=ignore)
    shutil.copy(CHECKOUT / "pyproject.toml", clone)
    planted = _plant_checkpoints(clone)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DEFAULT_RUN_DIR_TESTS],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, out
    assert "already holds checkpoints" not in out
    assert {str(p): p.stat().st_mtime_ns for p in (clone / "runs").rglob("*")} == planted
