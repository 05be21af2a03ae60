"""The environment protocol an agent episode runs against.

An episode: ``messages = env.reset(item)`` (the conversation so far: system, user), then per
turn the model's assistant message goes to ``env.step(message)``, which answers with
observation messages (tool results, a user's reply), a reward, and whether the episode is
over. The agent loop (:mod:`.loop`) keeps the model's tokens as sampled and appends each
observation's tokens (:mod:`.chat`); the environment only sees and returns text messages.

The protocol is veRL's ``AgentLoopBase`` / TRL's ``environment_factory`` in a plain form:
two methods, messages in OpenAI's chat format (``{"role", "content"}``; tool results
``{"role": "tool", "content", "name"?, "tool_call_id"?}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

#: Why an episode ended (the ``end_reasons`` metric counts each).
END_REASONS = ("done", "max_turns", "max_tokens", "error")


@dataclass
class EnvStep:
    """What :meth:`Environment.step` returns for one assistant turn.

    Attributes:
        messages: observation messages appended to the conversation (``[]``: none; with
            ``done`` the episode ends and they are not shown to the model).
        reward: this turn's reward (the episode's reward is the sum over its turns).
        done: the episode is over (a final answer, a terminal state).
        info: counters for the step's metrics: ``tool_calls`` (int), ``tool_errors`` (dict
            reason -> count), ``tool_latency_s`` (list of seconds), anything else (logged
            under ``env/<key>`` when numeric).
    """

    messages: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """A text environment (one instance per episode; not shared between threads).

    Attributes:
        tools: the tools' JSON schemas (OpenAI function format, ``{"type": "function",
            "function": {"name", "description", "parameters"}}``), handed to the chat
            template's ``tools=`` when the prompt is built; ``[]`` for none.
    """

    tools: list[dict]

    def reset(self, item: dict) -> list[dict]:
        """Start an episode on ``item`` (a prompt's entry:
        :meth:`~m2flow.workers.data.item.PromptItem.entry` plus ``prompt`` and, for chat
        data, ``messages``). Returns the opening messages (system?, user)."""
        ...

    def step(self, message: dict) -> EnvStep:
        """Answer the model's assistant message ``{"role": "assistant", "content": text}``
        (``text`` decoded from the sampled tokens, special tokens removed except tool-call
        markers). Raising is an ``error`` end of the episode (the loop catches it, names the
        environment and the item in the log); a hang is stopped at ``agent.env_timeout_s``."""
        ...
