"""Trusted verdicts of the code pipeline: what a sandbox evaluates, and pass/fail outside it.

The execute stage of DistRS's code reward (section 2.2, Figure 4(b): generated code is run against
test cases) must not take the program's word for its score. So a test never runs as a whole in the
sandbox. :func:`plan` splits a test snippet into *steps*: its top-level statements run in the
sandbox, but each top-level ``assert E`` becomes a *check*: the sandbox evaluates only the
sub-expressions of ``E`` that depend on the program (its *leaves*, e.g. ``f(2)``) and sends back
their values as plain data (tagged JSON, :mod:`.harness`); the constants they are compared with, the
comparison operators, ``not``/``and``/``or`` and the verdict stay here (:func:`decide`). Values are
decoded to built-in types only, so the "always equal" object (``__eq__`` returning True) and its kin
never pass: an object of another type decodes to a marker that equals nothing and is false; a
subclass of a built-in type was sent as its built-in value.

What that guarantees: whatever the program does -- forging the value pipe included -- a check
passes only if the values reported for its leaves satisfy it, and the sandbox never holds the
constants. A forged report is thus worth exactly what an honest program returning those
values would get. A test is *sealed* (:attr:`TestPlan.sealed`) when one of its checks has a
leaf compared with ``==`` to a constant: passing it needs that exact value. A snippet with no
top-level ``assert`` (e.g. ``check(f)``) can only report that it ran to the end: its pass is
self-reported and forgeable; so are asserts nested in ``if``/``for``/functions.
"""

from __future__ import annotations

import ast
import base64
import binascii
import json
import operator
from dataclasses import dataclass, field

_OPS = {
    "Eq": operator.eq,
    "NotEq": operator.ne,
    "Lt": operator.lt,
    "LtE": operator.le,
    "Gt": operator.gt,
    "GtE": operator.ge,
    "In": lambda a, b: a in b,
    "NotIn": lambda a, b: a not in b,
    "Is": operator.is_,
    "IsNot": operator.is_not,
}


@dataclass
class TestPlan:
    """One test, split.

    Attributes:
        steps: what the sandbox runs, in order: ``["exec", source]`` or ``["check",
            [leaf source, ...]]`` (JSON-ready).
        checks: per check, its verdict tree over leaf indices (into that check's leaves) and
            constants: ``("leaf", i)``, ``("const", value)``, ``("not", t)``, ``("and" |
            "or", [t, ...])``, ``("cmp", [t, ...], [op name, ...])``.
        sealed: passing needs a leaf to equal a constant the sandbox never sees.
    """

    steps: list = field(default_factory=list)
    checks: list = field(default_factory=list)
    sealed: bool = False


def plan(test: str) -> TestPlan:
    """Split a test snippet (e.g. ``"assert f(2) == 4"``) into sandbox steps and checks.

    Raises:
        SyntaxError: the snippet does not parse.
    """
    p = TestPlan()
    for stmt in ast.parse(test).body:
        if isinstance(stmt, ast.Assert):
            leaves: list[str] = []
            tree = _split(stmt.test, leaves)
            p.steps.append(["check", leaves])
            p.checks.append(tree)
            p.sealed = p.sealed or _sealed(tree)
        else:
            p.steps.append(["exec", ast.unparse(stmt)])
    return p


