"""The rich renderings of ``m2flow plan``'s text output (:mod:`.plan_cli`): the composition
tree and the tables of components, profile fits, runner-up plans and the spot rollout choice,
each from the plan or the documents the command builds (its ``--json`` fields).
"""

from __future__ import annotations

import math

from rich.table import Table
from rich.tree import Tree

from ..core.cluster import GiB


def gib(x) -> str:
    """Bytes as GiB with two decimals; ``-`` for ``None`` (not measured)."""
    return "-" if x is None else f"{x / GiB:.2f}"


def plan_tree(plan, label: str) -> Tree:
    """The composition tree of ``plan`` under ``label``: each node's kind, predicted seconds
    and device range (splits with their sizes and granularity)."""
    from ..scheduler.plan.tree import CycleSplit, Leaf, Spatial

    def head(node) -> str:
        span = f"[{node.devices.start}, {node.devices.stop})"
        if isinstance(node, Leaf):
            tag = ", time-shared" if node.shared else ""
            return f"[bold]{node.name}[/] {node.time:.4g} s on {span}{tag}"
        if isinstance(node, CycleSplit):
            return (
                f"[cyan]cycle {node.name} split[/] {node.time:.4g} s on {span}: "
                f"{len(node.upstream.devices)}+{len(node.downstream.devices)}, "
                f"{node.chunks} sub-batches of {node.granularity}, {node.round_trips:g} round trips"
            )
        if isinstance(node, Spatial):
            return (
                f"[cyan]spatial[/] {node.time:.4g} s on {span}: split "
                f"{len(node.upstream.devices)}+{len(node.downstream.devices)}, "
                f"m={node.granularity} ({node.chunks} chunks)"
            )
        return f"[magenta]temporal[/] {node.time:.4g} s on {span}"

    def add(parent: Tree, node) -> None:
        branch = parent.add(head(node))
        for child in node._children():
            add(branch, child)

    root = Tree(label)
    add(root, plan)
    return root


def components_table(comps: dict, nodes: int) -> Table:
    """The components table from :func:`~.plan_cli.components`' document (a nodes column when
    ``nodes > 1``)."""
    t = Table(title="components")
    cols = ["component", "devices", "#"] + (["nodes"] if nodes > 1 else [])
    cols += ["granularity (out)", "predicted s", "memory GiB"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("component", "devices") else "right")
    for name, c in comps.items():
        n = str(c["num_devices"])
        if c["devices_used"] != c["num_devices"]:
            n += f" (uses {c['devices_used']})"
        outs = ", ".join(f"{d}: {m}" for d, m in c["granularity_out"].items()) or "-"
        row = [name, f"[{c['devices'][0]}, {c['devices'][1]})", n]
        row += [c["nodes"]] if nodes > 1 else []
        row += [outs, f"{c['time_s']:.4f}", gib(c["memory_bytes"])]
        t.add_row(*row)
    return t


def fit_quality(f: dict) -> str:
    """``4.2% held out`` from 3 device counts on; below, no error is known (two points fit
    a two-parameter model exactly: its residual of ~1e-15 says nothing)."""
    if f["held_out_error"] is not None:
        return f"{100 * f['held_out_error']:.2g}% held out"
    return "none: exact fit" if len(f["device_counts"]) == 2 else "none: 1 point"


def fits_table(fit_doc: dict) -> Table:
    """The profile fits table: per component its time model and formula, the device counts
    measured, the held-out error (:func:`fit_quality`) and the memory model."""
    t = Table(title="profile fits (n = devices)")
    for col in ("component", "time model", "seconds", "measured n", "error", "memory model"):
        t.add_column(col, justify="right" if col in ("error", "measured n") else "left")
    for name, f in fit_doc.items():
        counts = ", ".join(map(str, f["device_counts"]))
        t.add_row(name, f["time"]["model"], f["time"]["formula"], counts, fit_quality(f),
                  f["memory"]["model"])  # fmt: skip
    return t


def shown(runner_ups, limit: int) -> list:
    """The fastest ``limit`` runner-ups, plus the fastest of every kind (each mode's best)."""
    firsts = {}
    for p in runner_ups:
        firsts.setdefault(p.kind(), p)
    keep = {id(p) for p in runner_ups[:limit]} | {id(p) for p in firsts.values()}
    return [p for p in runner_ups if id(p) in keep]


def runner_ups_table(result, overhead: float) -> Table:
    """The runner-up plans (:func:`shown`): kind, shape, devices used, predicted seconds (with
    the profile's step ``overhead``) and time against the best plan's."""
    t = Table(title="runner-ups")
    for col in ("kind", "plan", "devices used", "predicted s", "vs best"):
        t.add_column(col, justify="left" if col in ("kind", "plan") else "right")
    n = result.num_devices
    for p in shown(result.runner_ups, 10):
        used = n - sum(len(r) for r in p.idle(n))
        t.add_row(
            p.kind(),
            p.shape(),
            f"{used}/{n}",
            f"{p.time + overhead:.4f}",
            f"{p.time / result.time:.3f}x" if result.time > 0 else "-",
        )
    return t


def spot_table(spot, prof) -> Table:
    """The spot rollout choice and its runner-ups (:class:`~m2flow.scheduler.spot.plan.
    SpotPlan`): mode, ``T_seed``, ``N_prem``, instances, step seconds, $ per step, items per $."""
    t = Table(title=f"rollout: reserved or spot (objective {spot.objective})")
    for col in ("", "rollout", "T_seed s", "N_prem", "instances", "step s", "$/step",
                f"{prof.item}s/$"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("", "rollout") else "right")
    for label, c in [("chosen", spot.best)] + [("runner-up", c) for c in spot.runner_ups]:
        t.add_row(
            label, c.mode, "-" if c.t_seed is None else f"{c.t_seed:.3f}", str(c.n_prem),
            f"{c.instances:.2f}", f"{c.step_s:.4f}", f"{c.cost_per_step:.4f}",
            "inf" if math.isinf(c.items_per_dollar) else f"{c.items_per_dollar:.2f}",
        )  # fmt: skip
    return t
