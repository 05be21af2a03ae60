"""Placement: a plan as the runtime applies it (RLinf section 3.4's plan, executed by the
elastic pipelining and context switching of section 3.3).

A :class:`Placement` says, per worker group, which global device ids it runs on, and per
channel edge ``src -> dst`` how many items a producer puts per chunk (elastic pipelining:
``granularity < batch`` lets the consumer start early; the whole batch = coalesced, the
temporal choice). Groups that share devices share their device locks, so a placement needs no
other mechanism: the locks switch collocated groups, disjoint groups run at once.

A collapsed cycle (env <-> policy) that the plan splits across devices runs its leader's share
in sub-batches: ``sub_batches`` gives each member the items per sub-batch (``None``: its whole
share, the members time-sharing), and a cycle member's calls get that as their granularity
(:meth:`Placement.granularity_for`), never the granularity of an edge leaving the cycle.

Placements come from the planner (:func:`from_plan`), from a YAML file
(``m2flow run ... plan=path/to/plan.yaml``, as written by ``m2flow plan --save``), or are the
plain temporal default (every group on every device, every edge coalesced).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import ConfigError

if TYPE_CHECKING:
    from .cluster import Cluster


class PlacementError(ConfigError):
    """A placement that does not fit the cluster or the workflow (the message says which)."""


@dataclass
class Placement:
    """Devices per group and granularity per edge.

    Attributes:
        mode: ``temporal``, ``spatial``, ``hybrid`` or ``manual`` (for reports).
        groups: group name -> global device ids; a group not named runs on
            ``default_devices`` (or every device when that is ``None``).
        granularity: ``"src->dst"`` -> items per chunk; edges not named use
            ``default_granularity`` (``None``: the runner's default, i.e. coalesced).
        predicted_step_s: the planner's predicted seconds per step (``None`` if not planned).
        predicted: group name -> predicted busy seconds per step.
        tree: the plan's composition tree as text (for reports).
        sub_batches: cycle member -> items per sub-batch of the leader's share when the plan
            splits the cycle across devices, ``None`` when the members time-share.
        options: group name -> constructor keyword arguments the plan sets, deep-merged over
            the runner's at launch (:func:`merge_options`; a dict reaches into a role's typed
            options): how a plan turns on the spot rollout pool (``{"rollout": {"options":
            {"spot": {"enabled": True, "t_seed_init": ...}}}}``) without a line of the runner
            changing.
        max_staleness: the bound K the planner chose for this placement
            (:mod:`m2flow.scheduler.plan.staleness`; ``trainer.max_staleness=auto``), or ``None``.
        remote: what the plan runs off the reserved devices, for reports (the spot choice:
            mode, ``t_seed``, ``n_prem``, cost per step; :mod:`m2flow.scheduler.spot.plan`).
        plan: what draws the predicted step next to the measured one (``m2flow timeline``):
            ``tree`` (the planner's tree, ``Plan.to_dict``), per component ``switch_s`` and
            ``chunk_overhead_s``, the profile's ``step_overhead_s``, ``profiled_devices``
            (device counts measured per component) and ``measured_on``; empty when the
            placement was not planned from a profile.
    """

    mode: str = "temporal"
    groups: dict[str, list[int]] = field(default_factory=dict)
    granularity: dict[str, int] = field(default_factory=dict)
    default_devices: list[int] | None = None
    default_granularity: int | None = None
    predicted_step_s: float | None = None
    predicted: dict[str, float] = field(default_factory=dict)
    tree: str = ""
    sub_batches: dict[str, int | None] = field(default_factory=dict)
    options: dict[str, dict] = field(default_factory=dict)
    remote: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    max_staleness: int | None = None  # the planner's K (trainer.max_staleness=auto)

    def devices_for(self, group: str, cluster: Cluster) -> list[int]:
        """Device ids of ``group`` on ``cluster``."""
        if group in self.groups:
            return list(self.groups[group])
        if self.default_devices is not None:
            return list(self.default_devices)
        return [d.global_id for d in cluster.devices]

    def granularity_for(self, src: str, dst: str | None, default: int | None) -> int | None:
        """Items per chunk on the edge ``src -> dst`` (``default`` when the plan is silent).

        ``dst=None``: the finest granularity on any edge downstream of ``src``. Intermediate
        groups that forward chunk by chunk (a reward scorer between rollout and actor) cannot
        split a chunk further, so the first producer must chunk that finely. A member of a
        collapsed cycle gets its ``sub_batches`` entry instead (``default`` for ``None``), and
        ``default`` (its whole share) when the placement does not say: a cycle's items are
        its own (an observation batch), not those of the edges leaving it.
        """
        if dst is not None:
            m = self.granularity.get(f"{src}->{dst}", self.default_granularity)
            return default if m is None else int(m)
        if src in self.sub_batches:
            m = self.sub_batches[src]
            return default if m is None else int(m)
        edges = [(k.split("->", 1), int(v)) for k, v in self.granularity.items()]
        if _on_cycle(src, [e for e, _ in edges]):
            return default
        seen, frontier, found = {src}, [src], []
        while frontier:
            node = frontier.pop()
            for (s, d), m in edges:
                if s == node:
                    found.append(m)
                    if d not in seen:
                        seen.add(d)
                        frontier.append(d)
        if not found:
            return default if self.default_granularity is None else self.default_granularity
        return min(found)

    def check(self, cluster: Cluster) -> None:
        """Raises :class:`PlacementError` when a device id is not on ``cluster``."""
        self.check_count(cluster.num_devices)

    def check_count(self, n: int) -> None:
        """Raises :class:`PlacementError` when a device id is not in ``[0, n)`` (``n``: the
        cluster's devices; checked before the cluster starts when the config knows ``n``)."""
        named = dict(self.groups)
        if self.default_devices is not None:
            named["(default)"] = self.default_devices
        for group, ids in named.items():
            if not ids:
                raise PlacementError(f"placement gives group '{group}' no devices")
            bad = [d for d in ids if not 0 <= d < n]
            if bad:
                raise PlacementError(
                    f"placement puts group '{group}' on devices {bad}, but the cluster has "
                    f"{n} devices (ids 0..{n - 1}): plan for {n} devices or declare more "
                    "(cluster.devices_per_node)"
                )
        for edge, m in self.granularity.items():
            if "->" not in edge or int(m) < 1:
                raise PlacementError(
                    f"placement granularity {edge!r}: {m!r}; write 'src->dst': items >= 1"
                )

    # -- files ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "groups": {k: list(v) for k, v in self.groups.items()},
            "granularity": dict(self.granularity),
            "default_devices": self.default_devices,
            "default_granularity": self.default_granularity,
            "predicted_step_s": self.predicted_step_s,
            "predicted": dict(self.predicted),
            "tree": self.tree,
            "sub_batches": dict(self.sub_batches),
            "options": {k: dict(v) for k, v in self.options.items()},
            "remote": dict(self.remote),
            "plan": dict(self.plan),
        }

    def save(self, path: str | Path) -> None:
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def load(cls, path: str | Path) -> Placement:
        """Read a placement YAML file.

        Raises:
            PlacementError: missing, empty or unparsable file, not a mapping, unknown keys,
                or a value of another type than :data:`FIELD_TYPES` says (one line naming
                the key and the entry).
        """
        import yaml

        p = Path(path)
        if not p.is_file():
            raise PlacementError(f"plan file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise PlacementError(f"plan file {str(p)!r} is not valid YAML: {e}") from None
        if not data:
            raise PlacementError(
                f"plan file {str(p)!r} is empty: write one with m2flow plan --save, or use "
                "plan=temporal"
            )
        if not isinstance(data, dict):
            raise PlacementError(f"plan file {str(p)!r} is not a YAML mapping")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlacementError(
                f"plan file {str(p)!r}: unknown keys {unknown}; known: {sorted(known)}"
            )
        for key, value in data.items():
            _check_field(key, value, f"plan file {str(p)!r}")
        return cls(**data)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(d) for d in v)


#: a plan file's key -> (is the value right, is each entry right (mappings), what it should be)
FIELD_TYPES: dict[str, tuple[Callable, Callable | None, str]] = {
    "mode": (lambda v: isinstance(v, str), None, "a name (temporal, spatial, hybrid, manual)"),
    "groups": (dict, _is_ids, "group -> a list of device ids ({actor: [0, 1]})"),
    "granularity": (dict, _is_int, "'src->dst' -> items per chunk ({rollout->actor: 4})"),
    "default_devices": (lambda v: v is None or _is_ids(v), None, "a list of device ids"),
    "default_granularity": (lambda v: v is None or _is_int(v), None, "items per chunk"),
    "predicted_step_s": (
        lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)),
        None,
        "seconds",
    ),
    "predicted": (dict, lambda v: isinstance(v, (int, float)), "group -> seconds"),
    "tree": (lambda v: isinstance(v, str), None, "text"),
    "sub_batches": (dict, lambda v: v is None or _is_int(v), "group -> items per sub-batch"),
    "options": (dict, lambda v: isinstance(v, dict), "group -> {keyword: value}"),
    "remote": (dict, None, "a mapping"),
    "plan": (dict, None, "a mapping"),
}


