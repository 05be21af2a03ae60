"""Agent rollouts in the planner: turns per episode, tool latency, observation tokens.

An agent episode is several assistant turns (model prefill + decode) separated by tool calls:
a turn that is not the episode's last ends in one tool call, whose wall time the episode waits
out with no device work of its own, then the tool's observation (``observation_tokens``) is
appended and prefilled and the next turn decodes. Other episodes' turns decode meanwhile
(continuous batching), so only part of the tool time lands on the step's critical path.

**What the profile measures.** The rollout component's points are the *model* time of the
whole agent rollout per step (every turn's prefill and decode, observation prefill included)
with tools answering at once: what ``m2flow profile`` or the emulator with zero tool latency
measures. The ``agent:`` block adds the tool time the planner cannot measure on the devices::

    agent:                              # optional; the rollout of agent episodes
      component: rollout                # the component that runs the episodes
      episodes_per_item: 8              # episodes per batch item (GRPO: the group size)
      turns: {1: 0.2, 2: 0.5, 3: 0.3}   # assistant turns per episode: {turns: share}, or an int
      tool_latency_s: {median: 2.0, p90: 6.0}   # per tool call: lognormal (or {samples: [...]})
      tool_timeout_s: null              # a call is cut here (agent.tool_timeout_s; null: never)
      observation_tokens: 200           # tokens appended per tool call (the emulator's)

**The model** (:class:`AgentRolloutTime`). Episodes run independently (a turn is resubmitted
the moment its tool returns), so the step's rollout ends with its slowest episode: its *critical
path* is its own turns' decode plus its own tool waits. With ``E = batch_size x
episodes_per_item`` episodes, episode ``i`` has ``T_i`` turns and waits ``S_i = sum_{j < T_i}
X_ij`` on tools (``X`` iid latencies, each ``min(X, tool_timeout_s)``). With tools answering at
once the step takes the measured ``model(n)``: ``T_max`` waves of turns (the longest episodes'),
a turn ``d(n) = model(n) / T_max``. The planner prices

    rollout(n) = max( model(n),  E[max_i (S_i + T_i d(n))] ),
    E[max_i Y_i] = integral_0^inf (1 - F_Y(x)^E) dx,

``F_Y`` the mixture over the turn table of the ``(T - 1)``-fold convolution of the latency's law
shifted by ``T d`` (on a grid; exact for the rounded law). The ``max``: zero latency or one
turn give ``model(n)`` exactly; a tool wait batching hides (shorter than the turns other
episodes still decode) costs nothing. Assumptions: a turn of the critical episode takes a
whole wave's time whatever the batch (decode memory-bound: an iteration costs about the weight
read at any batch), and the engine's busy time does not grow when tool waits spread the turns
out (it does: see ``docs/results/planning.md``, "Agents", for the error against the emulated
engine). The tool wait is ``rollout(n) - model(n)``; ``tau = E[max_i S_i]``
(:func:`tool_wait_s`) is the rollout's limit as the model time goes to 0.

**Pipelined** in ``k`` chunks (the flow shop of :mod:`.cost`, a chunk taking ``(T - o) / k +
o``): a chunk holds at least one item's episodes and waits at least for their slowest tool
chain, so ``tau`` over ``episodes_per_item`` episodes is added to the per-chunk fixed cost
``o``; the rest of the wait is split over the chunks like the decode time (a streaming rollout
overlaps its chunks' tool waits).

**With bounded staleness** (:mod:`.staleness`): a waiting episode holds no decode slot, so the
tool wait is idle device time that partial rollouts of later steps fill, as they fill the
long tail: :func:`idle_share` folds it into the tail share ``u`` (``m2flow plan --staleness``).

Not used: the synchronous-turn model (:func:`synchronous_turns_s`: each turn waits for the
slowest tool call of its batch, ``sum_t E[max]``, for an agent loop that barriers every turn),
which is >= ``tau`` (the max of sums is at most the sum of maxes) and far above the emulated
engine's times. Pure: numpy and scipy only.

Not modelled: several tool calls per turn (their max would replace ``X``), tool time that
grows with load (a shared sandbox pool), a tool that fails fast (every call draws the same
law), and a spot pool's rollout of agent episodes (its rate stays the profile's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

_Z90 = NormalDist().inv_cdf(0.9)  # a lognormal's p90 / median = exp(sigma * z90)
_GRID = 4096  # grid points per tool call's latency range
_TAIL = 1e-9  # latency mass beyond the grid's end (uncapped lognormal)


class AgentError(ValueError):
    """An ``agent:`` block that cannot be planned from (the message names the key and the fix)."""


@dataclass(frozen=True)
class ToolLatency:
    """Seconds of one tool call: a lognormal (``median_s``, ``p90_s``) or the empirical law of
    ``samples`` (seconds, each drawn with equal chance), cut at ``timeout_s`` (``None``: never).
    """

    median_s: float | None = None
    p90_s: float | None = None
    samples: tuple[float, ...] = ()
    timeout_s: float | None = None

    @property
    def sigma(self) -> float:
        """The lognormal's log-space standard deviation, ``ln(p90 / median) / z_0.9``."""
        if not self.median_s or self.p90_s is None:
            return 0.0
        return math.log(self.p90_s / self.median_s) / _Z90

    def quantile(self, u) -> np.ndarray:
        """Latency (seconds) at probability ``u`` in (0, 1) (array), the timeout applied."""
        u = np.asarray(u, dtype=np.float64)
        if self.samples:
            s = np.sort(np.asarray(self.samples, dtype=np.float64))
            x = s[np.minimum((u * len(s)).astype(np.int64), len(s) - 1)]
        elif not self.median_s:
            x = np.zeros_like(u)
        else:
            z = np.array([NormalDist().inv_cdf(float(v)) for v in u.ravel()]).reshape(u.shape)
            x = self.median_s * np.exp(self.sigma * z)
        return x if self.timeout_s is None else np.minimum(x, self.timeout_s)

    def cdf(self, x) -> np.ndarray:
        """``P(latency <= x)`` (seconds; array)."""
        x = np.asarray(x, dtype=np.float64)
        if self.samples:
            s = np.sort(np.asarray(self.samples, dtype=np.float64))
            f = np.searchsorted(s, x, side="right") / len(s)
        elif not self.median_s:
            f = (x >= 0).astype(np.float64)
        elif self.sigma == 0.0:
            f = (x >= self.median_s).astype(np.float64)
        else:
            from scipy.special import ndtr

            with np.errstate(divide="ignore"):
                z = (np.log(np.maximum(x, 0.0)) - math.log(self.median_s)) / self.sigma
            f = ndtr(z)
        if self.timeout_s is not None:
            f = np.where(x >= self.timeout_s, 1.0, f)
        return f

    def upper(self) -> float:
        """The grid's end: the largest latency (timeout, sample) or the ``1 - 1e-9`` quantile."""
        if self.timeout_s is not None:
            return float(self.timeout_s)
        if self.samples:
            return float(max(self.samples))
        return float(self.quantile(np.array([1.0 - _TAIL]))[0])

    def mean_s(self) -> float:
        """Mean seconds of one call (numerical, on the planner's grid)."""
        dx, p = self.pmf()
        return float(np.dot(np.arange(len(p)) * dx, p))

    def pmf(self) -> tuple[float, np.ndarray]:
        """``(dx, p)``: the latency rounded to the nearest multiple of ``dx`` seconds, ``p[k] =
        P(latency ~ k dx)`` (the mass past the grid's end on its last point)."""
        hi = self.upper()
        if hi <= 0:
            return 1.0, np.array([1.0])
        dx = hi / _GRID
        edges = self.cdf((np.arange(_GRID + 1) + 0.5) * dx)
        p = np.diff(np.concatenate([[0.0], edges]))
        p[-1] += 1.0 - edges[-1]
        return dx, np.maximum(p, 0.0)


