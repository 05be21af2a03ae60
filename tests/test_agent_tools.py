"""Tool calls (issue 33, items 1 and 3): the hermes and llama3_json parsers, parser choice
from a tokenizer, and a ToolEnvironment whose failures (malformed JSON, unknown tool, wrong
arguments, a tool that raises, one that hangs, a sandbox failure) each become an ``error:``
observation with a counted reason, never an exception; the calculator's safe arithmetic.

Checks that could fail: a call or argument parsed wrongly, a malformed call that raises or is
silently dropped, a reason counted under the wrong key, a hung tool that blocks the step, a
final answer not scored, a calculator that evaluates a name, an attribute or a huge power.
"""

from __future__ import annotations

import json
import threading

import pytest
from m2flow.workers.agent.env import Environment
from m2flow.workers.agent.parsers import PARSERS, parse_tool_calls, parser_for
from m2flow.workers.agent.tools import TOOL_ERRORS, Tool, ToolEnvironment, calculator
from m2flow.workers.llm import build_tokenizer


def hermes(name: str, args) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


# ---------------------------------------------------------------------------- parsers


def test_hermes_parser():
    text = "Let me compute.\n" + hermes("calculator", {"expression": "2+3"}) + "\n"
    text += hermes("lookup", {"key": "a;b"}) + "<tool_call>{'single': quotes}</tool_call>"
    turn = parse_tool_calls(text, "hermes", start=3)
    assert turn.content == "Let me compute."
    assert [(c.name, c.arguments, c.id) for c in turn.calls] == [
        ("calculator", {"expression": "2+3"}, "call_3"),
        ("lookup", {"key": "a;b"}, "call_4"),
    ]
    assert len(turn.errors) == 1 and turn.errors[0].startswith("malformed tool-call JSON")
    # arguments as a JSON string (some models), an unclosed block, no name, a list
    s = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "hermes"
    )
    assert s.calls[0].arguments == {"x": 1} and not s.errors
    cut = parse_tool_calls('Sure <tool_call>{"name": "f", "argu', "hermes")
    assert cut.content == "Sure" and not cut.calls and "without </tool_call>" in cut.errors[0]
    bad = parse_tool_calls(
        '<tool_call>{"arguments": {}}</tool_call><tool_call>[1]</tool_call>', "hermes"
    )
    assert not bad.calls and len(bad.errors) == 2
    assert parse_tool_calls("The answer is 5.", "hermes").calls == []


def test_llama3_json_parser():
    call = '{"name": "calculator", "parameters": {"expression": "7*8"}}'
    turn = parse_tool_calls(
        "<|python_tag|>" + call + '; {"name": "g", "parameters": {}}', "llama3_json"
    )
    assert [(c.name, c.arguments, c.id) for c in turn.calls] == [
        ("calculator", {"expression": "7*8"}, "call_0"),
        ("g", {}, "call_1"),
    ]
    assert parse_tool_calls(call, "llama3_json").calls[0].arguments == {"expression": "7*8"}
    plain = parse_tool_calls("56 is 7*8 {not a call}", "llama3_json")
    assert plain.content == "56 is 7*8 {not a call}" and not plain.calls and not plain.errors
    bad = parse_tool_calls('{"name": "calculator", "parameters": {"expr', "llama3_json")
    assert not bad.calls and bad.errors[0].startswith("malformed tool-call JSON")
    with pytest.raises(ValueError, match="agent.tool_parser='mistral'"):
        parse_tool_calls("x", "mistral")


def test_parser_for_tokenizers():
    qwen = build_tokenizer({"name": "qwen2"})
    char_chat = build_tokenizer({"name": "char", "alphabet": "0123456789", "chat": True})
    assert parser_for(qwen) == "hermes" and parser_for(char_chat) == "hermes"
    assert parser_for(qwen, "llama3_json") == "llama3_json"

    class Llama:  # only what parser_for reads: a template text and the added vocabulary
        chat_template = "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>' }}"

        def get_added_vocab(self):
            return {}

    assert parser_for(Llama()) == "llama3_json"
    with pytest.raises(ValueError, match="agent.tool_parser"):
        parser_for(build_tokenizer({"name": "char"}))
    with pytest.raises(ValueError, match="pick auto or one of hermes, llama3_json"):
        parser_for(qwen, "bogus")
    assert PARSERS == ("hermes", "llama3_json")


# ---------------------------------------------------------------------------- environment


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def broken(x: str) -> str:
    """Always fails.

    Args:
        x: ignored.
    """
    raise RuntimeError("disk on fire")


@pytest.fixture
def release():
    ev = threading.Event()
    yield ev
    ev.set()  # lets the abandoned thread of the hung tool finish


def make_env(release, parser="hermes", **kw):
    def hang(x: str) -> str:
        """Never answers in time.

        Args:
            x: ignored.
        """
        release.wait(60)
        return "late"

    def remote(code: str) -> str:
        """Runs code elsewhere.

        Args:
            code: the program.
        """
        raise ConnectionError("sandbox unreachable")

    tools = [
        Tool.from_function(calculator),
        Tool.from_function(add),
        Tool.from_function(broken),
        Tool.from_function(hang, name="slow"),
        Tool.from_function(remote, sandbox=True),
    ]
    score = lambda text, item: float(text.strip() == str(item["answer"]))  # noqa: E731
    return ToolEnvironment(tools, score, parser, system_prompt="Use tools.", **kw)


