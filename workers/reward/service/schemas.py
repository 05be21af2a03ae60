"""Pydantic models: the service configuration file and the HTTP API bodies."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from .pipelines import PIPELINES


class StageConfig(BaseModel):
    """One stage's pool: timeout (seconds), worker bounds, stage options (e.g. sandbox)."""

    timeout_s: float = Field(30.0, gt=0)
    max_workers: int = Field(4, ge=1)
    min_workers: int = Field(0, ge=0)
    initial_workers: int | None = Field(
        None, ge=0, description="workers for a batch without history (default: max_workers)"
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
        return self


class TenantConfig(BaseModel):
    token: str = Field(min_length=8, description="bearer token of this tenant")


class ServiceConfig(BaseModel):
    """The service configuration (YAML or JSON file)."""

    host: str = "127.0.0.1"
    port: int = 8765
    tenants: dict[str, TenantConfig]
    pipelines: dict[str, PipelineConfig]
    default_delay_bound_s: float = Field(5.0, ge=0)
    policy: Literal["distrs", "history-only", "fcfs", "static"] = "distrs"

    @classmethod
    def load(cls, path: str | Path) -> ServiceConfig:
        """Read a YAML/JSON file. Raises ValueError naming the problem."""
        from omegaconf import OmegaConf

        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} not found")
        data = OmegaConf.to_container(OmegaConf.load(p), resolve=True)
        return cls.model_validate(data)


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
    status: Literal["ok", "failed", "timeout", "error"]
    stage: str = Field(description="the last stage the request entered")
    detail: str = ""
    stage_s: list[float] = Field(description="seconds in each stage entered")
    latency_s: float = Field(description="submit to result, seconds")
