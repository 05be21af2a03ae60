"""``workflows/agent.py`` from the command line (issue 33's must-shows): the smoke run logs
turns and tool calls; an agent written against the ``openai`` client trains two steps through
the rollout group's endpoint; tools that raise, hang or are called with malformed JSON become
error observations with counted reasons and the run finishes; contradictory settings are
one-line errors before Ray starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import ROOT, assert_one_line_exit_2, m2flow

AGENT = ROOT / "workflows" / "agent.py"


def _run(tmp_path, *overrides: str) -> list[dict]:
    """The run's step records (``metrics.jsonl``, steps >= 1); the run must succeed."""
    run_dir = tmp_path / "run"
    args = ["run", str(AGENT), "-c", "smoke", "warm_start.steps=5", *overrides,
            f"trainer.run_dir={run_dir}"]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "m2flow.run.cli", *args], capture_output=True,
                          text=True, timeout=900, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("step", 0) >= 1 and "step_s" in r]


CONTRADICTORY = [
    (["agent.mode=openai"], "agent.mode=openai needs agent.agent=module:function"),
    (["agent.mode=chat"], "agent.mode=chat: pick one of env, openai"),
    (["agent.max_turns=0"], "agent.max_turns must be >= 1"),
    (["agent.max_episode_tokens=8"], "agent.max_episode_tokens=8 < agent.max_turn_tokens"),
    (["agent.env=missing.py:make"], "agent.env=missing.py:make: no file missing.py"),
    (["agent.tool_timeout_s=0"], "agent.tool_timeout_s must be > 0"),
]  # fmt: skip


@pytest.mark.parametrize("args,message", CONTRADICTORY)
def test_contradictory_settings_are_config_errors(tmp_path, args, message):
    """The workflow's checks refuse each one with its message (in-process: ``prepare`` is
    what ``m2flow run`` calls before Ray starts; a ``ConfigError`` there is exit 2, below)."""
    from m2flow.core.config import ConfigError
    from m2flow.run.workflow import prepare

    with pytest.raises(ConfigError, match=re.escape(message)):
        prepare(str(AGENT), [*args, f"trainer.run_dir={tmp_path / 'r'}"])


def test_a_contradictory_setting_exits_2_before_ray(tmp_path):
    """Through the command line (one process: the other settings take the same path)."""
    args, message = CONTRADICTORY[1]
    code, out, _ = m2flow("run", str(AGENT), *args, f"trainer.run_dir={tmp_path / 'r'}")
    assert_one_line_exit_2(code, out, message)


@pytest.mark.e2e
def test_smoke_logs_turns_and_tool_calls(tmp_path):
    """The must-show: ``m2flow run workflows/agent.py -c smoke trainer.steps=2`` runs and its
    ``metrics.jsonl`` has ``num_turns_mean`` and ``tool_calls_mean``."""
    # the preset's settings, its batches and evaluation splits smaller (CI time): 4 prompts
    # x 8 samples a step, 8 held-out episodes per evaluation
    steps = _run(tmp_path, "trainer.steps=2", "trainer.prompts_per_step=4",
                 "warm_start.batch_size=16", "task.val_size=8", "task.heldout_size=8")  # fmt: skip
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["num_turns_mean"] >= 1.0 and r["tool_calls_mean"] >= 0.0
        assert 0.0 < r["masked_share"] < 1.0  # the prompt's template ids are out of the loss
        ends = sum(r[f"end/{k}"] for k in ("done", "max_turns", "max_tokens", "error"))
        assert ends == 4 * 8  # every episode of the step ended, once
    assert [r["weight_version"] for r in steps] == [1, 2]


AGENT_FILE = '''
def play(client, item):
    """Two chat calls with a tool's reply between them; reward: a short final answer."""
    msgs = [{"role": "user", "content": item["prompt"]}]
    first = client.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=12)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "tool", "content": "7"}]
    second = client.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=8)
    return float(len(second.choices[0].message.content) <= 4)
'''


