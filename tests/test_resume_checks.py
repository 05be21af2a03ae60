"""Checkpoints and run directories as a careless or hostile user leaves them: a state file with
an object that runs code, a damaged checkpoint, a checkpoint beyond ``trainer.steps``, two runs
on one run directory. Each is refused with one line before Ray starts, and nothing runs.

One real GRPO run (a subprocess: this process never starts Ray) leaves the checkpoints of
steps 1 and 2; each case damages a copy of that run directory."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import ray
import torch
from gymnasium.vector import AutoresetMode
from helpers import wait_until
from m2flow.workers.checkpoint import StateFileError, load_state, save_state
from m2flow.workers.embodied.env_state import restore_vector_env, vector_env_state
from test_cli import RAY_STARTED, assert_one_line_exit_2, m2flow

from m2flow.core.config import ConfigError
from m2flow.run.runlock import RunDirBusy, hold_run_dir
from m2flow.run.workflow import prepare

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "workflows" / "grpo.py"
HOLD = Path(__file__).resolve().parent / "workflows" / "hold.py"
TINY_RUN = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "warm_start.steps=1",
    "warm_start.batch_size=8",
    "task.train_size=16",
    "task.val_size=8",
    "task.heldout_size=8",
    "trainer.prompts_per_step=2",
    "rollout.n_samples=2",
    "trainer.save_every=1",
    "rollout.threads=1",
    "actor.threads=1",
    "cluster.devices_per_node=1",
]


class RunsCode:
    """Unpickled, it runs ``touch marker`` (what an attacker's object would do instead)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step GRPO run (checkpoints of steps 1 and 2), run by ``m2flow run``."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "m2flow.run.cli", "run", str(GRPO), *TINY_RUN, "trainer.steps=2",
         f"trainer.run_dir={run_dir}"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_000001", "step_000002"], names
    return run_dir


def _copy(finished: Path, tmp_path: Path) -> Path:
    """The run directory without its Ray session (which may hold sockets: not copyable)."""
    skip = shutil.ignore_patterns("ray")
    return Path(shutil.copytree(finished, tmp_path / "run", ignore=lambda d, names: skip(d, names)
                                if Path(d) == finished else []))  # fmt: skip


def _resume(run_dir: Path, steps: int = 2) -> str:
    """``prepare`` of ``--resume`` on ``run_dir``: the ConfigError's message. Asserts it is
    one line and that no Ray session was started for it."""
    assert not ray.is_initialized()
    overrides = [*TINY_RUN, f"trainer.steps={steps}", f"trainer.run_dir={run_dir}", "resume=true"]
    with pytest.raises(ConfigError) as e:
        prepare(str(GRPO), overrides)
    assert not ray.is_initialized()
    message = str(e.value)
    assert "\n" not in message, message
    return message


# -- item 5: state files hold tensors and plain values; loads run no code ---------------------


@pytest.mark.e2e
def test_state_file_with_an_object_is_refused_and_runs_nothing(finished, tmp_path):
    """A finished run's ``actor_state.pt`` gains an object whose unpickling would run a
    command: ``--resume`` is one line naming the file, exit 2, before Ray; the command never
    ran and the run directory is as it was."""
    run_dir = _copy(finished, tmp_path)
    marker = tmp_path / "ran"
    state_file = run_dir / "checkpoints" / "step_000002" / "actor" / "actor_state.pt"
    state = torch.load(state_file, weights_only=True)
    torch.save({**state, "extra": RunsCode(marker)}, state_file)
    metrics = (run_dir / "metrics.jsonl").read_text()

    code, out, _ = m2flow("run", str(GRPO), *TINY_RUN, "trainer.steps=3",
                          f"trainer.run_dir={run_dir}", "--resume", timeout=300)  # fmt: skip
    assert_one_line_exit_2(code, out, f"{state_file}: holds an object of posix.system")
    assert "weights_only" not in out, out  # never advise loading it unsafely
    assert "previous good checkpoint is step_000001" in out, out
    assert len(out.strip().splitlines()) == 1, out
    assert not marker.exists(), "the object in the state file ran"
    assert (run_dir / "metrics.jsonl").read_text() == metrics


def test_workers_load_state_files_without_running_code(tmp_path):
    """The workers' own load (each role's ``load_checkpoint``) refuses such a file too, and a
    state with a numpy value is refused when saved, not when loaded."""
    marker = tmp_path / "ran"
    torch.save({"generator": torch.zeros(3), "x": RunsCode(marker)}, tmp_path / "rank0.pt")
    with pytest.raises(StateFileError, match=r"rank0.pt: holds an object of posix.system"):
        load_state(tmp_path, 0)
    assert not marker.exists()
    with pytest.raises(TypeError, match=r"rank1.pt\['ep'\] is a numpy.ndarray"):
        save_state(tmp_path, 1, {"ep": np.zeros(3)})


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Acrobot-v1", "MountainCar-v0"])
def test_vector_env_state_restores_into_a_fresh_env_exactly(env_id):
    """The embodied env's checkpoint form: a vector env stepped mid-episode, saved as tensors
    and plain values (``weights_only`` loads it), restored into an env built fresh from the
    config, steps exactly as the original from there (observations, rewards, ends, resets)."""

    def make():
        v = gym.make_vec(env_id, num_envs=3, vectorization_mode="sync",
                         vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP})  # fmt: skip
        v.reset(seed=0)
        return v

    rng = np.random.default_rng(1)
    original, fresh = make(), make()
    for _ in range(250):
        original.step(rng.integers(0, 2, 3))
    buf = io.BytesIO()
    torch.save(vector_env_state(original), buf)
    buf.seek(0)
    restore_vector_env(fresh, torch.load(buf, weights_only=True))
    for _ in range(600):  # past the time limits: autoresets draw from the restored RNGs
        action = rng.integers(0, 2, 3)
        a, b = original.step(action), fresh.step(action)
        for x, y in zip(a[:4], b[:4]):
            np.testing.assert_array_equal(x, y)


