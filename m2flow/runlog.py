"""Run directory, metrics log (JSONL, optional TensorBoard) and a progress bar for runners."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ._context import current_session
from .config import ConfigError


class RunLog:
    """Writes one JSON object per step to ``run_dir/metrics.jsonl`` and shows progress.

    Args:
        run_dir: the run's directory (created).
        total_steps: steps of the progress bar.
        tensorboard: also write scalars with ``torch.utils.tensorboard`` (needs tensorboard).
        resume_step: the checkpoint's step when the run resumes: the records of later steps
            (logged before the run stopped, about to be redone) are dropped from
            ``metrics.jsonl``, and ``time`` continues from the last record kept.
    """

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        tensorboard: bool = False,
        resume_step: int | None = None,
    ) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.console = Console()
        elapsed = 0.0
        if resume_step is not None:
            elapsed = _keep_until(self.dir / "metrics.jsonl", resume_step)
        self._file = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self._t0 = time.time() - elapsed
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(
                    "TensorBoard logging needs the tensorboard package: "
                    'pip install -c constraints.txt -e ".[tensorboard]"'
                ) from None
            self._tb = SummaryWriter(str(self.dir / "tb"))
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            transient=False,
        )
        self._task = self.progress.add_task("steps", total=total_steps, status="")

    def log(self, step: int, metrics: dict[str, Any], echo: bool = True) -> None:
        """Append ``{"step", "time", **metrics}`` to the JSONL file (and TensorBoard)."""
        now = time.time()
        record = {"step": step, "time": round(now - self._t0, 3), **metrics}
        self._file.write(json.dumps(record, default=float) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        if echo:
            shown = " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
            self.progress.console.print(f"step {step}: {shown}", highlight=False)
        from .spot import first_step

        first_step.set()  # a replayed spot trace starts its clock (m2flow.spot)
        session = current_session()
        if session is not None:
            session.mark_step(step, now)  # may raise StopRun (profiling)

    def advance(self, completed: int, status: str = "") -> None:
        self.progress.update(self._task, completed=completed, status=status)

    def print(self, *args) -> None:
        self.progress.console.print(*args, highlight=False)

    def __enter__(self) -> RunLog:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _keep_until(path: Path, step: int) -> float:
    """Drop the records of ``path`` after ``step`` (rewritten atomically); returns the last
    kept record's ``time`` (0 without one). A torn last line (a run killed mid-write) goes
    too."""
    if not path.is_file():
        return 0.0
    kept, elapsed = [], 0.0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line)
            elapsed = float(record.get("time", elapsed))
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)
    return elapsed
