"""When each response of a rollout step finishes on emulated engines, without Ray or sleeping.

:class:`~.emulated.EmulatedEngine` times one engine call (a block of decode iterations over the
requests it is given); the spot pool's loops (:func:`.spot.pool.seed`, the instances) decide
which requests each engine runs. :func:`rollout_finish_times` is that loop with no manager in
between, for trace generation (e.g. the reward service's request arrivals at cluster scale,
``benchmarks/reward_cluster.py``): ``n_engines`` engines share one queue of requests in key
order; whenever an engine's clock is the earliest, it leases up to ``max_batch - running``
requests from the queue, at most ``ceil(N / n_engines)`` at a time so that the first leases
split the ``N`` requests evenly (as the manager's dispatch spreads them; a lease of all the
room would give the first engine everything that fits), then keeps its batch full from the
queue as requests end (continuous batching, as ``pool.seed`` leases), runs one
:meth:`~.emulated.EmulatedEngine.step` of ``block`` tokens (sleep disabled: only the modelled
seconds count), and every request that ended in that block finishes at the engine's clock
after it -- the time the pool would report it. So a finish time is exact to one block (a
request that ends mid-block is reported at the block's end, as live). Weight loading is not
included (the step starts with the weights in place). Times are modelled seconds from the
step's start.

:func:`agent_finish_times` is the same loop over agent episodes
(:class:`~m2flow.scheduler.plan.agent.AgentWorkload`: turns per episode, tool latency,
observation tokens): each turn is one request; when it ends, its episode waits out a tool call
on the modelled clock (no device work) and its next turn returns to the same engine (session
affinity, so the engine's prefix cache holds its context and only the observation tokens and
later turns are prefilled). ``benchmarks/agent_plan.py`` compares it with the planner.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...scheduler.plan.agent import AgentWorkload
from .emulated import EmulatedEngine, ResponseLengths, ThroughputModel
from .exact import GenRequest


def rollout_finish_times(
    model: ThroughputModel,
    lengths: ResponseLengths,
    keys: Sequence[tuple[int, int, int]],
    n_engines: int,
    seed: int = 0,
    max_batch: int = 256,
    block: int = 128,
    prompt_tokens: int = 200,
    max_new_tokens: int = 16384,
) -> tuple[np.ndarray, np.ndarray]:
    """Finish time (seconds after the step's start) and length (tokens) of each response.

    Args:
        model: every engine's throughput model (e.g. ``throughput_preset("qwen3-8b")``).
        lengths: the response length distribution; a response's length is drawn from
            ``(seed, key)`` (:meth:`ResponseLengths.lengths`), as on a live engine.
        keys: ``(step, prompt, sample)`` per response, in the order the queue serves them.
        n_engines: engines sharing the queue.
        seed: the run seed (the length counter's).
        max_batch: most requests an engine runs at once (the pool's ``max_batch``).
        block: tokens per engine call (the pool's ``block_tokens``).
        prompt_tokens: modelled prompt length (tokens).
        max_new_tokens: the response cap (with ``lengths.cap``).

    Returns:
        ``(finish_s, tokens)``: arrays in ``keys`` order (seconds; response tokens).

    Raises:
        ValueError: ``n_engines``, ``max_batch`` or ``block`` < 1.
    """
    if min(n_engines, max_batch, block) < 1:
        raise ValueError(f"need n_engines, max_batch, block >= 1: {n_engines, max_batch, block}")
    reqs = [GenRequest(f"{k[0]}:{k[1]}:{k[2]}", [0], tuple(k), max_new_tokens) for k in keys]
    engines = [
        EmulatedEngine(model, lengths, 1, 2, seed, prompt_tokens=prompt_tokens, sleep=_no_sleep)
        for _ in range(n_engines)
    ]
    finish = np.full(len(reqs), np.nan)
    running: list[list[int]] = [[] for _ in engines]
    share = -(-len(reqs) // n_engines)  # most requests per lease
    nxt = 0  # the queue's head
    clocks = [(0.0, e) for e in range(n_engines)]  # (engine clock, engine): earliest first
    while clocks:
        _, e = heapq.heappop(clocks)
        take = min(max_batch - len(running[e]), len(reqs) - nxt, share)
        running[e] += range(nxt, nxt + take)
        nxt += take
        if not running[e]:
            continue  # nothing left for this engine
        eng = engines[e]
        eng.step([reqs[i] for i in running[e]], block, 0)
        done = [i for i in running[e] if reqs[i].done]
        finish[done] = eng.emulated_s
        running[e] = [i for i in running[e] if not reqs[i].done]
        heapq.heappush(clocks, (eng.emulated_s, e))
    return finish, np.array([len(r.tokens) for r in reqs], dtype=np.int64)


def _no_sleep(seconds: float) -> None:
    """The engines' sleep: modelled time only."""


# Counter salts (a 4th key column): turn counts and tool latencies never equal a length draw.
_TURNS_SALT = 0xA6E7_7001
_TOOL_SALT = 0xA6E7_7002
TURN_STRIDE = 1 << 20  # turn t > 0 draws its length at key (step, prompt, sample + t * stride)


@dataclass
class AgentRollout:
    """One emulated step of agent episodes (arrays in episode order; seconds from the step's
    start, modelled).

    Attributes:
        finish_s: when each episode's last turn ended ``[E]``.
        turns: assistant turns per episode (drawn) ``[E]``.
        model_tokens: tokens the model generated over all turns ``[E]``.
        tool_s: seconds the episode waited on its tools ``[E]``.
        busy_s: per engine, modelled seconds of prefill and decode ``[n_engines]``.
    """

    finish_s: np.ndarray
    turns: np.ndarray
    model_tokens: np.ndarray
    tool_s: np.ndarray
    busy_s: np.ndarray

    @property
    def step_s(self) -> float:
        """The rollout's seconds: when the last episode ended."""
        return float(self.finish_s.max()) if len(self.finish_s) else 0.0


def agent_draws(agent: AgentWorkload, keys, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(turns [E], tool latency seconds [E, max_turns - 1])`` of the episodes ``keys``
    ``[E, 3]``: a function of ``(seed, key)`` alone (counter draws), so a rerun or another
    engine count sees the same episodes. Latency ``[i, t]`` is the call after turn ``t + 1``."""
    from ..llm.sampling import counter_uniforms_at  # here: that module imports torch

    k = np.asarray(keys, dtype=np.int64).reshape(-1, 3)
    e = len(k)
    salt = np.full((e, 1), _TURNS_SALT, dtype=np.int64)
    turns = agent.turns_at(counter_uniforms_at(seed, np.hstack([k, salt]), np.zeros(e)))
    calls = max(agent.max_turns - 1, 0)
    tk = np.repeat(np.hstack([k, np.full((e, 1), _TOOL_SALT, dtype=np.int64)]), calls, axis=0)
    u = counter_uniforms_at(seed, tk, np.tile(np.arange(calls), e))
    lat = agent.tool_latency.quantile(u).reshape(e, calls) if calls else np.zeros((e, 0))
    return turns, lat


def agent_finish_times(
    model: ThroughputModel,
    lengths: ResponseLengths,
    agent: AgentWorkload,
    keys: Sequence[tuple[int, int, int]],
    n_engines: int,
    seed: int = 0,
    max_batch: int = 256,
    block: int = 128,
    prompt_tokens: int = 200,
    max_new_tokens: int = 16384,
) -> AgentRollout:
    """Emulate one rollout step of agent episodes on ``n_engines`` engines (modelled time).

    New episodes are leased from one queue as in :func:`rollout_finish_times`; an episode's
    turn ``t`` is a request of context ``prompt_tokens`` + its earlier turns + ``t x
    observation_tokens``, length drawn at key ``(step, prompt, sample + t * TURN_STRIDE)``
    from ``lengths`` (per turn, capped at ``max_new_tokens``). When a turn that is not the
    episode's last ends (at its block's end), its tool call's latency (:func:`agent_draws`) is
    waited on the engine's clock, then the next turn joins the same engine's batch (ahead of
    new episodes). An engine with nothing to run idles until its next tool call returns. With
    one turn per episode the finish times equal :func:`rollout_finish_times`'s.

    Args: as :func:`rollout_finish_times`, plus ``agent`` (its turns, tool latency and
    observation tokens; ``component`` and ``episodes_per_item`` are the planner's).

    Raises:
        ValueError: ``n_engines``, ``max_batch`` or ``block`` < 1.
    """
    if min(n_engines, max_batch, block) < 1:
        raise ValueError(f"need n_engines, max_batch, block >= 1: {n_engines, max_batch, block}")
    keys = [tuple(int(x) for x in k) for k in keys]
    turns, latency = agent_draws(agent, keys, seed)
    n = len(keys)
    engines = [
        EmulatedEngine(model, lengths, 1, 2, seed, sleep=_no_sleep, prefix_cache=True)
        for _ in range(n_engines)
    ]
    ctx = np.full(n, prompt_tokens, dtype=np.int64)  # context at the next turn's start
    done_turns = np.zeros(n, dtype=np.int64)
    made = np.zeros(n, dtype=np.int64)
    tool = np.zeros(n)
    finish = np.full(n, np.nan)
    idle = [0.0] * n_engines  # an engine's clock: its idle seconds + its modelled seconds
    running: list[dict[int, GenRequest]] = [{} for _ in engines]
    waiting: list[list[tuple[float, int]]] = [[] for _ in engines]  # (tool returns at, episode)
    share = -(-n // n_engines)
    nxt = 0

    def turn_request(i: int) -> GenRequest:
        s, p, k = keys[i]
        key = (s, p, k + int(done_turns[i]) * TURN_STRIDE)
        return GenRequest(f"{s}:{p}:{k}", [0] * int(ctx[i]), key, max_new_tokens)

    heap = [(0.0, e) for e in range(n_engines)]
    while heap:
        now, e = heapq.heappop(heap)
        room = max_batch - len(running[e])
        while waiting[e] and waiting[e][0][0] <= now and room > 0:
            i = heapq.heappop(waiting[e])[1]
            running[e][i] = turn_request(i)
            room -= 1
        take = min(room, n - nxt, share)
        for i in range(nxt, nxt + take):
            running[e][i] = turn_request(i)
        nxt += take
        if not running[e]:
            if waiting[e]:  # idle until the next tool call returns
                idle[e] += max(waiting[e][0][0] - now, 0.0)
                heapq.heappush(heap, (idle[e] + engines[e].emulated_s, e))
            continue
        eng = engines[e]
        eng.step(list(running[e].values()), block, 0)
        clock = idle[e] + eng.emulated_s
        for i, r in list(running[e].items()):
            if not r.done:
                continue
            del running[e][i]
            made[i] += len(r.tokens)
            done_turns[i] += 1
            if done_turns[i] >= turns[i]:
                finish[i] = clock
                continue
            wait = float(latency[i, done_turns[i] - 1])
            tool[i] += wait
            ctx[i] += len(r.tokens) + agent.observation_tokens
            heapq.heappush(waiting[e], (clock + wait, i))
        heapq.heappush(heap, (clock, e))
    busy = np.array([eng.emulated_s for eng in engines])
    return AgentRollout(finish, turns, made, tool, busy)
