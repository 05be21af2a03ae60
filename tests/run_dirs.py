"""Run directories for resume tests: an uninterrupted run's directory cut back to what a run
stopped after an earlier step leaves, so a test runs the uninterrupted run once and resumes a
copy of it, instead of running the first steps a second time (each run starts its worker
processes: seconds of imports each)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def stopped_copy(run_dir: Path, dst: Path, step: int) -> Path:
    """Copy ``run_dir`` to ``dst`` as a run stopped after ``step`` leaves it: the checkpoints
    of later steps removed (``step`` must have one) and ``metrics.jsonl`` cut after ``step``'s
    records, so every later record in ``dst`` comes from the resumed run.

    Returns:
        ``dst``.

    Raises:
        AssertionError: ``run_dir`` has no complete checkpoint at ``step``.
    """
    shutil.copytree(run_dir, dst)
    checkpoints = dst / "checkpoints"
    assert (checkpoints / f"step_{step:06d}").is_dir(), sorted(checkpoints.iterdir())
    for ckpt in checkpoints.glob("step_*"):
        if int(ckpt.name.split("_")[1].split(".")[0]) > step:  # step_000003[.partial]
            shutil.rmtree(ckpt)
    metrics = dst / "metrics.jsonl"
    kept = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= step]
    metrics.write_text("".join(line + "\n" for line in kept))
    return dst
