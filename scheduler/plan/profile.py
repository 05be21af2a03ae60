"""Profile documents: what ``m2flow profile`` measures and the planner plans from.

Schema (YAML; units: seconds, bytes, items per step)::

    workflow: grpo                    # name
    batch_size: 32                    # items per step, M (e.g. prompts)
    item: prompt                      # what an item is (display only)
    device_memory_bytes: 17179869184  # per-device capacity where it was measured (or null)
    step_overhead_s: 0.1              # seconds per step no component accounts for (default 0)
    edges:                            # traced channel traffic, group -> group
      - {src: rollout, dst: reward, items_per_step: 32}
    components:
      rollout:
        min_devices: 1
        max_devices: null             # null: no limit
        switch_s: 0.05                # offload + onload when time-shared, per step
        chunk_overhead_s: 0.01        # fixed seconds per pipelined chunk
        points:                       # seconds per step of the whole batch on `devices`
          - {devices: 1, seconds: 0.40, memory_bytes: 1.2e8}
    cycles:                           # two-member cycles that may split (optional, .cycle)
      - members: [env, policy]        # leader (splits its share into sub-batches), follower
        round_trips: 33               # R: round trips per step (per leader rank)
        batch: 64                     # items of the leader's share sub-batches split
        shared_gap_s: 0.03            # per round trip, time-shared: hand-offs and latency
        split_gap_s: 0.02             # per round trip, on disjoint devices: latency
        sub_batch_overhead_s: 0.001   # per extra sub-batch per round trip, each member
        split_scale: 0.8              # a member's time split / its time-shared busy time
    spot:                             # a remote rollout pool the plan may use (optional)
      component: rollout              # the component it can take over
      instance_items_per_s: 2.5       # one instance's rollout throughput, items/s
      devices_per_instance: 2         # TP size of an instance
      expected_instances: 6.53        # available on average (or m2flow plan --spot-trace)
      max_instances: null             # most the plan may hold (null: ceil(expected))
      weight_sync_s: 1.5              # weight push to the instances, per step
      tail_s: 0.0                     # when the longest responses end (s from step start)
      tail_train_fraction: 0.0        # share of training that waits for them, [0, 1]
    prices: {reserved: 10.47, spot: 2.66}   # $ per device-hour (optional; cost reports)
    reward_service:                   # a component scored by a remote service (optional)
      component: reward               # runs off the reserved devices (.reward_remote)
      extra_delay_s: 0.62             # the service's predicted extra delay per batch
      tail_s: 0.05                    # scoring time of the last request
    agent:                            # agent episodes: turns, tool latency (optional, .agent)
      component: rollout              # the component running them (its points: model time)
      episodes_per_item: 8            # episodes per item
      turns: {1: 0.2, 2: 0.5, 3: 0.3} # assistant turns per episode: share of episodes
      tool_latency_s: {median: 2.0, p90: 6.0}   # seconds per tool call (or {samples: [...]})
      tool_timeout_s: null            # calls cut here (null: never)
      observation_tokens: 200         # tokens appended per tool call
    measured_on:                      # where it was measured (optional; m2flow profile writes it)
      host: node-7                    # hostname
      cpu: AMD EPYC 7B13              # CPU model
      cpus: 2                         # logical CPUs
      gpu: null                       # GPU model (null: none)
      load_1m: 5.2                    # mean 1-minute load average while profiling

Only ``batch_size`` and ``components`` (each with ``points``) are required; a profile without
``cycles`` (written before cycles could split) plans its cycles time-shared, as before; one
without ``spot`` plans rollout on the reserved devices only (:mod:`.spot_plan`). Numbers
may be written ``1.2e8`` (YAML 1.1 reads that as a string; it is accepted as a number here).
Every number must be finite and >= 0 (device counts and ``batch_size`` >= 1, whole).
``seconds: 0`` (the profiler rounds to 1 us, so a group with nothing measurable to do) or
``memory_bytes: 0`` (a group holding no device memory) at *every* point of a component means it
costs nothing;
0 at some points only is rejected: the relative-error fit (:mod:`.fit`) would take the 0 as
exact and predict about 0 at every device count.

:func:`to_workflow` turns a profile into the planner's :class:`~.planner.Workflow`, each
component's time and memory fitted over its points (:mod:`.fit`: time over every model,
memory over ``constant`` and ``amdahl``, i.e. replicated + sharded bytes). Source: RLinf
section 3.4 (the profiler and the scheduler). Pure: no Ray, no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..reward.remote import RewardService, RewardServiceError
from ..spot.plan import Prices, SpotPlanError, SpotPool
from .agent import AgentError, AgentWorkload, agent_from_dict, with_tool_wait
from .cycle import CycleCost, CycleError
from .fit import Fit, fit_scaling

MEMORY_MODELS = ("constant", "amdahl")


class ProfileError(ValueError):
    """A profile document that cannot be planned from (the message says what and how to fix)."""


@dataclass
class Point:
    """One measurement: ``seconds`` per step (whole batch) and peak ``memory_bytes`` per device
    on ``devices`` devices."""

    devices: int
    seconds: float
    memory_bytes: float


@dataclass
class ComponentProfile:
    """A worker group's measured points and planning constants (see the module schema)."""

    points: list[Point]
    min_devices: int = 1
    max_devices: int | None = None
    switch_s: float = 0.0
    chunk_overhead_s: float = 0.0

    def time_fit(self) -> Fit:
        """Seconds per step as a function of devices (:func:`~.fit.fit`)."""
        return fit_scaling([p.devices for p in self.points], [p.seconds for p in self.points])

    def memory_fit(self) -> Fit:
        """Peak bytes per device as a function of devices (constant or replicated+sharded)."""
        return fit_scaling(
            [p.devices for p in self.points],
            [p.memory_bytes for p in self.points],
            models=MEMORY_MODELS,
            kind="memory",
        )