# -- item 7: a damaged checkpoint is named before Ray -----------------------------------------


def _damage_runner_json(ckpt: Path) -> None:
    (ckpt / "runner.json").write_text('{"step": 2, "data": {"epo')


def _remove_runner_json(ckpt: Path) -> None:
    (ckpt / "runner.json").unlink()


def _truncate_safetensors(ckpt: Path) -> None:
    f = ckpt / "actor" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])


def _random_state_file(ckpt: Path) -> None:
    (ckpt / "actor" / "actor_state.pt").write_bytes(np.random.default_rng(0).bytes(4096))


def _remove_role_directory(ckpt: Path) -> None:
    shutil.rmtree(ckpt / "actor")


@pytest.mark.e2e
@pytest.mark.parametrize(
    "damage,problem",
    [
        (_damage_runner_json, "runner.json is not JSON"),
        (_remove_runner_json, "no runner.json"),
        (_truncate_safetensors, "model.safetensors: damaged or truncated safetensors file"),
        (_random_state_file, "actor_state.pt: damaged"),
        (_remove_role_directory, "no actor/ directory"),
    ],
)
def test_damaged_checkpoint_named_with_the_previous_good_one(finished, tmp_path, damage, problem):
    run_dir = _copy(finished, tmp_path)
    damaged = run_dir / "checkpoints" / "step_000002"
    damage(damaged)
    message = _resume(run_dir)
    assert f"checkpoint {damaged} is damaged (" in message, message
    assert problem in message, message
    assert "previous good checkpoint is step_000001 (step 1): move step_000002 aside" in message
    # ... and that advice works: moved aside, the previous one passes the checks
    damaged.rename(damaged.with_name("step_000002.damaged"))
    prepare(str(GRPO), [*TINY_RUN, "trainer.steps=2", f"trainer.run_dir={run_dir}", "resume=true"])
    assert not ray.is_initialized()


