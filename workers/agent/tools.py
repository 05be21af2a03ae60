"""Tools from Python functions, and the environment that runs them for an agent episode.

A :class:`Tool` is a function plus its JSON schema (OpenAI's function format, what chat
templates' ``tools=`` render; built from the signature and Google-style docstring by
``transformers.utils.get_json_schema``, as TRL's ``tools=`` does). A :class:`ToolEnvironment`
(an :class:`~.env.Environment`) answers each assistant turn: the tool calls parsed from it
(:mod:`.parsers`) run one by one and each result becomes a ``tool`` message; a turn without a
call is the final answer, scored by the reward function, and ends the episode.

Nothing a model writes can crash the episode: a malformed call, an unknown tool, arguments
that do not fit the schema or signature, a tool that raises, a tool that runs past
``timeout_s`` (in-process tools run on a daemon worker thread; a hung one is abandoned) all
become an observation whose content starts with ``error:``, and the reason is counted in
``info["tool_errors"]`` (:data:`TOOL_ERRORS`). A ``sandbox`` tool is one whose function calls
out to an isolated runner (the reward service's sandboxes); its failures count as
``sandbox``.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .env import EnvStep
from .parsers import PARSERS, parse_tool_calls

#: Why a tool call failed (``info["tool_errors"]`` keys).
TOOL_ERRORS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "sandbox")

_JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass
class Tool:
    """A callable the model may call by ``name``.

    Attributes:
        name: the name the model calls it by (the schema's ``function.name``).
        fn: called with the call's arguments as keywords; its return value becomes the
            observation (``str`` as is, anything else as JSON, else ``str()``).
        schema: ``{"type": "function", "function": {"name", "description", "parameters"}}``.
        sandbox: ``fn`` runs the work in a sandbox elsewhere; its failures count as
            ``sandbox`` rather than ``raised``.
    """

    name: str
    fn: Callable
    schema: dict
    sandbox: bool = False

    @classmethod
    def from_function(cls, fn: Callable, name: str | None = None, sandbox: bool = False) -> Tool:
        """A tool from a type-hinted function with a Google-style docstring (``Args:``
        describing every argument); the schema comes from
        ``transformers.utils.get_json_schema``.

        Raises:
            ValueError: the function lacks type hints or argument descriptions (the
                transformers message, prefixed with the function's name).
        """
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except (
            Exception
        ) as e:  # transformers raises its own TypeHintParsingException/DocstringParsingException
            raise ValueError(
                f"Tool.from_function({getattr(fn, '__name__', fn)!r}): {e} (give every "
                "argument a type hint and an 'Args:' line in the docstring)"
            ) from None
        if name:
            schema["function"]["name"] = name
        return cls(schema["function"]["name"], fn, schema, sandbox)


def _schema_problem(args: dict, schema: dict) -> str | None:
    """Why ``args`` do not fit the JSON schema's ``parameters`` (names, required, JSON
    types of the top level), or ``None``."""
    params = schema.get("function", schema).get("parameters") or {}
    props = params.get("properties") or {}
    missing = [k for k in params.get("required", []) if k not in args]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    unknown = [k for k in args if props and k not in props]
    if unknown:
        return f"unknown argument(s) {', '.join(unknown)} (known: {', '.join(props)})"
    for k, v in args.items():
        want = props.get(k, {}).get("type")
        kinds = [want] if isinstance(want, str) else list(want or [])
        if not kinds or any(t not in _JSON_TYPES for t in kinds):
            continue
        ok = any(
            isinstance(v, _JSON_TYPES[t]) and not (t in ("integer", "number") and v is True)
            for t in kinds
        )
        if not ok or (isinstance(v, bool) and "boolean" not in kinds):
            return f"argument {k!r} must be {'/'.join(kinds)}, got {type(v).__name__}"
    return None


def _as_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


def _run_with_timeout(fn: Callable, args: dict, timeout_s: float) -> tuple[str, Any]:
    """``("ok", result)``, ``("raised", exception)`` or ``("timeout", None)``; the call runs
    on a daemon thread that is abandoned past ``timeout_s``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["ok"] = fn(**args)
        except BaseException as e:  # noqa: BLE001 (any failure is the model's observation)
            box["raised"] = e

    worker = threading.Thread(target=target, name="m2flow-tool", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return "timeout", None
    return ("raised", box["raised"]) if "raised" in box else ("ok", box.get("ok"))


class ToolEnvironment:
    """An :class:`~.env.Environment` over tools: calls in a turn run and answer as ``tool``
    messages; a turn without calls is the final answer (``done``, ``reward(content, item)``).

    Args:
        tools: the tools (unique names).
        reward: ``reward(final_answer_text, item) -> float``; the text is the turn's content
            with any call blocks removed, stripped.
        parser: the tool-call format, one of :data:`~.parsers.PARSERS`
            (:func:`~.parsers.parser_for`).
        system_prompt: the system turn's text; ``""``: none.
        timeout_s: seconds one call may run (``agent.tool_timeout_s``).
        question_key: the item key whose text is the user turn, when the item has no
            ``messages``.
        max_result_chars: longer tool results are cut to this many characters (a note says so).

    Raises:
        ValueError: an unknown parser, duplicate tool names, or ``timeout_s <= 0``.
    """

    def __init__(
        self,
        tools: list[Tool],
        reward: Callable[[str, dict], float],
        parser: str,
        system_prompt: str = "",
        timeout_s: float = 10.0,
        question_key: str = "prompt",
        max_result_chars: int = 4096,
    ):
        if parser not in PARSERS:
            raise ValueError(f"agent.tool_parser={parser!r}: pick one of {', '.join(PARSERS)}")
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        if not timeout_s > 0:
            raise ValueError(f"agent.tool_timeout_s={timeout_s}: must be > 0")
        self._tools = {t.name: t for t in tools}
        self.reward, self.parser = reward, parser
        self.system_prompt, self.timeout_s = system_prompt, float(timeout_s)
        self.question_key, self.max_result_chars = question_key, max_result_chars
        self.item: dict = {}
        self.n_calls = 0  # calls so far in the episode (ids call_<k> stay unique)

    @property
    def tools(self) -> list[dict]:
        """The tools' JSON schemas, for the chat template's ``tools=``."""
        return [t.schema for t in self._tools.values()]

    def reset(self, item: dict) -> list[dict]:
        """The opening messages: the system turn (when ``system_prompt``), then the item's
        ``messages`` or a user turn with ``item[question_key]``.

        Raises:
            KeyError: the item has neither ``messages`` nor ``question_key`` (names both).
        """
        self.item, self.n_calls = item, 0
        if item.get("messages"):
            opening = [dict(m) for m in item["messages"]]
        elif self.question_key in item:
            opening = [{"role": "user", "content": str(item[self.question_key])}]
        else:
            raise KeyError(
                f"ToolEnvironment.reset: the item has neither 'messages' nor "
                f"{self.question_key!r} (keys: {', '.join(item)})"
            )
        if self.system_prompt and opening[0].get("role") != "system":
            opening.insert(0, {"role": "system", "content": self.system_prompt})
        return opening

    def step(self, message: dict) -> EnvStep:
        """Answer one assistant message (see the class docstring).

        Returns:
            An :class:`~.env.EnvStep`; ``info``: ``tool_calls`` (calls attempted, malformed
            ones included), ``tool_errors`` (reason -> count), ``tool_latency_s`` (seconds
            per call run).
        """
        turn = parse_tool_calls(message.get("content") or "", self.parser, start=self.n_calls)
        errors = {r: 0 for r in TOOL_ERRORS}
        info: dict[str, Any] = {
            "tool_calls": len(turn.calls) + len(turn.errors),
            "tool_errors": errors,
            "tool_latency_s": [],
        }
        if not turn.calls and not turn.errors:
            return EnvStep([], float(self.reward(turn.content, self.item)), True, info)
        observations = []
        for call in turn.calls:
            reason, text = self._run(call.name, call.arguments, info["tool_latency_s"])
            if reason:
                errors[reason] += 1
            observations.append(
                {"role": "tool", "name": call.name, "tool_call_id": call.id, "content": text}
            )
        for k, why in enumerate(turn.errors, start=self.n_calls + len(turn.calls)):
            errors["malformed"] += 1
            observations.append(
                {"role": "tool", "tool_call_id": f"call_{k}", "content": f"error: {why}"}
            )
        self.n_calls += len(turn.calls) + len(turn.errors)
        return EnvStep(observations, 0.0, False, info)

    def _run(self, name: str, args: dict, latencies: list) -> tuple[str | None, str]:
        """``(error reason or None, observation text)`` of one call."""
        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            return "unknown_tool", f"error: unknown tool {name!r} (tools: {known})"
        why = _schema_problem(args, tool.schema)
        if why is None:
            try:
                inspect.signature(tool.fn).bind(**args)
            except TypeError as e:
                why = str(e)
            except ValueError:  # a builtin without a signature: the call itself will tell
                pass
        if why is not None:
            return "bad_arguments", f"error: bad arguments for {name}: {why}"
        t0 = time.perf_counter()
        outcome, value = _run_with_timeout(tool.fn, args, self.timeout_s)
        latencies.append(time.perf_counter() - t0)
        if outcome == "timeout":
            return "timeout", f"error: {name} timed out after {self.timeout_s:g} s"
        if outcome == "raised":
            reason = "sandbox" if tool.sandbox else "raised"
            return reason, f"error: {name} failed: {type(value).__name__}: {value}"
        text = _as_text(value)
        if tool.sandbox and text.startswith("error:"):  # the sandbox's failure, as text
            return "sandbox", text
        if len(text) > self.max_result_chars:
            text = text[: self.max_result_chars] + f" ... (cut at {self.max_result_chars} chars)"
        return None, text


# ---------------------------------------------------------------------------- calculator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_ABS = 10**100  # no intermediate value beyond this (big-int products stay cheap)
_MAX_LEN = 256  # characters of an expression


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):
            raise ValueError(f"only numbers are allowed, got {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if (
                b > 100
                or b < -100
                or (abs(a) > 1 and b > 0 and b * math.log10(abs(a)) > math.log10(_MAX_ABS))
            ):
                raise ValueError("exponent too large")
        value = _BINARY[type(node.op)](a, b)
        if isinstance(value, complex):
            raise ValueError("complex result")
        if abs(value) > _MAX_ABS:
            raise ValueError("result too large")
        return value
    what = {ast.Name: "names", ast.Attribute: "attribute access", ast.Call: "calls"}
    kind = what.get(type(node), type(node).__name__)
    raise ValueError(f"{kind} not allowed (only numbers, + - * / // % ** and parentheses)")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "12*(3+4)".

    Returns:
        The value (an integer's digits, a float to 12 significant digits), or a text
        starting with "error:" for anything else (names, calls, attribute access, huge
        exponents or results, division by zero, bad syntax).
    """
    if not isinstance(expression, str) or len(expression) > _MAX_LEN:
        return f"error: the expression must be text of at most {_MAX_LEN} characters"
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except SyntaxError as e:
        return f"error: not an expression ({e.msg})"
    except (ValueError, OverflowError, RecursionError, MemoryError) as e:
        return f"error: {e}"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)
