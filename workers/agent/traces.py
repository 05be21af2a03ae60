"""Tool-use traces for the supervised warm start: solved episodes of a built-in environment
(:func:`~.builtin.demonstration`) as token lists with their loss mask, built exactly as the
agent loop builds episodes (:mod:`.chat`): the opening's template ids, each assistant message
encoded alone plus the turn's stop token (loss mask 1), each observation's ids (loss mask 0).
Supervised on these, the model learns the tool-call format and to read the tool's result
before GRPO starts (issue 33 item 6)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .builtin import demonstration, question
from .chat import ChatTokens, Trajectory
from .env import Environment


def episode_trace(chat: ChatTokens, tokenizer, opening: list[dict], turns: list[dict]) -> dict:
    """``{"prompt_ids", "response_ids", "loss_mask"}`` of a conversation: ``opening``
    (system?, user) then ``turns`` (assistant messages and the observations between them;
    observations that follow one another form one block of observation ids).

    Raises:
        ValueError: ``turns`` that do not start with an assistant message.
    """
    if not turns or turns[0]["role"] != "assistant":
        raise ValueError("a trace's turns start with an assistant message")
    traj = Trajectory(chat.prompt_ids(opening))
    pending: list[dict] = []
    for msg in turns:
        if msg["role"] == "assistant":
            if pending:
                traj.add_observation(chat.observation_ids(pending))
                pending = []
            ids = tokenizer.encode(msg["content"], add_special_tokens=False)
            traj.add_model(ids + [chat.turn_end_id], [0.0] * (len(ids) + 1), 0)
        else:
            pending.append(msg)
    return {
        "prompt_ids": traj.prompt_ids,
        "response_ids": traj.response_ids,
        "loss_mask": traj.loss_mask,
    }


def demonstration_traces(
    entries: Sequence[dict],
    env_factory: Callable[[], Environment],
    chat: ChatTokens,
    tokenizer,
    name: str,
    parser: str,
    compact: bool,
) -> list[dict]:
    """One trace per entry (:func:`episode_trace` of ``env.reset(entry)`` and the built-in
    ``name``'s :func:`~.builtin.demonstration`)."""
    out = []
    for entry in entries:
        opening = env_factory().reset({**entry, "prompt": question(entry, compact)})
        out.append(episode_trace(chat, tokenizer, opening,
                                 demonstration(name, entry, parser, compact)))  # fmt: skip
    return out


def agent_traces(cfg, lm: dict, entries: Sequence[dict], compact: bool) -> list[dict]:
    """The warm start's traces for the agent workflow's configuration ``cfg`` (its ``agent``
    section, a built-in ``agent.env``) on ``entries``, built with the run's tokenizer
    (``lm["tokenizer"]``: the roles' spec) in the driver.

    Raises:
        ValueError: ``agent.env`` is not a built-in (a user environment brings no
            demonstrations: set ``warm_start.enabled=false``).
    """
    from ..llm import build_tokenizer
    from .builtin import BUILTINS, make_env_factory
    from .parsers import parser_for

    a = cfg.agent
    if a.env not in BUILTINS:
        raise ValueError(
            f"agent.env={a.env} brings no demonstrations for the warm start: set "
            "warm_start.enabled=false, or use a built-in environment "
            f"({', '.join(BUILTINS)})"
        )
    tokenizer = build_tokenizer(lm["tokenizer"])
    parser = parser_for(tokenizer, a.tool_parser)
    factory = make_env_factory(a.env, None, parser, a.tool_timeout_s, a.system_prompt)
    chat = ChatTokens(tokenizer, tools=factory().tools or None)
    return demonstration_traces(entries, factory, chat, tokenizer, a.env, parser, compact)
