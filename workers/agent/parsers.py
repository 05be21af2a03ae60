"""Tool calls parsed out of an assistant turn's text, per model family.

A model family writes its tool calls in the format its chat template and fine-tuning taught:

- ``hermes``: Qwen2.5 / Hermes (ChatML). Each call is a JSON object between the added tokens
  ``<tool_call>`` and ``</tool_call>`` (``{"name": ..., "arguments": {...}}``), one or more per
  turn, after optional free text (Qwen's function-calling docs; vLLM's ``hermes`` parser). The
  content is the text outside the call blocks.
- ``llama3_json``: Llama 3.1 with JSON (zero-shot) tool calling. The whole turn is a JSON object
  ``{"name": ..., "parameters": {...}}`` (Meta's Llama 3.1 prompt-format docs), optionally after
  ``<|python_tag|>``; several calls are separated by ``;`` (vLLM's ``llama3_json`` parser). A
  turn that does not start with ``{`` (after the tag) is a plain answer.

Malformed calls never raise: each becomes an entry of :attr:`ParsedTurn.errors` (the
environment answers it with an error observation and counts it). :func:`parser_for` picks the
parser from a tokenizer's chat template and vocabulary (``agent.tool_parser=auto``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

#: The tool-call formats :func:`parse_tool_calls` knows.
PARSERS = ("hermes", "llama3_json")

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    """One parsed call: the tool's ``name``, its keyword ``arguments``, and an ``id``
    (``call_<k>``, ``k`` counted over the episode by the caller's ``start``)."""

    name: str
    arguments: dict
    id: str


@dataclass
class ParsedTurn:
    """An assistant turn split into its free text (``content``, calls removed and stripped),
    its well-formed ``calls`` in order, and one message per malformed call (``errors``,
    e.g. ``"malformed tool-call JSON: ..."``)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _call_from_json(raw: str, args_keys: tuple[str, ...]) -> tuple[str, dict] | str:
    """``(name, arguments)`` from one call's JSON text, or an error message."""
    raw = raw.strip()
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return f"malformed tool-call JSON: {e.msg} at char {e.pos} in {raw[:80]!r}"
    if not isinstance(obj, dict):
        return f"malformed tool call: expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"malformed tool call: no string 'name' in {raw[:80]!r}"
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"malformed tool-call JSON: arguments string: {e.msg} in {args[:80]!r}"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"malformed tool call: '{args_keys[0]}' of {name!r} must be a JSON object"
    return name, args


def _parse_hermes(text: str) -> tuple[str, list[tuple[str, dict]], list[str]]:
    calls, errors = [], []
    for m in _HERMES_BLOCK.finditer(text):
        got = _call_from_json(m.group(1), ("arguments", "parameters"))
        (errors.append if isinstance(got, str) else calls.append)(got)
    content = _HERMES_BLOCK.sub("", text)
    if "<tool_call>" in content:  # an opened block never closed (e.g. cut at max tokens)
        head, _, tail = content.partition("<tool_call>")
        errors.append(f"malformed tool call: <tool_call> without </tool_call>: {tail[:80]!r}")
        content = head
    return content.strip(), calls, errors


def _split_json_objects(text: str) -> list[str]:
    """``text`` split at top-level ``;`` (outside strings and braces)."""
    parts, depth, in_str, esc, start = [], 0, False, False, 0
    for i, c in enumerate(text):
        if in_str:
            esc = (c == "\\") and not esc
            if c == '"' and not esc:
                in_str = False
            continue
        if c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c == ";" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def _parse_llama3_json(text: str) -> tuple[str, list[tuple[str, dict]], list[str]]:
    head, tag, body = text.partition(_PYTHON_TAG)
    if not tag:
        head, body = "", text
    if not body.lstrip().startswith("{"):
        return text.replace(_PYTHON_TAG, "").strip(), [], []
    calls, errors = [], []
    for part in _split_json_objects(body.strip()):
        got = _call_from_json(part, ("parameters", "arguments"))
        (errors.append if isinstance(got, str) else calls.append)(got)
    return head.strip(), calls, errors


def parse_tool_calls(text: str, parser: str, start: int = 0) -> ParsedTurn:
    """Split an assistant turn's decoded ``text`` into content and tool calls.

    Args:
        text: the turn as decoded (special tokens removed except the tool-call markers).
        parser: one of :data:`PARSERS`.
        start: the first call's number (ids ``call_<start>``, ``call_<start+1>``, ...): the
            calls made earlier in the episode, so ids stay unique over it.

    Returns:
        The :class:`ParsedTurn`; malformed calls are in ``errors``, never raised.

    Raises:
        ValueError: an unknown ``parser`` (names the choices and ``agent.tool_parser``).
    """
    if parser == "hermes":
        content, found, errors = _parse_hermes(text)
    elif parser == "llama3_json":
        content, found, errors = _parse_llama3_json(text)
    else:
        raise ValueError(f"agent.tool_parser={parser!r}: pick one of {', '.join(PARSERS)}")
    calls = [ToolCall(n, a, f"call_{start + k}") for k, (n, a) in enumerate(found)]
    return ParsedTurn(content, calls, errors)


def _template_text(tokenizer) -> str:
    t = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(t, dict):  # several named templates (transformers allows a dict)
        t = "\n".join(str(v) for v in t.values())
    return str(t)


def parser_for(tokenizer, name: str = "auto") -> str:
    """The tool-call parser for ``tokenizer``: ``name`` itself when it is one of
    :data:`PARSERS`; with ``"auto"``, from the chat template's text and the added tokens:
    ``<tool_call>`` or ChatML's ``<|im_start|>`` -> ``hermes`` (Qwen2/2.5, Hermes, the chat
    character tokenizer); ``<|python_tag|>`` or ``<|start_header_id|>`` -> ``llama3_json``.

    Raises:
        ValueError: an unknown ``name``, or ``auto`` on a tokenizer with no known marker
            (names ``agent.tool_parser`` and the choices).
    """
    if name in PARSERS:
        return name
    if name != "auto":
        raise ValueError(f"agent.tool_parser={name!r}: pick auto or one of {', '.join(PARSERS)}")
    text = _template_text(tokenizer)
    try:
        added = set(tokenizer.get_added_vocab())
    except (AttributeError, TypeError):
        added = set()
    if "<tool_call>" in text or "<tool_call>" in added or "<|im_start|>" in text:
        return "hermes"
    if _PYTHON_TAG in text or "<|start_header_id|>" in text:
        return "llama3_json"
    raise ValueError(
        "agent.tool_parser=auto: the tokenizer's chat template shows no known tool-call format "
        f"(no <tool_call>, <|im_start|>, <|python_tag|>): set agent.tool_parser to one of "
        f"{', '.join(PARSERS)}"
    )
