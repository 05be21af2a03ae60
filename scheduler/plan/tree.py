"""The plan tree the planner returns, and its JSON/YAML-friendly form.

A plan (RLinf section 3.4, Algorithm 1's output) is a tree: :class:`Leaf` (one component, or a
collapsed cycle of components time-sharing a device range), :class:`Temporal` (children one
after the other on the same devices), :class:`Spatial` (upstream and downstream on disjoint
devices, pipelined in chunks of ``granularity`` items) and :class:`CycleSplit` (a collapsed
two-member cycle whose members run on disjoint devices, pipelined over sub-batches:
:mod:`.cycle`). Every node carries its concrete device range (the
devices its leaves use) and predicted time (seconds per step). A plan may leave devices idle
when a component is no faster on more of them (:meth:`Plan.idle`). :class:`PlanResult` adds
what a runtime or ``m2flow plan`` needs around the tree: the cluster, the batch size, the
granularity of every workflow edge and the runner-up plans.

``to_dict`` / ``from_dict`` round-trip exactly (floats included) through JSON and YAML.
Units: seconds, bytes per device, items (of the step's batch of ``M``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


class PlanError(ValueError):
    """The workflow cannot be planned on the given cluster, or a plan document is malformed
    (the message names the problem)."""


@dataclass(frozen=True)
class Plan:
    """A node of the plan tree: ``devices`` (concrete range) and predicted ``time`` (seconds)."""

    devices: range
    time: float

    def leaves(self) -> list[Leaf]:
        """Leaves left to right."""
        raise NotImplementedError

    def breakdown(self) -> dict[str, float]:
        """Per original component: its predicted busy time per step (seconds) on its devices,
        ``time(n)`` plus ``switch_cost`` when time-shared (not the critical path)."""
        out: dict[str, float] = {}
        for leaf in self.leaves():
            out.update(zip(leaf.components, leaf.component_times, strict=True))
        return out

    def placement(self) -> dict[str, range]:
        """Device range of every original component (the devices it uses)."""
        return {c: leaf.devices for leaf in self.leaves() for c in leaf.components}

    def idle(self, num_devices: int) -> list[range]:
        """Device ranges of ``[0, num_devices)`` that no leaf uses, in increasing order."""
        used = sorted((lf.devices.start, lf.devices.stop) for lf in self.leaves())
        out, pos = [], 0
        for a, b in used:
            if a > pos:
                out.append(range(pos, min(a, num_devices)))
            pos = max(pos, b)
        if pos < num_devices:
            out.append(range(pos, num_devices))
        return [r for r in out if len(r)]

    def memory(self) -> dict[str, float]:
        """Per original component: predicted peak bytes per device on its devices (empty for
        plans rebuilt from documents that did not record it)."""
        out: dict[str, float] = {}
        for leaf in self.leaves():
            out.update(zip(leaf.components, leaf.component_memory))
        return out

    def kinds(self) -> set[str]:
        """Compositions used: a subset of ``{"temporal", "spatial"}`` (empty for one leaf)."""
        raise NotImplementedError

    def kind(self) -> str:
        """``"temporal"``, ``"spatial"``, ``"hybrid"`` (both used) or ``"single"`` (a leaf)."""
        ks = self.kinds()
        return "hybrid" if len(ks) == 2 else (next(iter(ks)) if ks else "single")

    def shape(self) -> str:
        """Compact structure, e.g. ``S(rollout | T(actor_train, critic_train))``."""
        raise NotImplementedError

    def signature(self) -> tuple:
        """Hashable structure (compositions, device ranges, granularities, components); equal
        for plans that differ only in how their predicted times were rounded."""
        if isinstance(self, Leaf):
            return ("leaf", self.devices.start, self.devices.stop, self.components)
        if isinstance(self, CycleSplit):
            head: tuple = ("cycle", self.devices.start, self.devices.stop, self.granularity)
        elif isinstance(self, Spatial):
            head: tuple = ("spatial", self.devices.start, self.devices.stop, self.granularity)
        else:
            head = ("temporal", self.devices.start, self.devices.stop)
        return head + tuple(c.signature() for c in self._children())

    def edge_granularity(
        self, edges: Iterable[tuple[str, str]], batch_size: int
    ) -> dict[tuple[str, str], int]:
        """Items per chunk on every workflow edge ``(src, dst)``.

        The granularity ``m`` of the :class:`Spatial` node whose cut the edge crosses (the
        lowest common ancestor of both ends; for a :class:`CycleSplit`, the items of the
        leader's share per sub-batch); ``batch_size`` (one coalesced chunk) when both ends
        share a temporal node or a leaf (a time-shared cycle, or a self-loop).

        Raises:
            PlanError: an edge names a component that is not in the plan.
        """
        paths: dict[str, list[Plan]] = {}

        def walk(node: Plan, path: list[Plan]) -> None:
            path = path + [node]
            if isinstance(node, Leaf):
                paths.update({c: path for c in node.components})
            for child in node._children():
                walk(child, path)

        walk(self, [])
        out: dict[tuple[str, str], int] = {}
        for src, dst in edges:
            for x in (src, dst):
                if x not in paths:
                    raise PlanError(f"edge ({src!r}, {dst!r}): {x!r} is not in the plan")
            lca = self
            for a, b in zip(paths[src], paths[dst]):
                if a is not b:
                    break
                lca = a
            out[(src, dst)] = lca.granularity if isinstance(lca, Spatial) else int(batch_size)
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-friendly form; :meth:`from_dict` rebuilds an equal tree."""
        raise NotImplementedError

    @staticmethod
    def from_dict(doc: Mapping[str, Any]) -> Plan:
        """Rebuild a plan tree from :meth:`to_dict` output.

        Raises:
            PlanError: a missing key or an unknown node type (the message names where).
        """
        return _from_dict(doc, "plan")

    def _children(self) -> tuple[Plan, ...]:
        return ()

    def _lines(self, indent: str) -> list[str]:
        raise NotImplementedError

    def __str__(self) -> str:
        return "\n".join(self._lines(""))


def _fmt(devices: range) -> str:
    return f"devices [{devices.start}, {devices.stop})"


def _base(node: Plan, kind: str) -> dict[str, Any]:
    return {"type": kind, "devices": [node.devices.start, node.devices.stop], "time_s": node.time}


@dataclass(frozen=True)
class Leaf(Plan):
    """One (collapsed) node on ``devices`` (the k devices it uses, possibly fewer than its
    parent gave it: the rest idle); ``components``: original names (several = a cycle).

    ``component_times``: each member's busy seconds per step (switch cost included when
    ``shared``); ``component_memory``: each member's predicted peak bytes per device;
    ``component_devices``: devices each member actually uses (``min(k, max_devices)``).
    """

    name: str = ""
    components: tuple[str, ...] = ()
    component_times: tuple[float, ...] = ()
    shared: bool = False
    component_memory: tuple[float, ...] = ()
    component_devices: tuple[int, ...] = ()

    def leaves(self) -> list[Leaf]:
        return [self]

    def kinds(self) -> set[str]:
        return set()

    def shape(self) -> str:
        return self.name

    def to_dict(self) -> dict[str, Any]:
        d = _base(self, "leaf")
        d["name"] = self.name
        d["shared"] = self.shared
        mem = self.component_memory or (None,) * len(self.components)
        used = self.component_devices or (None,) * len(self.components)
        d["components"] = [
            {"name": c, "time_s": t, "memory_bytes": m, "devices_used": u}
            for c, t, m, u in zip(self.components, self.component_times, mem, used, strict=True)
        ]
        return d

    def _lines(self, indent):
        tag = ", time-shared" if self.shared else ""
        return [f"{indent}{self.name}: {self.time:.6g} s on {_fmt(self.devices)}{tag}"]


@dataclass(frozen=True)
class Temporal(Plan):
    """Children run one after the other on the same ``devices`` (nested temporal flattened)."""

    children: tuple[Plan, ...] = ()

    def leaves(self):
        return [lf for c in self.children for lf in c.leaves()]

    def kinds(self):
        return {"temporal"}.union(*(c.kinds() for c in self.children))

    def shape(self):
        return "T(" + ", ".join(c.shape() for c in self.children) + ")"

    def to_dict(self):
        d = _base(self, "temporal")
        d["children"] = [c.to_dict() for c in self.children]
        return d

    def _children(self):
        return self.children

    def _lines(self, indent):
        head = f"{indent}Temporal {self.time:.6g} s on {_fmt(self.devices)}"
        return [head] + [ln for c in self.children for ln in c._lines(indent + "  ")]


@dataclass(frozen=True)
class Spatial(Plan):
    """``upstream`` and ``downstream`` on disjoint devices, pipelined in chunks of
    ``granularity`` items (``chunks = M / granularity``)."""

    upstream: Plan = None  # type: ignore[assignment]
    downstream: Plan = None  # type: ignore[assignment]
    granularity: int = 0
    chunks: int = 0

    def leaves(self):
        return self.upstream.leaves() + self.downstream.leaves()

    def kinds(self):
        return {"spatial"} | self.upstream.kinds() | self.downstream.kinds()

    def shape(self):
        return f"S({self.upstream.shape()} | {self.downstream.shape()})"

    def to_dict(self):
        d = _base(self, "spatial")
        d["granularity"] = self.granularity
        d["chunks"] = self.chunks
        d["upstream"] = self.upstream.to_dict()
        d["downstream"] = self.downstream.to_dict()
        return d

    def _children(self):
        return (self.upstream, self.downstream)

    def _lines(self, indent):
        head = (
            f"{indent}Spatial {self.time:.6g} s on {_fmt(self.devices)}, m={self.granularity}"
            f" ({self.chunks} chunks), split {len(self.upstream.devices)}+"
            f"{len(self.downstream.devices)}"
        )
        return [head] + self.upstream._lines(indent + "  ") + self.downstream._lines(indent + "  ")


@dataclass(frozen=True)
class CycleSplit(Spatial):
    """A collapsed two-member cycle split across devices (:mod:`.cycle`): ``upstream`` is the
    leader's leaf (it splits its share), ``downstream`` the follower's, on disjoint devices;
    the leader's share of ``batch`` items goes round in ``chunks`` sub-batches of
    ``granularity`` items, ``round_trips`` times per step. ``name``: the collapsed node's
    (``env+policy``)."""

    name: str = ""
    round_trips: float = 0.0

    def shape(self):
        return f"C({self.upstream.shape()} | {self.downstream.shape()})"

    def to_dict(self):
        d = _base(self, "cycle")
        d["name"] = self.name
        d["granularity"] = self.granularity
        d["sub_batches"] = self.chunks
        d["round_trips"] = self.round_trips
        d["leader"] = self.upstream.to_dict()
        d["follower"] = self.downstream.to_dict()
        return d

    def _lines(self, indent):
        head = (
            f"{indent}Cycle {self.name} {self.time:.6g} s on {_fmt(self.devices)}, split "
            f"{len(self.upstream.devices)}+{len(self.downstream.devices)}, {self.chunks} "
            f"sub-batches of {self.granularity}"
        )
        return [head] + self.upstream._lines(indent + "  ") + self.downstream._lines(indent + "  ")


def _get(doc: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(doc, Mapping):
        raise PlanError(f"{where}: expected a mapping, got {type(doc).__name__}")
    if key not in doc:
        raise PlanError(f"{where}: missing key {key!r}")
    return doc[key]


def _from_dict(doc: Mapping[str, Any], where: str) -> Plan:
    kind = _get(doc, "type", where)
    span = _get(doc, "devices", where)
    if not (isinstance(span, list | tuple) and len(span) == 2):
        raise PlanError(f"{where}.devices: expected [start, stop], got {span!r}")
    devices = range(int(span[0]), int(span[1]))
    time = float(_get(doc, "time_s", where))
    if kind == "leaf":
        comps = _get(doc, "components", where)
        names = tuple(str(_get(c, "name", f"{where}.components")) for c in comps)
        times = tuple(float(_get(c, "time_s", f"{where}.components")) for c in comps)
        mem = tuple(c.get("memory_bytes") for c in comps)
        used = tuple(c.get("devices_used") for c in comps)
        return Leaf(
            devices,
            time,
            str(_get(doc, "name", where)),
            names,
            times,
            bool(doc.get("shared", False)),
            tuple(float(m) for m in mem) if None not in mem else (),
            tuple(int(u) for u in used) if None not in used else (),
        )
    if kind == "temporal":
        kids = _get(doc, "children", where)
        return Temporal(
            devices,
            time,
            tuple(_from_dict(c, f"{where}.children[{i}]") for i, c in enumerate(kids)),
        )
    if kind == "spatial":
        return Spatial(
            devices,
            time,
            _from_dict(_get(doc, "upstream", where), f"{where}.upstream"),
            _from_dict(_get(doc, "downstream", where), f"{where}.downstream"),
            int(_get(doc, "granularity", where)),
            int(_get(doc, "chunks", where)),
        )
    if kind == "cycle":
        return CycleSplit(
            devices,
            time,
            _from_dict(_get(doc, "leader", where), f"{where}.leader"),
            _from_dict(_get(doc, "follower", where), f"{where}.follower"),
            int(_get(doc, "granularity", where)),
            int(_get(doc, "sub_batches", where)),
            str(_get(doc, "name", where)),
            float(_get(doc, "round_trips", where)),
        )
    raise PlanError(f"{where}.type: {kind!r} is not one of 'leaf', 'temporal', 'spatial', 'cycle'")


@dataclass(frozen=True)
class PlanResult:
    """The best plan with its context and the runner-ups.

    ``plan``: the best plan tree; ``mode``: the mode it was searched in; ``num_devices``;
    ``batch_size`` (``M``, items per step); ``edges``: the workflow's ``(src, dst)`` edges;
    ``capacity``: bytes per device (``inf`` = unlimited); ``runner_ups``: the best plan of each
    other mode and of each other top-level (cut, composition), distinct from ``plan`` and from
    each other, fastest first; ``allow_idle``: whether components could leave devices idle;
    ``slack``: the fraction of its fastest time a component could give up to use fewer devices
    (0: exact).
    """

    plan: Plan
    mode: str
    num_devices: int
    batch_size: int
    edges: tuple[tuple[str, str], ...] = ()
    capacity: float = math.inf
    runner_ups: tuple[Plan, ...] = ()
    allow_idle: bool = True
    slack: float = 0.0

    @property
    def time(self) -> float:
        """Predicted seconds per step of the best plan."""
        return self.plan.time

    def idle(self) -> list[range]:
        """Device ranges the best plan leaves idle (empty when it uses every device)."""
        return self.plan.idle(self.num_devices)

    def throughput(self) -> float:
        """Predicted items per second of the best plan (``batch_size / time``)."""
        return self.batch_size / self.plan.time if self.plan.time > 0 else math.inf

    def edge_granularity(self) -> dict[tuple[str, str], int]:
        """Items per chunk on every workflow edge (see :meth:`Plan.edge_granularity`)."""
        return self.plan.edge_granularity(self.edges, self.batch_size)

    def to_dict(self) -> dict[str, Any]:
        """JSON/YAML-friendly form (``capacity_bytes`` is None when unlimited)."""
        return {
            "mode": self.mode,
            "kind": self.plan.kind(),
            "num_devices": self.num_devices,
            "batch_size": self.batch_size,
            "capacity_bytes": None if math.isinf(self.capacity) else self.capacity,
            "allow_idle": self.allow_idle,
            "slack": self.slack,
            "idle_devices": [[r.start, r.stop] for r in self.idle()],
            "time_s": self.plan.time,
            "throughput_items_per_s": self.throughput() if self.plan.time > 0 else None,
            "edges": [
                {"src": s, "dst": d, "granularity": m}
                for (s, d), m in self.edge_granularity().items()
            ],
            "plan": self.plan.to_dict(),
            "runner_ups": [
                {"kind": p.kind(), "shape": p.shape(), "time_s": p.time, "plan": p.to_dict()}
                for p in self.runner_ups
            ],
        }

    @staticmethod
    def from_dict(doc: Mapping[str, Any]) -> PlanResult:
        """Rebuild from :meth:`to_dict` output.

        Raises:
            PlanError: a missing key or a malformed plan tree.
        """
        cap = doc.get("capacity_bytes") if isinstance(doc, Mapping) else None
        return PlanResult(
            plan=Plan.from_dict(_get(doc, "plan", "result")),
            mode=str(_get(doc, "mode", "result")),
            num_devices=int(_get(doc, "num_devices", "result")),
            batch_size=int(_get(doc, "batch_size", "result")),
            edges=tuple((str(e["src"]), str(e["dst"])) for e in doc.get("edges", [])),
            capacity=math.inf if cap is None else float(cap),
            allow_idle=bool(doc.get("allow_idle", False)),  # older documents used every device
            slack=float(doc.get("slack", 0.0)),
            runner_ups=tuple(
                _from_dict(_get(r, "plan", f"runner_ups[{i}]"), f"runner_ups[{i}].plan")
                for i, r in enumerate(doc.get("runner_ups", []))
            ),
        )
