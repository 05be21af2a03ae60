"""Run directory, metric sinks (``trainer.logger``: :mod:`m2flow.run.loggers`) and the console:
one progress bar per phase (its name, elapsed time and ETA) and a metrics line every
``log_every`` steps."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from .._context import current_session
from .loggers import open_sinks

#: the default of ``trainer.logger``
DEFAULT_LOGGERS = ("console", "jsonl")


class RunLog:
    """Writes one record per step (``{"step", "time", **metrics}``) to the run's sinks and shows
    progress on the console.

    Args:
        run_dir: the run's directory (created).
        total_steps: steps of the step bar.
        logger: sink names (:mod:`m2flow.run.loggers`): ``console``, ``jsonl``, ``tensorboard``,
            ``wandb``, ``mlflow``; a bool is the older ``tensorboard`` flag (JSONL and the
            console, plus TensorBoard when true).
        resume_step: the checkpoint's step when the run resumes: the records of later steps
            (logged before the run stopped, about to be redone) are dropped from
            ``metrics.jsonl``, and ``time`` continues from the last record kept.
        log_every: print a step's metrics every this many steps (and step 0 and the last).
        config: the run's configuration as a dict, for sinks that keep one (wandb, mlflow).
        steps_name: the label of the step bar.

    Raises:
        ConfigError: an unknown logger, or one whose optional package is missing.
    """

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        logger: Sequence[str] | bool = DEFAULT_LOGGERS,
        resume_step: int | None = None,
        log_every: int = 1,
        config: dict | None = None,
        steps_name: str = "steps",
    ) -> None:
        if isinstance(logger, bool):
            logger = DEFAULT_LOGGERS + (("tensorboard",) if logger else ())
        names = list(logger)
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.echo = "console" in names
        self.console = Console(quiet=not self.echo, soft_wrap=True)  # a record is one line
        self.total_steps = total_steps
        self.log_every = max(1, int(log_every))
        elapsed = 0.0
        if resume_step is not None:
            elapsed = _keep_until(self.dir / "metrics.jsonl", resume_step)
        self._sinks = open_sinks(names, self.dir, config)
        self._t0 = time.time() - elapsed
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[done]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            transient=False,
        )
        self._task = None  # the step bar, added at the first advance()
        self._steps_name = steps_name
        self._last: dict[str, float] = {}  # phase -> seconds it took last time (its ETA)

    def log(self, step: int, metrics: dict[str, Any], echo: bool | None = None) -> None:
        """Write ``{"step", "time", **metrics}`` to every sink as it is (None and NaN too:
        ``null`` and ``NaN`` in ``metrics.jsonl``); print it on the console at step 0, every
        ``log_every`` steps, at the last step, or when ``echo`` is True (False: never), without
        the metrics that have no value (None, NaN: e.g. a skipped warm start's loss)."""
        now = time.time()
        record = {"step": step, "time": round(now - self._t0, 3), **metrics}
        for sink in self._sinks:
            sink.write(step, record)
        if echo is None:
            echo = step == 0 or step % self.log_every == 0 or step == self.total_steps
        if echo:
            shown = " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items() if _has_value(v))
            self.progress.console.print(f"step {step}: {shown}", highlight=False)
        from ..core.spot import first_step

        first_step.set()  # a replayed spot trace starts its clock (m2flow.core.spot)
        session = current_session()
        if session is not None:
            session.mark_step(step, now)  # may raise StopRun (profiling)

    def advance(self, completed: int, status: str = "") -> None:
        """Move the step bar to ``completed`` steps (the first call shows it)."""
        if self._task is None:
            self._task = self.progress.add_task(
                self._steps_name, total=self.total_steps, completed=completed, status=status,
                done=f"{completed}/{self.total_steps}",
            )  # fmt: skip
            return
        self.progress.update(
            self._task, completed=completed, status=status, done=f"{completed}/{self.total_steps}"
        )

    def wait(self, name: str, call, expected_s: float | None = None, note: str = "") -> Any:
        """Wait for a group call (``call.wait()``: its results collected as the method
        declares, its errors and fail-fast unchanged) under a bar of its own, named ``name``:
        elapsed seconds against ``expected_s`` (else the time this phase took last time;
        unknown the first time), removed when the call returns.

        Raises:
            WorkerError: as ``call.wait()``.
        """
        expected = expected_s or self._last.get(name)
        task = self.progress.add_task(
            name, total=expected, status=note, done=f"of ~{expected:.0f} s" if expected else ""
        )
        t0, stop = time.time(), threading.Event()

        def tick() -> None:  # the bar moves with the clock while the driver waits
            while not stop.wait(0.2):
                if expected:
                    done = min(time.time() - t0, 0.99 * expected)
                    self.progress.update(task, completed=done)

        ticker = threading.Thread(target=tick, name=f"m2flow-bar-{name}", daemon=True)
        ticker.start()
        try:
            return call.wait()
        finally:
            stop.set()
            ticker.join()
            self._last[name] = time.time() - t0
            self.progress.remove_task(task)

    def print(self, *args) -> None:
        self.progress.console.print(*args, highlight=False)

    def __enter__(self) -> RunLog:
        if self.console.is_terminal:  # a log file gets the lines only, no frames
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress.live.is_started:
            self.progress.stop()
        for sink in self._sinks:
            sink.close()


def _has_value(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


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
