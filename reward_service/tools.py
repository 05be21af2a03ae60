"""Tool calls in the reward service's sandboxes: ``POST /v1/tools/run`` (issue 33, item 3).

An agent's code tool runs where rewards run: a pipeline of kind ``tool`` (one stage, ``run``)
has a pool of worker processes like a reward stage, and each call runs in a sandbox of
:mod:`.sandbox` (:func:`~.sandbox.run_code`: its own PID, mount and network namespaces, uid,
rlimits and scratch quota). The per-tenant limits are those of rewards: the bearer token names
the tenant (401 otherwise), a call holds one of its tenant's ``max_requests_per_tenant``
request slots while it runs (:mod:`.shares`; 429 past it), its arguments count toward
``max_queued_bytes_per_tenant`` until it ends (:mod:`.budget`; 429/413), its body toward
``max_body_bytes``, and a call may only tighten the pipeline's sandbox wall clock. Nothing
of a run is kept after its answer, so no tenant sees another's.

The pool grows with the calls in flight (up to ``max_workers``) and shrinks :data:`IDLE_S`
seconds after a call ends (to ``min_workers``: set it to keep a worker warm from the first
call on; a cold start costs a worker process start). Calls are served fairly across
tenants: a call is queued behind the calls of tenants with fewer calls of their own in
flight (then in arrival order), so one tenant's many calls do not delay another's first.
A call that does not start within the stage's ``timeout_s`` is refused (429,
``Retry-After``); one that runs past it is stopped (its worker killed) and answered as a
``timeout``.

What the code does is never an HTTP error: its exception, timeout, kill by a limit or a
sandbox failure is an answer ``{"ok": false, "status", "error", ...}``. Refusals are: 404 (an
unknown tool, or no tool pipeline configured), 422 (wrong arguments, a ``timeout_s`` over
the pipeline's limit, a non-tool ``pipeline``), and those above.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .pipelines import MAX_SOURCE_BYTES
from .sandbox import Limits
from .state import ServiceError

if TYPE_CHECKING:
    from .pools import Pool, Proc

#: seconds a tool pool keeps workers it no longer needs, for the next call
IDLE_S = 10.0

#: the tools, as the JSON schemas a chat template takes (``tools=``)
TOOLS = {
    "python": {
        "type": "function",
        "function": {
            "name": "python",
            "description": (
                "Run a Python 3 program in an isolated sandbox (no network, no files but "
                "/scratch) and return what it prints (stdout and stderr), or its error."
            ),
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {
                        "type": "string",
                        "description": "the program; print() what you want to see",
                    }
                },
                "required": ["code"],
            },
        },
    },
}


@dataclass
class ToolRun:
    """A tool call, queued or running (``running`` and ``since`` as a reward request's)."""

    tenant: str
    pipeline: str
    payload: dict
    bytes: int
    arrival: float
    done: asyncio.Future
    since: float = 0.0
    running: bool = False
    abandoned: bool = False


def check_arguments(tool: str, arguments: dict, max_source_bytes: int) -> None:
    """Refuse what the tool cannot take.

    Raises:
        ServiceError: 404 for an unknown tool, 422 naming a wrong, missing or too large
            argument.
    """
    if tool not in TOOLS:
        raise ServiceError(404, f"unknown tool {tool!r}: known {sorted(TOOLS)}")
    params = TOOLS[tool]["function"]["parameters"]
    unknown = sorted(set(arguments) - set(params["properties"]))
    if unknown:
        raise ServiceError(
            422,
            f"tool {tool!r} takes the arguments {sorted(params['properties'])}; unknown: {unknown}",
        )
    for name in params["required"]:
        if name not in arguments:
            raise ServiceError(422, f"tool {tool!r} needs the argument {name!r}")
    code = arguments["code"]
    if not isinstance(code, str):
        raise ServiceError(
            422, f"tool {tool!r}: argument 'code' must be a string, got {type(code).__name__}"
        )
    size = len(code.encode("utf-8", errors="surrogatepass"))
    if size > max_source_bytes:
        raise ServiceError(
            422,
            f"tool {tool!r}: code is {size} bytes, over the pipeline's max_source_bytes "
            f"({max_source_bytes})",
        )


class ToolRuns:
    """Tool calls of :class:`~.core.RewardService` (a mixin: it uses the service's
    ``config``, ``pools``, ``budget``, ``closing``, ``_ensure``, ``_dispatch``, ``_stop``)."""

    def _init_tools(self) -> None:
        self.tool_live: collections.Counter[str] = collections.Counter()  # pipeline -> calls
        self._tool_mine: collections.Counter[tuple[str, str]] = collections.Counter()
        self.tool_runs_done = 0

    def tool_pipeline(self, name: str | None) -> str:
        """The tool pipeline a call names (``None``: the only one).

        Raises:
            ServiceError: 404 when none is configured or ``name`` is unknown; 422 for a
                pipeline of another kind, or ``None`` among several.
        """
        tools = sorted(n for n, p in self.config.pipelines.items() if p.kind == "tool")
        if name is None:
            if not tools:
                raise ServiceError(
                    404, "this service has no tool pipeline: add a pipeline of kind 'tool'"
                )
            if len(tools) > 1:
                raise ServiceError(422, f"several tool pipelines {tools}: name one (pipeline)")
            return tools[0]
        if name not in self.config.pipelines:
            raise ServiceError(404, f"unknown pipeline {name!r}: tool pipelines {tools}")
        if name not in tools:
            raise ServiceError(
                422, f"pipeline {name!r} scores rewards, it runs no tools: tool pipelines {tools}"
            )
        return name

    def tool_payload(self, pipeline: str, tool: str, arguments: dict, timeout_s) -> dict:
        """The stage's payload of a valid call (``timeout_s``: default the sandbox's).

        Raises:
            ServiceError: as :func:`check_arguments`; 422 for a ``timeout_s`` over the
                pipeline's sandbox ``wall_s``.
        """
        options = self.config.pipelines[pipeline].stages["run"].options
        check_arguments(tool, arguments, options.get("max_source_bytes", MAX_SOURCE_BYTES))
        wall = Limits(**options.get("sandbox", {})).wall_s
        if timeout_s is None:
            timeout_s = wall
        elif timeout_s > wall:
            raise ServiceError(
                422,
                f"timeout_s {timeout_s:g} is over the tool pipeline's sandbox wall_s "
                f"({wall:g} s): a call may only tighten it",
            )
        return {"tool": tool, "arguments": arguments, "timeout_s": timeout_s}

    async def run_tool(
        self,
        tenant: str,
        tool: str,
        arguments: dict,
        timeout_s: float | None = None,
        pipeline: str | None = None,
        size: int = 0,
    ) -> dict:
        """Run ``tool`` for ``tenant`` in a sandbox; its answer ``{"tool", "ok", "status",
        "output", "error", "truncated", "seconds", "latency_s"}`` (``seconds``: the run;
        ``latency_s``: this call in the service, queueing and worker start included).
        ``size``: what ``arguments`` hold in memory (:func:`.budget.payload_bytes`).

        Raises:
            ServiceError: 404/422 as :meth:`tool_pipeline` and :meth:`tool_payload`;
                413/429 over the queued-bytes caps; 429 when the call did not start within
                the stage's ``timeout_s``; 503 while the service shuts down.
        """
        if self.closing:
            raise ServiceError(503, "the service is shutting down: retry on its next instance")
        name = self.tool_pipeline(pipeline)
        payload = self.tool_payload(name, tool, arguments, timeout_s)
        pool = self.pools[name][0]
        self.budget.take(tenant, size)
        loop = asyncio.get_running_loop()
        run = ToolRun(tenant, name, payload, size, time.monotonic(), loop.create_future())
        self.tool_live[name] += 1
        self._tool_mine[(name, tenant)] += 1
        try:
            self._tool_scale(name, up=True)
            prio = self._tool_mine[(name, tenant)]  # fair: fewer calls in flight first
            heapq.heappush(pool.queue, (prio, run.arrival, next(pool.seq), run))
            self._dispatch(pool)
            # the queue, then the run (bounded by the stage timeout in _run_tool)
            try:
                out = await asyncio.wait_for(asyncio.shield(run.done), pool.timeout_s)
            except TimeoutError:
                if not run.running:
                    raise ServiceError(
                        429,
                        f"the tool pool {name!r} started no worker for this call within "
                        f"{pool.timeout_s:g} s (all busy): retry",
                        retry_after_s=1,
                    ) from None
                out = await run.done
        finally:
            run.abandoned = True  # a queued call nobody waits for is skipped
            self.budget.give(tenant, size)
            self.tool_live[name] -= 1
            self._tool_mine[(name, tenant)] -= 1
            if not self._tool_mine[(name, tenant)]:
                del self._tool_mine[(name, tenant)]
            if not self.closing:
                loop.call_later(IDLE_S, self._tool_scale, name)
        return {"tool": tool, **out, "latency_s": time.monotonic() - run.arrival}

    def _tool_scale(self, pipeline: str, up: bool = False) -> None:
        """Workers for the calls in flight, within ``min_workers`` and ``max_workers``
        (``up``: only grow, as a call arrives)."""
        if self.closing:
            return
        cfg = self.config.pipelines[pipeline].stages["run"]
        pool = self.pools[pipeline][0]
        want = max(cfg.min_workers, self.tool_live[pipeline])
        if up:
            want = max(want, pool.target)
        pool.target = min(want, cfg.max_workers)
        self._ensure(pool)

    async def _run_tool(self, pool: Pool, proc: Proc, run: ToolRun) -> None:
        """Run one call on ``proc``; always answers ``run.done``."""
        if run.abandoned:  # its caller left while it queued
            pool.account()
            pool.busy.discard(proc)
            pool.idle.append(proc)
            self._dispatch(pool)
            return
        t0 = time.monotonic()
        out, healthy = None, True
        try:
            out = await asyncio.wait_for(proc.call(run.payload, {}), pool.timeout_s)
            if "status" not in out:  # the stage function raised (the worker's own answer)
                out = _failed("crashed", f"tool run failed: {out.get('detail', '')}")
        except TimeoutError:
            healthy = False
            out = _failed(
                "timeout", f"timeout: the tool run passed its stage's {pool.timeout_s:g} s limit"
            )
        except Exception as e:  # the worker died under the call
            healthy = False
            out = _failed("crashed", f"sandbox worker failed: {e}")
        finally:
            if out is None:  # cancelled (shutdown)
                out = _failed("crashed", "the service shut down during the run")
            if not run.done.done():
                run.done.set_result(out)
        dt = time.monotonic() - t0
        pool.account()
        pool.busy.discard(proc)
        pool.busy_s += dt
        self.tool_runs_done += 1
        if not healthy:
            self._stop(proc)
            self._ensure(pool)
        elif proc.retire or self.closing:
            self._stop(proc)
        else:
            pool.idle.append(proc)
        self._dispatch(pool)


def _failed(status: str, error: str) -> dict:
    return {
        "ok": False,
        "status": status,
        "output": "",
        "error": error,
        "truncated": False,
        "seconds": 0.0,
    }