def _const(node: ast.expr):
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _split(node: ast.expr, leaves: list[str]):
    is_const, value = _const(node)
    if is_const:
        return ("const", value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ("not", _split(node.operand, leaves))
    if isinstance(node, ast.BoolOp):
        kind = "and" if isinstance(node.op, ast.And) else "or"
        return (kind, [_split(v, leaves) for v in node.values])
    if isinstance(node, ast.Compare):
        operands = [_operand(x, leaves) for x in [node.left, *node.comparators]]
        return ("cmp", operands, [type(op).__name__ for op in node.ops])
    return _operand(node, leaves)


def _operand(node: ast.expr, leaves: list[str]):
    is_const, value = _const(node)
    if is_const:
        return ("const", value)
    leaves.append(ast.unparse(node))
    return ("leaf", len(leaves) - 1)


def _sealed(tree) -> bool:
    kind = tree[0]
    if kind == "and":
        return any(_sealed(t) for t in tree[1])
    if kind == "or":
        return all(_sealed(t) for t in tree[1])
    if kind == "cmp":
        ts, ops = tree[1], tree[2]
        return any(
            op == "Eq" and {a[0], b[0]} == {"leaf", "const"} for a, b, op in zip(ts, ts[1:], ops)
        )
    return False


class Opaque:
    """A value of a type other than the built-in data types: equals nothing, is false."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<{self.type_name} object>"


class _LeafError:
    def __init__(self, message: str) -> None:
        self.message = message


class TestFailed(Exception):
    """The test did not pass; the message says why."""


def _tagged(obj: dict):
    if obj.keys() <= {"v", "e", "m"}:
        return obj  # the report itself (values are tagged with other letters)
    if len(obj) != 1:
        raise ValueError("malformed value")
    ((tag, v),) = obj.items()
    if tag == "t":
        return tuple(v)
    if tag == "d":
        return {k: x for k, x in v}
    if tag == "s":
        return set(v)
    if tag == "f":
        return frozenset(v)
    if tag == "b":
        return bytes.fromhex(v)
    if tag == "c":
        return complex(v[0], v[1])
    if tag == "i":
        return int(v, 16)
    if tag == "o":
        return Opaque(str(v))
    if tag == "x":
        return _LeafError(str(v)[:300])
    raise ValueError(f"unknown value tag {tag!r}")


def decode(out_b64: str) -> dict:
    """The child's report from the harness's base64 text.

    Raises:
        TestFailed: not a report (garbage, truncated, or not what a child writes).
    """
    try:
        report = json.loads(base64.b64decode(out_b64, validate=True), object_hook=_tagged)
    except (ValueError, TypeError, KeyError, IndexError, RecursionError, binascii.Error) as e:
        raise TestFailed(f"unreadable result from the sandbox ({type(e).__name__})") from None
    if not isinstance(report, dict) or not isinstance(report.get("v", []), list):
        raise TestFailed("unreadable result from the sandbox")
    return report


def decide(p: TestPlan, report: dict) -> None:
    """Pass silently, or raise :class:`TestFailed` naming the failure.

    ``report`` is the child's decoded report: ``{"v": values}`` (every step ran) or ``{"e":
    error, "v": values}`` (a step raised). Each check consumes its number of leaf values, in
    order; a leaf that raised fails the check only if the verdict needs its value (Python's
    short-circuit of ``and``/``or`` and of comparison chains).
    """
    if "e" in report:
        raise TestFailed(str(report["e"])[:300])
    values = report.get("v", [])
    pos = 0
    for step, tree in zip((s for s in p.steps if s[0] == "check"), p.checks):
        n = len(step[1])
        if pos + n > len(values):
            raise TestFailed("the sandbox returned fewer values than the test has")
        got = values[pos : pos + n]
        ok = _truth(_eval(tree, got))
        pos += n
        if not ok:
            shown = ", ".join(f"{e} = {_repr(v)}" for e, v in zip(step[1], got))
            raise TestFailed(f"AssertionError: assert {_show(step, tree)}"[:200] + f" ({shown})")
    if pos != len(values):
        raise TestFailed("the sandbox returned more values than the test has")


def _eval(tree, values: list):
    kind = tree[0]
    if kind == "const":
        return tree[1]
    if kind == "leaf":
        v = values[tree[1]]
        if isinstance(v, _LeafError):
            raise TestFailed(v.message)
        return v
    if kind == "not":
        return not _truth(_eval(tree[1], values))
    if kind in ("and", "or"):
        r = None
        for t in tree[1]:
            r = _eval(t, values)
            if _truth(r) == (kind == "or"):
                return r
        return r
    operands, ops = tree[1], tree[2]
    left = _eval(operands[0], values)
    for op, node in zip(ops, operands[1:]):
        right = _eval(node, values)
        try:
            ok = _OPS[op](left, right)
        except Exception as e:  # e.g. '<' between a str and an int, as in Python
            raise TestFailed(f"{type(e).__name__}: {e}"[:300]) from None
        if not ok:
            return False
        left = right
    return True


def _repr(v) -> str:
    return v.message[:60] if isinstance(v, _LeafError) else short(v)


#: ints wider than this are shown by their width: printing them costs time, and past
#: ``sys.get_int_max_str_digits()`` digits (4300) it raises
_PRINT_BITS = 4096


def short(v, n: int = 60) -> str:
    """At most ``n`` characters showing ``v``, for messages only: never raises (an int too
    wide to print is ``<int of N bits>``, anything else that cannot be printed
    ``<list, not printable>``). A verdict never depends on it."""
    if type(v) is int and v.bit_length() > _PRINT_BITS:
        return f"<int of {v.bit_length()} bits>"
    try:
        return repr(v)[:n]
    except Exception:  # e.g. a list holding a 20,000-digit int, or nested too deep
        return f"<{type(v).__name__}, not printable>"


def _truth(v) -> bool:
    try:
        return bool(v)
    except Exception:
        return False


def _show(step, tree) -> str:
    leaves = step[1]

    def show(t) -> str:
        if t[0] == "const":
            return short(t[1], 80)
        if t[0] == "leaf":
            return leaves[t[1]][:80]
        if t[0] == "not":
            return f"not {show(t[1])}"
        if t[0] in ("and", "or"):
            return f" {t[0]} ".join(show(x) for x in t[1])
        sym = {"Eq": "==", "NotEq": "!=", "Lt": "<", "LtE": "<=", "Gt": ">", "GtE": ">="}
        parts = [show(t[1][0])]
        for op, x in zip(t[2], t[1][1:]):
            parts += [sym.get(op, op.lower()), show(x)]
        return " ".join(parts)

    return show(tree)[:200]