@dataclass(frozen=True)
class AgentWorkload:
    """The ``agent:`` block of a profile (module docstring): ``turns`` as ``(turns, share)``
    pairs (shares sum to 1), the tool latency, tokens appended per tool call."""

    component: str = "rollout"
    episodes_per_item: int = 1
    turns: tuple[tuple[int, float], ...] = ((1, 1.0),)
    tool_latency: ToolLatency = ToolLatency()
    observation_tokens: int = 0

    @property
    def max_turns(self) -> int:
        return max(t for t, _ in self.turns)

    def mean_turns(self) -> float:
        return float(sum(t * s for t, s in self.turns))

    def turns_at(self, u) -> np.ndarray:
        """Turns per episode by inverse CDF of uniforms ``u`` in (0, 1) (array -> int64)."""
        ts = np.array([t for t, _ in self.turns], dtype=np.int64)
        cum = np.cumsum([s for _, s in self.turns])
        idx = np.searchsorted(cum, np.asarray(u, dtype=np.float64), side="right")
        return ts[np.minimum(idx, len(ts) - 1)]

    def to_dict(self) -> dict[str, Any]:
        """The ``agent:`` block (:func:`agent_from_dict` reads back an equal workload)."""
        lat = self.tool_latency
        law = None  # tools answer at once
        if lat.samples:
            law = {"samples": list(lat.samples)}
        elif lat.median_s is not None:
            law = {"median": lat.median_s, "p90": lat.p90_s}
        return {
            "component": self.component,
            "episodes_per_item": self.episodes_per_item,
            "turns": {int(t): float(s) for t, s in self.turns},
            "tool_latency_s": law,
            "tool_timeout_s": lat.timeout_s,
            "observation_tokens": self.observation_tokens,
        }