def _check_field(key: str, value: Any, where: str) -> None:
    """Raises :class:`PlacementError` naming ``key`` (and the entry) when ``value`` is not
    of the :data:`FIELD_TYPES` form: checked when a file is read, not deep in a run."""
    whole, entry, form = FIELD_TYPES[key]
    ok = isinstance(value, dict) if whole is dict else whole(value)
    if not ok:
        raise PlacementError(f"{where}: {key} must be {form}, not {_brief(value)}")
    if whole is dict and entry is not None:
        for name, v in value.items():
            if not isinstance(name, str) or not entry(v):
                raise PlacementError(f"{where}: {key}.{name} is {_brief(v)}; {key} must be {form}")


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def merge_options(kwargs: dict, options: dict | None) -> dict:
    """``kwargs`` with ``options`` deep-merged over it: a nested dict updates the runner's
    dict, or the fields of its dataclass (a role's typed options, e.g. ``{"options": {"spot":
    {...}}}`` over the rollout's ``options=RolloutOptions(...)``), key by key; anything else
    replaces. Neither argument is modified.

    Raises:
        PlacementError: an option replaces a runner's dict or dataclass with a non-dict (or
            the reverse), or names a field the dataclass lacks: a plan written for another
            runner.
    """
    out = dict(kwargs)
    for key, value in (options or {}).items():
        old = out.get(key)
        if isinstance(value, dict) and _is_record(old):
            out[key] = _merge_record(key, old, value)
        elif isinstance(value, dict) and isinstance(old, dict):
            out[key] = merge_options(old, value)
        elif isinstance(value, dict) != (isinstance(old, dict) or _is_record(old)) and (
            old is not None
        ):
            raise PlacementError(
                f"plan option {key}={value!r} does not fit the runner's {key}={old!r}: the plan "
                "was made for another workflow; re-plan it for this one"
            )
        else:
            out[key] = value
    return out


