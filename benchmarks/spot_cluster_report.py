"""Report of ``benchmarks/spot_cluster.py``: its table and plot, from the results dict."""

from __future__ import annotations

from pathlib import Path


def table(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="RLBoost emulated at cluster scale (emulated seconds; RLBoost section 6.2)")
    for col in (
        "model/config",
        "tok/s",
        "x veRL",
        "tok/$",
        "x veRL $",
        "step s",
        "$/step",
        "avail",
        "held",
        "spot share",
        "planner step (err)",
        "planner $ (err)",
        "planner@avail step (err)",
    ):
        t.add_column(col, justify="right")
    for key, d in results["derived"].items():
        p = d.get("planner")
        t.add_row(
            key, f"{d['throughput']:,.0f}", f"{d.get('x_throughput', float('nan')):.2f}",
            f"{d['tokens_per_dollar']:,.0f}", f"{d.get('x_tokens_per_dollar', float('nan')):.2f}",
            f"{d['step_s']:.0f}", f"{d['cost_per_step']:.3f}", f"{d['avg_available']:.1f}",
            f"{d['avg_held']:.1f}", f"{d['spot_share']:.0%}",
            f"{p['step_s']:.0f} ({p['step_error']:+.0%})" if p else "",
            f"{p['cost_per_step']:.3f} ({p['cost_error']:+.0%})" if p else "",
            (f"{d['planner_window']['step_s']:.0f} ({d['planner_window']['step_error']:+.0%})"
             if p else ""),
        )  # fmt: skip
    Console(width=200).print(t)
    print(f"wall: {results['wall_s']:.0f} s")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = {k: v for k, v in results["derived"].items() if "x_throughput" in v}
    names = list(d)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.barh(names, [d[n]["x_throughput"] for n in names])
    ax1.set(xlabel="throughput / veRL", title="training throughput (tokens/s)")
    ax2.barh(names, [d[n]["x_tokens_per_dollar"] for n in names], color="tab:green")
    ax2.set(xlabel="tokens per $ / veRL", title="cost efficiency")
    for ax in (ax1, ax2):
        ax.axvline(1.0, color="k", lw=0.8)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
