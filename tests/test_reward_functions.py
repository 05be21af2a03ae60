"""Your own reward (``reward.*``): functions from files with veRL's signature, the built-ins on
real strings, failures that stop the run or cost the penalty (counted), config-time checks.

Real parts only: reward functions written to tmp files and imported, math-verify, reasoning-gym's
scorer. No Ray."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from m2flow.workers.data.reasoning_gym import task_items
from m2flow.workers.llm import build_char_tokenizer
from m2flow.workers.reward.config import check_reward, reward_spec
from m2flow.workers.scoring.builtins import dispatch, exact_reward, math_answer, math_reward
from m2flow.workers.scoring.functions import (
    RewardFunction,
    RewardFunctionError,
    merge_reward_metrics,
    result_metrics,
)
from m2flow.workers.tasks import TaskDataset

from m2flow.config import ConfigError
from m2flow.workflow import prepare

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "workflows" / "grpo.py"
PPO = ROOT / "workflows" / "ppo.py"

FUNCTIONS = """
import math


def exact(data_source, solution_str, ground_truth, extra_info):
    return float(solution_str.strip() == str(ground_truth))


def with_metrics(data_source, solution_str, ground_truth, extra_info):
    right = solution_str.strip() == str(ground_truth)
    return {"score": 2.0 if right else -1.0, "length": len(solution_str), "right": right,
            "pred": solution_str}