def _is_record(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _merge_record(key: str, record: Any, options: dict) -> Any:
    """``record`` (a dataclass instance) with ``options`` merged over its fields, a copy."""
    names = {f.name for f in dataclasses.fields(record)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise PlacementError(
            f"plan option {key}.{unknown[0]}: the runner's {key} ({type(record).__name__}) has "
            f"no such field; the plan was made for another workflow; re-plan it for this one"
        )
    fields = {n: getattr(record, n) for n in options}
    return dataclasses.replace(record, **merge_options(fields, options))


def _on_cycle(group: str, edges: list) -> bool:
    """Whether ``group`` can reach itself over ``edges`` (``[src, dst]`` pairs)."""
    seen, frontier = set(), [group]
    while frontier:
        node = frontier.pop()
        for s, d in edges:
            if s == node and d not in seen:
                if d == group:
                    return True
                seen.add(d)
                frontier.append(d)
    return False


def _sub_batches(plan) -> dict[str, int | None]:
    """Cycle member -> items per sub-batch (a split cycle) or None (a time-shared one)."""
    from ..scheduler.plan.tree import CycleSplit, Leaf

    out: dict[str, int | None] = {}

    def walk(node) -> None:
        if isinstance(node, CycleSplit):
            for c in node.upstream.leaves() + node.downstream.leaves():
                out.update({name: int(node.granularity) for name in c.components})
            return
        if isinstance(node, Leaf):
            if len(node.components) > 1:
                out.update({name: None for name in node.components})
            return
        for child in node._children():
            walk(child)

    walk(plan)
    return out


def temporal() -> Placement:
    """Every group on every device, every edge coalesced (RLinf's collocated mode)."""
    return Placement(mode="temporal")


def from_plan(
    plan, edges: list[tuple[str, str]], batch_size: int, num_devices: int | None = None
) -> Placement:
    """The placement of a planner :class:`~m2flow.scheduler.plan.planner.Plan`.

    Each group gets the devices its leaf *uses*: a component the planner gave n devices but
    that is fastest on k < n of them (``plan_workflow(allow_idle=True)``) launches on those k
    only, and the devices no leaf uses stay idle.

    Args:
        plan: the plan tree (device ranges per component, granularity per spatial cut).
        edges: the workflow's ``(src, dst)`` group edges.
        batch_size: items per step ``M`` (the granularity of a coalesced edge).
        num_devices: the devices planned for; when given, the idle ones are noted in ``tree``.
    """
    groups = {name: list(devs) for name, devs in plan.placement().items()}
    tree = str(plan)
    idle = plan.idle(num_devices) if num_devices is not None else []
    if idle:
        tree += "\nidle: " + ", ".join(f"[{r.start}, {r.stop})" for r in idle)
    gran = {f"{s}->{d}": int(m) for (s, d), m in plan.edge_granularity(edges, batch_size).items()}
    kinds = plan.kinds()
    mode = "hybrid" if len(kinds) == 2 else (next(iter(kinds)) if kinds else "temporal")
    return Placement(
        mode=mode,
        groups=groups,
        granularity=gran,
        predicted_step_s=float(plan.time),
        predicted={k: float(v) for k, v in plan.breakdown().items()},
        tree=tree,
        sub_batches=_sub_batches(plan),
    )