@dataclass
class Edge:
    """Traced channel traffic ``src -> dst`` (group names), items per step."""

    src: str
    dst: str
    items_per_step: float = 0.0


@dataclass
class Profile:
    """A whole profile document (see the module schema)."""

    batch_size: int
    components: dict[str, ComponentProfile]
    edges: list[Edge] = field(default_factory=list)
    workflow: str = "workflow"
    item: str = "item"
    device_memory_bytes: float | None = None
    step_overhead_s: float = 0.0
    cycles: list[CycleCost] = field(default_factory=list)
    spot: SpotPool | None = None
    prices: Prices | None = None
    reward_service: RewardService | None = None
    measured_on: dict[str, Any] | None = None
    agent: AgentWorkload | None = None

    def agent_rollout_s(self, devices: int) -> tuple[float, float]:
        """``(model s, rollout s)`` of the ``agent:`` block's component per step on
        ``devices`` devices (:class:`~.agent.AgentRolloutTime`; the tool wait is their
        difference).

        Raises:
            ValueError: no ``agent:`` block.
        """
        if self.agent is None:
            raise ValueError("the profile has no agent: block")
        model = self.components[self.agent.component].time_fit()
        episodes = self.batch_size * self.agent.episodes_per_item
        rollout = with_tool_wait(_Timed(model), self.agent, episodes).time
        return float(model(devices)), float(rollout(devices))

    def to_dict(self) -> dict[str, Any]:
        """The document, keys in schema order (what :func:`save_profile` writes)."""
        return {
            "workflow": self.workflow,
            "batch_size": self.batch_size,
            "item": self.item,
            "device_memory_bytes": self.device_memory_bytes,
            "step_overhead_s": self.step_overhead_s,
            "edges": [
                {"src": e.src, "dst": e.dst, "items_per_step": e.items_per_step} for e in self.edges
            ],
            "components": {
                name: {
                    "min_devices": c.min_devices,
                    "max_devices": c.max_devices,
                    "switch_s": c.switch_s,
                    "chunk_overhead_s": c.chunk_overhead_s,
                    "points": [
                        {"devices": p.devices, "seconds": p.seconds, "memory_bytes": p.memory_bytes}
                        for p in c.points
                    ],
                }
                for name, c in self.components.items()
            },
            **({"cycles": [_cycle_doc(c) for c in self.cycles]} if self.cycles else {}),
            **({"spot": asdict(self.spot)} if self.spot else {}),
            **({"prices": asdict(self.prices)} if self.prices else {}),
            **({"reward_service": asdict(self.reward_service)} if self.reward_service else {}),
            **({"agent": self.agent.to_dict()} if self.agent else {}),
            **({"measured_on": dict(self.measured_on)} if self.measured_on else {}),
        }


