"""The planner's table records and composition vocabulary, shared by :mod:`.tables` (the
tables), :mod:`.chain_search` (pipelines of stages) and :mod:`.plan_build` (the plan tree).
Internal: nothing here is public API."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


def _used(c, n):
    """Devices component ``c`` (a :class:`~.planner.Component`) uses when given ``n`` (int or
    int array)."""
    return n if c.max_devices is None else np.minimum(n, c.max_devices)


def _evaluate(fn: Callable, ns: np.ndarray) -> np.ndarray:
    """``fn`` at every device count in ``ns`` (floats; one call per distinct count)."""
    if getattr(fn, "vectorized", False):
        out = np.asarray(fn(ns), dtype=float)
        if out.shape == ns.shape:
            return out
    uniq, inv = np.unique(ns, return_inverse=True)
    return np.array([float(fn(int(x))) for x in uniq])[inv]


# Families of DP tables: for each, the (composition, upstream family, downstream family)
# variants tried at every cut, in tie-break order (temporal first). "A": any plan, "T"/"S":
# temporal/spatial compositions only, "CS"/"CT": contains a spatial/temporal node, "H": both.
# A spatial variant's upstream is the chain's first stage (its top is not spatial).
_TEMPORAL, _SPATIAL = 1, 2
_VARIANTS: dict[str, tuple[tuple[int, str, str], ...]] = {
    "A": ((_TEMPORAL, "A", "A"), (_SPATIAL, "A", "A")),
    "T": ((_TEMPORAL, "T", "T"),),
    "S": ((_SPATIAL, "S", "S"),),
    "CS": ((_TEMPORAL, "CS", "A"), (_TEMPORAL, "A", "CS"), (_SPATIAL, "A", "A")),
    "CT": ((_TEMPORAL, "A", "A"), (_SPATIAL, "CT", "A"), (_SPATIAL, "A", "CT")),
    "H": (
        (_TEMPORAL, "CS", "A"),
        (_TEMPORAL, "A", "CS"),
        (_SPATIAL, "CT", "A"),
        (_SPATIAL, "A", "CT"),
    ),
}
FAMILY = {"auto": "A", "temporal": "T", "spatial": "S", "hybrid": "H"}


def _of_kind(fam: str, kind: int) -> tuple[tuple[str, str], ...]:
    """The (upstream, downstream) families of ``fam``'s variants of one composition kind."""
    return tuple((fu, fd) for k, fu, fd in _VARIANTS[fam] if k == kind)


def _leaf_kind(fam: str, node) -> str | None:
    """Which runs of a single node family ``fam`` allows: ``"shared"`` (its members on the
    same devices; a plain component), ``"split"`` (a cycle split across devices: a spatial
    composition), ``"any"`` (the faster), or None (a leaf has no temporal composition: CT and
    H are infeasible, and so is CS without a split)."""
    splits = node.cycle is not None
    if fam == "T" or (fam in ("A", "S") and not splits):
        return "shared"
    if fam in ("A", "S"):
        return "any"
    return "split" if fam == "CS" and splits else None


def _span(p: np.ndarray) -> tuple[int, int]:
    """First and last n >= 1 with finite ``p[n]`` (``(1, 0)``: none)."""
    fin = np.flatnonzero(np.isfinite(p[1:]))
    return (int(fin[0]) + 1, int(fin[-1]) + 1) if fin.size else (1, 0)


class Choice(NamedTuple):
    """How a subgraph is planned on ``n`` devices: its ``cost`` (seconds), and -- unless it is
    a leaf (``variant < 0``) -- the composition ``variant`` of its family, the s-t ``cut``
    (index into the subgraph's cuts), the upstream side's device count ``n_up`` and the
    chunk-count index ``k`` (spatial only: the chain's first stage and its k; -1 for
    temporal)."""

    cost: float
    variant: int = -1
    cut: int = -1
    n_up: int = -1
    k: int = -1


@dataclass(eq=False)
class _Stage:
    """``P_st(S, n)`` for n = 0..N (seconds), S's chunk overhead ``o`` (seconds per extra
    chunk) and, per n, the winning temporal variant and cut (-1: a leaf); ``hull``: the
    convex minorant of ``cost``, computed on first use."""

    cost: np.ndarray
    o: float
    var: np.ndarray | None = None
    cut: np.ndarray | None = None
    hull: np.ndarray | None = None

    @property
    def feasible(self) -> bool:
        return bool(np.isfinite(self.cost).any())


@dataclass(eq=False)
class _Branch:
    """A chain's first stage ``u`` (stage table ``stage``, family ``fu``) and the rest ``d``
    (any table ``rest``, family ``fd``); ``cut``: index of ``u`` among the subset's cuts."""

    cut: int
    u: int
    d: int
    fu: str
    fd: str
    stage: _Stage
    rest: _Any


@dataclass(eq=False)
class _Chain:
    """Chains of a subset (module docstring). ``ck[k, n]``: the least cost in ``chunks[k]``
    chunks (seconds) where ``cmu[k, n] > -inf``, a lower bound of it elsewhere (a k that is
    not n's best; :meth:`Planner._phi` solves it when a query needs it); ``cmu``: a lower bound
    of the slowest chunk (seconds) of a chain reaching ``ck``. ``asum[n]``: the least sum of
    stage times (seconds), with ``aa[n] = max_i (T_i - o_i)`` and ``ab[n] = max_i o_i`` over
    that chain's stages (its slowest chunk is at most ``aa / k + ab``). Per n: the least cost
    over k (``cost``, exact) and its branch, first-stage devices and k index."""

    branches: list[_Branch]
    cost: np.ndarray
    br: np.ndarray
    nu: np.ndarray
    ki: np.ndarray
    ck: np.ndarray
    cmu: np.ndarray
    asum: np.ndarray
    aa: np.ndarray
    ab: np.ndarray


@dataclass(eq=False)
class _Any:
    """``P(S, n)``: the better of the stage and chain tables (``is_chain``: the chain wins),
    ``asum``/``aa``/``ab`` as in :class:`_Chain` over both (a stage is a chain of one), S's
    chunk overhead ``o`` (seconds), and the lazily computed convex minorants of ``asum``
    (``ha``) and of the per-k lower bound ``min(k t_st, ck)`` of the own cost (``hc``,
    flattened ``(K, N+1)``; only with a chain)."""

    stage: _Stage
    chain: _Chain | None
    cost: np.ndarray
    is_chain: np.ndarray
    asum: np.ndarray
    aa: np.ndarray
    ab: np.ndarray
    o: float
    span: tuple[int, int] = (1, 0)
    ha: np.ndarray | None = field(default=None, repr=False)
    hc: np.ndarray | None = field(default=None, repr=False)

    @property
    def feasible(self) -> bool:
        return bool(np.isfinite(self.cost).any())
