"""Shared test set-up: one real Ray session per test module, the ``gpu`` marker, and tests kept
out of the checkout (a temporary cwd for the session, :mod:`checkout_guard` around each test).

Ray worker processes inherit the driver's environment, so everything here that a worker needs
(the tests directory on ``PYTHONPATH``, Ray's CI settings) is put into ``os.environ`` at import
time, before any ``ray.init``. With the tests directory importable, worker classes defined in a
test module (module ``test_group``, ...) unpickle in the Ray workers by reference.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from checkout_guard import CheckoutGuard

TESTS_DIR = Path(__file__).resolve().parent

# Ray settings for tests and CI (DESIGN.md, environment facts).
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# A bug that makes a wait hang should fail the test in minutes, not after the 30 min default.
os.environ.setdefault("M2FLOW_WAIT_TIMEOUT", "120")
_pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if str(TESTS_DIR) not in _pythonpath:
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), *_pythonpath])


def _short_tmp_dir(prefix: str) -> Path:
    # Ray's unix socket paths must stay under 107 bytes: keep the temp dir short (/tmp/...).
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp" if os.path.isdir("/tmp") else None))


@pytest.fixture(scope="session", autouse=True)
def session_cwd(tmp_path_factory):
    """The session's cwd: a temporary directory, never the checkout.

    Workflow defaults are relative (``trainer.run_dir=runs/grpo``): from here they cannot meet
    the user's runs in ``<checkout>/runs``, in this process or in the subprocesses and Ray
    processes tests start (they inherit the cwd). Set up before any module's Ray session."""
    cwd = tmp_path_factory.mktemp("cwd")
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        yield cwd
    finally:
        os.chdir(previous)


_guard: CheckoutGuard | None = None


@pytest.fixture(autouse=True)
def checkout_guard(session_cwd, tmp_path_factory):
    """Fails the test that touched ``<checkout>/runs``, wrote into the checkout, wrote to a
    default run directory (``<session cwd>/runs``) or left the cwd changed. Yields the
    :class:`~checkout_guard.CheckoutGuard` (``take()`` clears what it recorded)."""
    global _guard
    if _guard is None:  # one audit hook per process
        allowed = (tmp_path_factory.getbasetemp().resolve(), Path(tempfile.gettempdir()).resolve())
        _guard = CheckoutGuard(allowed=allowed).install()
    _guard.take()
    _guard.active = True
    try:
        yield _guard
    finally:
        _guard.active = False
    problems = [f"{event} {path}" for event, path in _guard.take()]
    if (session_cwd / "runs").exists():
        problems.append(f"wrote the default run directory {session_cwd / 'runs'}")
        shutil.rmtree(session_cwd / "runs", ignore_errors=True)  # the next test starts clean
    if Path.cwd() != session_cwd:
        problems.append(f"left the cwd at {Path.cwd()}")
        os.chdir(session_cwd)
    if problems:
        pytest.fail(
            "tests must not touch the checkout's runs/ or write into the checkout; give the "
            "test a tmp_path (trainer.run_dir=..., -o ...): " + "; ".join(problems),
            pytrace=False,
        )


@pytest.fixture(scope="module")
def cluster(request):
    """A fresh embedded Ray session (2 CPUs; 2 virtual devices, or the module's
    ``VIRTUAL_DEVICES``) shared by one test module. Device switches offload (``offload=
    "always"``, not the virtual-device default) so tests exercise the context switch."""
    import ray

    import m2flow
    import m2flow.core.channel

    if ray.is_initialized():  # a session leaked by an earlier module: start clean
        ray.shutdown()
    run_dir = _short_tmp_dir("m2t-")
    devices = getattr(request.module, "VIRTUAL_DEVICES", 2)
    c = m2flow.Cluster(
        run_dir=run_dir, virtual_devices_per_node=devices, num_cpus=2, offload="always"
    )
    try:
        yield c
    finally:
        c.shutdown()  # also forgets this session's channels (m2flow.core.channel registry)
        assert not m2flow.core.channel.created_channels()
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def tmp_ray_dir_factory():
    """Short temp dirs for Ray sessions a test module starts itself (removed at the end)."""
    made: list[Path] = []

    def make(prefix: str = "m2t-") -> Path:
        d = _short_tmp_dir(prefix)
        made.append(d)
        return d

    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


requires_gpu = pytest.mark.skipif(not cuda_available(), reason="needs an NVIDIA GPU (CUDA)")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when torch sees no CUDA device."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
