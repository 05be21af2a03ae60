"""Built-in reward pipelines: stage functions run inside the service's worker processes.

A stage function takes ``(payload, carry, options)`` -- the request's payload, what earlier
stages passed on, and the stage's configured options -- and returns a dict ``{"ok": bool,
"reward": float | None, "carry": dict, "detail": str}``. ``ok = False`` stops the request
there: the service gives it the pipeline's penalty reward and skips the later stages. The
last stage sets ``reward``, which the service clamps to :data:`REWARD_RANGE` of the kind.

- ``code``: ``check`` (the generated program and its tests are within the size limits and
  parse: :func:`ast.parse`, in a worker whose address space is limited), then ``execute``
  (run against the test cases in :mod:`.sandbox`; reward = share of tests passed, in [0, 1];
  a program that raises at top level, is killed by a limit or times out fails the stage).
  Payload: ``{"code": str, "tests": [str, ...]}`` (each test a snippet, e.g. ``"assert
  f(2) == 4"``); optional ``"limits"``: tighter values of :class:`~.sandbox.Limits` fields
  (checked when the request is submitted: :func:`validate_payload`). Check-stage options:
  ``max_source_bytes`` (code, and all tests together; default 256 KiB), ``max_tests``
  (default 256). Execute-stage options: ``sandbox`` (the service's :class:`~.sandbox.Limits`).
- ``tool``: ``run`` (one tool call of the tool API, ``POST /v1/tools/run``, not a reward:
  :mod:`.tools`). Payload: ``{"tool": "python", "arguments": {"code": str}, "timeout_s":
  float}`` (validated by the service before it is queued). ``python`` runs the code as a
  script in a sandbox of :mod:`.sandbox` (:func:`~.sandbox.run_code`, ``timeout_s`` its
  wall-clock limit, the CPU limit no more than that, rounded up) and answers ``{"ok",
  "status", "output", "error", "truncated", "seconds"}``. Options: ``sandbox`` (the
  service's :class:`~.sandbox.Limits`), ``max_output_bytes`` (of stdout and stderr kept;
  default 4 KiB), ``max_source_bytes`` (default 256 KiB).
- ``math``: ``extract`` (the final answer from the response with math-verify's parser), then
  ``verify`` (math-verify's equivalence check against the reference; reward 1.0 or 0.0).
  Payload: ``{"response": str, "answer": str}``.
"""

from __future__ import annotations

import ast
import math
from dataclasses import asdict, replace

from .sandbox import Limits, check_limit, run_code, run_tests

#: documented reward range of each pipeline kind (the penalty is configured separately)
REWARD_RANGE = {"code": (0.0, 1.0), "math": (0.0, 1.0)}
MAX_SOURCE_BYTES = 256 * 2**10
MAX_TESTS = 256
#: most bytes of a tool run's output (stdout and stderr) sent back
MAX_OUTPUT_BYTES = 4 * 2**10


def clamp_reward(kind: str, reward) -> float:
    """``reward`` clamped to the kind's :data:`REWARD_RANGE`; a non-number or NaN gives the
    range's low end (never more than the pipeline can legitimately give)."""
    lo, hi = REWARD_RANGE[kind]
    try:
        r = float(reward)
    except (TypeError, ValueError):
        return lo
    return lo if math.isnan(r) else min(max(r, lo), hi)


def validate_payload(kind: str, payload: dict, stage_options: dict) -> None:
    """Checks done when a request is submitted, for what a *trainer* sets (a policy's output
    is judged by the stages instead, and a bad one costs the penalty).

    ``code``: ``limits`` must be a dict of known :class:`~.sandbox.Limits` fields, each a
    positive finite number no larger than the service's own limit (a request may only
    tighten). ``stage_options``: stage name -> options.

    Raises:
        ValueError: the problem, naming the field and the allowed range.
    """
    if kind != "code" or "limits" not in payload:
        return
    asked = payload["limits"]
    if not isinstance(asked, dict):
        raise ValueError(f"payload 'limits' must be an object, got {type(asked).__name__}")
    base = asdict(Limits(**stage_options.get("execute", {}).get("sandbox", {})))
    for name, value in asked.items():
        check_limit(name, value)
        if value > base[name]:
            raise ValueError(
                f"sandbox limit {name}={value!r} is above the service's {base[name]!r}: "
                "a request may only tighten the limits"
            )


#: the options each stage takes (anything else in a stage's ``options`` is a config error)
STAGE_OPTIONS = {
    ("code", "check"): {"max_source_bytes", "max_tests"},
    ("code", "execute"): {"sandbox"},
    ("tool", "run"): {"sandbox", "max_output_bytes", "max_source_bytes"},
}


