"""The plan tree the planner's tables encode: :class:`~.tables.Planner`'s ``build`` and its
helpers, a mixin (it reads the tables' winning choices); internal."""

from __future__ import annotations

import numpy as np

from .cost import chunk_time
from .table_types import _TEMPORAL, _VARIANTS, Choice, _Branch, _leaf_kind, _of_kind, _used
from .tree import CycleSplit, Leaf, Plan, Spatial, Temporal


class PlanBuilder:
    """:class:`~.tables.Planner`'s plan-building methods."""

    def build(self, mask, shared, fam, start, n, choice: Choice | None = None) -> Plan:
        """The Plan subtree of ``mask`` in family ``fam`` on devices [start, start + n)."""
        if choice is not None and choice.variant >= 0:
            kind, fu, fd = _VARIANTS[fam][choice.variant]
            u = self.cuts(mask)[choice.cut]
            if kind == _TEMPORAL:
                return self._temporal(u, mask & ~u, fu, fd, start, n, choice.cost)
            b = self._branch(choice.cut, u, mask & ~u, shared, fu, fd)
            return self._build_chain(b, shared, start, n, choice.n_up, choice.k, 0.0)[0]
        if choice is None and mask & (mask - 1):
            at = self.table(mask, shared, fam)
            if at.is_chain[n]:
                ch = at.chain
                b = ch.branches[int(ch.br[n])]
                return self._build_chain(b, shared, start, n, int(ch.nu[n]), int(ch.ki[n]), 0.0)[0]
        return self._build_stage(mask, shared, fam, start, n)

    def _build_stage(self, mask, shared, fam, start, n) -> Plan:
        """The plan of ``mask``'s stage table (a leaf or a temporal node) on n devices."""
        st = self.stage(mask, shared, fam)
        cost = float(st.cost[n])
        if mask & (mask - 1):
            fu, fd = _of_kind(fam, _TEMPORAL)[int(st.var[n])]
            u = self.cuts(mask)[int(st.cut[n])]
            return self._temporal(u, mask & ~u, fu, fd, start, n, cost)
        node = self.nodes[mask.bit_length() - 1]
        kind = _leaf_kind(fam, node)
        if kind == "split" or (kind == "any" and node.split[0][n] < node.times[n]):
            return self._build_split(node, shared, start, n, cost)
        k = int(node.use[n])  # devices it uses of the n it is given
        devices = range(start, start + k)
        used = [int(_used(c, k)) for c in node.members]
        times = tuple(
            float(c.time(k)) + (c.switch_cost if shared else 0.0)
            for c, k in zip(node.members, used, strict=True)
        )
        mem = tuple(float(c.memory(k)) for c, k in zip(node.members, used, strict=True))
        names = tuple(c.name for c in node.members)
        return Leaf(devices, cost, node.name, names, times, shared, mem, tuple(used))

    def _temporal(self, u, d, fu, fd, start, n, cost) -> Temporal:
        kids: list[Plan] = []
        for part in (self.build(u, True, fu, start, n), self.build(d, True, fd, start, n)):
            kids.extend(part.children if isinstance(part, Temporal) else [part])
        stop = max(kid.devices.stop for kid in kids)
        return Temporal(range(start, stop), float(cost), tuple(kids))

    def _build_chain(self, b: _Branch, shared, start, n, j, ki, floor):
        """The chain starting with branch ``b``'s first stage on ``j`` of ``n`` devices in
        ``chunks[ki]`` chunks under ``floor``: ``(plan, sum of chunk times, slowest chunk)``.
        Each :class:`~.plan.Spatial` node's time is its own chain's cost."""
        k = int(self.chunks[ki])
        up = self._build_stage(b.u, shared, b.fu, start, j)
        t = float(chunk_time(b.stage.cost[j], b.stage.o, k))
        # Downstream right after what upstream uses: its cost depends on its count, not start.
        down, s_d, mu_d = self._build_rest(b, shared, up.devices.stop, n - j, ki, max(floor, t))
        total, mu = t + s_d, max(t, mu_d)
        node = Spatial(
            range(start, down.devices.stop), total + (k - 1) * mu, up, down, self.m_list[ki], k
        )
        return node, total, mu

    def _build_rest(self, b: _Branch, shared, start, m, ki, floor):
        """Branch ``b``'s rest on ``m`` devices under ``floor`` (:meth:`_build_chain`)."""
        at = self.table(b.d, shared, b.fd)
        q = (np.array([ki]), np.array([m]), np.array([floor]))
        v_st = float(self._phi_stage(at, *q)[0][0])
        if at.chain is not None:
            v, _, br, j, _ = self._chain_query(at.chain.branches, *q)
            if v[0] < v_st:
                nxt = at.chain.branches[int(br[0])]
                return self._build_chain(nxt, shared, start, m, int(j[0]), ki, floor)
        plan = self._build_stage(b.d, shared, b.fd, start, m)
        t = float(chunk_time(at.stage.cost[m], at.o, int(self.chunks[ki])))
        return plan, t, t

    def _build_split(self, node, shared: bool, start: int, n: int, cost: float) -> CycleSplit:
        """The :class:`~.plan.CycleSplit` of cycle ``node`` given n devices from ``start``:
        the leader on the first devices it uses, the follower right after."""
        cyc = node.cycle
        _, n_a, k, parts = node.split
        j, sub = int(n_a[n]), int(k[n])
        leaves, pos = [], start
        for c, (_, use), given in zip(node.members, parts, (j, n - j), strict=True):
            kd = int(use[given])
            used = int(_used(c, kd))
            busy = float(cyc.member_busy(float(c.time(used)), sub))
            busy += c.switch_cost if shared else 0.0
            mem = float(c.memory(used))
            leaves.append(
                Leaf(range(pos, pos + kd), busy, c.name, (c.name,), (busy,), shared, (mem,),
                     (used,))
            )  # fmt: skip
            pos += kd
        return CycleSplit(
            range(start, pos), cost, leaves[0], leaves[1], cyc.batch // sub, sub, node.name,
            float(cyc.round_trips),
        )  # fmt: skip
