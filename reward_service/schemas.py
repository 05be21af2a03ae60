"""Pydantic models: the service configuration file and the HTTP API bodies.

The configuration is strict: an unknown key (a typo such as ``max_body_byte``) is an error that
names it (and the key it likely meant), numbers must be finite (no ``.nan``, ``.inf``) and
counts must be integers (not ``true``). The API bodies take integers as integers (``size:
true`` or ``1e400`` is a 422) and ids as text that UTF-8 can encode.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from m2flow.core.config import ConfigError

from .pipelines import PIPELINES, check_options

#: the configuration's models: unknown keys are errors, no coercion (``true`` is no count)
_CONFIG = ConfigDict(extra="forbid", strict=True)


class StageConfig(BaseModel):
    """One stage's pool: timeout (seconds), worker bounds, the address-space limit of each
    worker process (bytes), stage options (e.g. sandbox limits)."""

    model_config = _CONFIG
    timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
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
    """A reward pipeline: its kind (``code`` / ``math``), penalty reward, stage pools; or a
    tool pipeline (``tool``: the tool API's sandboxes, :mod:`.tools`; no penalty, no tasks)."""

    model_config = _CONFIG
    kind: Literal["code", "math", "tool"]
    penalty: float = Field(0.0, allow_inf_nan=False)
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
    model_config = _CONFIG
    token: str = Field(min_length=8, description="bearer token of this tenant")


class ServiceConfig(BaseModel):
    """The service configuration (YAML or JSON file).

    Bounds that keep one tenant from exhausting the service: ``max_body_bytes`` (largest HTTP
    request body; 413 beyond), ``max_batch_size`` (most requests a batch may announce; 422
    beyond), ``max_decision_jobs`` (most requests a scaling decision simulates; sampled and
    scaled up beyond, DistRS section 5.2), ``max_queued_bytes`` and
    ``max_queued_bytes_per_tenant`` (memory that queued and running requests' payloads may
    hold, as Python objects, in total and per tenant; 429 while full, 413 for one call that
    can never fit). Connections (anyone who reaches the port, token or not): at most
    ``max_connections`` open (default: what the file-descriptor limit allows; at the limit
    the longest idle one is closed for a new one), each must send a request's headers within
    ``header_timeout_s`` of connecting or of its last answer, an idle keep-alive connection
    is closed after ``keep_alive_s``, and a body must arrive within ``body_timeout_s`` (408).
    Bodies over 1 MiB are read and handled ``max_large_bodies`` at a time, at most half of
    them per tenant (the others wait their turn, up to half of ``body_timeout_s``, then 429).
    Each tenant may have ``max_requests_per_tenant`` requests in flight (its share of the
    connections and so of the bodies in flight), requests without a known token
    ``max_anonymous_requests`` together; one over its share gets 429 at once
    (:mod:`.shares`). A service needs at least one tenant and one pipeline.
    ``scratch_dir``: where the service's scratch root goes (default: the system temp dir).
    ``state_dir``: where the results journal is kept (:mod:`.journal`), so that a restarted
    service scores no request twice (default: none, results live in memory only).
    """

    model_config = _CONFIG
    host: str = "127.0.0.1"
    port: int = Field(8765, ge=0, le=65535, description="TCP port (0: any free one)")
    tenants: dict[str, TenantConfig]
    pipelines: dict[str, PipelineConfig]
    default_delay_bound_s: float = Field(5.0, ge=0, allow_inf_nan=False)
    policy: Literal["distrs", "history-only", "fcfs", "static"] = "distrs"
    max_body_bytes: int = Field(8 * 2**20, ge=1024)
    max_batch_size: int = Field(65536, ge=1)
    max_decision_jobs: int = Field(2048, ge=16)
    max_queued_bytes: int = Field(512 * 2**20, ge=2**20)
    max_queued_bytes_per_tenant: int = Field(128 * 2**20, ge=2**20)
    max_connections: int | None = Field(None, ge=16)
    header_timeout_s: float = Field(10.0, gt=0, le=3600, allow_inf_nan=False)
    keep_alive_s: float = Field(5.0, gt=0, le=3600, allow_inf_nan=False)
    body_timeout_s: float = Field(60.0, gt=0, le=3600, allow_inf_nan=False)
    max_large_bodies: int = Field(8, ge=1)
    max_requests_per_tenant: int | None = Field(
        None,
        ge=1,
        description="requests one tenant may have in flight (default: an equal "
        "share of max_connections after the anonymous share)",
    )
    max_anonymous_requests: int | None = Field(
        None,
        ge=1,
        description="requests without a known token in flight, together "
        "(default: max_connections / 16, at most 32)",
    )
    scratch_dir: str | None = None
    state_dir: str | None = None

    @model_validator(mode="after")
    def _usable(self) -> ServiceConfig:
        for key, what in (("tenants", "a tenant with a token"), ("pipelines", "a pipeline")):
            if not getattr(self, key):
                raise ValueError(
                    f"{key} is empty: nobody could use this service; add {what} to the config"
                )
        return self

    @model_validator(mode="after")
    def _queue_caps(self) -> ServiceConfig:
        if self.max_queued_bytes_per_tenant > self.max_queued_bytes:
            raise ValueError(
                f"max_queued_bytes_per_tenant ({self.max_queued_bytes_per_tenant}) is over "
                f"max_queued_bytes ({self.max_queued_bytes}): lower it or raise the total"
            )
        return self

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
            ConfigError: missing file, unparsable YAML, not a mapping, or a bad value or
                unknown key (one line naming each, and the key an unknown one likely meant).
        """
        import yaml
        from pydantic import ValidationError

        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{p} is not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p} must be a YAML mapping with 'tenants' and 'pipelines'")
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError("; ".join(_problem(err) for err in e.errors())) from None


def _problem(err: dict) -> str:
    """One validation error as ``key.path: problem`` (an unknown key with the known key it
    most likely meant)."""
    loc = ".".join(map(str, err["loc"])) or "config"
    if err["type"] == "value_error":  # our validators' messages, without pydantic's prefix
        return f"{loc}: {err.get('ctx', {}).get('error', err['msg'])}"
    if err["type"] != "extra_forbidden":
        return f"{loc}: {err['msg']}"
    known = {n for m in (ServiceConfig, PipelineConfig, StageConfig, TenantConfig)
             for n in m.model_fields}  # fmt: skip
    near = difflib.get_close_matches(str(err["loc"][-1]), sorted(known), n=1, cutoff=0.75)
    hint = f" (did you mean {near[0]}?)" if near else ""
    return f"{loc}: unknown key{hint}: remove it or fix its name"


def _utf8(value: str | None) -> str | None:
    """Refuse text that UTF-8 cannot encode (lone surrogates): ids are echoed in answers."""
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be text that UTF-8 can encode (no lone surrogates)") from None
    return value


class RegisterTask(BaseModel):
    task: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    pipeline: str = Field(max_length=128)
    delay_bound_s: float | None = Field(None, ge=0, allow_inf_nan=False)


class AnnounceBatch(BaseModel):
    size: int = Field(ge=1, strict=True, description="number of requests the batch will hold")
    batch: str | None = Field(None, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")


class SubmitRequest(BaseModel):
    payload: dict[str, Any]
    id: str | None = Field(None, min_length=1, max_length=128)

    _id_utf8 = field_validator("id")(_utf8)


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


class RunTool(BaseModel):
    """A tool call (``POST /v1/tools/run``): the tool's name, its arguments, the run's
    wall-clock limit (seconds; default and maximum: the tool pipeline's sandbox ``wall_s``),
    the tool pipeline (default: the only one)."""

    tool: str = Field(min_length=1, max_length=64)
    arguments: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    pipeline: str | None = Field(None, min_length=1, max_length=128)

    _tool_utf8 = field_validator("tool", "pipeline")(_utf8)