def raises(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "boom":
        raise KeyError("no such field")
    return 1.0


def nan(data_source, solution_str, ground_truth, extra_info):
    return math.nan if solution_str == "nan" else 0.5


def text(data_source, solution_str, ground_truth, extra_info):
    return "1.0"


def no_score(data_source, solution_str, ground_truth, extra_info):
    return {"reward": 1.0}


compute_score = exact
"""


@pytest.fixture
def fns(tmp_path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(FUNCTIONS)
    return path


def entry(gt, index=0, source="mine", extra=None) -> dict:
    return {"data_source": source, "ground_truth": gt, "extra_info": extra or {}, "index": index}


def test_file_function_float_and_dict(fns):
    res = RewardFunction(f"{fns}:exact")([" 9", "8"], [entry("9"), entry("9", 1)])
    assert res.scores == [1.0, 0.0] and res.metrics == {} and res.errors == 0
    res = RewardFunction(f"{fns}:with_metrics")(["9", "80"], [entry("9"), entry("9", 1)])
    # Numeric extras are metrics (bool as 0/1); strings are not logged.
    assert res.scores == [2.0, -1.0]
    assert res.metrics == {"length": [1.0, 2.0], "right": [1.0, 0.0]}
    # A bare path is veRL's default name, compute_score.
    assert RewardFunction(str(fns))(["9"], [entry("9")]).scores == [1.0]
    # The step's extra metrics: means over samples, reward/<name>; errors with penalty only.
    outs = [result_metrics([res]), result_metrics([res, res])]
    assert outs[1]["reward_metrics"]["length"] == [6.0, 4]
    assert merge_reward_metrics(outs) == {"reward/length": 1.5, "reward/right": 0.5}
    assert merge_reward_metrics(outs, "penalty")["reward_errors"] == 0


@pytest.mark.parametrize(
    "fn,response,why",
    [
        ("raises", "boom", r"KeyError: 'no such field'"),
        ("nan", "nan", r"returned nan \(rewards must be finite\)"),
        ("text", "x", r"returned str '1.0', not a number"),
        ("no_score", "x", r"returned a dict without 'score'"),
    ],
)
def test_failing_function_stops_or_costs_the_penalty(fns, fn, response, why):
    """One error naming the function, the sample's index and data_source; with
    on_error=penalty the sample gets the penalty and the count says how many."""
    name = f"{fns}:{fn}"
    batch = [entry("1", index=41, source="ok_source"), entry("1", index=42, source="bad/source")]
    with pytest.raises(RewardFunctionError) as err:
        RewardFunction(name)(["fine" if fn in ("raises", "nan") else response, response], batch)
    msg = str(err.value)
    first_bad = 42 if fn in ("raises", "nan") else 41
    assert f"reward function '{name}' failed on sample index {first_bad}" in msg
    assert ("'bad/source'" if first_bad == 42 else "'ok_source'") in msg
    assert re.search(why, msg), msg
    assert "reward.on_error=penalty" in msg
    res = RewardFunction(name, on_error="penalty", penalty=-0.5)(["fine", response], batch)
    expected_errors = 1 if fn in ("raises", "nan") else 2
    assert res.errors == expected_errors
    assert res.scores[1] == -0.5 and (res.scores[0] == -0.5) == (expected_errors == 2)
    assert merge_reward_metrics([result_metrics([res])], "penalty") == {
        "reward_errors": expected_errors
    }


def test_math_builtin_on_real_strings():
    assert math_reward("openai/gsm8k", "so the total is \\boxed{42}.", "42") == 1.0
    assert math_reward("lighteval/MATH", "\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("lighteval/MATH", "\\boxed{\\frac{1}{3}}", "\\frac{1}{2}") == 0.0
    # GSM8K's marker, commas and the reference's own "#### " solution.
    solution = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert math_reward("openai/gsm8k", "48 + 24 = 72 clips\n#### 72", solution) == 1.0
    assert math_reward("openai/gsm8k", "#### 1,000", "1000") == 1.0
    assert math_reward("openai/gsm8k", "#### 71", solution) == 0.0
    assert math_reward("x", "the answer is 42", "42") == 0.0  # neither \boxed{} nor ####
    assert math_answer("a \\boxed{x^{2}} then \\boxed{\\sqrt{4}}") == "\\sqrt{4}"  # last, nested
    assert math_answer("\\boxed{unclosed") is None


def test_exact_builtin_on_real_strings():
    assert exact_reward("", "thinking... <answer> Paris </answer>", "Paris") == 1.0
    assert exact_reward("", "  42\n", 42) == 1.0  # stripped; the ground truth as text
    assert exact_reward("", "<answer>41</answer> no: <answer>42</answer>", "42") == 1.0
    assert exact_reward("", "<answer>Paris, France</answer>", "Paris") == 0.0
    assert exact_reward("", "b", ["a", "b"]) == 1.0  # a list: any


def test_reasoning_gym_builtin_and_auto():
    """reasoning_gym is the task's own scorer on the entry in extra_info (partial credit);
    auto picks it for reasoning-gym items and math for veRL's math sources."""
    tok = build_char_tokenizer()
    items = task_items(TaskDataset("chain_sum", {"max_terms": 2}, seed=0, size=4), tok)
    answers = [str(it.ground_truth) for it in items]
    rg = RewardFunction("reasoning_gym")
    assert rg(answers, [it.entry() for it in items]).scores == [1.0] * 4
    partial = rg([answers[0] + "1"], [items[0].entry()]).scores[0]
    assert 0.0 < partial < 1.0
    auto = RewardFunction()
    batch = [items[0].entry(), entry("7", source="openai/gsm8k")]
    assert auto([answers[0], "\\boxed{7}"], batch).scores == [1.0, 1.0]
    assert dispatch("aime24") == "math" and dispatch("mine") is None
    with pytest.raises(RewardFunctionError, match=r"'auto' failed on sample index 3 \(data_source "
                                                  r"'mine'\).*set reward.function"):  # fmt: skip
        auto(["x"], [entry("x", index=3)])
    with pytest.raises(RewardFunctionError, match=r"needs the task's entry in extra_info"):
        RewardFunction("reasoning_gym")(["1"], [entry("1", source="reasoning_gym/chain_sum")])


def test_config_checks(tmp_path, fns, monkeypatch):
    """reward.* is checked before anything starts: the file exists and defines the function
    (one line each); a relative path becomes absolute (workers run elsewhere); auto needs a
    built-in for every data_source; a function with the reward service is refused."""
    run = [f"trainer.run_dir={tmp_path / 'run'}"]
    monkeypatch.chdir(tmp_path)
    _, cfg = prepare(str(GRPO), run + ["reward.function=my_reward.py:with_metrics"])
    spec = reward_spec(cfg.reward)
    assert spec == {"function": f"{fns}:with_metrics", "on_error": "raise", "penalty": 0.0}
    assert Path(spec["function"].rsplit(":", 1)[0]).is_absolute()
    _, cfg = prepare(str(PPO), run + ["reward.function=my_reward.py", "reward.on_error=penalty",
                                      "reward.penalty=-1"])  # fmt: skip
    assert reward_spec(cfg.reward)["function"] == f"{fns}:compute_score"
    cases = [
        ("reward.function=nope.py:fn", r"nope.py does not exist \(relative paths are from"),
        ("reward.function=my_reward.py:missing", r"defines no function 'missing'"),
        ("reward.function=bogus", r"neither auto, a built-in \(math, exact, reasoning_gym\)"),
        ("reward.on_error=ignore", r"reward.on_error must be raise or penalty"),
        ("reward.penalty=nan", r"reward.penalty must be a finite number"),
    ]
    for override, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            prepare(str(GRPO), run + [override])
    (tmp_path / "broken.py").write_text("import not_a_module_here\n")
    with pytest.raises(ConfigError, match=r"importing broken.py raised ModuleNotFoundError"):
        prepare(str(GRPO), run + ["reward.function=broken.py:fn"])
    with pytest.raises(ConfigError, match=r"with reward_service.url: the service scores with "):
        prepare(str(GRPO), run + ["reward.function=math", "reward_service.url=http://x:1"])
    _, cfg = prepare(str(GRPO), run)
    assert reward_spec(cfg.reward, {"reasoning_gym/chain_sum", "openai/gsm8k"})["function"] == (
        "auto"
    )
    with pytest.raises(ConfigError, match=r"no built-in reward for data_source 'mine': set "
                                          r"reward.function"):  # fmt: skip
        reward_spec(cfg.reward, {"mine", "openai/gsm8k"})
    check_reward(cfg.reward)  # the default passes
    assert math.isfinite(cfg.reward.penalty)