@pytest.mark.e2e
def test_no_sound_checkpoint_left_says_so(finished, tmp_path):
    run_dir = _copy(finished, tmp_path)
    for step in (1, 2):
        _random_state_file(run_dir / "checkpoints" / f"step_{step:06d}")
    message = _resume(run_dir)
    assert "step_000002 is damaged" in message and "no earlier checkpoint is sound" in message


@pytest.mark.e2e
def test_checkpoint_beyond_trainer_steps_is_refused(finished, tmp_path):
    """Resumed with ``trainer.steps`` below the checkpoint's step, the run would train nothing
    (it did so silently): refused, naming trainer.steps."""
    message = _resume(_copy(finished, tmp_path), steps=1)
    assert "is step 2, beyond trainer.steps=1" in message, message
    assert "set trainer.steps above 2" in message, message


# -- item 6: one run per run directory --------------------------------------------------------


def _start_holding(run_dir: Path, gate: Path) -> subprocess.Popen:
    """``m2flow run`` of the holding workflow, waited for until it holds ``run_dir``'s lock."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "m2flow.run.cli", "run", str(HOLD), f"trainer.run_dir={run_dir}",
         f"gate={gate}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lock = run_dir / ".lock"

    def holding() -> bool:
        assert proc.poll() is None, proc.communicate()[0]
        return lock.is_file() and f'"pid": {proc.pid}' in lock.read_text()

    wait_until(holding, timeout=120, what="the first run to hold the run directory")
    return proc


def test_second_run_on_a_run_dir_is_refused_naming_the_first(tmp_path):
    """Two real runs: the first holds ``trainer.run_dir`` (waited for until its lock file
    names it); the second is refused at once, exit 2, one line naming the first's PID;
    ``--show-config`` takes no lock; the first then finishes normally and the directory is
    free again."""
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    first = _start_holding(run_dir, gate)
    try:
        code, out, _ = m2flow("run", str(HOLD), f"trainer.run_dir={run_dir}", f"gate={gate}")
        assert_one_line_exit_2(code, out, f"trainer.run_dir={run_dir} is in use by another run")
        assert f"(PID {first.pid}: " in out, out
        # the lock itself, not only the pre-start check, refuses a second holder
        with pytest.raises(RunDirBusy, match=f"PID {first.pid}"):
            with hold_run_dir(run_dir):
                pass
        code, out, _ = m2flow("run", str(HOLD), f"trainer.run_dir={run_dir}", "--show-config")
        assert code == 0 and RAY_STARTED not in out, out
        assert first.poll() is None
    finally:
        gate.touch()
        out = first.communicate(timeout=120)[0]
    assert first.returncode == 0, out
    with hold_run_dir(run_dir):  # released with the run
        pass


def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    """``kill -9`` of the holder: the kernel drops its lock, the next run starts."""
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    first = _start_holding(run_dir, gate)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=120)
    with hold_run_dir(run_dir) as lock:
        assert f'"pid": {os.getpid()}' in lock.read_text()
    code, out, _ = m2flow("run", str(HOLD), f"trainer.run_dir={run_dir}", f"gate={tmp_path}")
    assert code == 0, out


def test_lock_is_reentrant_in_one_process_and_not_inherited_by_forks(tmp_path):
    """The run and the profiling runs it nests hold one lock; a forked child closes its copy
    of the descriptor (it must not keep the lock after the run's process dies)."""
    run_dir = tmp_path / "run"
    with hold_run_dir(run_dir), hold_run_dir(run_dir):
        pid = os.fork()
        if pid == 0:  # the child: its descriptor was closed at fork
            held = any(
                os.path.realpath(f"/proc/self/fd/{fd}") == str((run_dir / ".lock").resolve())
                for fd in map(int, os.listdir("/proc/self/fd"))
                if os.path.exists(f"/proc/self/fd/{fd}")
            )
            os._exit(1 if held else 0)
        assert os.waitpid(pid, 0)[1] == 0, "the forked child kept the lock's descriptor"
    assert (run_dir / ".lock").read_text() == ""  # the lock file stays, emptied
