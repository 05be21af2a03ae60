"""A code tool that runs in the reward service's sandboxes (issue 33, item 3).

:func:`sandbox_tool` makes a :class:`~m2flow.workers.agent.tools.Tool` whose calls go to the
reward service's tool API (``POST /v1/tools/run``, :mod:`m2flow.reward_service.tools`): the
code runs in a sandbox with its own PID, mount and network namespaces, uid, rlimits and
scratch quota, under the tenant's limits, as rewards do. Nothing of the model's code runs in
the rollout process.

Its function never raises: the code's output is the observation; the code's error, a
timeout, a kill by a sandbox limit, the service's refusal (a tenant limit, a bad argument)
or an unreachable service is the text ``"error: ..."`` (the model reads it and may try
again). Arguments the function cannot take (``code`` missing, an unknown name) raise
:class:`TypeError` at the call, as any tool's, which the environment counts as
``bad_arguments``.
"""

from __future__ import annotations

import copy

from m2flow.reward_service.client import RewardClient, RewardServiceError
from m2flow.reward_service.tools import TOOLS

from .tools import Tool

#: seconds allowed on top of the run's timeout for the service's queue and a worker's start
WAIT_SLACK_S = 20.0
#: seconds a call keeps retrying while the service is unreachable or the tenant at its limit
RETRY_S = 5.0
#: what an observation says when the code printed nothing
NO_OUTPUT = "(no output)"


def observation(answer: dict) -> str:
    """The tool message's text for the service's ``answer`` (``POST /v1/tools/run``): the
    output (with a note when it was cut), or ``"error: <error>"`` followed by the output
    printed before the error."""
    output = answer.get("output") or ""
    if answer.get("truncated"):
        output += "\n[output truncated]"
    if answer.get("ok"):
        return output or NO_OUTPUT
    text = f"error: {answer.get('error') or answer.get('status') or 'failed'}"
    return text + (f"\noutput before the error:\n{output}" if output else "")


def sandbox_tool(
    url: str,
    token: str,
    name: str = "python",
    timeout_s: float = 10.0,
    pipeline: str | None = None,
) -> Tool:
    """A tool that runs the service's tool ``name`` in its sandboxes (``sandbox=True``).

    Args:
        url: the reward service (``http://host:port``); token: the tenant's bearer token.
        name: the service's tool (:data:`~m2flow.reward_service.tools.TOOLS`; ``python``:
            ``fn(code: str) -> str``, what the program prints).
        timeout_s: the run's wall-clock limit (seconds; at most the tool pipeline's sandbox
            ``wall_s``, or every call answers ``error: ... 422``). The call itself waits up
            to ``timeout_s + WAIT_SLACK_S`` (+ ``RETRY_S`` of retries): give the agent's
            ``agent.tool_timeout_s`` as much, or it gives up first.
        pipeline: the tool pipeline (default: the service's only one).

    Raises:
        ValueError: an unknown tool or a ``timeout_s`` that is not a positive number.
    """
    if name not in TOOLS:
        raise ValueError(f"unknown sandbox tool {name!r}: the reward service has {sorted(TOOLS)}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    wait = float(timeout_s) + WAIT_SLACK_S

    def call(arguments: dict) -> str:
        try:
            with RewardClient(url, token, timeout_s=wait, retry_s=RETRY_S) as rc:
                answer = rc.run_tool(name, arguments, timeout_s, pipeline, wait_s=wait)
        except RewardServiceError as e:  # refused (a limit, a bad argument) or unreachable
            return f"error: sandbox call failed: {e}"
        except Exception as e:  # never crash the episode: the model sees what went wrong
            return f"error: sandbox call failed: {type(e).__name__}: {e}"
        return observation(answer)

    def python(code: str) -> str:
        return call({"code": code})

    python.__doc__ = TOOLS[name]["function"]["description"]
    python.__name__ = name
    return Tool(name=name, fn=python, schema=copy.deepcopy(TOOLS[name]), sandbox=True)
