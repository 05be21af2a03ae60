"""Overhead of the measured timeline (``trace.json``): step time with and without recording.

Runs a workflow several times in one Ray session, alternating ``M2FLOW_TRACE=1`` and ``=0``
(interleaved, so load drifts hit both alike), and compares the median step time of each run
(steps after the first ``--skip``). Prints one line per run and a summary: the median over
runs of each side, the spread (min-max of the run medians), the overhead
``(traced - untraced) / untraced`` of the medians and the paired overhead (the median over
repeats of the ratio of its two runs), plus the trace's size and events per step.

    python benchmarks/trace_overhead.py --workflow grpo --repeats 4 --steps 12
    python benchmarks/trace_overhead.py --workflow handoff --repeats 6 --steps 30

``grpo``: workflows/grpo.py at the tests' tiny size (a real rollout, reward and actor);
``handoff``: tests/workflows/handoff.py (two groups sharing one device, ~0.08 s steps, the
most events per second of step: the worst case for the recording's share).

On a loaded machine the step time's run-to-run spread is larger than the recording's cost,
so the cost is also measured directly: the driver's seconds in the trace writer (its
``driver_cost_s``, per step) and, per event, what a worker pays to record and ship it
(``events.record`` plus pickling the shipped buffer, timed here in a loop); their sum per step
over the untraced step time is ``direct_overhead``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY_GRPO = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1",
    "model.num_attention_heads=2", "model.num_key_value_heads=1", "warm_start.steps=0",
    "task.train_size=64", "task.val_size=16", "task.heldout_size=16",
    "trainer.prompts_per_step=4", "rollout.n_samples=4", "actor.mini_batch_size=8",
    "actor.micro_batch_size=4", "trainer.eval_every=1000", "trainer.save_every=1000",
    "rollout.threads=1", "actor.threads=1",
]  # fmt: skip
WORKFLOWS = {
    "grpo": (str(ROOT / "workflows" / "grpo.py"), TINY_GRPO),
    "handoff": (str(ROOT / "tests" / "workflows" / "handoff.py"), ["cluster.offload=always"]),
}


def one_run(workflow: str, overrides: list[str], steps: int, traced: bool, run_dir: Path):
    from m2flow.run.workflow import run_workflow

    os.environ["M2FLOW_TRACE"] = "1" if traced else "0"
    session = run_workflow(
        workflow,
        [*overrides, f"trainer.steps={steps}", f"trainer.run_dir={run_dir}"],
        log=lambda *a: None,
    )
    return session.step_times()


def worker_cost_per_event(n: int = 2000, repeats: int = 9) -> float:
    """Seconds a process spends per event, recording it and pickling it for shipment: the
    median of ``repeats`` loops of ``n`` events (one loop descheduled by the load does not
    decide it)."""
    import pickle

    from m2flow.core import events

    events.enable(True)
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            start = events.now()
            events.record("channel_get", "rollout_out", start, wait_s=0.001)
        pickle.loads(pickle.dumps(events.recorder.drain()))
        per.append((time.perf_counter() - t0) / n)
    events.enable(False)
    return statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workflow", choices=sorted(WORKFLOWS), default="grpo")
    ap.add_argument("--repeats", type=int, default=4, help="runs per side")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of each median")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    import ray

    import m2flow

    workflow, overrides = WORKFLOWS[args.workflow]
    tmp = Path(tempfile.mkdtemp(prefix="m2trace-"))
    cluster = m2flow.Cluster(run_dir=tmp / "ray", num_cpus=2, offload="always")
    runs: dict[bool, list[float]] = {True: [], False: []}
    size = per_step = None
    driver: list[float] = []  # the trace writer's seconds per step, per traced run
    try:
        for i in range(args.repeats):
            for traced in (i % 2 == 0, i % 2 != 0):  # alternate which side goes first
                run_dir = tmp / f"run{i}{'t' if traced else 'u'}"
                t0 = time.time()
                steps = one_run(workflow, overrides, args.steps, traced, run_dir)[args.skip :]
                med = statistics.median(steps)
                runs[traced].append(med)
                load = os.getloadavg()[0]
                print(f"run {i} traced={traced}: median step {med:.4f} s over {len(steps)} steps "
                      f"(run {time.time() - t0:.1f} s, load {load:.1f})", flush=True)  # fmt: skip
                trace = run_dir / "trace.json"
                if traced and trace.is_file():
                    size = trace.stat().st_size
                    evs = json.loads(trace.read_text())
                    n = sum(1 for e in evs if e.get("ph") == "X" and e.get("cat") != "step")
                    per_step = n / args.steps
                    summary = [e for e in evs if e.get("name") == "trace summary"][0]["args"]
                    driver.append(summary["driver_cost_s"] / args.steps)
    finally:
        cluster.shutdown()
        ray.shutdown()
    on, off = statistics.median(runs[True]), statistics.median(runs[False])
    # each repeat ran both sides back to back: the median of their ratios cancels slow drifts
    paired = statistics.median(a / b - 1 for a, b in zip(runs[True], runs[False], strict=True))
    per_event = worker_cost_per_event()
    direct = statistics.median(driver) + per_step * per_event
    doc = {
        "workflow": args.workflow,
        "repeats": args.repeats,
        "steps": args.steps,
        "traced_median_s": on,
        "untraced_median_s": off,
        "traced_runs_s": runs[True],
        "untraced_runs_s": runs[False],
        "overhead": (on - off) / off,
        "paired_overhead": paired,
        "trace_bytes": size,
        "events_per_step": per_step,
        "driver_cost_per_step_s": statistics.median(driver),
        "worker_cost_per_event_s": per_event,
        "direct_overhead": direct / off,
    }
    print(
        f"{args.workflow}: traced {on:.4f} s/step (runs {min(runs[True]):.4f}-"
        f"{max(runs[True]):.4f}), untraced {off:.4f} s/step (runs {min(runs[False]):.4f}-"
        f"{max(runs[False]):.4f}), overhead {doc['overhead']:+.1%} (paired {paired:+.1%}); "
        f"trace {size} bytes, "
        f"{per_step:.0f} events/step"
    )
    print(
        f"direct: driver {doc['driver_cost_per_step_s'] * 1e3:.3f} ms/step in the trace writer, "
        f"{per_event * 1e6:.2f} us per event in a worker: {doc['direct_overhead']:.2%} of the "
        "untraced step"
    )
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
