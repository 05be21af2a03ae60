"""Your own reward (``reward.*``): functions from files with veRL's signature, the built-ins on
real strings, failures that stop the run or cost the penalty (counted), config-time checks.
A file function runs in a child process: one that hangs, dies, exits, returns a huge reward
or prints megabytes is named, killed, bounded or capped; a file that exits, dies or blocks at
import is one line before anything starts (through the real CLI too).

Real parts only: reward functions written to tmp files and imported in real child processes,
math-verify, reasoning-gym's scorer. No Ray."""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
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
from test_cli import assert_one_line_exit_2, m2flow

from m2flow.core.config import ConfigError
from m2flow.run.workflow import prepare

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
    assert spec == {
        "function": f"{fns}:with_metrics", "on_error": "raise", "penalty": 0.0,
        "timeout_s": 60.0, "import_timeout_s": 60.0, "max_abs": 1e6,
    }  # fmt: skip
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
        ("reward.timeout_s=0", r"reward.timeout_s must be a finite number > 0"),
        ("reward.import_timeout_s=inf", r"reward.import_timeout_s must be a finite number > 0"),
        ("reward.max_abs=nan", r"reward.max_abs must be a finite number > 0"),
        ("reward.penalty=-1e7", r"reward.penalty=-1e\+07 is beyond reward.max_abs=1e\+06"),
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


# Functions that misbehave in every way a process can: hang, sleep, die, exit, print megabytes.
# Each returns the pid of the process that scored it as a metric (a new one after a kill).
MISBEHAVING = """
import ctypes
import os
import sys
import time


def _ok():
    return {"score": 0.5, "pid": os.getpid()}


def hang(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str == "slow":
        time.sleep(1.5)
    if solution_str == "nap":
        time.sleep(0.4)
    return _ok()


def die(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "sysexit":
        sys.exit(0)
    if solution_str == "segv":
        ctypes.string_at(0)
    if solution_str == "interrupt":
        raise KeyboardInterrupt
    return _ok()


def huge(data_source, solution_str, ground_truth, extra_info):
    return {"big": 1e308, "edge": 1e6, "neg": -2e6}.get(solution_str, 0.5)


def loud(data_source, solution_str, ground_truth, extra_info):
    print(f"[call {ground_truth}]" + "x" * 1_000_000)
    os.write(2, b"fd-level " * 100_000)  # under Python's sys.stderr: caught all the same
    return 1.0
"""


@pytest.fixture
def bad(tmp_path) -> Path:
    path = tmp_path / "misbehaving.py"
    path.write_text(MISBEHAVING)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_hanging_function_is_killed_named_and_replaced(bad, caplog):
    """A call past reward.timeout_s: its process is killed and the sample is an error naming
    the function, the sample's index and data_source, "timed out after N s"; while it waits,
    a note says so; with on_error=penalty the sample gets the penalty (counted) and a new
    process scores the rest."""
    name = f"{bad}:hang"
    batch = [entry("1", 5, "ok/src"), entry("1", 6, "hang/src"), entry("1", 7, "ok/src")]
    fn = RewardFunction(name, timeout_s=2, note_every_s=0.5)
    with caplog.at_level(logging.WARNING, logger="m2flow.workers.scoring.isolated"):
        with pytest.raises(RewardFunctionError) as err:
            fn(["a", "hang", "b"], batch)
    msg = str(err.value)
    assert f"reward function '{name}' failed on sample index 6 (data_source 'hang/src'): " in msg
    assert "timed out after 2 s" in msg, msg
    notes = [r.getMessage() for r in caplog.records]
    assert any(f"'{name}' is slow: " in n and "this chunk: 1 of 3 samples scored in" in n
               for n in notes), notes  # fmt: skip

    fn = RewardFunction(name, on_error="penalty", penalty=-1.0, timeout_s=2)
    res = fn(["a", "hang", "b"], batch)
    assert res.scores == [0.5, -1.0, 0.5] and res.errors == 1
    first, second = res.metrics["pid"]
    assert first != second and not _alive(int(first))  # killed; a new process took the rest
    assert fn(["c"], batch[:1]).metrics["pid"] == [second]  # which stays for the next call
    fn.close()
    assert not _alive(int(second))


def test_slow_function_says_so_and_finishes(bad, caplog):
    """A slow call within reward.timeout_s is scored; the wait is said on the way, also when
    it is spread over calls shorter than the note's period."""
    fn = RewardFunction(f"{bad}:hang", timeout_s=60, note_every_s=0.5)
    with caplog.at_level(logging.WARNING, logger="m2flow.workers.scoring.isolated"):
        res = fn(["slow", "a"], [entry("1", 0), entry("1", 1)])
    assert res.scores == [0.5, 0.5] and res.errors == 0
    notes = [r.getMessage() for r in caplog.records]
    assert any("is slow: " in n and "this chunk: 0 of 2 samples scored in" in n for n in notes)
    fn = RewardFunction(f"{bad}:hang", timeout_s=60, note_every_s=1.0)
    fn(["a"], [entry("1", 0)])  # the process starts: not counted below
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="m2flow.workers.scoring.isolated"):
        for _ in range(3):  # 3 x 0.4 s of scoring, each call shorter than 1 s
            assert fn(["nap"], [entry("1", 0)]).scores == [0.5]
    note = r"is slow: \d+ s spent scoring since (its start|the last such note); this chunk: 0 of 1"
    assert any(re.search(note, r.getMessage()) for r in caplog.records)


