"""What a mid-rollout preemption costs: token-level migration against recomputing the lost
responses (RLBoost section 4.2; section 6.4.3 and Figure 14 report -33 % early and -76 % mid).

Setup: a local cluster (``m2flow.core.spot.LocalSpotCluster``) with the reserved head node and two
spot nodes, a rollout rank with the spot pool on (no seeding: the step's rollout is on the two
spot instances), fixed-length responses (``min_new_tokens = max_new_tokens``) so every step has
the same work. Each measured step is one of:

- ``base``: no preemption;
- ``migrate@F`` / ``recompute@F``: when a fraction ``F`` of the step's tokens is generated, a
  spot node is removed (its instance dies) and a new node is added at once (RLBoost's trace
  replayer: "shut down the instance and immediately start a new one"); the dead instance's
  requests continue elsewhere with their tokens (``migrate``) or restart from the prompt
  (``recompute``, the ablation ``rollout.spot.migration=recompute``).

Overhead of a case = its step time minus ``base``'s; the reduction is ``1 - overhead(migrate) /
overhead(recompute)`` at each ``F``. Cases are interleaved round by round (``--repeats``); medians
and half-ranges are reported. Writes ``benchmarks/results/spot_migration.json``.

    python benchmarks/spot_migration.py [--repeats 3] [--prompts 32] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from m2flow.workers.actor.config import ActorOptions  # noqa: E402
from m2flow.workers.actor.worker import ActorWorker  # noqa: E402
from m2flow.workers.data.item import prompt_items  # noqa: E402
from m2flow.workers.data.reasoning_gym import task_items  # noqa: E402
from m2flow.workers.data.sampler import PromptSampler  # noqa: E402
from m2flow.workers.llm import build_char_tokenizer  # noqa: E402
from m2flow.workers.rollout.config import RolloutOptions  # noqa: E402
from m2flow.workers.rollout.spot.names import MANAGER_NAME  # noqa: E402
from m2flow.workers.rollout.worker import RolloutWorker  # noqa: E402
from m2flow.workers.tasks import TaskDataset  # noqa: E402

from m2flow import Channel, sync_weights  # noqa: E402
from m2flow.core.cluster import NAMESPACE, VIRTUAL_DEVICE_RESOURCE, Cluster  # noqa: E402
from m2flow.core.spot import LocalSpotCluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 256}  # fmt: skip
ALPHABET = "0123456789+-="
TOKENIZER = {"name": "char", "alphabet": ALPHABET}  # the character tokenizer's spec
SAMPLES = 4


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step (x4 samples)")
    ap.add_argument("--tokens", type=int, default=96, help="response length (fixed)")
    ap.add_argument("--fractions", default="0.25,0.5", help="preemption points (step share)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spot_migration.json"))
    a = ap.parse_args()
    fractions = [float(x) for x in a.fractions.split(",")]
    cases = ["base"] + [f"{m}@{f:g}" for f in fractions for m in ("migrate", "recompute")]

    local = LocalSpotCluster(2, {VIRTUAL_DEVICE_RESOURCE: 1}, spot_cpus=1)
    local.add_spot(2)
    cluster = Cluster(virtual_devices_per_node=1, offload="never", spot=local)
    spot = {"enabled": True, "seeding": False, "n_prem_min": 2, "n_prem_max": 2,
            "block_tokens": 4, "max_batch": 256, "batch_rows": 32, "theta": 1000,
            "micro_batch_prompts": a.prompts, "min_new_tokens": a.tokens}  # fmt: skip
    try:
        actor = ActorWorker.launch(
            cluster, [0], name="actor", model=MODEL, tokenizer=TOKENIZER, options=ActorOptions()
        )
        opts = RolloutOptions(n_samples=SAMPLES, max_new_tokens=a.tokens, temperature=1.0,
                              threads=1, spot=spot)  # fmt: skip
        rollout = RolloutWorker.launch(
            cluster, [0], name="rollout", model=MODEL, tokenizer=TOKENIZER, options=opts
        )
        sync_weights(actor, rollout)
        mgr = ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)
        ready = lambda: ray.get(mgr.spot_ready.remote()) >= 2  # noqa: E731
        tok = build_char_tokenizer(ALPHABET)
        train = TaskDataset("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                          "max_digits": 1}, seed=1, size=256)  # fmt: skip
        train, sampler = task_items(train, tok), PromptSampler(len(train))
        total = a.prompts * SAMPLES * a.tokens
        rows: dict[str, list[dict]] = {c: [] for c in cases}
        step = 0
        for rnd in range(a.repeats + 1):  # round 0 warms up (first-call costs), not counted
            for case in cases:
                _wait(ready, 600, "two spot instances on the current weights")
                step += 1
                mode, frac = (case.split("@") + ["1"])[:2] if "@" in case else (case, "2")
                ray.get(mgr.set_config.remote(
                    migration="recompute" if mode == "recompute" else "tokens"))  # fmt: skip
                inp, out = Channel.create(f"p{step}"), Channel.create(f"o{step}")
                inp.put_many(prompt_items(train, sampler.take(a.prompts), step))
                t0 = time.monotonic()
                call = rollout.generate(inp, out, a.prompts)
                preempted = None
                while not call.done():
                    m = ray.get(mgr.metrics.remote())
                    if preempted is None and m["spot_tokens"] >= float(frac) * total:
                        busy = [v["node"] for v in m["instances"].values()
                                if v["kind"] == "spot" and v["executing"]]  # fmt: skip
                        if busy:
                            local.remove_node_id(busy[0])
                            local.add_spot(1)  # the replacement, as RLBoost's replayer does
                            preempted = time.monotonic() - t0
                    time.sleep(0.02)
                res = call.wait(timeout=1800)[0]
                seconds = time.monotonic() - t0
                got = 0
                while got < a.prompts:
                    got += len(out.get(timeout=60).entries)
                inp.close()
                out.close()
                row = {"step_s": seconds, "preempted_at_s": preempted, **res["spot"]}
                print(f"round {rnd} {case:14} {seconds:7.2f} s  {res['spot']}", flush=True)
                if rnd > 0:
                    rows[case].append(row)
        med = {c: statistics.median(r["step_s"] for r in rows[c]) for c in cases}
        half = {c: (max(r["step_s"] for r in rows[c]) - min(r["step_s"] for r in rows[c])) / 2
                for c in cases}  # fmt: skip
        summary = {}
        print(f"\n{'case':14} {'step s':>9} {'+-':>6} {'overhead s':>11}")
        for c in cases:
            print(f"{c:14} {med[c]:9.2f} {half[c]:6.2f} {med[c] - med['base']:11.2f}")
        for f in fractions:
            om, orc = med[f"migrate@{f:g}"] - med["base"], med[f"recompute@{f:g}"] - med["base"]
            summary[f"{f:g}"] = {
                "overhead_migrate_s": om,
                "overhead_recompute_s": orc,
                "reduction": (1 - om / orc) if orc > 0 else None,
            }
            print(f"preempted at {f:.0%}: migration overhead {om:.2f} s vs recompute {orc:.2f} s"
                  f" -> {'-' if orc <= 0 else f'{-(1 - om / orc):+.0%}'}")  # fmt: skip
        out_path = Path(a.out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(
            json.dumps(
                {
                    "args": vars(a),
                    "median_step_s": med,
                    "half_range_s": half,
                    "summary": summary,
                    "runs": rows,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {out_path}")
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
