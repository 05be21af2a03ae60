"""Worker death and failure reach the user within seconds, named.

- A producer that dies (SIGKILL: what the kernel's OOM killer sends) while its consumer waits:
  the consumer's wait fails and the driver raises ``WorkerError`` naming the dead group, rank
  and node, within seconds (not after the 30-minute wait timeout).
- A producer that raises: its abort marker fails the consumer's stream at once.
- Through the CLI: a killed GRPO actor and a worker killed by Ray's memory monitor (a real
  ``OutOfMemoryError``) end the run with one paragraph and exit 1, leave the checkpoints
  intact, and ``--resume`` continues.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m2flow import Channel, StreamAborted, Worker, WorkerError, group_method

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "workflows" / "grpo.py"
MEMHOG = Path(__file__).resolve().parent / "workflows" / "memhog.py"


class Producer(Worker):
    @group_method
    def pid(self) -> int:
        return os.getpid()

    @group_method
    def produce(self, out: Channel, n: int, pause_s: float, fail_at: int = -1) -> int:
        for i in range(n):
            if i == fail_at:
                raise ValueError(f"producer-broke-at-{i}")
            out.put(i)
            time.sleep(pause_s)
        return n


class Consumer(Worker):
    @group_method
    def consume_stream(self, inp: Channel) -> list:
        return [x for items in inp.stream() for x in items]

    @group_method
    def consume_count(self, inp: Channel, n: int) -> list:
        return [inp.get() for _ in range(n)]


@pytest.mark.parametrize("how", ["consume_stream", "consume_count"])
def test_dead_producer_fails_its_consumer_within_seconds(cluster, how):
    prod = Producer.launch(cluster, [0], name=f"dp_prod_{how[8:]}")
    cons = Consumer.launch(cluster, [1], name=f"dp_cons_{how[8:]}")
    ch = Channel.create(f"dp_{how}")
    try:
        pid = prod.pid().wait(timeout=60)[0]
        args = (ch,) if how == "consume_stream" else (ch, 1000)
        waiting = getattr(cons, how)(*args)  # the driver waits on the consumer first
        producing = prod.produce(ch, 1000, 0.05)
        deadline = time.monotonic() + 60
        while sum(n for *_, n in ch.graph_edges()) < 3:  # the consumer is taking items
            assert time.monotonic() < deadline and not waiting.done()
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerError) as e:
            waiting.wait(timeout=120)
        took = time.monotonic() - t0
        err = e.value
        assert err.group == prod.name and err.rank == 0 and err.died, str(err)
        assert err.node == cluster.nodes[0].address
        assert "abruptly" in str(err.cause), str(err)
        assert took < 10, f"the death took {took:.1f} s to reach the driver"
        with pytest.raises(WorkerError, match=prod.name):
            producing.wait(timeout=30)
    finally:
        prod.shutdown()  # forget the death: later waits of this session proceed
        cons.shutdown()
        ch.close()


def test_producer_that_raises_aborts_the_stream_at_once(cluster):
    prod = Producer.launch(cluster, [0], name="ab_prod")
    cons = Consumer.launch(cluster, [1], name="ab_cons")
    ch = Channel.create("ab")
    try:
        got = cons.consume_stream(ch)
        t0 = time.monotonic()
        prod.produce(ch, 10, 0.0, fail_at=3)
        with pytest.raises(WorkerError) as e:
            got.wait(timeout=120)
        assert time.monotonic() - t0 < 10
        # Either the driver saw the producer's failed call first, or the consumer's aborted
        # stream: both name the producer and its error.
        assert "producer-broke-at-3" in str(e.value)
        assert e.value.group in ("ab_prod", "ab_cons")
        if e.value.group == "ab_cons":
            assert isinstance(e.value.cause.cause, StreamAborted)
    finally:
        prod.shutdown()
        cons.shutdown()
        ch.close()


TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "warm_start.steps=2",
    "warm_start.batch_size=16",
    "task.train_size=64",
    "task.val_size=16",
    "task.heldout_size=16",
    "trainer.prompts_per_step=4",
    "rollout.n_samples=4",
    "trainer.eval_every=100",
    "trainer.save_every=2",
    "rollout.threads=1",
    "actor.threads=1",
    "cluster.num_cpus=2",
]


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env.update(extra)
    return env


def _pids_of(title: str, root: int) -> list[int]:
    """Descendants of process ``root`` whose command line starts with ``title`` (Ray names actor
    processes ``ray::<Class>...``). Only ``root``'s tree: another test's run on the machine (an
    xdist worker beside this one) has actors of the same name."""
    parent, cmdline = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            cmdline[int(d.name)] = cmd

    def under_root(pid: int) -> bool:
        while pid > 1:
            if pid == root:
                return True
            pid = parent.get(pid, 0)
        return False

    return [pid for pid, cmd in cmdline.items() if cmd.startswith(title) and under_root(pid)]


def _steps(run_dir: Path) -> list[int]:
    f = run_dir / "metrics.jsonl"
    return [json.loads(x)["step"] for x in f.read_text().splitlines()] if f.exists() else []


def _assert_paragraph(out: str, group: str, cause: str) -> None:
    assert f"worker group '{group}' rank 0 on node" in out and cause in out, out
    assert "Traceback" not in out, out
    assert "continue with --resume" in out, out


def test_cli_killed_actor_one_paragraph_exit_1_and_resume(tmp_path):
    """SIGKILL the GRPO actor mid-run (as the kernel OOM killer would): exit 1 with one
    paragraph; the last checkpoint is complete and ``--resume`` finishes the run."""
    run_dir = tmp_path / "grpo"
    cmd = [sys.executable, "-m", "m2flow.run.cli", "run", str(GRPO), *TINY,
           f"trainer.run_dir={run_dir}"]  # fmt: skip
    proc = subprocess.Popen(
        [*cmd, "trainer.steps=200"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while max(_steps(run_dir), default=-1) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        victims = _pids_of("ray::ActorWorker", proc.pid)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, out
    _assert_paragraph(out, "actor", "the process ended abruptly")
    # A kill during a save leaves that checkpoint as step_N.partial, which resume ignores.
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if "." not in p.name)
    assert done, list((run_dir / "checkpoints").iterdir())
    last = int(done[-1].name.split("_")[1])
    assert last >= 2 and (done[-1] / "actor" / "actor_state.pt").is_file()
    resumed = subprocess.run(
        [*cmd, f"trainer.steps={last + 2}", "--resume"], capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert max(_steps(run_dir)) == last + 2


def test_cli_failure_says_resume_only_when_a_checkpoint_exists(tmp_path):
    """A worker that raises before the first checkpoint: the paragraph says a rerun starts
    over (not "continue with --resume"); one that raises at step 3 names the checkpoint of
    step 2, which --resume continues from."""
    run_dir = tmp_path / "fails"
    cmd = [sys.executable, "-m", "m2flow.run.cli", "run", str(MEMHOG), f"trainer.run_dir={run_dir}"]
    early = subprocess.run([*cmd, "fail_at_step=1"], capture_output=True, text=True, timeout=300)
    out = early.stdout + early.stderr
    assert early.returncode == 1 and "counter-broke-at-step-1" in out, out
    assert f"No checkpoint was written under {run_dir}: run it again" in out, out
    assert "--resume" not in out, out
    late = subprocess.run([*cmd, "fail_at_step=3"], capture_output=True, text=True, timeout=300)
    out = late.stdout + late.stderr
    assert late.returncode == 1 and "counter-broke-at-step-3" in out, out
    step_2 = run_dir / "checkpoints" / "step_000002"
    assert f"The checkpoint of step 2 ({step_2}) is intact: continue with --resume." in out, out


def test_cli_out_of_memory_one_paragraph_exit_1_and_resume(tmp_path):
    """Ray's memory monitor kills the worker that allocates past its threshold (set 4 GiB, or
    half of what is available if less, above what this machine uses now: the monitor watches the
    whole machine, and a test on the other xdist worker grew past a 1.5 GiB margin once, so a
    channel actor was killed before the hog started): the run ends with one paragraph naming
    the group and 'out of memory', exit 1; checkpoints 1-2 stay and ``--resume`` continues to
    the end."""
    mem = {
        k: int(v.split()[0]) * 1024
        for k, v in (line.split(":") for line in Path("/proc/meminfo").read_text().splitlines())
    }
    total, available = mem["MemTotal"], mem["MemAvailable"]
    margin = min(4 * 2**30, available // 2)  # the hog takes up to 16 GiB, 256 MiB at a time
    threshold = min(0.95, (total - available + margin) / total)
    env = _env(RAY_memory_usage_threshold=f"{threshold:.4f}", RAY_memory_monitor_refresh_ms="100")
    run_dir = tmp_path / "memhog"
    cmd = [sys.executable, "-m", "m2flow.run.cli", "run", str(MEMHOG), f"trainer.run_dir={run_dir}"]
    hog = subprocess.run(
        [*cmd, "hog_at_step=3"], capture_output=True, text=True, timeout=300, env=env
    )
    out = hog.stdout + hog.stderr
    assert hog.returncode == 1, out
    _assert_paragraph(out, "counter", "out of memory: Ray's memory monitor killed it")
    assert _steps(run_dir) == [1, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_000001",
        "step_000002",
    ]
    resumed = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert _steps(run_dir) == [1, 2, 3, 4]
    assert (run_dir / "checkpoints" / "step_000004" / "counter" / "value").read_text() == "4"
