"""The ``agent`` section of ``workflows/agent.py`` (issue 33)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

#: ``agent.mode`` values: episodes against an environment, or an OpenAI-client agent.
MODES = ("env", "openai")


@dataclass
class AgentConfig:
    """How episodes run (:mod:`.loop`) and which environment or agent plays them."""

    mode: str = "env"  # env: agent.env's episodes; openai: agent.agent against the endpoint
    # env mode: a built-in environment (calculator: arithmetic with a calculator tool; answer:
    # the same task without tools, one turn) or an import path module:factory (a callable
    # that returns a fresh Environment; it gets the run's reward function and tool timeout)
    env: str = "calculator"
    # openai mode: module:function(client, item) -> reward, an agent written against the
    # openai client (docs/how-to/agents.md)
    agent: Optional[str] = None
    tool_parser: str = "auto"  # auto (from the chat template) | hermes | llama3_json
    max_turns: int = 4  # assistant turns per episode
    max_episode_tokens: int = 160  # response tokens per episode (model + observations)
    max_turn_tokens: int = 96  # tokens of one assistant turn (stop token included)
    tool_timeout_s: float = 10.0  # one tool call; past it the model sees an error
    env_timeout_s: float = 60.0  # one env.reset/env.step; past it the episode ends as error
    concurrency: int = 8  # threads running environment steps and tool calls
    system_prompt: str = ""  # the environment's system turn ("" none)