@pytest.mark.e2e
def test_openai_client_agent_trains_two_steps(tmp_path):
    """An agent using the ``openai`` package's client against the rollout group's endpoint:
    every episode's two calls merge into one sample (no split), the actor trains on them."""
    (tmp_path / "my_agent.py").write_text(AGENT_FILE)
    steps = _run(tmp_path, "agent.mode=openai", f"agent.agent={tmp_path / 'my_agent.py'}:play",
                 "warm_start.enabled=false", "trainer.steps=2", "task.heldout_size=8")  # fmt: skip
    assert [r["weight_version"] for r in steps] == [1, 2]
    for r in steps:
        assert r["env/openai_calls"] == 2 * 64 and r["env/openai_splits"] == 0
        assert r["num_turns_mean"] == 2.0 and r["end/done"] == 64
    assert any(r["loss"] != 0.0 for r in steps), steps  # some group had mixed rewards


ENV_FILE = '''
import time

from m2flow.workers.agent.tools import Tool, ToolEnvironment


def raises(x: int) -> str:
    """A tool that fails.

    Args:
        x: anything.
    """
    raise RuntimeError("tool broke")


def hangs(x: int) -> str:
    """A tool that does not answer in time.

    Args:
        x: anything.
    """
    time.sleep(60)
    return "late"


# the model's side of the first turn: a raising call, a hanging call, malformed JSON
SCRIPT = (
    '<tool_call>{"name": "raises", "arguments": {"x": 1}}</tool_call>'
    '<tool_call>{"name": "hangs", "arguments": {"x": 2}}</tool_call>'
    '<tool_call>{"name": "raises", "arguments": </tool_call>'
)


class Scripted(ToolEnvironment):
    """Plays the model's side of the first turn (SCRIPT); the model's own second message ends
    the episode."""

    def step(self, message):
        if self.n_calls == 0:
            message = {**message, "content": SCRIPT}
        return super().step(message)


def make(reward, parser, tool_timeout_s, system_prompt):
    tools = [Tool.from_function(raises), Tool.from_function(hangs)]
    return Scripted(tools, lambda text, item: 0.0, parser, system_prompt, tool_timeout_s)
'''


@pytest.mark.e2e
def test_failing_tools_are_error_observations_and_the_run_finishes(tmp_path):
    """A tool that raises, one that hangs past ``agent.tool_timeout_s`` (5 s against its 60: a
    loaded machine does not turn the raising call into a timeout) and malformed tool-call
    JSON: each an error observation with its reason counted, every step."""
    (tmp_path / "envs.py").write_text(ENV_FILE)
    # a small alphabet: the random model samples its turn end within a few tokens (seeded:
    # the same episodes every run)
    steps = _run(tmp_path, f"agent.env={tmp_path / 'envs.py'}:make", "warm_start.enabled=false",
                 "model.alphabet=0123456789+-=", "agent.tool_timeout_s=5",
                 "agent.max_turns=2", "agent.max_turn_tokens=16", "trainer.steps=2",
                 # 16 episodes a step, all on their own thread: a step's hanging calls time out
                 # together (one 5 s wait, not one per 8 episodes)
                 "trainer.prompts_per_step=4", "rollout.n_samples=4", "agent.concurrency=16",
                 "task.heldout_size=8")  # fmt: skip
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # episodes whose first turn ran past max_turn_tokens (max_tokens) met no tool
        assert r["tool_errors/raised"] >= 1
        assert r["tool_errors/timeout"] >= 1
        assert r["tool_errors/malformed"] >= 1
        assert r["tool_errors"] == sum(
            r[f"tool_errors/{k}"]
            for k in (
                "raised",
                "timeout",
                "malformed",
                "bad_arguments",
                "unknown_tool",
                "sandbox",
            )  # fmt: skip
        )
        assert r["end/error"] == 0  # failures are the model's observations, not the run's


@pytest.mark.e2e
def test_runs_from_a_pretrained_qwen2_directory(tmp_path):
    """``model.path`` with Qwen2's tokenizer files and chat template: the episodes' prompts are
    the template's (ChatML, the question as the user turn), tool calls parsed as Hermes'."""
    from m2flow.workers.llm.tokenizer import build_qwen2_tokenizer
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = build_qwen2_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(tmp_path / "qwen2")
    tok.save_pretrained(tmp_path / "qwen2")
    steps = _run(tmp_path, f"model.path={tmp_path / 'qwen2'}", "rollout.n_samples=2",
                 "trainer.prompts_per_step=2", "task.heldout_size=4", "agent.max_turn_tokens=12",
                 "agent.max_episode_tokens=48", "trainer.steps=1")  # fmt: skip
    assert [r["step"] for r in steps] == [1]
    assert steps[0]["end/max_tokens"] + steps[0]["end/done"] + steps[0]["end/max_turns"] == 4