def check_options(kind: str, stage: str, options: dict) -> None:
    """Validate a stage's configured options at start-up.

    Raises:
        ValueError: an unknown option or sandbox limit, or a bad value, naming it.
    """
    known = STAGE_OPTIONS.get((kind, stage), set())
    for name in options:
        if name not in known:
            raise ValueError(
                f"{kind}.{stage} has no option {name!r}: known {sorted(known) or 'none'}"
            )
    if "sandbox" in options:
        sandbox = options["sandbox"]
        if not isinstance(sandbox, dict):
            raise ValueError(f"{kind}.{stage} option sandbox must be a mapping of limits")
        for name, value in sandbox.items():
            check_limit(name, value)
        Limits(**sandbox)
    for name in sorted(known & {"max_source_bytes", "max_tests", "max_output_bytes"}):
        v = options.get(name, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{kind}.{stage} option {name} must be an integer >= 1, got {v!r}")


def code_check(payload: dict, carry: dict, options: dict) -> dict:
    code, tests = payload.get("code"), payload.get("tests")
    if not isinstance(code, str) or not isinstance(tests, list) or not tests:
        return _fail("payload needs 'code' (str) and 'tests' (non-empty list of str)")
    tests = [str(t) for t in tests]
    max_bytes = options.get("max_source_bytes", MAX_SOURCE_BYTES)
    max_tests = options.get("max_tests", MAX_TESTS)
    # sizes first: parsing costs ~600x the source in memory
    if len(code.encode()) > max_bytes:
        return _fail(f"code is {len(code.encode())} bytes, over the limit of {max_bytes}")
    if len(tests) > max_tests:
        return _fail(f"{len(tests)} tests, over the limit of {max_tests}")
    size = sum(len(t.encode()) for t in tests)
    if size > max_bytes:
        return _fail(f"tests are {size} bytes together, over the limit of {max_bytes}")
    try:
        ast.parse(code)
        for t in tests:
            ast.parse(t)
    except SyntaxError as e:
        return _fail(f"SyntaxError: {e.msg} (line {e.lineno})")
    except (MemoryError, RecursionError) as e:
        return _fail(f"{type(e).__name__} while parsing: the source is too large or deep")
    return {"ok": True, "reward": None, "carry": {}, "detail": "syntax ok"}


def code_execute(payload: dict, carry: dict, options: dict) -> dict:
    base = Limits(**options.get("sandbox", {}))
    asked = payload.get("limits") or {}
    # validated at submit (validate_payload): known fields, positive, at most the base
    limits = Limits(**{k: min(v, asked.get(k, v)) for k, v in asdict(base).items()})
    res = run_tests(
        payload["code"], [str(t) for t in payload["tests"]], limits, options.get("scratch_dir")
    )
    if res.status != "ok":
        return _fail(f"{res.status}: {res.detail}")
    return {
        "ok": True,
        "reward": res.passed / max(res.total, 1),
        "carry": {},
        "detail": f"{res.passed}/{res.total} tests passed"
        + (f" ({res.total - res.sealed} unsealed)" if res.sealed < res.total else "")
        + (f"; {res.detail}" if res.detail else ""),
    }


def tool_run(payload: dict, carry: dict, options: dict) -> dict:
    base = Limits(**options.get("sandbox", {}))
    wall = min(float(payload.get("timeout_s") or base.wall_s), base.wall_s)
    limits = replace(base, wall_s=wall, cpu_s=min(base.cpu_s, max(1, math.ceil(wall))))
    res = run_code(
        payload["arguments"]["code"],
        limits,
        options.get("scratch_dir"),
        options.get("max_output_bytes", MAX_OUTPUT_BYTES),
    )
    return {
        "ok": res.status == "ok",
        "status": res.status,
        "output": res.output,
        "error": res.error,
        "truncated": res.truncated,
        "seconds": res.seconds,
    }


def math_extract(payload: dict, carry: dict, options: dict) -> dict:
    from math_verify import parse

    response, answer = payload.get("response"), payload.get("answer")
    if not isinstance(response, str) or answer is None:
        return _fail("payload needs 'response' (str) and 'answer'")
    parsed = parse(response)
    if not parsed:
        return _fail("no answer found in the response")
    return {"ok": True, "reward": None, "carry": {"extracted": str(parsed[-1])}, "detail": ""}


def math_verify(payload: dict, carry: dict, options: dict) -> dict:
    from math_verify import parse, verify

    gold = parse(_as_math(str(payload["answer"])))
    pred = parse(_as_math(carry["extracted"]))
    ok = bool(gold) and bool(pred) and verify(gold, pred)
    return {"ok": True, "reward": 1.0 if ok else 0.0, "carry": {}, "detail": carry["extracted"]}


def _as_math(text: str) -> str:
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def _fail(detail: str) -> dict:
    return {"ok": False, "reward": None, "carry": {}, "detail": detail}


#: pipeline kind -> ordered (stage name, function)
PIPELINES = {
    "code": [("check", code_check), ("execute", code_execute)],
    "math": [("extract", math_extract), ("verify", math_verify)],
    "tool": [("run", tool_run)],
}


def stage_function(kind: str, stage: str):
    """The function of stage ``stage`` of pipeline kind ``kind``.

    Raises:
        KeyError: unknown kind or stage (names the known ones).
    """
    if kind not in PIPELINES:
        raise KeyError(f"unknown pipeline kind {kind!r}: known {sorted(PIPELINES)}")
    for name, fn in PIPELINES[kind]:
        if name == stage:
            return fn
    raise KeyError(f"pipeline {kind!r} has no stage {stage!r}: {[n for n, _ in PIPELINES[kind]]}")
