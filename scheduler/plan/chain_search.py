"""Chain tables of the planner: the best pipeline of two or more stages per chunk count and
device count, and the floor-constrained queries behind them (the search :mod:`.tables`'
docstring describes). A mixin of :class:`~.tables.Planner`; internal."""

from __future__ import annotations

import numpy as np

from .cost import INF, chunk_time, convex_minorant
from .search import _threshold, split_query
from .table_types import _Any, _Branch, _Chain, _span, _Stage

_CELLS = 1 << 13  # (k, n) queries of a chain table searched at once (bounds temporaries)


class ChainSearch:
    """:class:`~.tables.Planner`'s chain-table methods (it holds the tables they read)."""

    def _chain_table(self, branches: list[_Branch]) -> _Chain | None:
        size, nk = self.n + 1, self.chunks.size
        # Least sum of stage times: a plain min-plus split per branch (sums are k-free; it is
        # also the cost in one chunk, chunks[0] = 1).
        asum, aa, ab = np.full(size, INF), np.full(size, INF), np.full(size, INF)
        a_br, a_j = np.full(size, -1, np.int64), np.full(size, -1, np.int64)
        ns = np.arange(2, size)
        for b_i, b in enumerate(branches):
            p_u, h_u, p_d = b.stage.cost, self._hull(b.stage), b.rest.asum
            ha = self._bounds(b.rest)[0]
            fa, la = _span(p_u)
            fb, lb = b.rest.span
            lo = np.maximum(np.maximum(fa, ns - lb), 1)
            hi = np.minimum(np.minimum(la, ns - fb), ns - 1)

            def bound(q, h_u=h_u, ha=ha):
                return lambda j: h_u[j] + ha[ns[q] - j]

            def exact(q, j, cap, p_u=p_u, p_d=p_d):
                return p_u[j] + p_d[ns[q] - j], np.zeros(q.size)

            runs = p_u if self.allow_idle else None
            val, at, _, _ = split_query(lo, hi, bound, exact, None, runs, self.exhaustive)
            win = np.flatnonzero(val < asum[2:])
            jw, dw = at[win], ns[win] - at[win]
            asum[ns[win]], a_br[ns[win]], a_j[ns[win]] = val[win], b_i, jw
            aa[ns[win]] = np.maximum(b.stage.cost[jw] - b.stage.o, b.rest.aa[dw])
            ab[ns[win]] = np.maximum(b.stage.o, b.rest.ab[dw])
        if not np.isfinite(asum).any():
            return None
        # C_k(S, n) for every (k, n): the chain search without a floor. Only each n's best k
        # must be exact: a k that cannot win keeps a lower bound (and no bottleneck, so that
        # _phi solves it where a query needs it). Rows in blocks of about _CELLS queries: the
        # search's temporaries stay a few MB at any N.
        cv, ck, cmu = (np.full((nk, size), x) for x in (INF, INF, -INF))
        bk, jk = np.full((nk, size), -1, np.int64), np.full((nk, size), -1, np.int64)
        cv[0], ck[0], cmu[0], bk[0], jk[0] = asum, asum, INF, a_br, a_j  # no floor binds at k=1
        rows = max(1, _CELLS // max(nk - 1, 1))
        for r in range(0, ns.size if nk > 1 else 0, rows):
            part = ns[r : r + rows]
            ki, m = np.repeat(np.arange(1, nk), part.size), np.tile(part, nk - 1)
            val, mu, br, j, low = self._chain_query(
                branches, ki, m, np.zeros(ki.size), ub=asum[m], group=m
            )
            cv[ki, m], ck[ki, m], bk[ki, m], jk[ki, m] = val, low, br, j
            cmu[ki, m] = np.where(np.isfinite(val) & (low == val), mu, -INF)
        self._piece_cache.clear()  # brackets of this table's queries (and nested ones)
        k_best = np.argmin(cv, axis=0)  # the first, fewest chunks, among the least
        cols = np.arange(size)
        cost = cv[k_best, cols]
        fin = np.isfinite(cost)
        return _Chain(
            branches,
            cost,
            np.where(fin, bk[k_best, cols], -1).astype(np.int16),
            np.where(fin, jk[k_best, cols], -1).astype(np.int32),
            np.where(fin, k_best, -1).astype(np.int16),
            ck,
            cmu,
            asum,
            aa,
            ab,
        )

    def _hull(self, st: _Stage) -> np.ndarray:
        if st.hull is None:
            st.hull = convex_minorant(st.cost)[0]
        return st.hull

    def _bounds(self, at: _Any) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Convex minorants of ``at``'s least sum (over n), of its per-k lower bound of the own
        cost ``min(k t_st, C_k)`` (flattened ``(K, N+1)``; None without a chain: then it is
        ``k t_st = P_st + (k - 1) o``, the third, the stage table's minorant, shifted)."""
        if at.ha is None:
            at.ha = convex_minorant(at.asum)[0]
        h_st = self._hull(at.stage)
        if at.chain is not None and at.hc is None:
            own = np.minimum(at.stage.cost[None, :] + (self.kf[:, None] - 1) * at.o, at.chain.ck)
            at.hc = np.concatenate([convex_minorant(row)[0] for row in own])
        return at.ha, at.hc, h_st

    def _chain_query(self, branches, ki, m, floor, ub=None, group=None):
        """``min over the chains of (branches)`` of ``sum_i t_i + (k - 1) max(floor, max_i
        t_i)`` on ``m`` devices in ``chunks[ki]`` chunks, per query (module docstring).

        Returns ``(seconds, slowest-chunk lower bound, branch index, first-stage devices,
        lower bound of the seconds)``, each of the queries' shape (``inf``, ``nan``, -1, -1:
        infeasible, or not below ``ub``). With ``group`` (:func:`~.search.split_query`) only
        each group's least cost is exact; elsewhere ``seconds`` may be above the exact cost,
        which is at least the last array (equal where exact). Ties: the first branch, then
        the fewest first-stage devices.
        """
        nq = ki.size
        best, mu = np.full(nq, INF), np.full(nq, np.nan)
        br, bj = np.full(nq, -1, np.int64), np.full(nq, -1, np.int64)
        low_all = np.full(nq, INF)
        if ub is not None:
            best[:] = ub
        k = self.kf[ki]
        # Many queries without a floor: the bound is a max of min-plus sums of convex tables
        # (_pieces), which gives each query's j* bracket and a lower bound before any search.
        tabled = nq >= self.n // 2
        pieces = tabled and not floor.any()

        setups = []

        def rest_of(rest, q, j, t, cap):  # first stage's chunk t, then the rest under its floor
            v, mu_d = self._phi(rest, ki[q], m[q] - j, np.maximum(floor[q], t), cap - t)
            return t + v, np.maximum(t, mu_d)

        for b in branches:
            st, rest = b.stage, b.rest
            fa, la = _span(st.cost)
            fb, lb = rest.span
            lo = np.maximum(np.maximum(fa, m - lb), 1)
            hi = np.minimum(np.minimum(la, m - fb), m - 1)
            h_u, p_u, o_u, o_d = self._hull(st), st.cost, st.o, rest.o
            ha, hc, h_d = self._bounds(rest)

            # Many queries: the minorants' chunk times per k once (flattened (K, N+1)), so
            # that a bound costs two gathers; few (a nested search): scale on the fly.
            if tabled:
                h_u = chunk_time(h_u[None, :], o_u, self.kf[:, None]).ravel()
                h_d = chunk_time((ha if hc is not None else h_d)[None, :], o_d, self.kf[:, None])
                h_d = h_d.ravel()

            def bound(q, h_u=h_u, o_u=o_u, o_d=o_d, ha=ha, hc=hc, h_d=h_d, tabled=tabled):
                km1, mq, fl = k[q] - 1, m[q], floor[q]
                low = fl.any()  # no floor: max(floor, t) = t
                row = ki[q] * (self.n + 1)
                if tabled:  # t = h_u[row + j], per-chunk least sum (or stage) h_d[row + m - j]

                    def f(j):
                        t, d = h_u[row + j], h_d[row + mq - j]
                        top = np.maximum(fl, t) if low else t
                        if hc is None:  # one stage: t + t_d + (k - 1) max(floor, t, t_d)
                            return t + d + km1 * np.maximum(top, d)
                        return t + np.maximum(hc[row + mq - j], d + km1 * top)

                    return f
                inv = 1.0 / k[q]
                c_u, c_d = o_u - o_u * inv, o_d - o_d * inv  # t = h * inv + c: chunk_time

                def f(j):
                    t = h_u[j] * inv + c_u
                    top = np.maximum(fl, t) if low else t
                    if hc is None:
                        t_d = h_d[mq - j] * inv + c_d
                        return t + t_d + km1 * np.maximum(top, t_d)
                    return t + np.maximum(hc[row + mq - j], ha[mq - j] * inv + c_d + km1 * top)

                return f

            def exact(q, j, cap, p_u=p_u, o_u=o_u, rest=rest):
                t = chunk_time(p_u[j], o_u, k[q])
                fin = np.isfinite(t)
                if fin.all():
                    return rest_of(rest, q, j, t, cap)
                out, low = np.full(q.size, INF), np.full(q.size, np.nan)  # holes (no idle)
                if fin.any():
                    out[fin], low[fin] = rest_of(rest, q[fin], j[fin], t[fin], cap[fin])
                return out, low

            runs = p_u if self.allow_idle else None  # every table nonincreasing: Phi too
            bracket, least = None, np.where(lo <= hi, -INF, INF)
            if pieces:
                left, right, least = self._pieces(b, h_u, h_d, hc, ki, m, lo, hi)
                bracket = (left, right)
            setups.append((lo, hi, bound, exact, runs, bracket, least))

        def search(b_i, sel):  # branch b_i's chains for the queries sel; their lower bounds
            lo, hi, bound, exact, runs, bracket, _ = setups[b_i]
            val, at, low, lower = split_query(
                np.where(sel, lo, hi + 1), hi, bound, exact, best, runs, self.exhaustive, group,
                bracket,
            )  # fmt: skip
            # an earlier branch wins ties even when searched later (best first)
            win = (val < best) | ((val == best) & (b_i < br) & np.isfinite(val))
            best[win], mu[win], br[win], bj[win] = val[win], low[win], b_i, at[win]
            return lower

        lowers = [np.array(x[6]) for x in setups]  # per branch: a lower bound per query
        if pieces and group is not None:
            # Best first: per group (only its least cost must be exact), the query and
            # branch with the least lower bound, searched before the rest so that its cost
            # prunes the others'.
            g_best = np.full(int(group.max()) + 1, INF)
            np.minimum.at(g_best, group, best)
            bounds = np.stack(lowers)
            lb_q, b_q = bounds.min(axis=0), bounds.argmin(axis=0)
            g_lb = np.full(g_best.size, INF)
            np.minimum.at(g_lb, group, lb_q)
            cand = (lb_q == g_lb[group]).nonzero()[0]
            pick = cand[np.unique(group[cand], return_index=True)[1]]
            pick = pick[lb_q[pick] < INF]
            first = np.zeros((len(setups), nq), bool)
            first[b_q[pick], pick] = True
            for b_i in np.unique(b_q[pick]).tolist():
                lowers[b_i] = np.where(first[b_i], search(b_i, first[b_i]), lowers[b_i])
            np.minimum.at(g_best, group, best)
        for b_i, (lo, hi, *_, least) in enumerate(setups):
            sel = lo <= hi
            if pieces:
                cap = best if group is None else np.minimum(best, g_best[group])
                sel &= least <= _threshold(cap)  # else it cannot beat what is held
                if group is not None:
                    sel &= ~first[b_i]
            if sel.any():
                lowers[b_i] = np.where(sel, search(b_i, sel), lowers[b_i])
            if pieces and group is not None:
                np.minimum.at(g_best, group, best)
        for lower in lowers:
            low_all = np.minimum(low_all, lower)
        if ub is not None:
            best[br < 0] = INF
        return best, mu, br, bj, np.minimum(low_all, best)

    def _pieces(self, b: _Branch, h_u, h_d, hc, ki, m, lo, hi):
        """Per query ``(ki, m)`` of branch ``b`` without a floor: a bracket ``(left, right)``
        of the tabled bound's smallest minimiser over ``[lo, hi]`` and a lower bound of its
        minimum (seconds; :func:`~.search.split_query`'s ``bracket``; ``-inf`` where unknown,
        ``inf`` where no split is feasible).

        With ``t(j)`` the first stage's chunk time and ``d``, ``c`` the rest's (least-sum,
        own) per-k minorants at ``m - j``, the bound is ``max(t + c, k t + d)`` (with a chain
        in the rest) or ``max(k t + d, t + k d)``: each piece ``A(j) + B(m - j)`` with ``A``,
        ``B`` convex, whose smallest minimiser over every ``m`` at once comes from merging the
        two slope sequences: from ``m = first_A + first_B`` on, the sum takes the smallest
        slope left, so ``j`` is ``first_A`` plus the number of ``A``'s slopes among the ``m -
        first_A - first_B`` smallest of both (``B``'s first on ties; O(N log N) per chunk
        count, where a bisection costs O(log N) bound evaluations per query). Below both
        pieces' minimisers the bound falls, above both it rises, so its own smallest minimiser
        lies between them (widened by one for rounding); the larger of the pieces' minima
        bounds it from below. Tables ``h_u``, ``h_d``, ``hc``: flattened ``(K, N+1)`` chunk
        times (the bound's); the merges use the unscaled minorants, whose slopes are the chunk
        times' times ``k``.
        """
        size, nk = self.n + 1, self.chunks.size
        key = (id(b.stage), id(b.rest))
        got = self._piece_cache.get(key)
        if got is None:
            got = self._piece_merges(b, hc)
            self._piece_cache[key] = got
        a0, merges = got
        ends = []
        for pos, b0, width in merges:  # pos: per row, the places of A's slopes in the merge
            steps = m - a0 - b0[ki]
            count = np.searchsorted(pos, steps + ki * width) - ki * (pos.size // nk)
            ok = (steps >= 0) & (count >= 0) & (count <= pos.size // nk)
            ends.append((np.clip(a0 + count, lo, np.maximum(hi, lo)), ok))
        (j1, ok1), (j2, ok2) = ends
        km1, row = self.kf[ki] - 1, ki * size
        with np.errstate(invalid="ignore"):
            t1, t2 = h_u[row + j1], h_u[row + j2]
            d1, d2 = h_d[row + m - j1], h_d[row + m - j2]
            if hc is None:  # the bound's own arithmetic: t + d + (k - 1) max(t, d)
                least = np.maximum(t1 + d1 + km1 * t1, t2 + d2 + km1 * d2)
            else:  # t + max(c, d + (k - 1) t)
                least = np.maximum(t1 + hc[row + m - j1], t2 + (d2 + km1 * t2))
        sure = ok1 & ok2 & (lo <= hi) & ~np.isnan(least)
        left = np.where(sure, np.maximum(np.minimum(j1, j2) - 1, lo), lo)
        right = np.where(sure, np.minimum(np.maximum(j1, j2) + 1, hi), hi)
        return left, right, np.where(sure, least, np.where(lo <= hi, -INF, INF))

    def _piece_merges(self, b: _Branch, hc):
        """:meth:`_pieces`' merges of branch ``b``, per piece ``(pos, b0, width)``: ``pos`` the
        merge places of the first stage's slopes, row ``r`` (chunk count) offset by ``r *
        width`` and flattened; ``b0[r]`` where that row's ``B`` becomes finite."""
        nk = self.chunks.size
        h_u = self._hull(b.stage)
        ha, _, h_st = self._bounds(b.rest)
        kf = self.kf[:, None]

        def slopes(h):
            fin = np.isfinite(h).nonzero()[0]
            if not fin.size:
                return np.zeros(0), 0
            return np.maximum.accumulate(np.diff(h[fin[0] : fin[-1] + 1])), int(fin[0])

        su, a0 = slopes(h_u)
        sd, d0 = slopes(ha if hc is not None else h_st)
        # The chunk times' slopes are the minorants' over k: compare su / k (t) with sd / k
        # (d), su (k t) with sd / k, su / k with sd (k d).
        if hc is None:
            vals = [su[None, :] * kf, su[None, :] / kf]  # against sd: P1 = k t + d, P2 = t + k d
            rows = [(sd, d0)] * 2
        else:
            size = self.n + 1
            vals = [su[None, :] / kf, su[None, :] * kf]  # P1 = t + c (c per row), P2 = k t + d
            rows = [None, (sd, d0)]
            crow = [slopes(hc[r * size : (r + 1) * size]) for r in range(nk)]
        out = []
        for v, base in zip(vals, rows):
            if base is not None:
                places = np.searchsorted(base[0], v, side="right")
                b0 = np.full(nk, base[1])
                width = su.size + base[0].size + 2
            else:  # one B per row
                places = np.stack(
                    [np.searchsorted(c, v[r], side="right") for r, (c, _) in enumerate(crow)]
                )
                b0 = np.array([c0 for _, c0 in crow])
                width = su.size + max(c.size for c, _ in crow) + 2
            pos = places + np.arange(su.size) + np.arange(nk)[:, None] * width
            out.append((pos.ravel(), b0, width))
        return a0, out

    def _phi_stage(self, at: _Any, ki, m, floor):
        """:meth:`_phi` over ``at``'s stage table alone: ``t + (k - 1) max(floor, t)`` and
        ``t`` (``inf``, ``nan`` where infeasible)."""
        k, p = self.kf[ki], at.stage.cost[m]
        t = chunk_time(p, at.o, k)
        with np.errstate(invalid="ignore"):
            val = t + (k - 1) * np.maximum(floor, t)
        fin = np.isfinite(p)
        if fin.all():
            return val, t
        return np.where(fin, val, INF), np.where(fin, t, np.nan)

    def _phi(self, at: _Any, ki, m, floor, cap=None):
        """``Phi_D(m, floor)`` of the any table ``at`` (module docstring) per query, and a lower
        bound of the slowest chunk of the plan reaching it (seconds); where ``Phi_D`` is above
        ``cap`` (seconds), any value above ``cap`` (the chains are not searched)."""
        val, low = self._phi_stage(at, ki, m, floor)
        k, o, ch = self.kf[ki], at.o, at.chain
        if ch is None:
            return val, low
        c = ch.ck[ki, m]
        least = chunk_time(ch.asum[m], o, k) + (k - 1) * floor  # every chain costs at least
        lb = np.maximum(c, least)
        cand = np.isfinite(c) & (lb < val)  # the chain may win (ties: the stage)
        if cap is not None:
            cand &= lb <= cap
        if not cand.any():
            return val, low
        low_c = ch.cmu[ki, m]
        todo = cand & (low_c == -INF)  # C_k only bounded (_chain_table): solve it now
        if todo.any():
            cells = np.unique(ki[todo] * (self.n + 1) + m[todo])
            cki, cm = np.divmod(cells, self.n + 1)
            v, lw, _, _, _ = self._chain_query(ch.branches, cki, cm, np.zeros(cells.size))
            ch.ck[cki, cm], ch.cmu[cki, cm] = v, np.where(np.isfinite(v), lw, -INF)
            c, low_c = ch.ck[ki, m], ch.cmu[ki, m]
            lb = np.maximum(c, least)
            cand &= lb < val
            if cap is not None:
                cand &= lb <= cap
        free = cand & (floor <= low_c)  # the floor does not bind: D's own best chain
        val[free], low[free] = c[free], low_c[free]
        fits = cand & ~free & (ch.aa[m] / k + ch.ab[m] <= floor)  # the least-sum chain fits
        val[fits], low[fits] = least[fits], 0.0
        corner = np.flatnonzero(cand & ~free & ~fits)
        if corner.size:
            ub = val[corner] if cap is None else np.minimum(val[corner], cap[corner])
            v, lw, _, _, _ = self._chain_query(
                ch.branches, ki[corner], m[corner], floor[corner], ub
            )
            win = v < val[corner]
            val[corner[win]], low[corner[win]] = v[win], lw[win]
        return val, low
