"""Report of ``benchmarks/spot_cluster.py``: its table and plot, from the results dict."""

from __future__ import annotations

from pathlib import Path

# RLBoost section 6 / appendices, as printed (paper:328-353, 367, 384, 503, 544)
PAPER_X_VERL = {"qwen3-8b": 1.66, "qwen3-14b": 1.97, "qwen3-32b": 1.51}
PAPER_COST = {"qwen3-8b": 1.34, "qwen3-14b": 1.49, "qwen3-32b": 1.28}
PAPER_COST_A = {"qwen3-8b": 1.36, "qwen3-14b": 1.53, "qwen3-32b": 1.45}
PAPER_DISAGG_COST = {"qwen3-8b": 1.62, "qwen3-14b": 1.75, "qwen3-32b": 1.45}


def _t(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def fig10_md(res: dict) -> str:
    runs, parts = res["runs"], []
    for model in dict.fromkeys(k.split("/")[0] for k in runs):
        base = runs[f"{model}/veRL"]
        rows = []
        rl = [v for k, v in runs.items() if k.startswith(f"{model}/RLBoost/")]
        for key, r in runs.items():
            if not key.startswith(model + "/"):
                continue
            name = key.split("/", 1)[1]
            paper = ""
            if name == "RLBoost/A":
                paper = f"x{PAPER_COST_A[model]:.2f} tok/$ (seg. A)"
            elif name == "Disagg.BAL":
                paper = f"RLBoost tok/$ / {PAPER_DISAGG_COST[model]:.2f}"
            rows.append(
                [
                    name,
                    f"{r['throughput']:,.0f}",
                    f"{r['throughput'] / base['throughput']:.2f}",
                    f"{r['tokens_per_dollar']:,.0f}",
                    f"{r['tokens_per_dollar'] / base['tokens_per_dollar']:.2f}",
                    f"{r['step_s']:.0f}",
                    r["steps"],
                    f"{r['avg_held']:.2f}",
                    f"{r['spot_share']:.0%}",
                    int(r["preemptions"]),
                    paper,
                ]
            )
        if rl:
            thr = sum(r["throughput"] for r in rl) / len(rl) / base["throughput"]
            eff = sum(r["tokens_per_dollar"] for r in rl) / len(rl) / base["tokens_per_dollar"]
            rows.append(
                [
                    f"**RLBoost, mean of {len(rl)} segments**",
                    "",
                    f"**{thr:.2f}**",
                    "",
                    f"**{eff:.2f}**",
                    "",
                    "",
                    "",
                    "",
                    "",
                    f"x{PAPER_X_VERL[model]:.2f} thr, x{PAPER_COST[model]:.2f} tok/$",
                ]
            )
        k = res["disagg_size"].get(model, {}).get("k")
        share = sum(r["last_response"] for r in base["records"]) / base["time_s"]
        parts.append(
            f"**{model}** (Disagg.BAL: {k} instances; veRL's rollout: {share:.0%} of its step)\n\n"
            + _t(
                [
                    "system",
                    "tok/s",
                    "x veRL",
                    "tok/$",
                    "x veRL",
                    "step s",
                    "steps",
                    "held",
                    "spot share",
                    "preempt.",
                    "paper",
                ],
                rows,
            )
        )
    return "\n\n".join(parts)


def fig11_md(res: dict) -> str:
    paper = {1: "1.37x thr, 1.28x tok/$", 6: "2.25x thr, 1.62x tok/$"}
    rows = []
    for n, r in res["rows"].items():
        f = r.get("seed_all", {})
        rows.append(
            [
                n,
                f"{r['throughput']:,.0f}",
                f"{r['x_throughput']:.2f}",
                f"{r['x_tokens_per_dollar']:.2f}",
                f"{r['step_s']:.0f}",
                f"{r['t_seed']:.0f}",
                f"{r['spot_share']:.0%}",
                f"{f.get('x_throughput', float('nan')):.2f} / "
                f"{f.get('x_tokens_per_dollar', float('nan')):.2f}",
                paper.get(int(n), ""),
            ]
        )
    return _t(
        [
            "instances",
            "tok/s",
            "x (0)",
            "tok/$ x (0)",
            "step s",
            "T_seed",
            "spot share",
            "old seeding rule (all): x thr / x tok/$",
            "paper",
        ],
        rows,
    )


def fig12_md(res: dict) -> str:
    paper = {"full": "", "w/o memory": "-6 %", "w/o seeding": "-19 %"}
    rows = [
        [
            n,
            f"{r['throughput']:,.0f}",
            f"{r['vs_full']:+.1%}",
            r["steps"],
            paper[n],
            sum(1 for s in r["steps_detail"] if s["memory_hit"]),
        ]
        for n, r in res["runs"].items()
    ]
    return _t(["variant", "tok/s", "vs full", "steps", "paper", "steps with memory recall"], rows)


def fig13_md(out: dict) -> str:
    rows = []
    for fig in ("fig13", "fig17"):
        for mode, r in out.get(fig, {}).get("runs", {}).items():
            rows.append(
                [
                    fig,
                    mode,
                    f"{r['step_s']:.0f}",
                    f"{r['next_step_s']:.0f}",
                    f"{r['mean_gen_tps']:,.0f}",
                    f"{max(r['gen_tps']):,.0f}",
                    f"{r['push_s']:.1f}",
                ]
            )
    return _t(
        [
            "scenario",
            "weights",
            "step s",
            "next step s",
            "spot gen tok/s (mean)",
            "peak (10 s bin)",
            "push s",
        ],
        rows,
    )


def fig14_md(res: dict) -> str:
    paper = {"100s": "33 %", "200s": "76 %"}
    rows = []
    for at, r in res.items():
        m, c = r["migrate"], r["recompute"]
        rows.append(
            [
                at,
                f"{m['mean_s']:.1f} [{m['p2.5']:.1f}, {m['p97.5']:.1f}]",
                f"{c['mean_s']:.1f} [{c['p2.5']:.1f}, {c['p97.5']:.1f}]",
                f"{r['reduction']:.0%}" if r["reduction"] is not None else "n/a",
                paper[at],
            ]
        )
    return _t(
        ["preempted at", "migrate +s [95 %]", "recompute +s [95 %]", "overhead reduction", "paper"],
        rows,
    )


def fig16_md(res: dict) -> str:
    rows = []
    for model, r in res["models"].items():
        d = r["x_verl_by_discount"]
        rows.append(
            [model]
            + [f"{d[k]:.2f}" for k in ("0.0", "0.3", "0.5", "0.7", "1.0")]
            + [
                f"{r['break_even']:.0%}" if r["break_even"] is not None else "none",
                ", ".join(f"{n} {v:.2f}" for n, v in r["baselines"].items()),
            ]
        )
    return (
        _t(
            [
                "model",
                "0 %",
                "30 %",
                "50 %",
                "70 %",
                "100 %",
                "break-even",
                "baselines (x veRL tok/$)",
            ],
            rows,
        )
        + f"\n\n(Table 2's prices are a {res['table2_discount']:.0%} discount.)"
    )


def appe_md(res: dict) -> str:
    rows = []
    for cap, r in res.items():
        a, b = r["alg1"], r["best_static"]
        rows.append(
            [
                cap,
                f"{r['verl_step_s']:.0f}",
                f"{a['x_throughput']:.2f}",
                f"{a['x_tokens_per_dollar']:.2f}",
                a["n_prem"][-1],
                f"{a['held']:.1f}",
                b["n"],
                f"{b['x_throughput']:.2f}",
                f"{b['x_tokens_per_dollar']:.2f}",
            ]
        )
    return (
        _t(
            [
                "cap",
                "veRL step s",
                "Alg.1 x thr",
                "Alg.1 x tok/$",
                "N_prem (last)",
                "held",
                "best static n",
                "x thr",
                "x tok/$",
            ],
            rows,
        )
        + "\n\nPaper (Fig. 18, 5K-14K): N_prem 3 -> 6, 1.47x-2.22x throughput, 1.24x-1.61x tok/$."
    )


def tail_md(res: dict) -> str:
    rows = [
        [
            k.split("/")[0],
            r["sigma"],
            f"{r['median']:,.0f}",
            f"{r['capped_share']:.1%}",
            f"{r['verl_step_s']:.0f}",
            f"{r['x_throughput']:.2f}",
            f"{r['x_tokens_per_dollar']:.2f}",
            f"{r['held']:.1f}",
        ]
        for k, r in res.items()
    ]
    return _t(
        ["model", "sigma", "median", "capped", "veRL step s", "RLBoost/A x thr", "x tok/$", "held"],
        rows,
    )


def agents_md(res: dict) -> str:
    rows = []
    for n, r in res.items():
        label = n.replace(",", " node(s),", 1) if "," in n else f"{n} node(s)"
        rows.append([label, f"{r['throughput']:,.0f}", f"{r['step_s']:.1f}", r["steps"]])
    return _t(["weight senders", "tok/s", "step s", "steps"], rows)


def causes_md(res: dict, warmup: int = 3) -> str:
    """Where RLBoost's step goes, per model on segment A: means over the steps after
    ``warmup`` of the live manager's own Algorithm 1 inputs and output (``T_seed``,
    ``t_train``, ``t_train^wait``, ``t_remote^wait``, ``n_bar``, ``N_prem``) and of when the
    step's last response came, beside veRL's step and last response (emulated seconds)."""
    runs, rows = res["runs"], []
    for m in dict.fromkeys(k.split("/")[0] for k in runs):
        rl, base = runs.get(f"{m}/RLBoost/A"), runs.get(f"{m}/veRL")
        if rl is None or base is None:
            continue
        rec = rl["records"][warmup:] or rl["records"]

        def mean(key: str, rec=rec) -> float:
            return sum(r[key] for r in rec) / len(rec)

        last = sum(r["last_response"] for r in base["records"]) / len(base["records"])
        rows.append([
            m, f"{mean('step_s'):.0f}", f"{mean('t_seed'):.0f}", f"{mean('t_train'):.0f}",
            f"{mean('t_train_wait'):.0f}", f"{mean('last_response'):.0f}",
            f"{mean('t_remote_wait'):.0f}", f"{mean('n_bar'):.1f}", f"{mean('n_prem'):.1f}",
            f"{base['step_s']:.0f} / {last:.0f}",
        ])  # fmt: skip
    return _t(["model (RLBoost/A)", "step s", "T_seed", "t_train", "t_train_wait",
               "last response at", "t_remote_wait", "n_bar", "N_prem",
               "veRL: step / last response"],
              rows)  # fmt: skip


def markdown(out: dict) -> str:
    parts = []
    for key, title, fn in (
        ("fig10", "Fig. 10", fig10_md),
        ("fig10", "Where RLBoost's step goes (segment A, after 3 warm-up steps)", causes_md),
        ("fig11", "Fig. 11", fig11_md),
        ("fig12", "Fig. 12", fig12_md),
        ("fig13", "Figs. 13, 17", None),
        ("fig14", "Fig. 14", fig14_md),
        ("fig16", "Fig. 16", fig16_md),
        ("appE", "Appendix E (Fig. 18)", appe_md),
        ("tail", "Ours: the response-length tail", tail_md),
        ("agents", "Section 4.3: per-node transfer agents (32B)", agents_md),
    ):
        if key in out:
            parts.append(f"### {title}\n\n" + (fn(out[key]) if fn else fig13_md(out)))
    return "\n\n".join(parts)


def plot(out: dict, path: Path) -> None:
    """Fig. 10's ratios to veRL (left) and Figs. 13/17's spot generation over the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    runs = out.get("fig10", {}).get("runs", {})
    names = [k for k in runs if "ours" not in k and not k.endswith("/veRL")]
    for ax, metric, title in ((axes[0], "throughput", "throughput / veRL"),
                              (axes[1], "tokens_per_dollar", "tokens per $ / veRL")):  # fmt: skip
        vals = [runs[k][metric] / runs[k.split("/")[0] + "/veRL"][metric] for k in names]
        ax.barh(names, vals)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.invert_yaxis()
        ax.set(title=f"Fig. 10 (emulated): {title}")
    ax = axes[2]
    for fig_key, style in (("fig13", "-"), ("fig17", "--")):
        for mode, r in out.get(fig_key, {}).get("runs", {}).items():
            t = [10 * i for i in range(len(r["gen_tps"]))]
            ax.plot(t, r["gen_tps"], style, label=f"{fig_key} {mode}")
    ax.set(title="Figs. 13/17: spot tokens/s in the step", xlabel="s into the step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
