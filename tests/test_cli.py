"""The CLI's failure contract: a user mistake is one line on stderr and exit code 2, found
before anything starts (no Ray session, no worker); a worker failure is one paragraph and
exit code 1 (tests/test_liveness.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "workflows" / "grpo.py"
RAY_STARTED = "[a Ray session was started]"


def m2flow(*args: str, cwd: Path | None = None, timeout: float = 120) -> tuple[int, str, float]:
    """Run ``m2flow ARGS``; ``(exit code, stderr, seconds)``. The command gets a temporary
    directory of its own; if Ray started, its session directory is there or in the run
    directory's ``ray/`` (``trainer.run_dir=``), and :data:`RAY_STARTED` is appended to the
    output."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="m2flow-cli-test-") as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "m2flow.run.cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env={**os.environ, "TMPDIR": tmp},
        )
        run_dirs = [Path(a.split("=", 1)[1]) for a in args if a.startswith("trainer.run_dir=")]
        sessions = [s for d in [Path(tmp), *run_dirs] for s in d.rglob("session_*")]
    out = proc.stderr + proc.stdout
    started = sessions or "node 0 (head)" in out  # the workflows print the cluster once up
    return proc.returncode, out + (f"\n{RAY_STARTED}" if started else ""), time.monotonic() - t0


def assert_one_line_exit_2(code: int, out: str, message: str) -> None:
    assert code == 2, out
    assert message in out, out
    assert "Traceback" not in out, out
    assert RAY_STARTED not in out, "a user mistake must be found before Ray starts"


@pytest.mark.parametrize(
    "args,message",
    [
        (["trainer.stepz=3"], "unknown config key 'trainer.stepz'"),
        (["trainer.steps=many"], "bad value for 'trainer.steps'"),
        (["rollout.temperature=0"], "rollout.temperature must be a finite number > 0"),
        (["plan=sideways"], "plan='sideways': give one of auto, temporal"),
        (["plan=no/such/plan.yaml"], "plan file 'no/such/plan.yaml' does not exist"),
        (["trainer.steps"], "not of the form key=value"),
        # values that would otherwise fail late in the run, or never
        (["trainer.eval_every=0"], "trainer.eval_every must be >= 1"),
        (["trainer.save_every=0"], "trainer.save_every must be >= 1"),
        (["actor.lr=inf"], "actor.lr must be a finite number > 0"),
        (["actor.lr=nan"], "actor.lr must be a finite number > 0"),
        (["warm_start.lr=-1"], "warm_start.lr must be a finite number > 0"),
        (["cluster.devices_per_node=0"], "cluster.devices_per_node must be >= 1"),
        # the list of choices is printed whole (rich markup ate "[auto, always, never]")
        (["cluster.offload=bogus"], "expected one of [auto, always, never]"),
        # values that started Ray (or hung) before
        (["model.hidden_size=0"], "model.hidden_size and model.intermediate_size must be >= 1"),
        (["model.num_attention_heads=3"], "must be >= 1 and divide model.hidden_size=128"),
        (["cluster.devices_per_node=100000000"], "at most 1024 virtual devices a node"),
        (["trainer.logger=[console,csv]"], "unknown logger 'csv'; choose from console, jsonl"),
        (["trainer.log_every=0"], "trainer.log_every must be >= 1"),
        (["trainer.tensorboard=true"], "trainer.tensorboard is now trainer.logger"),
        (["actor.lora.rank=-1"], "actor.lora.rank=-1: give an integer >= 0"),
        (
            ["actor.lora.rank=4", "actor.engine=megatron"],
            "actor.lora.rank=4 with actor.engine=megatron: that engine has no exact LoRA",
        ),
    ],
)
def test_config_errors_exit_2(tmp_path, args, message):
    code, out, _ = m2flow("run", str(GRPO), *args, f"trainer.run_dir={tmp_path / 'r'}")
    assert_one_line_exit_2(code, out, message)


def test_unknown_workflow_exit_2():
    code, out, _ = m2flow("run", "no_such_flow.py")
    assert_one_line_exit_2(code, out, "neither a file nor a built-in")


