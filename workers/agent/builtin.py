"""The built-in environments (``agent.env``) and their demonstrations (the supervised warm
start's tool-use traces).

- ``calculator``: a reasoning-gym arithmetic prompt; one tool, :func:`~.tools.calculator`; the
  episode ends at the first assistant message without a tool call, scored by the run's reward
  function (the task's own scorer) on that message.
- ``answer``: the same prompts without tools: one turn, the answer scored (the no-tool
  baseline of docs/results/agent.md).

An episode's user turn is the prompt's question: the compact expression (``4817+2963=``) for a
character tokenizer, reasoning-gym's question text otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ..tasks import compact_prompt
from .env import Environment
from .tools import Tool, ToolEnvironment, calculator

#: ``agent.env`` built-in names
BUILTINS = ("calculator", "answer")


def question(item: dict, compact: bool) -> str:
    """The user turn of ``item`` (a prompt entry): a reasoning-gym entry's compact prompt
    (``compact``) or question; otherwise the item's ``prompt`` text."""
    entry = (item.get("extra_info") or {}).get("entry")
    if entry is None:
        return str(item.get("prompt", ""))
    if compact:
        name = item.get("data_source", "").rpartition("/")[2] or "chain_sum"
        return compact_prompt(entry, name)
    return entry["question"]


def make_env_factory(
    name: str,
    reward: Callable[[str, dict], float],
    parser: str,
    tool_timeout_s: float,
    system_prompt: str = "",
) -> Callable[[], Environment]:
    """A factory of fresh environments for ``agent.env=name``: a built-in (:data:`BUILTINS`)
    or ``module:factory`` / ``path/to/file.py:factory`` (:func:`load_callable`; called with
    keywords ``reward``, ``parser``, ``tool_timeout_s``, ``system_prompt``; it returns an
    :class:`~.env.Environment`).

    Raises:
        ValueError: an unknown name or an import path that does not import.
    """
    if name in BUILTINS:
        tools = [Tool.from_function(calculator)] if name == "calculator" else []

        def factory() -> Environment:  # the user turn: the item's prompt (its question)
            return ToolEnvironment(tools, reward, parser, system_prompt, tool_timeout_s)

        return factory
    fn = load_callable(name, "agent.env")

    def user_factory() -> Environment:
        return fn(
            reward=reward, parser=parser, tool_timeout_s=tool_timeout_s,
            system_prompt=system_prompt,
        )  # fmt: skip

    return user_factory


def load_callable(spec: str, key: str):
    """``module:function`` or ``path/to/file.py:function`` imported (``agent.env``,
    ``agent.agent``: named by ``key`` in errors).

    Raises:
        ValueError: not of that form, or it does not import (names the error).
    """
    import importlib
    import importlib.util
    from pathlib import Path

    module, _, attr = spec.rpartition(":")
    if not (module and attr):
        choices = f"one of {', '.join(BUILTINS)}, " if key == "agent.env" else ""
        raise ValueError(
            f"{key}={spec!r}: give {choices}module:function or path/to/file.py:function"
        )
    try:
        if module.endswith(".py"):
            where = importlib.util.spec_from_file_location(f"m2flow_user_{Path(module).stem}",
                                                           module)  # fmt: skip
            mod = importlib.util.module_from_spec(where)
            where.loader.exec_module(mod)
        else:
            mod = importlib.import_module(module)
        return getattr(mod, attr)
    except (ImportError, AttributeError, FileNotFoundError, SyntaxError) as e:
        raise ValueError(f"{key}={spec!r}: cannot import it ({e})") from e


def tool_call_text(parser: str, name: str, arguments: dict) -> str:
    """A tool call as the model family writes it (``hermes``: ``<tool_call>{json}
    </tool_call>``; ``llama3_json``: the bare JSON object), compact JSON."""
    if parser == "llama3_json":
        return json.dumps({"name": name, "parameters": arguments}, separators=(",", ":"))
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def demonstration(name: str, item: dict, parser: str, compact: bool) -> list[dict]:
    """A solved episode of built-in ``name`` on ``item`` as chat messages after the opening
    (the warm start's trace): ``calculator``: the tool call on the expression, the tool's
    result, the answer; ``answer``: the answer. Raises ValueError for another name."""
    answer = str(item.get("ground_truth", ""))
    if name == "answer":
        return [{"role": "assistant", "content": answer}]
    if name != "calculator":
        raise ValueError(f"agent.env={name}: no demonstrations (built-ins only)")
    entry = (item.get("extra_info") or {}).get("entry") or {}
    expression = (entry.get("metadata") or {}).get("expression", question(item, compact))
    expression = expression.replace(" ", "").rstrip("=")
    return [
        {"role": "assistant", "content": tool_call_text(parser, "calculator",
                                                        {"expression": expression})},
        {"role": "tool", "name": "calculator", "content": calculator(expression)},
        {"role": "assistant", "content": answer},
    ]  # fmt: skip