def _sum_laws(agent: AgentWorkload) -> tuple[float, dict[int, np.ndarray]]:
    """``(dx, {turns: cdf})``: per turn count ``T`` of the table, the CDF of an episode's tool
    wait ``S`` (``T - 1`` latencies summed) on the grid ``k dx`` (``cdf[k] = P(S <= k dx)``)."""
    from scipy.signal import fftconvolve

    dx, p = agent.tool_latency.pmf()
    laws, conv = {}, np.array([1.0])
    for calls in range(agent.max_turns):
        if calls:
            conv = np.maximum(fftconvolve(conv, p), 0.0)
        laws[calls + 1] = np.minimum(np.cumsum(conv), 1.0)
    return dx, {t: laws[t] for t, _ in agent.turns}


def _expected_max(agent: AgentWorkload, episodes: int, per_turn_s: float, laws) -> float:
    """``E[max_i (S_i + T_i d)]`` over ``episodes`` iid episodes, ``d = per_turn_s``: exact for
    the discretised law (its CDF is a step function: the sum over its steps of ``(1 -
    F^E)`` times the step's width, from the least value ``T_min d``)."""
    dx, cdfs = laws
    shares = dict(agent.turns)
    xs = np.unique(np.concatenate([t * per_turn_s + np.arange(len(c)) * dx
                                   for t, c in cdfs.items()]))  # fmt: skip
    f = np.zeros(len(xs))
    for t, c in cdfs.items():
        k = np.floor((xs - t * per_turn_s) / dx + 1e-9).astype(np.int64)
        f += shares[t] * np.where(k < 0, 0.0, c[np.clip(k, 0, len(c) - 1)])
    f = np.minimum(f, 1.0)
    return float(xs[0] + np.sum(np.diff(xs) * (1.0 - f[:-1] ** episodes)))


def tool_wait_s(agent: AgentWorkload, episodes: int) -> float:
    """``tau = E[max_i S_i]``: seconds of the slowest of ``episodes`` episodes' tool waits
    (module docstring); 0.0 with one turn per episode or zero latency (then the planner
    adds nothing).

    Raises:
        ValueError: ``episodes`` < 1.
    """
    if episodes < 1:
        raise ValueError(f"episodes = {episodes}: need at least one episode per step")
    if agent.max_turns <= 1 or agent.tool_latency.upper() <= 0:
        return 0.0
    return _expected_max(agent, episodes, 0.0, _sum_laws(agent))