@pytest.mark.parametrize(
    "response,why",
    [
        ("exit", r"its process exited with code 3$"),
        ("segv", r"its process exited with code -11 \(SIGSEGV\)$"),
        ("sysexit", r"SystemExit: 0 \(sys.exit was called\)$"),
        ("interrupt", r"\): KeyboardInterrupt$"),
    ],
)
def test_dying_or_exiting_function_is_a_named_error(bad, response, why):
    """os._exit, a segfault, sys.exit and KeyboardInterrupt in a call: an error naming the
    function (never the worker's death, a hang or a silent 0); with penalty, counted, and the
    other samples scored."""
    name = f"{bad}:die"
    batch = [entry("1", 1, "s"), entry("1", 2, "bad/src"), entry("1", 3, "s")]
    with pytest.raises(RewardFunctionError) as err:
        RewardFunction(name, timeout_s=60)(["a", response, "b"], batch)
    msg = str(err.value).removesuffix(
        " (reward.on_error=penalty scores such samples reward.penalty instead)"
    )
    assert msg.startswith(f"reward function '{name}' failed on sample index 2 (data_source "
                          "'bad/src'): "), msg  # fmt: skip
    assert re.search(why, msg), msg
    res = RewardFunction(name, on_error="penalty", penalty=-1.0)(["a", response, "b"], batch)
    assert res.scores == [0.5, -1.0, 0.5] and res.errors == 1


def test_reward_beyond_max_abs_is_an_error(bad):
    """A finite reward beyond reward.max_abs (1e308 would make every weight NaN) is an error
    like NaN; max_abs itself passes; with penalty it is counted."""
    name = f"{bad}:huge"
    fn = RewardFunction(name)
    assert fn(["edge", "a"], [entry("1", 0), entry("1", 1)]).scores == [1e6, 0.5]
    for response, shown in [("big", "1e+308"), ("neg", "-2e+06")]:
        with pytest.raises(RewardFunctionError) as err:
            fn(["a", response], [entry("1", 0), entry("1", 9, "x")])
        assert (
            f"reward function '{name}' failed on sample index 9 (data_source 'x'): returned "
            f"{shown}, beyond reward.max_abs=1e+06"
        ) in str(err.value)
    fn = RewardFunction(name, on_error="penalty", max_abs=10)
    res = fn(["big", "edge", "a"], [entry("1", i) for i in range(3)])
    assert res.scores == [0.0, 0.0, 0.5] and res.errors == 2


def test_function_output_is_captured_and_capped(bad):
    """20 calls printing 2 MB each (Python's stdout and a raw write to fd 2) forward the first
    4 KiB of each call, 64 KiB in all per process, to the process's stderr; "output
    truncated" is said once; nothing reaches its stdout."""
    script = (
        "from m2flow.workers.scoring.functions import RewardFunction\n"
        f"fn = RewardFunction({f'{bad}:loud'!r})\n"
        "entries = [{'data_source': 's', 'ground_truth': i, 'index': i} for i in range(20)]\n"
        "print(fn(['x'] * 20, entries).scores == [1.0] * 20)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == b"True\n"
    err = proc.stderr
    assert 16 * 4096 <= len(err) <= 64 * 1024 + 1024, len(err)
    assert err.count(b"output truncated") == 1
    assert b"[call 0]" in err and b"[call 15]" in err and b"[call 16]" not in err


@pytest.mark.parametrize(
    "source,extra,needle",
    [
        ("import sys\nsys.exit(0)\n", [], "importing bad.py raised SystemExit: 0 (sys.exit was"),
        ("import os\nos._exit(3)\n", [], "importing bad.py ended its process (exited with code 3)"),
        ("raise KeyboardInterrupt\n", [], "importing bad.py raised KeyboardInterrupt"),
        ("import time\ntime.sleep(3600)\n", ["reward.import_timeout_s=1"],
         "importing bad.py did not finish within 1 s"),
    ],
)  # fmt: skip
def test_reward_file_that_exits_dies_or_blocks_at_import(
    tmp_path, monkeypatch, source, extra, needle
):
    """Config time imports the file in a child process, bounded: an exit, a death, an
    interrupt or a block is one ConfigError naming the file; this process lives on."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_text(source)
    run = [f"trainer.run_dir={tmp_path / 'run'}", "reward.function=bad.py:fn", *extra]
    with pytest.raises(ConfigError) as err:
        prepare(str(GRPO), run)
    assert str(err.value).startswith("reward.function='bad.py:fn': " + needle), str(err.value)


@pytest.mark.parametrize(
    "source,extra,needle",
    [
        ("import sys\nsys.exit(0)\n", [], "raised SystemExit: 0"),
        ("import time\ntime.sleep(3600)\n", ["reward.import_timeout_s=2"],
         "did not finish within 2 s"),
    ],
)  # fmt: skip
def test_cli_reward_file_exiting_or_blocking_at_import_exit_2(tmp_path, source, extra, needle):
    """Through the real CLI: ``sys.exit(0)`` at import was a silent exit code 0; a block, a
    hang. Now: exit code 2, one line on stderr, before Ray."""
    (tmp_path / "bad.py").write_text(source)
    code, out, _ = m2flow(
        "run", str(GRPO), f"reward.function={tmp_path / 'bad.py'}:fn",
        f"trainer.run_dir={tmp_path / 'r'}", *extra,
    )  # fmt: skip
    assert_one_line_exit_2(code, out, needle)
    assert len(out.strip().splitlines()) == 1, out
