"""The user docs' generated parts and their example workflow (docs/, mkdocs.yml).

Checks that could fail: the configuration reference lists every key of a built-in workflow with
its default; the CLI reference has every command; the example workflow of "Write a workflow"
gives its documented result under the temporal default and under its plan file, which puts the
two groups on different devices."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from m2flow.run.workflow import load_workflow, resolve_workflow, run_workflow

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "squares.py"
EXAMPLE_PLAN = ROOT / "docs" / "examples" / "squares_plan.yaml"


def _hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts/mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaves(node, prefix: str = "") -> dict[str, object]:
    """The config's keys: dataclass sections are descended into, a dict-typed field (e.g.
    ``task.config``) is one key."""
    out = {}
    for k in node:
        v = node[k]
        if OmegaConf.is_dict(v) and OmegaConf.get_type(v) is not dict:
            out |= _leaves(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = OmegaConf.to_container(v) if OmegaConf.is_config(v) else v
    return out


@pytest.mark.parametrize("workflow", ["grpo", "ppo", "embodied", "agent"])
def test_config_reference_lists_every_key_with_its_default(workflow):
    page = _hooks().config_reference(workflow)
    module = load_workflow(resolve_workflow(workflow))
    defaults = _leaves(OmegaConf.structured(module.Config))
    rows = dict(re.findall(r"^\| `([\w.]+)` \| (.+?) \|", page, re.MULTILINE))
    assert set(defaults) <= set(rows), sorted(set(defaults) - set(rows))
    assert rows["trainer.steps"] == f"`{defaults['trainer.steps']}`"
    assert rows["resume"] == "`false`"


def test_config_reference_takes_meanings_from_field_comments():
    page = _hooks().config_reference("grpo")
    row = next(line for line in page.splitlines() if line.startswith("| `rollout.n_samples`"))
    assert "GRPO group size" in row  # workers/recipe.py: the comment beside the field


def test_cli_reference_has_every_command():
    page = _hooks().cli_reference()
    for command in ("run", "profile", "plan", "version", "reward-service"):
        assert f"## `m2flow {command}`" in page
    assert "Usage: m2flow run" in page and "--show-config" in page


@pytest.mark.e2e
def test_example_workflow_gives_its_documented_result_under_each_plan(cluster, tmp_path):
    runs = {}
    for plan in ("temporal", str(EXAMPLE_PLAN)):
        run_dir = tmp_path / Path(plan).stem
        session = run_workflow(
            EXAMPLE, ["trainer.steps=2", f"trainer.run_dir={run_dir}"], plan=plan, log=print
        )
        runs[plan] = session
        assert session.result == {"total": 140}  # the docs: sum of the squares of 0..7
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    planned = runs[str(EXAMPLE_PLAN)].placement
    assert planned.groups == {"squarer": [0], "summer": [1]}
    assert planned.granularity_for("squarer", None, 8) == 2
