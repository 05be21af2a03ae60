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
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

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