def test_workflow_with_a_syntax_error_exit_2(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("from dataclasses import dataclass\n\ndef main(cfg:\n    pass\n")
    code, out, _ = m2flow("run", str(bad))
    assert_one_line_exit_2(code, out, f"{bad}:3: syntax error")


def test_workflow_with_a_missing_import_exit_2(tmp_path):
    bad = tmp_path / "imports.py"
    bad.write_text("import no_such_module_xyz\n")
    code, out, _ = m2flow("run", str(bad))
    assert_one_line_exit_2(code, out, "cannot import no_such_module_xyz")


def test_run_dir_that_is_a_file_exit_2(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    code, out, _ = m2flow("run", str(GRPO), f"trainer.run_dir={f}")
    assert_one_line_exit_2(code, out, "is a file, not a directory")


def test_show_config_does_not_read_the_run_dir(tmp_path):
    """``--show-config`` prints every key without the value checks: a run directory that
    holds checkpoints (the main job's, say) does not stop it, and nothing is created."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000100").mkdir(parents=True)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, out, _ = m2flow("run", str(GRPO), f"trainer.run_dir={run_dir}", "--show-config")
    assert code == 0, out
    assert f"run_dir: {run_dir}" in out and "max_new_tokens:" in out
    assert RAY_STARTED not in out
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_run_dir_that_cannot_be_created_exit_2(tmp_path):
    code, out, _ = m2flow("run", str(GRPO), "trainer.run_dir=/proc/m2flow-run")
    assert_one_line_exit_2(code, out, "cannot be created (/proc is not a writable directory)")


def test_malformed_yaml_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  steps: 3\n  run_dir: [unclosed\n")
    code, out, _ = m2flow("run", str(GRPO), "-c", str(bad), f"trainer.run_dir={tmp_path / 'r'}")
    assert_one_line_exit_2(code, out, f"{bad}: line 4, column 1: not valid YAML")


def test_resume_without_a_checkpoint_exit_2_before_ray(tmp_path):
    code, out, _ = m2flow("run", str(GRPO), f"trainer.run_dir={tmp_path}", "--resume")
    assert_one_line_exit_2(code, out, "--resume: no checkpoint under")


def test_empty_plan_file_exit_2(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("")
    code, out, _ = m2flow("run", str(GRPO), f"plan={plan}", f"trainer.run_dir={tmp_path}")
    assert_one_line_exit_2(code, out, "is empty")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--steps", "0"], "measure at least one step (--steps >= 1)"),
        (["--warmup", "-1"], "--warmup >= 0"),
        (["--devices", "0"], "every device count must be >= 1"),
        (["rollout.temperature=0"], "rollout.temperature must be a finite number > 0"),
    ],
)
def test_profile_bad_arguments_exit_2_before_ray(tmp_path, args, message):
    code, out, _ = m2flow("profile", str(GRPO), *args, "-o", str(tmp_path / "p.yaml"))
    assert_one_line_exit_2(code, out, message)


def test_plan_and_reward_service_commands_are_registered():
    code, out, _ = m2flow("--help")
    assert code == 0 and "plan" in out and "reward-service" in out and "export-merged" in out


def _imports(path: Path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(("." * node.level) + (node.module or ""))
    return names


def test_layers_import_only_downwards():
    """docs/concepts/design.md's layering: the runtime (m2flow/) imports no workers (the reward
    service's CLI joins through an entry point); the planner (scheduler/) imports neither the
    runtime nor Ray nor torch."""
    for f in sorted((ROOT / "m2flow").glob("*.py")):
        bad = [n for n in _imports(f) if "workers" in n.split(".")]
        assert not bad, f"{f.name} imports {bad}"
    for f in sorted((ROOT / "scheduler").glob("*.py")):
        bad = [
            n
            for n in _imports(f)
            if n.split(".")[0] in ("ray", "torch", "m2flow") and not n.startswith("m2flow.sch")
        ]
        assert not bad, f"scheduler/{f.name} imports {bad}"
    code = "import sys, m2flow.run.cli; sys.exit('torch' in sys.modules or 'ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


#: what a config error is found without: each takes seconds to import (torch ~2 s,
#: reasoning_gym ~2 s, transformers ~1 s, Ray ~1 s), paid by every CLI test that exits 2
HEAVY = ("torch", "transformers", "reasoning_gym", "ray", "numpy", "peft", "vllm", "megatron")

CONFIG_ERRORS = """
import sys
from m2flow.core.config import ConfigError
from m2flow.run.workflow import prepare
for wf in sys.argv[1:]:
    try:
        prepare(wf, ["trainer.log_every=0"])
    except ConfigError as e:
        print(wf, "refused:", e)
print("heavy:", sorted(m for m in HEAVY if m in sys.modules))
"""


def test_a_config_error_imports_no_heavy_package():
    """Loading each built-in workflow and running its checks up to a bad value imports none of
    :data:`HEAVY`: they load where a dataset, tokenizer, model or checkpoint file is built (and
    Ray once the config is good), so the CLI's exit 2 takes ~1 s, not ~5 s."""
    flows = [str(ROOT / "workflows" / f"{w}.py") for w in ("grpo", "ppo", "embodied")]
    code = f"HEAVY = {HEAVY!r}\n{CONFIG_ERRORS}"
    proc = subprocess.run(
        [sys.executable, "-c", code, *flows], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    for wf in flows:
        assert f"{wf} refused: trainer.log_every must be >= 1" in proc.stdout, proc.stdout
    assert "heavy: []" in proc.stdout, proc.stdout


SERVICE_OK = 'tenants: {a: {token: "aaaaaaaaaa"}}\npipelines: {m: {kind: math}}\n'


@pytest.mark.parametrize(
    "text,args,message",
    [
        ("tenants: [\n  bad", [], "is not valid YAML"),
        ("- a list\n", [], "must be a YAML mapping"),
        (SERVICE_OK, ["--port", "99999"], "port: Input should be less than or equal to 65535"),
        (SERVICE_OK.replace("math", "cobol"), [], "pipelines.m.kind"),
    ],
)
def test_reward_service_bad_config_exit_2(tmp_path, text, args, message):
    cfg = tmp_path / "service.yaml"
    cfg.write_text(text)
    code, out, _ = m2flow("reward-service", "-c", str(cfg), *args, timeout=60)
    assert code == 2 and message in out and "Traceback" not in out, out
    assert len(out.strip().splitlines()) == 1, out


def test_reward_service_port_in_use_exit_2(tmp_path):
    import socket

    cfg = tmp_path / "service.yaml"
    cfg.write_text(SERVICE_OK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, out, _ = m2flow("reward-service", "-c", str(cfg), "--port", str(port), timeout=60)
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in out, out


@pytest.mark.parametrize(
    "text,message",
    [
        ("t_s,instances\n10,2\n5,1\n", "line 3"),
        ("t_s,instances\n0,-1\n", "line 2"),
        ("time,count\n0,1\n", "line 1"),
        ("t_s,instances\n0,two\n", "line 2"),
        ("t_s,instances\n0,1e30\n", "is more than 100000"),
    ],
)
def test_bad_spot_trace_exit_2(tmp_path, text, message):
    trace = tmp_path / "trace.csv"
    trace.write_text(text)
    code, out, _ = m2flow(
        "run", str(GRPO), f"cluster.spot.trace={trace}", f"trainer.run_dir={tmp_path / 'r'}"
    )
    assert_one_line_exit_2(code, out, "cluster.spot.trace")
    assert message in out and len(out.strip().splitlines()) == 1, out


def test_reserved_key_exit_2(tmp_path):
    """A key named like a config method (``items``) would read as the method: refused."""
    code, out, _ = m2flow("run", str(GRPO), "task.config.items=3", f"trainer.run_dir={tmp_path}")
    assert_one_line_exit_2(code, out, "config key 'task.config.items' is a reserved name")


def test_plan_naming_a_device_beyond_the_cluster_exit_2(tmp_path):
    """A plan file naming device 99 on a 1-device cluster: refused before Ray starts."""
    plan = tmp_path / "plan.yaml"
    plan.write_text("mode: spatial\ngroups:\n  rollout: [0]\n  reward: [0]\n  actor: [99]\n")
    code, out, _ = m2flow("run", str(GRPO), f"plan={plan}", f"trainer.run_dir={tmp_path / 'r'}")
    assert_one_line_exit_2(code, out, "devices [99], but the cluster has 1 devices")


def test_a_preset_by_name_and_an_unknown_one(tmp_path):
    """``-c smoke`` is the shipped preset (its keys show in the config); an unknown name lists
    the presets, one line, exit 2."""
    code, out, _ = m2flow("run", str(GRPO), "-c", "smoke", "--show-config")
    assert code == 0, out
    assert "run_dir: runs/smoke" in out and "time_budget_s: 15" in out
    code, out, _ = m2flow("run", str(GRPO), "-c", "smok", f"trainer.run_dir={tmp_path / 'r'}")
    assert_one_line_exit_2(code, out, "neither a file nor a built-in preset (presets: ")


def test_a_directory_given_as_a_file_says_so(tmp_path):
    """``-c DIR`` and a workflow that is a directory: it is a directory, not "does not
    exist"; ``profile -o DIR`` is refused too."""
    code, out, _ = m2flow("run", str(GRPO), "-c", str(tmp_path), f"trainer.run_dir={tmp_path}")
    assert_one_line_exit_2(code, out, f"config file '{tmp_path}' is a directory")
    code, out, _ = m2flow("run", str(tmp_path))
    assert_one_line_exit_2(code, out, f"workflow '{tmp_path}' is a directory")
    code, out, _ = m2flow("profile", str(GRPO), "-o", str(tmp_path))
    assert_one_line_exit_2(code, out, "it is a directory")


def test_profile_into_a_missing_directory_is_refused_before_profiling(tmp_path):
    """As ``plan --save``: a typo must not profile for a minute and then make a tree."""
    out_file = tmp_path / "missing" / "dir" / "p.yaml"
    code, out, _ = m2flow("profile", str(GRPO), "-o", str(out_file))
    assert_one_line_exit_2(code, out, f"{out_file.parent} is not a directory (create it first)")
    assert not (tmp_path / "missing").exists()


#: a workflow that says when it is imported (its imports are what takes seconds)
MARKED = """
import os
from dataclasses import dataclass, field
from pathlib import Path

from m2flow.run.recipe import ClusterConfig, validate_cluster

Path(os.environ["M2FLOW_TEST_MARK"]).write_text("imported")


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


def validate(cfg):
    validate_cluster(cfg.cluster)


def main(cfg):
    pass
"""

CHECK = """
import sys
from m2flow.run.cli import app
try:
    app(sys.argv[1:])
except SystemExit as e:
    print("exit", e.code, "ray" in sys.modules, "torch" in sys.modules)
"""


@pytest.mark.parametrize("how", ["override", "config file"])
def test_an_impossible_cluster_is_refused_before_the_workflow_is_imported(tmp_path, how):
    """``cluster.devices_per_node=100000000`` took 33-41 s on a loaded machine: the workflow's
    imports (Ray, torch, its tasks) ran before its ``validate``. The runtime's cluster section
    is checked first: the workflow is not imported, nor Ray or torch."""
    wf = tmp_path / "marked.py"
    wf.write_text(MARKED)
    mark = tmp_path / "imported"
    args = ["run", str(wf)]
    if how == "override":
        args.append("cluster.devices_per_node=100000000")
    else:
        (tmp_path / "c.yaml").write_text("cluster:\n  devices_per_node: 100000000\n")
        args += ["-c", str(tmp_path / "c.yaml")]
    proc = subprocess.run(
        [sys.executable, "-c", CHECK, *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, "M2FLOW_TEST_MARK": str(mark)},
    )  # fmt: skip
    assert "at most 1024 virtual devices a node" in proc.stderr, proc.stderr
    assert proc.stdout.split() == ["exit", "2", "False", "False"], (proc.stdout, proc.stderr)
    assert not mark.exists()
    mark_ok = subprocess.run(  # a possible value: the workflow is imported and runs
        [sys.executable, "-c", CHECK, "run", str(wf), "cluster.devices_per_node=2",
         "--show-config"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "M2FLOW_TEST_MARK": str(mark)},
    )  # fmt: skip
    assert "devices_per_node: 2" in mark_ok.stdout and mark.exists(), mark_ok.stderr