@dataclass
class _Timed:
    """A bare ``time`` and ``chunk_overhead`` for :func:`~.agent.with_tool_wait`."""

    time: Any
    chunk_overhead: float = 0.0


def _cycle_doc(c: CycleCost) -> dict[str, Any]:
    return {
        "members": list(c.members),
        "round_trips": c.round_trips,
        "batch": c.batch,
        "shared_gap_s": c.shared_gap_s,
        "split_gap_s": c.split_gap_s,
        "sub_batch_overhead_s": c.sub_batch_overhead_s,
        "split_scale": c.split_scale,
    }


_TOP = {
    "workflow",
    "batch_size",
    "item",
    "device_memory_bytes",
    "step_overhead_s",
    "edges",
    "components",
    "cycles",
    "spot",
    "prices",
    "reward_service",
    "agent",
    "measured_on",
}
_CYCLE = {
    "members",
    "round_trips",
    "batch",
    "shared_gap_s",
    "split_gap_s",
    "sub_batch_overhead_s",
    "split_scale",
}
_COMP = {"min_devices", "max_devices", "switch_s", "chunk_overhead_s", "points"}
_POINT = {"devices", "seconds", "memory_bytes"}
_EDGE = {"src", "dst", "items_per_step"}


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ProfileError(msg)


def _keys(doc: Any, known: set[str], required: set[str], where: str) -> dict:
    _need(isinstance(doc, dict), f"{where}: expected a mapping, got {doc!r}")
    unknown = sorted(set(doc) - known)
    _need(not unknown, f"{where}: unknown keys {unknown}; known keys: {sorted(known)}")
    missing = sorted(required - set(doc))
    _need(not missing, f"{where}: missing {missing}; add them (see m2flow.scheduler.plan.profile)")
    return doc