def synchronous_turns_s(agent: AgentWorkload, episodes: int) -> float:
    """The synchronous-turn tool wait (module docstring): ``sum_t E[max]`` of the tool calls
    after turn ``t``, over a binomial ``(episodes, P(T > t))`` count of callers (seconds).

    Raises:
        ValueError: ``episodes`` < 1.
    """
    if episodes < 1:
        raise ValueError(f"episodes = {episodes}: need at least one episode per step")
    if agent.max_turns <= 1 or agent.tool_latency.upper() <= 0:
        return 0.0
    dx, p = agent.tool_latency.pmf()
    cdf = np.minimum(np.cumsum(p), 1.0)
    total = 0.0
    for t in range(1, agent.max_turns):
        q = sum(s for n, s in agent.turns if n > t)  # P(an episode calls a tool after turn t)
        total += dx * float(np.sum(1.0 - (1.0 - q + q * cdf) ** episodes))
    return total


class AgentRolloutTime:
    """The agent component's seconds per step on ``n`` devices (module docstring)::

        rollout(n) = max(model(n), E[max_i (S_i + T_i model(n) / T_max)])

    ``model``: the fitted model time (a :mod:`.fit` fit or any ``n -> seconds``); evaluated
    with an int or an int array (memoised per model time)."""

    vectorized = True

    def __init__(self, model, agent: AgentWorkload, episodes: int) -> None:
        self.model, self.agent, self.episodes = model, agent, episodes
        self._laws = _sum_laws(agent)
        self._memo: dict[float, float] = {}

    def at(self, model_s: float) -> float:
        """``rollout`` for a model time of ``model_s`` seconds."""
        model_s = float(model_s)
        if model_s not in self._memo:
            d = model_s / self.agent.max_turns
            path = _expected_max(self.agent, self.episodes, d, self._laws)
            self._memo[model_s] = max(model_s, path)
        return self._memo[model_s]

    def __call__(self, n):
        m = np.asarray(self.model(n), dtype=np.float64)
        out = np.array([self.at(x) if np.isfinite(x) else x for x in m.ravel()]).reshape(m.shape)
        return float(out) if out.ndim == 0 else out


def with_tool_wait(component, agent: AgentWorkload, episodes: int):
    """``component`` (a :class:`~.planner.Component`) as the agent's rollout of ``episodes``
    episodes a step: its time :class:`AgentRolloutTime`, its per-chunk fixed cost plus
    ``tool_wait_s(agent, episodes_per_item)`` (module docstring); itself when the step's tool
    wait :func:`tool_wait_s` is 0."""
    from dataclasses import replace

    if tool_wait_s(agent, episodes) <= 0:
        return component
    return replace(
        component,
        time=AgentRolloutTime(component.time, agent, episodes),
        chunk_overhead=component.chunk_overhead + tool_wait_s(agent, agent.episodes_per_item),
    )


def idle_share(model_s: float, rollout_s: float, length_tail: float = 0.0) -> float:
    """The rollout's idle device share with tool waits, for the staleness model's tail ``u``
    (:mod:`.staleness`): the devices work ``(1 - u_len) model_s`` of the ``rollout_s`` the
    stage lasts, so ``u = 1 - (1 - u_len) model_s / rollout_s`` (``u_len``: the response-length
    tail; ``length_tail`` in [0, 1)). Partial rollouts fill tool waits as they fill the tail:
    a waiting episode holds no decode slot, so with ``K >= 1`` later steps' episodes decode
    meanwhile, up to the same ``K / (K + 1)`` bound."""
    if rollout_s <= 0:
        return length_tail
    return min(max(1.0 - (1.0 - length_tail) * model_s / rollout_s, length_tail), 1.0 - 1e-9)


# -- the profile's agent: block ---------------------------------------------------------------

_KEYS = {"component", "episodes_per_item", "turns", "tool_latency_s", "tool_timeout_s",
         "observation_tokens"}  # fmt: skip
_HOW = "see m2flow.scheduler.plan.agent"


