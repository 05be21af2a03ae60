"""Metric sinks of a run (``trainer.logger``), as veRL's and TRL's ``logger``/``report_to``.

``trainer.logger`` is a list of names:

- ``console``: metrics lines and progress bars on the terminal (:class:`~m2flow.run.runlog.RunLog`);
- ``jsonl``: one JSON object per step in ``<run_dir>/metrics.jsonl`` (resume and the tests
  read it);
- ``tensorboard``: event files in ``<run_dir>/tb`` (the ``tensorboard`` extra);
- ``wandb``: Weights & Biases in offline mode, files in ``<run_dir>/wandb`` (the ``wandb``
  extra; ``wandb sync`` uploads them later; ``WANDB_MODE`` set by the user wins);
- ``mlflow``: an MLflow file store in ``<run_dir>/mlruns`` (the ``mlflow`` extra; ``mlflow ui
  --backend-store-uri <run_dir>/mlruns``; ``MLFLOW_TRACKING_URI`` set by the user wins).

Only numbers reach the last three (a string metric such as ``phase`` stays in the JSONL file).
A missing package is a :class:`~m2flow.core.config.ConfigError` naming the extra, raised by
:func:`check_loggers` before any worker starts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.config import ConfigError

#: logger name -> (module that must import, extra that installs it); None: always there
LOGGERS: dict[str, tuple[str, str] | None] = {
    "console": None,
    "jsonl": None,
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


def check_loggers(names: Sequence[str], key: str = "trainer.logger") -> None:
    """Known names, no repeats, and the package of each optional one importable.

    Raises:
        ConfigError: an unknown or repeated name, or a logger whose extra is not installed
            (one line naming the extra's install command).
    """
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(
                f"{key}: unknown logger {name!r}; choose from {', '.join(LOGGERS)} "
                f"(e.g. {key}=[console,jsonl,tensorboard])"
            )
    if len(set(names)) != len(names):
        raise ConfigError(f"{key}={list(names)} names a logger twice")
    for name in names:
        need = LOGGERS[name]
        if need is not None and importlib.util.find_spec(need[0]) is None:
            raise ConfigError(
                f"{key} has {name}, but the {need[0]} package is not installed: "
                f'pip install -c constraints.txt -e ".[{need[1]}]" (or drop {name})'
            )


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics (bools excluded) as floats."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class Jsonl:
    """``<run_dir>/metrics.jsonl``: appended one record per :meth:`write`, line-buffered."""

    def __init__(self, run_dir: Path, **_: Any) -> None:
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)

    def write(self, step: int, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, default=float) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoard:
    """Scalars in ``<run_dir>/tb`` (``torch.utils.tensorboard``)."""

    def __init__(self, run_dir: Path, **_: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(run_dir / "tb"))

    def write(self, step: int, record: dict[str, Any]) -> None:
        for k, v in numbers(record).items():
            if k != "step":
                self._w.add_scalar(k, v, step)

    def close(self) -> None:
        self._w.close()


class Wandb:
    """A Weights & Biases run, offline, in ``<run_dir>/wandb``; resumed runs continue the
    same run id (kept in ``<run_dir>/wandb_run_id``)."""

    def __init__(self, run_dir: Path, config: dict | None = None, **_: Any) -> None:
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        self._run = wandb.init(
            dir=str(run_dir), project="m2flow", name=run_dir.name, id=run_id, resume="allow",
            config=config or {},
        )  # fmt: skip

    def write(self, step: int, record: dict[str, Any]) -> None:
        self._run.log({k: v for k, v in numbers(record).items() if k != "step"}, step=step)

    def close(self) -> None:
        self._run.finish()


class Mlflow:
    """An MLflow run in the file store ``<run_dir>/mlruns``, experiment ``m2flow``."""

    def __init__(self, run_dir: Path, config: dict | None = None, **_: Any) -> None:
        import mlflow

        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.x: opt in
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").absolute().as_uri()
        self._client = mlflow.MlflowClient(tracking_uri=uri)
        exp = self._client.get_experiment_by_name("m2flow")
        exp_id = exp.experiment_id if exp else self._client.create_experiment("m2flow")
        id_file = run_dir / "mlflow_run_id"
        if id_file.is_file():
            self._run_id = id_file.read_text().strip()
        else:
            self._run_id = self._client.create_run(exp_id, run_name=run_dir.name).info.run_id
            id_file.write_text(self._run_id)
            for k, v in _flat(config or {}).items():
                self._client.log_param(self._run_id, k, str(v)[:500])

    def write(self, step: int, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        ts = int(record.get("time", 0) * 1000)
        metrics = [Metric(k, v, ts, step) for k, v in numbers(record).items() if k != "step"]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


_SINKS = {"jsonl": Jsonl, "tensorboard": TensorBoard, "wandb": Wandb, "mlflow": Mlflow}


def open_sinks(names: Sequence[str], run_dir: Path, config: dict | None = None) -> list:
    """The file/service sinks of ``names`` (``console`` is the run log's own), opened.

    Raises:
        ConfigError: as :func:`check_loggers`.
    """
    check_loggers(names)
    return [_SINKS[n](run_dir, config=config) for n in names if n in _SINKS]


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
