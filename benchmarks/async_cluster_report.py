"""The report side of ``benchmarks/async_cluster.py``: the period estimator, the goals of
issue 32's first "Measure" bullet, re-scoring a results document, and its markdown tables
(``docs/results/async.md``)."""

from __future__ import annotations

import numpy as np


def trained_period(ends: dict, warm: int, steps: int) -> float:
    """Real seconds per step: the least-squares slope of the trainer's ends of steps
    ``warm - 1 .. warm + steps - 1`` (a new version each). Not the steps' ends (``done``):
    a step ends after its weight receive, which can queue behind later generate calls (see
    docs/results/async.md), so those come in bursts while the trainer keeps its pace."""
    ns = np.arange(warm - 1, warm + steps)
    return float(np.polyfit(ns, [ends[n] for n in ns], 1)[0])


def rescore(doc: dict) -> dict:
    """Recompute every run's samples/s, ratios and the goals from its recorded spans
    (:func:`trained_period`), e.g. for results measured with an older estimator."""
    for sizes in doc["results"].values():
        for size in sizes:
            for r in size["runs"]:
                ends = {int(n): sp["train"][1] for n, sp in r["spans"].items()}
                step = trained_period(ends, r["warmup"], r["steps"]) * r["time_scale"]
                r["step_s"], r["samples_per_s"] = step, r["samples_per_step"] / step
                for name in ("u_time", "u_len"):
                    r[f"ratio_{name}"] = r[f"pred_{name}"]["samples_per_s"] / r["samples_per_s"]
            first = size["runs"][0]
            size["overhead_s"] = max(first["step_s"] - first["sync_critical_path_s"], 0.0)
    doc["goals"] = goals(doc["results"]["long-tail"], doc["results"]["short"])
    return doc


def goals(long: list[dict], short: list[dict]) -> dict:
    """The issue's goals, per device count."""
    out = {}
    for size in long:
        runs, sync = size["runs"], size["runs"][0]["samples_per_s"]
        on = [(r["k"], r["samples_per_s"]) for r in runs if r["partial"]]
        g2 = max((v for k, v in on if k <= 2), default=sync) / sync
        g8 = max((v for k, v in on if k == 8), default=max((v for _, v in on), default=sync))
        g8 /= sync
        out[f"long-tail {size['devices']}"] = {
            "gain_k_le_2": g2, "gain_2x": g2 >= 2.0,
            "gain_k8": g8, "share_of_k8_gain": (g2 - 1) / (g8 - 1) if g8 > 1 else None,
            "within_10pct_u_time": all(abs(r["ratio_u_time"] - 1) <= 0.1 for r in runs),
            "within_10pct_u_len": all(abs(r["ratio_u_len"] - 1) <= 0.1 for r in runs),
            "max_error_u_time": max(abs(r["ratio_u_time"] - 1) for r in runs),
            "max_error_u_len": max(abs(r["ratio_u_len"] - 1) for r in runs),
        }  # fmt: skip
    for size in short:
        runs, sync = size["runs"], size["runs"][0]["samples_per_s"]
        chosen = {n: p["chosen"]["k"] for n, p in size["plans"].items()}
        better = max((r["samples_per_s"] for r in runs if r["k"] > 0), default=0.0)
        out[f"short {size['devices']}"] = {
            "planner_k": chosen, "planner_k0": chosen["u_time"] == 0 and chosen["u_len"] == 0,
            "best_async_vs_sync": better / sync, "measured_agrees": better < 1.05 * sync,
            "max_error_u_time": max(abs(r["ratio_u_time"] - 1) for r in runs),
        }  # fmt: skip
    return out


def markdown(doc: dict) -> str:
    """The tables of ``docs/results/async.md`` from a results document."""
    lines = []
    for name, sizes in doc["results"].items():
        if not sizes:
            continue
        lines += [f"**{name}**", "",
                  "| devices | placement | K | partial | samples/s | vs best sync | predicted "
                  "(u_time) | pred/meas | predicted (u_len) | pred/meas | staleness meas/pred |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for size in sizes:
            sync = size["runs"][0]["samples_per_s"]
            for r in size["runs"]:
                lines.append(
                    f"| {size['devices']} | {r['placement']} | {r['k']} | "
                    f"{'on' if r['partial'] else 'off'} | {r['samples_per_s']:.2f} | "
                    f"{r['samples_per_s'] / sync:.2f}x | {r['pred_u_time']['samples_per_s']:.2f}"
                    f" | {r['ratio_u_time']:.3f} | {r['pred_u_len']['samples_per_s']:.2f} | "
                    f"{r['ratio_u_len']:.3f} | {r['staleness_mean']:.2f} / "
                    f"{r['pred_u_time']['staleness_mean']:.2f} |"
                )  # fmt: skip
        lines += [
            "",
            "| devices | batch | time scale | overhead o (s/step) | u_len | u_time | "
            "planner's choice (u_time) | (u_len) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for size in sizes:
            c = {n: size["plans"][n]["chosen"] for n in ("u_time", "u_len")}
            lines.append(
                f"| {size['devices']} | {size['batch']} | {size['time_scale']:.0f} | "
                f"{size['overhead_s']:.1f} | {size['tails']['u_len']:.3f} | "
                f"{size['tails']['u_time']:.3f} | K={c['u_time']['k']} "
                f"{c['u_time']['placement']} | K={c['u_len']['k']} {c['u_len']['placement']} |"
            )  # fmt: skip
        lines.append("")
    return "\n".join(lines)
