"""Environment defaults for Ray on a developer machine or CI (docs/concepts/design.md,
"Machines")."""

import atexit
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


#: Longest Ray temp dir (bytes) whose unix sockets fit Ray's 107-byte limit: Ray puts them at
#: ``<temp>/session_<YYYY-MM-DD_HH-MM-SS_ffffff>_<pid>/sockets/plasma_store.<n>``, 64 bytes
#: after the temp dir for a 5-digit pid and one extra node (measured, Ray 2.60), 67 with a
#: 7-digit pid and up to 64 spot nodes.
RAY_TEMP_DIR_MAX = 40
_links: set[str] = set()  # short links made by ray_temp_dir, removed at exit if still there


def ray_temp_dir(run_dir: str | os.PathLike) -> tuple[str, str | None]:
    """Where a run's Ray session goes: ``<run_dir>/ray`` (created), so the session's files
    (logs, sockets, spilled objects, and the current-cluster pointer ``ray start`` writes into
    its temp dir) stay in the run directory and Ray's machine-wide temp dir (``/tmp/ray``) is
    not touched. When that path is longer than :data:`RAY_TEMP_DIR_MAX` bytes, Ray gets a
    short symbolic link to it in the system temp dir (or ``/tmp`` when that is deep too): the
    files still live in the run directory.

    Returns:
        ``(the temp dir to give Ray, the link to remove once Ray is down or None)``; a link
        left at exit (an error before the caller's shutdown) is removed then.

    Raises:
        OSError: the directory cannot be created, or no short link can be made.
    """
    import secrets
    import tempfile
    from pathlib import Path

    real = Path(run_dir).resolve() / "ray"
    real.mkdir(parents=True, exist_ok=True)
    if len(str(real).encode()) <= RAY_TEMP_DIR_MAX:
        return str(real), None
    for base in dict.fromkeys([tempfile.gettempdir(), "/tmp"]):
        link = os.path.join(base, f"m2flow-ray-{secrets.token_hex(4)}")
        if len(link.encode()) > RAY_TEMP_DIR_MAX:
            continue
        try:
            os.symlink(real, link)
        except OSError:
            continue
        _links.add(link)
        return link, link
    raise OSError(
        f"{real} is too long for Ray's unix sockets ({RAY_TEMP_DIR_MAX} bytes at most) and no "
        "short link to it could be made in the temp dir or /tmp"
    )


def release_ray_temp_dir(link: str | None) -> None:
    """Remove the short link :func:`ray_temp_dir` made (once Ray is down; None: nothing)."""
    if link is not None and link in _links:
        _links.discard(link)
        try:
            os.unlink(link)
        except FileNotFoundError:
            pass


def _remove_links() -> None:
    for link in list(_links):
        release_ray_temp_dir(link)


# registered when m2flow is imported, before Ray: exit handlers run last-in first-out, so Ray's
# own shutdown (registered when Ray is imported) runs first, while the link still leads there
atexit.register(_remove_links)
