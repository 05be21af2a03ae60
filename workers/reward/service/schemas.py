"""Pydantic models: the service configuration file and the HTTP API bodies."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from .pipelines import PIPELINES, check_options


class StageConfig(BaseModel):
    """One stage's pool: timeout (seconds), worker bounds, the address-space limit of each
    worker process (bytes), stage options (e.g. sandbox limits)."""

    timeout_s: float = Field(30.0, gt=0)
    max_workers: int = Field(4, ge=1)
    min_workers: int = Field(0, ge=0)
    initial_workers: int | None = Field(
        None, ge=0, description="workers for a batch without history (default: max_workers)"
    )
    memory_bytes: int | None = Field(
        1 * 2**30,
        ge=128 * 2**20,
        description="RLIMIT_AS of each worker process, bytes (None: unlimited); bounds what "
        "a worker itself parses (source code, answers), not the sandboxes (own limits)",
    )
    options: dict[str, Any] = Field(default_factory=dict)


class PipelineConfig(BaseModel):
    """A reward pipeline: its kind (``code`` / ``math``), penalty reward, stage pools."""

    kind: Literal["code", "math"]
    penalty: float = 0.0
    stages: dict[str, StageConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _stages(self) -> PipelineConfig:
        names = [n for n, _ in PIPELINES[self.kind]]
        unknown = set(self.stages) - set(names)
        if unknown:
            raise ValueError(f"{self.kind} pipeline has stages {names}; unknown: {unknown}")
        self.stages = {n: self.stages.get(n, StageConfig()) for n in names}
        for name, stage in self.stages.items():
            check_options(self.kind, name, stage.options)
        return self


class TenantConfig(BaseModel):
    token: str = Field(min_length=8, description="bearer token of this tenant")


class ServiceConfig(BaseModel):
    """The service configuration (YAML or JSON file).

    Bounds that keep one tenant from exhausting the service: ``max_body_bytes`` (largest HTTP
    request body; 413 beyond), ``max_batch_size`` (most requests a batch may announce; 422
    beyond), ``max_decision_jobs`` (most requests a scaling decision simulates; sampled and
    scaled up beyond, DistRS section 5.2). ``scratch_dir``: where the service's scratch root
    goes (default: the system temp dir). ``state_dir``: where the results journal is kept
    (:mod:`.journal`), so that a restarted service scores no request twice (default: none,
    results live in memory only).
    """

    host: str = "127.0.0.1"
    port: int = Field(8765, ge=0, le=65535, description="TCP port (0: any free one)")
    tenants: dict[str, TenantConfig]
    pipelines: dict[str, PipelineConfig]
    default_delay_bound_s: float = Field(5.0, ge=0)
    policy: Literal["distrs", "history-only", "fcfs", "static"] = "distrs"
    max_body_bytes: int = Field(8 * 2**20, ge=1024)
    max_batch_size: int = Field(65536, ge=1)
    max_decision_jobs: int = Field(2048, ge=16)
    scratch_dir: str | None = None
    state_dir: str | None = None

    @model_validator(mode="after")
    def _unique_tokens(self) -> ServiceConfig:
        seen: dict[str, str] = {}
        for name, t in self.tenants.items():
            if t.token in seen:
                raise ValueError(
                    f"tenants {seen[t.token]!r} and {name!r} have the same token: each tenant "
                    "needs its own (a token is the tenant's identity)"
                )
            seen[t.token] = name
        return self

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> ServiceConfig:
        """Read a YAML/JSON file, then apply ``overrides`` (e.g. ``port=``), validated.

        Raises:
            ValueError: missing file, unparsable YAML, not a mapping, or a bad value (one line
                naming each bad field).
        """
        import yaml
        from pydantic import ValidationError

        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} not found")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"{p} is not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{p} must be a YAML mapping with 'tenants' and 'pipelines'")
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors()
            )
            raise ValueError(problems) from None


class RegisterTask(BaseModel):
    task: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    pipeline: str
    delay_bound_s: float | None = Field(None, ge=0)


class AnnounceBatch(BaseModel):
    size: int = Field(ge=1, description="number of requests the batch will hold")
    batch: str | None = Field(None, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")


class SubmitRequest(BaseModel):
    payload: dict[str, Any]
    id: str | None = Field(None, max_length=128)


class SubmitMany(BaseModel):
    requests: list[SubmitRequest] = Field(min_length=1)


class Result(BaseModel):
    id: str
    reward: float
    status: Literal["ok", "failed", "timeout", "error", "settled"] = Field(
        description="settled: scored by an earlier instance of the service (after a restart)"
    )
    stage: str = Field(description="the last stage the request entered")
    detail: str = ""
    stage_s: list[float] = Field(description="seconds in each stage entered")
    latency_s: float = Field(description="submit to result, seconds")
