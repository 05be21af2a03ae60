"""Built-in reward pipelines: stage functions run inside the service's worker processes.

A stage function takes ``(payload, carry)`` -- the request's payload and what earlier stages
passed on -- and returns a dict ``{"ok": bool, "reward": float | None, "carry": dict,
"detail": str}``. ``ok = False`` stops the request there: the service gives it the pipeline's
penalty reward and skips the later stages. The last stage sets ``reward``.

- ``code``: ``check`` (the generated program and its tests parse: :func:`ast.parse`), then
  ``execute`` (run against the test cases in :mod:`.sandbox`; reward = share of tests passed;
  a program that raises at top level, is killed by a limit or times out fails the stage).
  Payload: ``{"code": str, "tests": [str, ...]}`` (each test a snippet, e.g. ``"assert
  f(2) == 4"``); optional ``"limits"`` overrides of :class:`~.sandbox.Limits` fields up to the
  service's own limits.
- ``math``: ``extract`` (the final answer from the response with math-verify's parser), then
  ``verify`` (math-verify's equivalence check against the reference; reward 1.0 or 0.0).
  Payload: ``{"response": str, "answer": str}``.
"""

from __future__ import annotations

import ast
from dataclasses import asdict

from .sandbox import Limits, run_tests


def code_check(payload: dict, carry: dict, options: dict) -> dict:
    code, tests = payload.get("code"), payload.get("tests")
    if not isinstance(code, str) or not isinstance(tests, list) or not tests:
        return _fail("payload needs 'code' (str) and 'tests' (non-empty list of str)")
    try:
        ast.parse(code)
        for t in tests:
            ast.parse(str(t))
    except SyntaxError as e:
        return _fail(f"SyntaxError: {e.msg} (line {e.lineno})")
    return {"ok": True, "reward": None, "carry": {}, "detail": "syntax ok"}


def code_execute(payload: dict, carry: dict, options: dict) -> dict:
    base = Limits(**options.get("sandbox", {}))
    asked = payload.get("limits") or {}
    # a request may tighten the service's limits, never loosen them
    limits = Limits(**{k: min(v, asked.get(k, v)) for k, v in asdict(base).items()})
    res = run_tests(payload["code"], [str(t) for t in payload["tests"]], limits)
    if res.status != "ok":
        return _fail(f"{res.status}: {res.detail}")
    return {
        "ok": True,
        "reward": res.passed / max(res.total, 1),
        "carry": {},
        "detail": f"{res.passed}/{res.total} tests passed"
        + (f"; {res.detail}" if res.detail else ""),
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
