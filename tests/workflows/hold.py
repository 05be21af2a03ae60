"""A workflow that starts nothing and holds its run until told: ``main`` waits for the file
``gate`` to exist (bounded by ``timeout_s``), so a test can start a second run while this one
holds ``trainer.run_dir`` (tests/test_resume_checks.py). No Ray."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from m2flow.run.recipe import TrainerConfig, validate_trainer


@dataclass
class Config:
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(run_dir="runs/hold"))
    gate: str = "gate"  # main returns once this file exists
    timeout_s: float = 300.0  # ... or fails after this long
    resume: bool = False


def validate(cfg) -> None:
    validate_trainer(cfg.trainer, cfg.resume)


def main(cfg) -> dict:
    deadline = time.monotonic() + cfg.timeout_s
    while not Path(cfg.gate).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{cfg.gate} did not appear in {cfg.timeout_s} s")
        time.sleep(0.05)
    return {"released": True}
