"""Operator configuration of the reward service: values JSON
and the service cannot use (NaN, infinities, booleans for counts), unknown keys (typos) and
unusable directories are refused at start with one line naming the key, never a traceback
or a service that answers 500 later."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import yaml
from m2flow.reward_service.schemas import ServiceConfig

from m2flow.core.config import ConfigError

BASE = {
    "tenants": {"alice": {"token": "alice-config-token"}},
    "pipelines": {
        "code": {
            "kind": "code",
            "penalty": -1.0,
            "stages": {
                "check": {"timeout_s": 10, "max_workers": 1},
                "execute": {"timeout_s": 10, "max_workers": 1, "options": {"sandbox": {}}},
            },
        }
    },
}


def _set(cfg: dict, path: str, value) -> dict:
    """``cfg`` with the dotted ``path`` set to ``value`` (a deep copy)."""
    out = yaml.safe_load(yaml.safe_dump(cfg))
    *parents, last = path.split(".")
    node = out
    for p in parents:
        node = node[p]
    node[last] = value
    return out


STAGE = "pipelines.code.stages"
# case -> (dotted key, value, what the one-line error must name); "FILE" is a regular file
BAD = {
    "penalty nan": ("pipelines.code.penalty", float("nan"), "penalty"),
    "penalty inf": ("pipelines.code.penalty", float("inf"), "penalty"),
    "penalty -inf": ("pipelines.code.penalty", float("-inf"), "penalty"),
    "timeout inf": (f"{STAGE}.check.timeout_s", float("inf"), "timeout_s"),
    "delay nan": ("default_delay_bound_s", float("nan"), "default_delay_bound_s"),
    "typo at top": ("max_body_byte", 1024, "max_body_bytes"),  # names the key it meant
    "typo in a stage": (f"{STAGE}.check.max_worker", 2, "max_worker"),
    "typo in a tenant": ("tenants.alice.tokn", "x", "tokn"),
    "typo in a pipeline": ("pipelines.code.penalti", 0, "penalti"),
    "typo in sandbox limits": (f"{STAGE}.execute.options.sandbox.wal_s", 3, "wal_s"),
    "typo in check options": (f"{STAGE}.check.options", {"max_source_byte": 9}, "max_source_byte"),
    "execute option on check": (f"{STAGE}.check.options", {"sandbox": {}}, "sandbox"),
    "bool for a count": (f"{STAGE}.check.max_workers", True, "max_workers"),
    "bool for bytes": ("max_body_bytes", True, "max_body_bytes"),
    "scratch_dir under a file": ("scratch_dir", "FILE/sub", "scratch_dir"),
    "state_dir is a file": ("state_dir", "FILE", "state_dir"),
    "no tenants": ("tenants", {}, "tenants is empty"),  # a service nobody can use
    "no pipelines": ("pipelines", {}, "pipelines is empty"),
    "shares over the connections": ("max_requests_per_tenant", 10**6, "is over max_connections"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_is_one_line_at_start(tmp_path, case):
    key, value, named = BAD[case]
    regular = tmp_path / "a-file"
    regular.write_text("not a directory")
    if isinstance(value, str):
        value = value.replace("FILE", str(regular))
    cfg = tmp_path / "service.yaml"
    cfg.write_text(yaml.safe_dump(_set(BASE, key, value)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "m2flow.reward_service.cli", "--config", str(cfg),
         "--port", str(_free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # it started: the bad value was accepted
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{case}: the service started with it; stderr: {err[-500:]}")
    lines = err.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error:"), err[-2000:]
    assert named in lines[0], lines[0]


def test_load_raises_config_error(tmp_path):
    cfg = tmp_path / "service.yaml"
    cfg.write_text(yaml.safe_dump(_set(BASE, "pipelines.code.penalty", float("nan"))))
    with pytest.raises(ConfigError, match="penalty"):
        ServiceConfig.load(cfg)
    cfg.write_text(yaml.safe_dump(BASE))
    assert ServiceConfig.load(cfg).pipelines["code"].penalty == -1.0  # the base is valid