def _num(value: Any, where: str, minimum: float = 0.0, integer: bool = False, above=False):
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise AgentError(f"{where} = {value!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AgentError(f"{where} = {value!r}: give a finite number ({_HOW})")
    if integer and not float(value).is_integer():
        raise AgentError(f"{where} = {value!r}: give a whole number")
    if value < minimum or (above and value <= minimum):
        raise AgentError(f"{where} = {value!r}: give a number {'>' if above else '>='} {minimum:g}")
    return int(value) if integer else float(value)


def _turns(doc: Any) -> tuple[tuple[int, float], ...]:
    where = "agent.turns"
    if not isinstance(doc, Mapping):
        return ((_num(doc, where, 1, integer=True), 1.0),)
    if not doc:
        raise AgentError(
            f"{where}: empty; give {{turns: share}}, e.g. {{1: 0.3, 2: 0.7}}, or an int"
        )
    pairs = []
    for t, s in doc.items():
        pairs.append((_num(t, f"{where} key {t!r}", 1, integer=True),
                      _num(s, f"{where}[{t}]")))  # fmt: skip
    total = sum(s for _, s in pairs)
    if abs(total - 1.0) > 1e-6:
        raise AgentError(
            f"{where}: the shares sum to {total:.6g}, not 1; give each turn count's share of "
            "the episodes (e.g. {1: 0.3, 2: 0.7})"
        )
    return tuple(sorted(pairs))


def _latency(doc: Any, timeout: float | None) -> ToolLatency:
    where = "agent.tool_latency_s"
    if doc is None:
        return ToolLatency(timeout_s=timeout)
    if not isinstance(doc, Mapping) or not doc or set(doc) - {"median", "p90", "samples"}:
        raise AgentError(
            f"{where} = {doc!r}: give {{median: <s>, p90: <s>}} (a lognormal) or {{samples: "
            f"[<s>, ...]}} (measured calls) ({_HOW})"
        )
    if "samples" in doc:
        if set(doc) != {"samples"}:
            raise AgentError(f"{where}: give either samples or median/p90, not both")
        s = doc["samples"]
        if not isinstance(s, list) or not s:
            raise AgentError(f"{where}.samples: give a non-empty list of seconds")
        return ToolLatency(
            samples=tuple(_num(x, f"{where}.samples[{i}]") for i, x in enumerate(s)),
            timeout_s=timeout,
        )
    if "median" not in doc:
        raise AgentError(f"{where}: missing median; add median: <seconds> (and p90: <seconds>)")
    median = _num(doc["median"], f"{where}.median")
    p90 = _num(doc.get("p90", median), f"{where}.p90")
    if p90 < median:
        raise AgentError(
            f"{where}: p90 = {p90:g} s < median = {median:g} s; the p90 is the slower one"
        )
    if median == 0 and p90 > 0:
        raise AgentError(f"{where}: median = 0 with p90 = {p90:g}; a lognormal needs median > 0")
    return ToolLatency(median, p90, (), timeout)


def agent_from_dict(doc: Any, components: Mapping | None = None) -> AgentWorkload:
    """Validate an ``agent:`` block (module docstring) into an :class:`AgentWorkload`.

    Raises:
        AgentError: not a mapping, an unknown key, a component the profile does not measure,
            a bad turns table (a count < 1, shares not summing to 1), a latency law that is
            neither ``{median, p90}`` (``p90 >= median``) nor ``{samples}``, or a negative,
            non-finite or non-numeric number; the message names the key and the fix.
    """
    if not isinstance(doc, Mapping):
        raise AgentError(f"agent: expected a mapping ({_HOW}), got {doc!r}")
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise AgentError(f"agent: unknown keys {unknown}; known keys: {sorted(_KEYS)}")
    name = str(doc.get("component", "rollout"))
    if components is not None and name not in components:
        raise AgentError(
            f"agent.component {name!r} is not a profiled component (components: "
            f"{sorted(components)}); name the rollout component"
        )
    timeout = doc.get("tool_timeout_s")
    timeout = None if timeout is None else _num(timeout, "agent.tool_timeout_s", above=True)
    return AgentWorkload(
        component=name,
        episodes_per_item=_num(
            doc.get("episodes_per_item", 1), "agent.episodes_per_item", 1, integer=True
        ),
        turns=_turns(doc.get("turns", 1)),
        tool_latency=_latency(doc.get("tool_latency_s"), timeout),
        observation_tokens=_num(
            doc.get("observation_tokens", 0), "agent.observation_tokens", integer=True
        ),
    )
