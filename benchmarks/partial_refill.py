"""What refilling the tail buys one rollout rank: partial rollouts (``rollout.partial``,
:mod:`m2flow.workers.rollout.continuous`) on the emulated engine, with and without refill.

One rank, one emulated engine (a throughput preset, e.g. Qwen3-8B on an H100), a long-tailed
response length mix (RLBoost's capped lognormal: median 3,000, sigma 1.0, cap 16,384 tokens),
``steps`` GRPO steps of ``num_prompts x n_samples`` responses whose batch fills the rank's
``max_batch`` slots. Without refill each step runs to its longest response with the freed slots
idle (a synchronous step); with refill the queued prompts of the next steps take the freed
slots: with ``--staleness K`` the prompts of steps up to ``m + K`` are queued during step
``m``'s call (the driver admits step ``m + K`` when step ``m - 1`` has trained; training
time is not modelled: this is the rollout rank's side alone). Emulated time (no sleeping):
deterministic given ``--seed``. Reported per mode: modelled seconds per step (mean over the
steps, and over the middle steps: the steady state), samples/s, decode slot idle share (the
time-weighted share of ``max_batch`` slots not decoding: ``1 - sum_i batch_i dt_i /
(max_batch sum_i dt_i)`` over decode iterations), engine calls (blocks) and tokens. The last
step has no later step to refill with; the steady state excludes the first and last steps.

    python benchmarks/partial_refill.py                      # Qwen3-8B, 8 steps, 32 x 8
    python benchmarks/partial_refill.py --steps 4 --block 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
from collections import deque
from pathlib import Path

import numpy as np
from m2flow.workers.rollout.continuous import ContinuousRollout
from m2flow.workers.rollout.emulated import EmulatedEngine, ResponseLengths, throughput_preset


class MeteredEngine(EmulatedEngine):
    """The emulated engine, also summing decode seconds and slot-seconds per iteration."""

    decode_s = slot_s = 0.0

    def _decode_iters(self, ctx: np.ndarray, new: np.ndarray) -> np.ndarray:
        secs = super()._decode_iters(ctx, new)
        if len(secs):
            n_sorted = np.sort(new)
            it = np.arange(len(secs))
            batch = len(new) - np.searchsorted(n_sorted, it, side="right")
            self.decode_s += float(secs.sum())
            self.slot_s += float((batch * secs).sum())
        return secs


def run(args, refill: bool) -> dict:
    """``args.steps`` steps through one :class:`ContinuousRollout`; the figures above."""
    model = throughput_preset(args.model)
    lengths = ResponseLengths(median=args.median, sigma=args.sigma, cap=args.cap)
    eng = MeteredEngine(model, lengths, eos_id=1, filler_id=2, seed=args.seed,
                        prompt_tokens=args.prompt_tokens, sleep=lambda s: None)  # fmt: skip
    cr = ContinuousRollout(eng, args.n_samples, args.cap, args.max_batch, args.block)
    queue: deque = deque()

    def admit(s: int) -> None:  # the driver puts step s's prompts when it admits the step
        if s < args.steps:
            queue.extend({"prompt_ids": [0], "group": g, "entry": {}, "step": s}
                         for g in range(args.num_prompts))  # fmt: skip

    def take_share(n: int) -> list[dict]:
        return [queue.popleft() for _ in range(n)]

    def take_ready(n: int) -> list[dict]:
        return [queue.popleft() for _ in range(min(n, len(queue)))] if refill else []

    step_s, blocks, tokens, refilled, t0 = [], 0, 0, 0, 0.0
    for s in range(args.staleness + 1):
        admit(s)
    for i in range(args.steps):
        if i:
            admit(i + args.staleness)  # step i - 1 trained: step i + K is admitted
        st = cr.run(args.num_prompts, take_share, take_ready, lambda groups: None)
        step_s.append(eng.emulated_s - t0)
        t0 = eng.emulated_s
        blocks += st.blocks
        tokens += st.tokens
        refilled += st.refilled
    samples = args.steps * args.num_prompts * args.n_samples
    mid = step_s[1:-1] or step_s
    return {
        "refill": refill,
        "step_s_mean": float(np.mean(step_s)),
        "step_s_steady": float(np.mean(mid)),
        "samples_per_s": samples / eng.emulated_s,
        "samples_per_s_steady": args.num_prompts * args.n_samples / float(np.mean(mid)),
        "idle_share": 1.0 - eng.slot_s / (args.max_batch * eng.decode_s),
        "blocks": blocks,
        "tokens": tokens,
        "refilled_groups": refilled,
        "step_s": step_s,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--median", type=float, default=3000.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--cap", type=int, default=16384)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--staleness", type=int, default=1, help="K: steps queued ahead")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows = [run(args, False), run(args, True)]
    print(f"{args.model}, K={args.staleness}, {args.steps} steps of {args.num_prompts} x "
          f"{args.n_samples}, "
          f"max_batch {args.max_batch}, block {args.block}, lognormal({args.median:g}, "
          f"{args.sigma:g}) cap {args.cap}")  # fmt: skip
    print(f"{'refill':>7} {'s/step':>8} {'steady':>8} {'samples/s':>10} {'steady/s':>9} "
          f"{'idle':>6} {'blocks':>7} {'refilled':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['refill']!s:>7} {r['step_s_mean']:8.1f} {r['step_s_steady']:8.1f} "
              f"{r['samples_per_s']:10.3f} {r['samples_per_s_steady']:9.3f} "
              f"{r['idle_share']:6.1%} {r['blocks']:7d} {r['refilled_groups']:8d}")  # fmt: skip
    gain = rows[1]["samples_per_s_steady"] / rows[0]["samples_per_s_steady"]
    print(f"steady-state samples/s with refill: {gain:.2f}x")
    out = {"args": vars(args) | {"json": None}, "rows": rows, "steady_gain": gain}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
