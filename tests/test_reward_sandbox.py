"""The code sandbox on its own: the verdict is decided outside it (forgery, the always-equal
object), it agrees with plain Python for honest programs, and its limits hold."""

from __future__ import annotations

import math

import pytest
from m2flow.reward_service.pipelines import clamp_reward
from m2flow.reward_service.sandbox import Limits, isolation, run_tests
from m2flow.reward_service.verdict import plan

LIMITS = Limits(wall_s=4.0, cpu_s=2, memory_bytes=256 * 2**20)
TESTS = ["assert f(2) == 4", "assert f(3) == 9", "assert False"]
FORGED = '{"module_error": null, "passed": 1000, "errors": []}'

# Each tries to make the tests above pass without computing f. None may score above 0.
FORGERIES = {
    "stdout": f"import os, sys\nsys.__stdout__.write({FORGED!r})\nsys.__stdout__.flush()\n"
    "os._exit(0)\n",
    "os-write-1": f"import os\nos.write(1, {FORGED!r}.encode())\nos._exit(0)\n",
    "every-fd": "import os\nfor fd in range(256):\n    try:\n"
    f"        os.write(fd, {FORGED!r}.encode())\n    except OSError:\n        pass\nos._exit(0)\n",
    "print-then-exit": "import os\nprint('3/3 tests passed', flush=True)\nos._exit(0)\n",
    # the value pipe is fd 3: claim values for every check, without knowing the constants
    "forge-value-pipe": "import os, json\nos.write(3, json.dumps({'v': [True, True]}).encode())\n"
    "os._exit(0)\n",
    # a runner that called exec/eval from builtins would now run nothing / return 1000
    "patch-builtins": "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
    "builtins.eval = lambda *a, **k: 1000\ndef f(x):\n    return 0\n",
    "replace-assertion-error": "import builtins\nclass E(BaseException):\n    pass\n"
    "builtins.AssertionError = E\ndef f(x):\n    return 0\n",
    "always-equal": "class A:\n    def __eq__(self, o):\n        return True\n"
    "    def __bool__(self):\n        return True\ndef f(x):\n    return A()\n",
    "int-subclass-eq": "class I(int):\n    def __eq__(self, o):\n        return True\n"
    "    __hash__ = int.__hash__\ndef f(x):\n    return I(0)\n",
    # look for the expected values anywhere in the process (they are never sent)
    "search-memory": "import gc, os, json\nfound = [s for s in gc.get_objects() if isinstance(s,"
    " str) and '== 4' in s]\nos.write(3, json.dumps({'v': [len(found), len(found)]}).encode())\n"
    "os._exit(0)\n",
    "kill-harness": "import os, signal\nfor p in (1, os.getppid()):\n    try:\n"
    "        os.kill(p, signal.SIGKILL)\n    except OSError:\n        pass\n"
    "def f(x):\n    return 0\n",
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_forged_verdict_is_worth_nothing(name):
    res = run_tests(FORGERIES[name], TESTS, LIMITS)
    assert res.passed == 0, (name, res)
    assert res.sealed == 2  # f(2) == 4 and f(3) == 9: the constants never enter the sandbox
    honest = run_tests("def f(x):\n    return x * x\n", TESTS, LIMITS)
    assert (honest.status, honest.passed, honest.total) == ("ok", 2, 3)


# (program, test, passes in plain Python): the split verdict must agree with Python.
SEMANTICS = [
    ("def f(x): return (x, x)", "assert f(1) == (1, 1)", True),
    ("def f(x): return [x, x]", "assert f(1) == (1, 1)", False),  # list != tuple
    ("def f(x): return 1.0", "assert f(0) == 1", True),
    ("def f(x): return {'a': {1, 2}}", "assert f(0) == {'a': {2, 1}}", True),
    ("def f(x): return b'ab'", "assert f(0) != b'ab'", False),
    ("def f(x): return None", "assert f(0) is None", True),
    ("def f(x): return 3", "assert 1 < f(0) <= 3", True),
    ("def f(x): return 3", "assert 1 < f(0) < 3", False),
    ("def f(x): return 2", "assert not f(0) == 3", True),
    ("def f(x): return None", "assert f(0) is not None and f(0).y == 1", False),
    ("def f(x): return 0", "assert f(0) == 0 or 1 / f(0)", True),  # short-circuit
    ("def f(x): return 0", "assert 1 / f(0)", False),  # ZeroDivisionError
    ("def f(x): return 'x'", "assert f(0) < 1", False),  # TypeError
    ("def f(x): return [3, 1]", "y = sorted(f(0))\nassert y == [1, 3]", True),
    ("def f(x): return 5", "assert f(0) == 5\nassert f(1) == 6", False),
    ("def f(x): return 2**100", "assert f(0) == 1267650600228229401496703205376", True),
    ("def f(x): return float('nan')", "assert f(0) == f(0)", False),
    ("def f(x): return 3 + 4j", "assert abs(f(0)) == 5.0", True),
    ("import enum\nclass C(enum.IntEnum):\n    A = 1\ndef f(x): return C.A", "assert f(0) == 1",
     True),
    ("def f(x): return x", "if f(1) != 1:\n    raise ValueError", True),  # unsealed: ran
    ("def f(x): return x", "if f(1) != 2:\n    raise ValueError", False),
]  # fmt: skip


@pytest.mark.parametrize("code, test, expected", SEMANTICS)
def test_the_split_verdict_agrees_with_python(code, test, expected):
    env: dict = {}
    try:
        exec(code, env)
        exec(test, env)
        python = True
    except Exception:
        python = False
    assert python == expected  # the table itself is right
    res = run_tests(code, [test], LIMITS)
    assert res.status == "ok" and res.passed == int(expected), res


def test_unsealed_tests_are_counted_and_a_forged_run_passes_them():
    # the documented residual: a snippet without a top-level assert only reports that it ran
    p = plan("check(f)")
    assert not p.sealed and p.steps == [["exec", "check(f)"]]
    forged = "import os\nos.write(3, b'{\"v\": []}')\nos._exit(0)\n"
    res = run_tests(forged, ["check(f)", "assert f(1) == 2"], LIMITS)
    assert (res.passed, res.sealed) == (1, 1)


def test_limits_are_validated_and_hold():
    for bad in (-1, 0, float("nan"), float("inf"), True, "abc", 1e30):
        with pytest.raises(ValueError, match="memory_bytes"):
            Limits(memory_bytes=bad)
    with pytest.raises(ValueError, match="integer"):
        Limits(cpu_s=1.5)
    alloc = "x = bytearray(200 * 2**20)\ndef f(x):\n    return x * x\n"
    assert run_tests(alloc, TESTS[:1], LIMITS).passed == 1
    tight = Limits(wall_s=4.0, cpu_s=2, memory_bytes=64 * 2**20)
    res = run_tests(alloc, TESTS[:1], tight)
    assert res.status == "module_error" and "MemoryError" in res.detail


def test_a_flood_of_values_is_cut_at_the_output_limit():
    flood = "import os\ndef f(x):\n    while True:\n        os.write(3, b'[' * 65536)\n"
    res = run_tests(flood, TESTS[:2], LIMITS)
    assert res.passed == 0 and "output limit" in res.detail
    big = "def f(x):\n    return 'x' * (1 << 20)\n"
    res = run_tests(big, ["assert f(0) == 'x'"], LIMITS)
    assert res.passed == 0 and "over" in res.detail


def test_rewards_are_clamped_to_the_documented_range():
    assert clamp_reward("code", 1000) == 1.0 and clamp_reward("code", -3) == 0.0
    assert clamp_reward("code", 0.25) == 0.25
    assert clamp_reward("math", float("nan")) == 0.0 and clamp_reward("math", "x") == 0.0
    assert clamp_reward("math", math.inf) == 1.0


@pytest.mark.skipif(isolation() != "namespaces", reason="needs PID namespaces (unshare)")
def test_a_run_sees_only_its_own_processes():
    code = (
        "import os\ndef f(x):\n    return sorted(p for p in os.listdir('/proc') if p.isdigit())\n"
    )
    # the harness (PID 1) and the test's child: nothing else is visible
    res = run_tests(code, ["assert len(f(0)) == 2 and f(0)[0] == '1'"], LIMITS)
    assert res.passed == 1, res


@pytest.mark.skipif(isolation() != "namespaces", reason="needs mount namespaces (unshare)")
def test_host_files_do_not_exist_in_the_sandbox():
    # e.g. a world-readable service config: read, it would leak every tenant's token
    import os
    import shutil
    import tempfile

    d = tempfile.mkdtemp()
    try:
        os.chmod(d, 0o755)
        path = os.path.join(d, "service.yaml")
        with open(path, "w") as f:
            f.write("token: secret-token")
        os.chmod(path, 0o644)
        code = f"def f(x):\n    return open({path!r}).read()\n"
        res = run_tests(code, ["assert f(0) == 'token: secret-token'"], LIMITS)
        assert res.passed == 0 and "FileNotFoundError" in res.detail, res
        allowed = {"bin", "dev", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "scratch"}
        allowed |= {"tmp", "usr"}
        listing = "import os\ndef f(x):\n    return set(os.listdir('/'))\n"
        res = run_tests(listing, [f"assert f(0) <= {allowed!r}", "assert 'usr' in f(0)"], LIMITS)
        assert res.passed == 2, res
    finally:
        shutil.rmtree(d)
