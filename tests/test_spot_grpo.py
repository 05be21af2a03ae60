"""GRPO with and without the spot rollout pool, on the real runtime (docs/how-to/spot.md).

The same seed and the same steps, once with the rollout on the reserved device alone and once
through the pool on a local cluster whose two spot nodes a trace (``cluster.spot.trace``)
drops to one during the first step's rollout. Responses are drawn from counter-based keys and
the exact engine continues a migrated response bit for bit, so the math does not depend on
where a response was generated or how often it moved: the trained weights are equal bit for
bit, and so are the per-step metrics of the math (rewards, response lengths, loss, gradient
norm).

What makes it exact and deterministic:

- ``actor.mini_batch_size`` = the step's responses: the actor sorts the step's chunks by prompt
  before it trains, so its sums run in one order whatever order the pool finished groups in
  (the streaming path, ``mini_batch_size=0``, accumulates chunks as they arrive: equal only
  within float rounding, as between plans in ``test_workflow``);
- ``actor.recompute_old_logprobs``: the behaviour logprobs come from the actor in both runs (the
  plain run's HF rollout and the pool's exact engine agree on every token here but differ in
  the last bits of the logprobs);
- the instances hold work when the trace takes a node: they start with the pool, during the
  warm start, so they are ready at the first step; ``t_seed_init=0`` hands them the whole
  step at once; ``decode_delay_s`` paces the exact engine as a slower device would, so the
  step's rollout lasts seconds, and the trace drops a node inside it. What the preempted
  instance held is read from the manager's counters, not inferred from timing.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from test_workflow import GRPO, TINY_RUN, _records

from m2flow.run.workflow import run_workflow

pytestmark = pytest.mark.e2e

PROMPTS, SAMPLES = 4, 4  # TINY_RUN's prompts per step and samples per prompt
RUN = [
    "trainer.steps=2",
    "warm_start.steps=150",  # mixed rewards within groups, so the steps train
    f"actor.mini_batch_size={PROMPTS * SAMPLES}",
    "actor.recompute_old_logprobs=true",
]
SPOT = [
    "rollout.spot.enabled=true",
    "rollout.spot.t_seed_init=0.0",
    "rollout.spot.n_prem_init=2",
    "rollout.spot.n_prem_min=2",
    "rollout.spot.block_tokens=1",
    "rollout.spot.max_batch=2",
    "rollout.spot.micro_batch_prompts=1",
    "rollout.spot.decode_delay_s=0.25",
]
# two spot nodes from the start; one goes 1 s into the first step's rollout (the trace's
# clock starts at the first logged step, right before it; that rollout lasts ~3 s or more)
TRACE = "t_s,instances\n0,2\n1.0,1\n"
#: per-step metrics that only the math decides (timings and the pool's counters aside)
EXACT = ("reward_mean", "sample_accuracy", "response_length", "loss", "clip_frac", "grad_norm",
         "weight_version", "heldout_accuracy")  # fmt: skip


def test_same_seed_same_weights_with_and_without_the_spot_pool(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    plain, spot = tmp_path / "plain", tmp_path / "spot"
    run_workflow(GRPO, TINY_RUN + RUN + [f"trainer.run_dir={plain}"])
    run_workflow(GRPO, TINY_RUN + RUN + SPOT + [f"cluster.spot.trace={trace}",
                                                f"trainer.run_dir={spot}"])  # fmt: skip
    a, b = _records(plain), _records(spot)
    assert [r["step"] for r in b] == [0, 1, 2]
    pool = {k: sum(r[f"spot_{k}"] for r in b[1:]) for k in (
        "spot_tokens", "reserved_tokens", "preemptions", "preempted_requests",
        "preempted_tokens", "migrated_samples")}  # fmt: skip
    print("pool per step:", [{k: r[k] for k in r if k.startswith("spot_")} for r in b[1:]])
    # the instances generated, and the trace preempted one holding requests (whether they had
    # tokens yet depends on where in a 1-token block the kill fell: test_spot.py gates on that)
    assert pool["spot_tokens"] > 0, pool
    assert pool["preemptions"] >= 1 and pool["preempted_requests"] >= 1, pool
    for ra, rb in zip(a[1:], b[1:]):
        # every response once: the tokens the engines made are the tokens trained on
        made = rb["spot_reserved_tokens"] + rb["spot_spot_tokens"]
        assert made == rb["response_length"] * PROMPTS * SAMPLES, rb
        for key in EXACT:
            assert ra.get(key) == rb.get(key), (key, ra, rb)
    assert any(r["grad_norm"] > 0 for r in b[1:])  # the steps trained
    wa = load_file(plain / "checkpoints/step_000002/actor/model.safetensors")
    wb = load_file(spot / "checkpoints/step_000002/actor/model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].equal(wb[k]), (k, float((wa[k] - wb[k]).abs().max()))