def _number(value: Any, where: str, minimum: float = 0.0, integer: bool = False) -> Any:
    """A finite number >= ``minimum`` (numeric strings such as ``1.2e8`` accepted)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ProfileError(f"{where} = {value!r} is not a number") from None
    _need(
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value),
        f"{where} = {value!r} is not a finite number",
    )
    if integer:
        _need(float(value).is_integer(), f"{where} = {value!r} must be a whole number")
        value = int(value)
    _need(value >= minimum, f"{where} = {value!r} must be >= {minimum:g}")
    return value


def _component(name: str, c: Any) -> ComponentProfile:
    where = f"components.{name}"
    _keys(c, _COMP, {"points"}, where)
    pts = c["points"]
    _need(
        isinstance(pts, list) and pts,
        f"{where}.points: no measured points; profile {name!r} on at least one device count "
        "(three or more for a checked fit)",
    )
    points, seen = [], set()
    for i, p in enumerate(pts):
        at = f"{where}.points[{i}]"
        _keys(p, _POINT, _POINT, at)
        pt = Point(
            _number(p["devices"], f"{at}.devices", 1, integer=True),
            float(_number(p["seconds"], f"{at}.seconds")),
            float(_number(p["memory_bytes"], f"{at}.memory_bytes")),
        )
        _need(
            pt.devices not in seen,
            f"{at}: devices={pt.devices} measured twice; keep one point per device count",
        )
        seen.add(pt.devices)
        points.append(pt)
    for what in ("seconds", "memory_bytes"):
        zero = [pt.devices for pt in points if getattr(pt, what) == 0]
        _need(
            len(zero) in (0, len(points)),
            f"{where}.points: {what} = 0 at devices {zero} but > 0 at the others; the fit "
            f"would pull {name!r} to 0 everywhere: re-measure those counts or drop them (0 at "
            "every point is fine: a component that costs nothing)",
        )
    cp = ComponentProfile(
        points,
        _number(c.get("min_devices", 1), f"{where}.min_devices", 1, integer=True),
        None
        if c.get("max_devices") is None
        else _number(c["max_devices"], f"{where}.max_devices", 1, integer=True),
        float(_number(c.get("switch_s", 0.0), f"{where}.switch_s")),
        float(_number(c.get("chunk_overhead_s", 0.0), f"{where}.chunk_overhead_s")),
    )
    _need(
        cp.max_devices is None or cp.max_devices >= cp.min_devices,
        f"{where}: max_devices={cp.max_devices} < min_devices={cp.min_devices}; raise it or "
        "set it to null",
    )
    return cp


def profile_from_dict(doc: Any) -> Profile:
    """Validate and build a :class:`Profile`.

    Raises:
        ProfileError: not a mapping, unknown or missing keys, a negative, non-finite or
            non-numeric number, a device count or batch size below 1, a bad ``agent:`` block
            (:func:`~.agent.agent_from_dict`), a component without
            points (or with a device count measured twice, or 0 seconds or bytes at some of its
            points only), an edge naming a component the profile does not measure, or a cycle
            entry naming other than two profiled components (or with round_trips below 1).
    """
    _keys(doc, _TOP, {"batch_size", "components"}, "profile")
    batch = _number(doc["batch_size"], "batch_size", 1, integer=True)
    comps_doc = doc["components"]
    _need(
        isinstance(comps_doc, dict) and comps_doc,
        "components: give at least one component (name: {points: [...]})",
    )
    comps = {str(name): _component(str(name), c) for name, c in comps_doc.items()}
    edges = []
    edges_doc = doc.get("edges") or []
    _need(isinstance(edges_doc, list), f"edges: expected a list, got {edges_doc!r}")
    for i, e in enumerate(edges_doc):
        _keys(e, _EDGE, {"src", "dst"}, f"edges[{i}]")
        for end in (e["src"], e["dst"]):
            _need(
                end in comps,
                f"edges[{i}]: {e['src']} -> {e['dst']} names {end!r}, which the profile does "
                f"not measure (components: {sorted(comps)}); profile it or drop the edge",
            )
        items = _number(e.get("items_per_step", 0.0), f"edges[{i}].items_per_step")
        edges.append(Edge(str(e["src"]), str(e["dst"]), float(items)))
    cycles = []
    cycles_doc = doc.get("cycles") or []
    _need(isinstance(cycles_doc, list), f"cycles: expected a list, got {cycles_doc!r}")
    for i, c in enumerate(cycles_doc):
        cycles.append(_cycle(c, f"cycles[{i}]", comps))
    cap = doc.get("device_memory_bytes")
    spot = _spot(doc["spot"], comps) if doc.get("spot") is not None else None
    prices = None
    if doc.get("prices") is not None:
        _keys(doc["prices"], {"reserved", "spot"}, set(), "prices")
        nums = {k: float(_number(v, f"prices.{k}")) for k, v in doc["prices"].items()}
        prices = _build(Prices, nums, "prices")
    service = None
    if doc.get("reward_service") is not None:
        service = _reward_service(doc["reward_service"], comps, spot)
    agent = None
    if doc.get("agent") is not None:
        try:
            agent = agent_from_dict(doc["agent"], comps)
        except AgentError as e:
            raise ProfileError(str(e)) from None
    return Profile(
        batch_size=batch,
        components=comps,
        edges=edges,
        workflow=str(doc.get("workflow", "workflow")),
        item=str(doc.get("item", "item")),
        device_memory_bytes=None if cap is None else float(_number(cap, "device_memory_bytes", 1)),
        step_overhead_s=float(_number(doc.get("step_overhead_s", 0.0) or 0.0, "step_overhead_s")),
        cycles=cycles,
        spot=spot,
        prices=prices,
        reward_service=service,
        measured_on=_measured_on(doc.get("measured_on")),
        agent=agent,
    )


def _measured_on(doc: Any) -> dict[str, Any] | None:
    _need(
        doc is None or isinstance(doc, dict),
        f"measured_on: give a mapping (host, cpu, cpus, gpu, load_1m), not {doc!r}",
    )
    return None if doc is None else dict(doc)


def _build(cls, doc: dict, where: str):
    try:
        return cls(**doc)
    except (SpotPlanError, RewardServiceError, TypeError) as e:
        raise ProfileError(f"{where}: {e}") from None


def _reward_service(doc: Any, comps: dict, spot: SpotPool | None) -> RewardService:
    _keys(doc, {"component", "extra_delay_s", "tail_s"}, set(), "reward_service")
    name = str(doc.get("component", "reward"))
    _need(
        name in comps,
        f"reward_service.component {name!r} is not a profiled component (components: "
        f"{sorted(comps)}); name the reward component",
    )
    _need(
        spot is None or spot.component != name,
        f"reward_service.component and spot.component are both {name!r}; a component runs "
        "on one of them",
    )
    nums = {k: float(_number(v, f"reward_service.{k}")) for k, v in doc.items() if k != "component"}
    return _build(RewardService, {**nums, "component": name}, "reward_service")


def _spot(doc: Any, comps: dict) -> SpotPool:
    known = {"component", "instance_items_per_s", "devices_per_instance", "expected_instances",
             "max_instances", "weight_sync_s", "tail_s", "tail_train_fraction"}  # fmt: skip
    _keys(doc, known, {"instance_items_per_s"}, "spot")
    name = str(doc.get("component", "rollout"))
    _need(
        name in comps,
        f"spot.component {name!r} is not a profiled component (components: {sorted(comps)}); "
        "name the rollout component",
    )
    nums = {k: _number(v, f"spot.{k}", integer=k in ("devices_per_instance", "max_instances"))
            for k, v in doc.items() if k != "component" and v is not None}  # fmt: skip
    return _build(SpotPool, {**doc, **nums, "component": name}, "spot")


def _cycle(doc: Any, where: str, comps: dict) -> CycleCost:
    _keys(doc, _CYCLE, {"members", "round_trips"}, where)
    members = doc["members"]
    _need(
        isinstance(members, list) and len(members) == 2 and all(m in comps for m in members),
        f"{where}.members: give the two profiled components of the cycle, leader first "
        f"(components: {sorted(comps)}); got {members!r}",
    )
    try:
        return CycleCost(
            (str(members[0]), str(members[1])),
            float(_number(doc["round_trips"], f"{where}.round_trips", 1)),
            _number(doc.get("batch", 1), f"{where}.batch", 1, integer=True),
            *(
                float(_number(doc.get(k, 0.0), f"{where}.{k}"))
                for k in ("shared_gap_s", "split_gap_s", "sub_batch_overhead_s")
            ),
            float(_number(doc.get("split_scale", 1.0), f"{where}.split_scale")),
        )
    except CycleError as e:
        raise ProfileError(f"{where}: {e}") from None


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile YAML file.

    Raises:
        ProfileError: missing file, bad YAML, or an invalid profile.
    """
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"profile {str(p)!r} does not exist: run `m2flow profile` first")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ProfileError(f"profile {str(p)!r} is not valid YAML: {e}") from None
    return profile_from_dict(doc)


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write ``profile`` as YAML (:func:`load_profile` reads back an equal profile)."""
    Path(path).write_text(yaml.safe_dump(profile.to_dict(), sort_keys=False))


def fits(profile: Profile) -> dict[str, tuple[Fit, Fit]]:
    """Per component: ``(time fit, memory fit)``."""
    return {n: (c.time_fit(), c.memory_fit()) for n, c in profile.components.items()}


def to_workflow(profile: Profile):
    """The planner's :class:`~.planner.Workflow`: fitted time and memory per component,
    the traced edges and ``batch_size``; an ``agent:`` block's tool wait added to its
    component (:func:`~.agent.with_tool_wait`; none when it is 0)."""
    from .planner import Component, Workflow

    comps = [
        Component(
            name,
            time=t,
            memory=m,
            min_devices=profile.components[name].min_devices,
            switch_cost=profile.components[name].switch_s,
            chunk_overhead=profile.components[name].chunk_overhead_s,
            max_devices=profile.components[name].max_devices,
        )
        for name, (t, m) in fits(profile).items()
    ]
    agent = profile.agent
    if agent is not None and agent.component in profile.components:
        episodes = profile.batch_size * agent.episodes_per_item
        comps = [with_tool_wait(c, agent, episodes) if c.name == agent.component else c
                 for c in comps]  # fmt: skip
    edges = [(e.src, e.dst) for e in profile.edges]
    return Workflow(comps, edges, profile.batch_size, tuple(profile.cycles))
