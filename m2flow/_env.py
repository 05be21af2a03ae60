"""Environment defaults for Ray on a developer machine or CI (docs/concepts/design.md,
"Machines")."""

import os

RAY_ENV_DEFAULTS = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # Keep CUDA_VISIBLE_DEVICES as m2flow sets it on actors that request no Ray GPU.
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    "RAY_DEDUP_LOGS": "0",
}


def apply_ray_env_defaults() -> None:
    """Set the defaults above where the user has not set them."""
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def wait_timeout() -> float:
    """Default upper bound, in seconds, on any blocking wait (``M2FLOW_WAIT_TIMEOUT``)."""
    return float(os.environ.get("M2FLOW_WAIT_TIMEOUT", "1800"))
