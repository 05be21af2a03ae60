"""RLBoost's load balancer: section 4.2.1, Algorithm 2, and its batching profile ``P``.

Line numbers ``paper:N`` refer to ``shared/papers/000_8942f305fc039a41.txt`` (Algorithm 2 at
paper:207-237, its explanation at paper:239-251). Algorithm line numbers are the extracted
listing's, which numbers comment lines too: from its line 20 on, the prose counts one lower
(the prose's "line 20", migrate one request, is the listing's 21; its "line 24", ``r``, is 25).
Each function is one decision on a snapshot the caller took (``QUERYPENDING`` /
``QUERYEXECUTING``, lines 5, 16-17); the loops of the pseudocode (``while true``,
``WAITANYCOMPLETION``) are the caller's:

- :func:`select_instance` -- SELECTINSTANCE lines 3-10, one pass: join the shortest queue among
  instances with fewer than ``theta`` pending requests; ``None`` means "wait for a completion
  and ask again" (line 12, delayed dispatch).
- :func:`rebalance` -- CONTINUOUSLB lines 15-27, one iteration: at most one :class:`Move`.
- :class:`ThroughputProfile` / :func:`batching_plateau` -- ``P`` and GETBATCHINGPLATEAU
  (line 24): decode throughput by batch size, captured online, calibrated to the current
  context length; the plateau ``B`` is the smallest batch size reaching ``1 - tolerance`` of
  the best throughput.

Ties are broken by the mappings' iteration order (insertion order for a dict): keys need not
be comparable, and the caller controls the order. Pure Python + numpy/scipy; no Ray, no torch.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls


def _check_counts(name: str, counts: Mapping[Hashable, int]) -> None:
    for key, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"{name}[{key!r}] must be an integer >= 0 requests, got {value!r}")


def select_instance(pending: Mapping[Hashable, int], theta: int) -> Hashable | None:
    """Algorithm 2 SELECTINSTANCE (lines 3-10), one pass over a snapshot.

    Args:
        pending: instance -> requests sent to it but not yet executing (``m_i^pending``).
        theta: ``Theta`` >= 1, the most pending requests an instance may hold.

    Returns:
        The instance with the fewest pending requests among those with fewer than ``theta``
        (line 6 admits ``m < theta``; the prose at paper:247 says "more than Theta", the
        pseudocode is followed). Line 9 takes the argmin over all of ``I``; that minimum is
        always a candidate when ``C`` is non-empty, so the two agree. Ties: the first in
        ``pending``'s iteration order. ``None`` when no instance qualifies (or there are none):
        the caller holds the request until a completion and asks again (line 12).

    Raises:
        ValueError: ``theta`` < 1 or a negative / non-integer count.
    """
    if isinstance(theta, bool) or not isinstance(theta, int | np.integer) or theta < 1:
        raise ValueError(f"theta must be an integer >= 1 pending requests, got {theta!r}")
    _check_counts("pending", pending)
    best: Hashable | None = None
    for key, m in pending.items():
        if m < theta and (best is None or m < pending[best]):
            best = key
    return best


@dataclass(frozen=True)
class Move:
    """Migrate ``count`` requests from ``src`` to ``dst`` (Algorithm 2 ``MIGRATEREQS``).

    ``executing=False``: pending (queued) requests, line 21; ``True``: requests in the running
    batch, lines 22-25 (their tokens so far move with them: the destination prefills them).
    """

    src: Hashable
    dst: Hashable
    count: int
    executing: bool


def _argmax(counts: Mapping[Hashable, int]) -> Hashable:
    best = None
    for key, m in counts.items():
        if best is None or m > counts[best]:
            best = key
    return best


def rebalance(
    pending: Mapping[Hashable, int],
    executing: Mapping[Hashable, int],
    plateau: int | None,
    room: Mapping[Hashable, int | None] | None = None,
) -> list[Move]:
    """Algorithm 2 CONTINUOUSLB, one iteration (lines 15-27) on a snapshot; at most one move.

    1. Line 18: some instance has 0 pending and another has pending requests -> move ONE
       pending request (line 21) from ``j``, the most pending (line 19), to the 0-pending
       instance with the fewest executing requests (the paper says "any"; the emptiest is the
       one that can start it soonest).
    2. Line 22, read with the prose at paper:251 ("if there are no pending requests on all
       instances"): when NO instance has pending requests and some instance executes nothing,
       move ``r = max(m_j^exec - B, 0)`` executing requests (line 25) from ``j``, the most
       executing (line 23), to the first idle one. The pseudocode's bare ``else`` would also
       fire when every instance has a queue; then each instance has its own work to start,
       so nothing moves. ``B`` is ``plateau`` (line 24); ``None`` (no profile yet: the first
       step, paper:251) -> no executing moves.
    3. Otherwise ``[]`` (also when ``r`` is 0: ``j`` is at or below the plateau, where
       splitting its batch only lowers throughput, paper:251).

    Several idle instances: one move per call; the caller applies it, re-queries and calls
    again until ``[]`` -- as the paper's ``while true`` loop does. Ties: iteration order.

    ``room`` (not in the paper): the most requests an instance may still take (a seeding
    reserved rank at its share, :func:`~.seeding.seeding_share`; ``None`` or a missing key:
    no bound). An instance with no room is no destination, and an executing move's ``r`` is
    cut to the destination's room.

    Args:
        pending: instance -> queued requests (``m^pending``).
        executing: instance -> requests in the running batch (``m^exec``); same keys.
        plateau: ``B``, the batch size where throughput plateaus (>= 1), or ``None``.
        room: instance -> requests it may still take (>= 0) or ``None``; default no bounds.

    Returns:
        ``[]`` or ``[Move]``.

    Raises:
        ValueError: different key sets, a negative / non-integer count, or ``plateau`` < 1.
    """
    if pending.keys() != executing.keys():
        raise ValueError(
            f"pending and executing must name the same instances, got {sorted(map(repr, pending))}"
            f" and {sorted(map(repr, executing))}"
        )
    _check_counts("pending", pending)
    _check_counts("executing", executing)
    if plateau is not None and (isinstance(plateau, bool) or plateau < 1):
        raise ValueError(f"plateau must be a batch size >= 1 or None, got {plateau!r}")
    room = room or {}

    def fits(k: Hashable) -> int | float:
        left = room.get(k)
        return math.inf if left is None else left

    empty = [k for k, m in pending.items() if m == 0]
    if empty and len(empty) < len(pending):  # line 18
        empty = [k for k in empty if fits(k) >= 1]
        if not empty:
            return []
        dst = min(empty, key=lambda k: executing[k])  # min() keeps the first of equals
        return [Move(_argmax(pending), dst, 1, executing=False)]  # lines 19-21
    if empty and plateau is not None:  # no pending anywhere
        idle = [k for k, m in executing.items() if m == 0 and fits(k) >= 1]
        if idle:  # line 22
            src = _argmax(executing)  # line 23
            r = int(min(max(executing[src] - plateau, 0), fits(idle[0])))  # lines 24-25
            if r > 0:
                return [Move(src, idle[0], r, executing=True)]
    return []


def batching_plateau(table: Sequence[tuple[int, float]], tolerance: float = 0.1) -> int | None:
    """GETBATCHINGPLATEAU (Algorithm 2 line 24): the smallest batch size whose throughput
    reaches ``(1 - tolerance)`` of the best in ``table``.

    Args:
        table: ``(batch_size, tokens_per_s)`` rows, any order.
        tolerance: in ``[0, 1)``; 0.1 -> the first batch size within 10% of the best.

    Returns:
        The batch size, or ``None`` with no rows or no positive throughput.

    Raises:
        ValueError: ``tolerance`` outside ``[0, 1)``, a batch size < 1 or a negative /
            non-finite throughput.
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    for b, tput in table:
        if b < 1 or not (math.isfinite(tput) and tput >= 0):
            raise ValueError(f"bad profile row ({b!r}, {tput!r}): need batch >= 1, tokens/s >= 0")
    best = max((tput for _, tput in table), default=0.0)
    if best <= 0:
        return None
    return min(int(b) for b, tput in table if tput >= (1 - tolerance) * best)


class ThroughputProfile:
    """The online batching profile ``P`` of section 4.2.1 (paper:251).

    Rollout instances report decode progress with :meth:`record` (a decode iteration, or a run
    of iterations at one batch size): batch size, tokens generated, seconds, and optionally the
    mean context length per sequence. :meth:`new_step` closes a step. The profile keeps the
    records of the last ``window_steps`` steps, the open one included (default 2: the previous
    step's rollout, "captured during the previous step", plus the current one as it goes).

    Calibration ("continuously calibrated to account for the current average context length"):
    a decode iteration's time is modelled as ``tau(b, L) = alpha + beta*b + gamma*b*L`` seconds
    (weights read once per iteration; per-sequence compute; KV reads growing with context ``L``),
    fitted by non-negative least squares to the records that carry a context length. The table
    itself stays empirical, binned by batch size only -- the paper found a 2-D performance model
    a worse estimate (paper:251) -- and the fit only rescales each record's throughput to the
    reference context: ``tput * tau(b, L_rec) / tau(b, L_ref)``. This removes the bias of decode,
    where large batches are seen early (short contexts) and small batches late (long contexts).
    ``L_ref`` is the ``context_len`` argument, else the token-weighted mean context of the open
    step's records (else of the window). Without at least ``min_fit`` records with contexts
    spanning both batch sizes and lengths, no rescaling is done.

    Binning: batch sizes ``(k*bin_width, (k+1)*bin_width]`` share a bin; its row is
    ``(round(seconds-weighted mean batch size), sum(calibrated tokens) / sum(seconds))``.
    ``bin_width=1`` (default) keeps exact batch sizes.

    Args:
        window_steps: steps kept, the open one included (>= 1).
        bin_width: batch sizes per bin (>= 1).
        min_fit: records with a context length needed before calibrating (>= 3).
        min_steps: closed steps needed before :meth:`plateau` answers (default 0: any data).
            The paper builds ``P`` during the first step and migrates executing requests from
            the second (paper:251): the caller passes ``plateau=None`` in step 1, or sets 1.
        max_records: records kept per step, the oldest dropped first (bounds memory when a
            caller records every decode iteration, or never calls :meth:`new_step`).
    """

    def __init__(
        self,
        *,
        window_steps: int = 2,
        bin_width: int = 1,
        min_fit: int = 8,
        min_steps: int = 0,
        max_records: int = 50_000,
    ) -> None:
        if window_steps < 1 or bin_width < 1 or min_fit < 3 or min_steps < 0 or max_records < 1:
            raise ValueError(
                "need window_steps >= 1, bin_width >= 1, min_fit >= 3, min_steps >= 0, "
                f"max_records >= 1; got {window_steps}, {bin_width}, {min_fit}, {min_steps}, "
                f"{max_records}"
            )
        self.max_records = max_records
        self.bin_width = bin_width
        self.min_fit = min_fit
        self.min_steps = min_steps
        self.closed_steps = 0
        # each step: rows of (batch_size, tokens, seconds, context_len or nan)
        self._steps: deque[deque[tuple[int, float, float, float]]] = deque(
            [deque(maxlen=max_records)], maxlen=window_steps
        )
        self._cache: dict = {}  # the rows and the context fit, until the next record

    def frozen(self) -> ThroughputProfile:
        """A copy that no later :meth:`record` changes: ``P`` as captured so far (the
        previous step's rollout, taken when a step closes), to calibrate to each context of
        the coming step at the cost of a rescale only (its rows and fit are computed once)."""
        copy = ThroughputProfile(
            window_steps=self._steps.maxlen or 1, bin_width=self.bin_width,
            min_fit=self.min_fit, min_steps=self.min_steps, max_records=self.max_records,
        )  # fmt: skip
        copy.closed_steps = self.closed_steps
        copy._steps = deque((deque(st, maxlen=st.maxlen) for st in self._steps),
                            maxlen=self._steps.maxlen)  # fmt: skip
        return copy

    def record(
        self, batch_size: int, tokens: float, seconds: float, context_len: float | None = None
    ) -> None:
        """Add decode progress: ``tokens`` generated in ``seconds`` at ``batch_size`` sequences,
        their mean context ``context_len`` (tokens per sequence: prompt + generated so far).

        Raises:
            ValueError: ``batch_size`` < 1, ``tokens`` < 0, ``seconds`` <= 0, a negative
                ``context_len`` or a non-finite value.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer):
            raise ValueError(f"batch_size must be an integer, got {batch_size!r}")
        ctx = math.nan if context_len is None else float(context_len)
        if (
            batch_size < 1
            or not (math.isfinite(tokens) and tokens >= 0)
            or not (math.isfinite(seconds) and seconds > 0)
            or (context_len is not None and not (math.isfinite(ctx) and ctx >= 0))
        ):
            raise ValueError(
                f"bad record: batch_size={batch_size!r}, tokens={tokens!r}, seconds={seconds!r},"
                f" context_len={context_len!r} (need >= 1, >= 0, > 0, >= 0 or None)"
            )
        self._steps[-1].append((int(batch_size), float(tokens), float(seconds), ctx))
        self._cache.clear()

    def new_step(self) -> None:
        """Close the open step; the oldest step beyond ``window_steps`` is dropped."""
        self.closed_steps += 1
        self._steps.append(deque(maxlen=self.max_records))
        self._cache.clear()

    def _rows(self) -> np.ndarray:
        if "rows" not in self._cache:
            rows = [r for step in self._steps for r in step]
            self._cache["rows"] = np.array(rows, dtype=float).reshape(-1, 4)
        return self._cache["rows"]

    def context_model(self) -> tuple[float, float, float] | None:
        """``(alpha, beta, gamma)`` of ``tau(b, L)`` in seconds, or ``None`` when the records
        cannot support a fit (fewer than ``min_fit`` with a context, or no spread in ``b``/``L``).
        """
        if "model" not in self._cache:
            self._cache["model"] = self._fit()
        return self._cache["model"]

    def _fit(self) -> tuple[float, float, float] | None:
        rows = self._rows()
        rows = rows[~np.isnan(rows[:, 3]) & (rows[:, 1] > 0)]
        if len(rows) < self.min_fit:
            return None
        b, tokens, seconds, ctx = rows.T
        design = np.column_stack([np.ones_like(b), b, b * ctx])
        if np.linalg.matrix_rank(design) < 3:
            return None
        tau = seconds * b / tokens  # seconds per decode iteration
        w = np.sqrt(seconds)  # long records weigh more; they average more iterations
        coef, _ = nnls(design * w[:, None], tau * w)
        if coef.sum() <= 0:
            return None
        return float(coef[0]), float(coef[1]), float(coef[2])

    def reference_context(self) -> float | None:
        """The default ``L_ref``: token-weighted mean context of the open step's records, else of
        the window's; ``None`` when no record has a context length."""
        for rows in (np.array(list(self._steps[-1]), dtype=float).reshape(-1, 4), self._rows()):
            rows = rows[~np.isnan(rows[:, 3])]
            if len(rows) and rows[:, 1].sum() > 0:
                return float(np.average(rows[:, 3], weights=rows[:, 1]))
        return None

    def table(self, context_len: float | None = None) -> list[tuple[int, float]]:
        """``[(batch_size, tokens_per_s)]`` by increasing batch size, binned and calibrated to
        ``context_len`` (default :meth:`reference_context`); ``[]`` with no records."""
        rows = self._rows()
        if not len(rows):
            return []
        b, tokens, seconds, ctx = rows.T
        cal_tokens = tokens.copy()
        model = self.context_model()
        ref = self.reference_context() if context_len is None else float(context_len)
        if model is not None and ref is not None:
            alpha, beta, gamma = model
            has = ~np.isnan(ctx)
            tau_rec = alpha + beta * b[has] + gamma * b[has] * ctx[has]
            tau_ref = alpha + beta * b[has] + gamma * b[has] * ref
            ok = tau_ref > 0
            scaled = cal_tokens[has]
            scaled[ok] *= tau_rec[ok] / tau_ref[ok]
            cal_tokens[has] = scaled
        _, inv = np.unique((b.astype(int) - 1) // self.bin_width, return_inverse=True)
        secs = np.bincount(inv, weights=seconds)
        labels = np.bincount(inv, weights=b * seconds) / secs  # seconds-weighted mean batch
        tput = np.bincount(inv, weights=cal_tokens) / secs
        return [(int(round(float(x))), float(y)) for x, y in zip(labels, tput, strict=True)]

    def plateau(self, tolerance: float = 0.1, context_len: float | None = None) -> int | None:
        """``B`` for Algorithm 2 line 24: :func:`batching_plateau` of :meth:`table`; ``None`` with
        no data or before ``min_steps`` closed steps."""
        if self.closed_steps < self.min_steps:
            return None
        return batching_plateau(self.table(context_len), tolerance)