def test_tool_environment_answers_calls_and_scores_the_final_answer(release):
    env = make_env(release, timeout_s=0.5)
    assert isinstance(env, Environment)
    assert [t["function"]["name"] for t in env.tools] == [
        "calculator", "add", "broken", "slow", "remote"
    ]  # fmt: skip
    assert env.tools[1]["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    opening = env.reset({"prompt": "What is 123*456?", "answer": 56088})
    assert opening == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "What is 123*456?"},
    ]
    text = (
        "Computing.\n"
        + hermes("calculator", {"expression": "123*456"})
        + hermes("add", {"a": 1, "b": 2})
    )
    step = env.step({"role": "assistant", "content": text})
    assert not step.done and step.reward == 0.0
    assert step.messages == [
        {"role": "tool", "name": "calculator", "tool_call_id": "call_0", "content": "56088"},
        {"role": "tool", "name": "add", "tool_call_id": "call_1", "content": "3"},
    ]
    assert step.info["tool_calls"] == 2 and sum(step.info["tool_errors"].values()) == 0
    assert len(step.info["tool_latency_s"]) == 2
    again = env.step({"role": "assistant", "content": hermes("add", {"a": 5, "b": 6})})
    assert again.messages[0]["tool_call_id"] == "call_2"  # unique over the episode
    final = env.step({"role": "assistant", "content": "56088"})
    assert final.done and final.reward == 1.0 and final.messages == []
    assert env.step({"role": "assistant", "content": "56000"}).reward == 0.0
    # chat items: their messages, the system turn prepended
    msgs = env.reset({"messages": [{"role": "user", "content": "hi"}], "answer": 1})
    assert [m["role"] for m in msgs] == ["system", "user"]
    with pytest.raises(KeyError, match="neither 'messages' nor 'prompt'"):
        env.reset({"question": "x"})


@pytest.mark.parametrize(
    "call, reason, says",
    [
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
            "malformed",
            "malformed tool-call JSON",
        ),
        (hermes("search", {"q": "x"}), "unknown_tool", "unknown tool 'search'"),
        (hermes("add", {"a": 1}), "bad_arguments", "missing required argument(s) b"),
        (hermes("add", {"a": 1, "b": 2, "c": 3}), "bad_arguments", "unknown argument(s) c"),
        (hermes("add", {"a": "1", "b": 2}), "bad_arguments", "'a' must be integer, got str"),
        (hermes("broken", {"x": "y"}), "raised", "broken failed: RuntimeError: disk on fire"),
        (hermes("slow", {"x": "y"}), "timeout", "slow timed out after 0.3 s"),
        (hermes("remote", {"code": "1"}), "sandbox", "ConnectionError: sandbox unreachable"),
    ],
    ids=["malformed", "unknown", "missing", "extra", "type", "raised", "timeout", "sandbox"],
)
def test_tool_failures_become_error_observations(release, call, reason, says):
    env = make_env(release, timeout_s=0.3)
    env.reset({"prompt": "q", "answer": 1})
    step = env.step({"role": "assistant", "content": "Trying.\n" + call})
    assert not step.done and step.reward == 0.0
    (obs,) = step.messages
    assert obs["role"] == "tool" and obs["content"].startswith("error:"), obs
    assert says in obs["content"] and obs["tool_call_id"] == "call_0"
    assert step.info["tool_errors"] == {r: int(r == reason) for r in TOOL_ERRORS}
    assert step.info["tool_calls"] == 1
    # the episode goes on: a good call after the failure works
    ok = env.step({"role": "assistant", "content": hermes("add", {"a": 2, "b": 2})})
    assert ok.messages[0]["content"] == "4" and ok.messages[0]["tool_call_id"] == "call_1"


def test_llama3_json_environment_and_bad_construction(release):
    env = make_env(release, parser="llama3_json")
    env.reset({"prompt": "q", "answer": 4})
    step = env.step(
        {"role": "assistant", "content": '{"name": "add", "parameters": {"a": 2, "b": 2}}'}
    )
    assert step.messages[0]["content"] == "4" and not step.done
    assert env.step({"role": "assistant", "content": "4"}).reward == 1.0
    with pytest.raises(ValueError, match="pick one of hermes, llama3_json"):
        ToolEnvironment([], lambda t, i: 0.0, "auto")
    with pytest.raises(ValueError, match="unique"):
        ToolEnvironment([Tool.from_function(add)] * 2, lambda t, i: 0.0, "hermes")
    with pytest.raises(ValueError, match="type hint|Args"):
        Tool.from_function(lambda x: x)


# ---------------------------------------------------------------------------- calculator


def test_calculator_does_arithmetic_only():
    assert calculator("123*456") == "56088"
    assert calculator(" (2+3)*-4 ") == "-20"
    assert calculator("7/2") == "3.5" and calculator("6/3") == "2"
    assert calculator("2**10 % 1000 // 3") == "8"
    refused = {
        "__import__('os').system('true')": "calls not allowed",
        "x + 1": "names not allowed",
        "(1).real": "attribute access not allowed",
        "9**9**9": "exponent too large",
        "10**99 * 10**99": "result too large",
        "1/0": "division by zero",
        "'a' * 3": "only numbers",
        "True + 1": "only numbers",
        "[1, 2]": "List not allowed",
        "2 +": "not an expression",
        "1" * 300: "at most 256 characters",
        "(-8) ** 0.5": "complex result",
    }
    for expr, why in refused.items():
        got = calculator(expr)
        assert got.startswith("error:") and why in got, (expr, got)
