"""Streaming GRPO training (elastic pipelining's consumer side) is the one-batch update."""

from __future__ import annotations

import copy

import pytest
import torch
from m2flow.workers.engines.trainer import PolicyTrainer
from m2flow.workers.llm import build_char_tokenizer
from test_llm import _params_close, _rollout_batch, tiny_model


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_accumulated_parts_equal_one_batch_update(tok):
    model = tiny_model(tok, seed=0)
    batch = _rollout_batch(tok, model)  # 3 prompts x 4 samples
    assert batch["advantages"].abs().sum() > 0
    batch["old_logprobs"] = PolicyTrainer(model).compute_logprobs(batch)
    m_full, m_stream = model, copy.deepcopy(model)
    t_full = PolicyTrainer(m_full, lr=1e-3)
    t_stream = PolicyTrainer(m_stream, lr=1e-3)
    r_full = t_full.train_on_batch(batch)
    # Chunks of whole GRPO groups arriving one by one: 4 + 8 samples, micro-batches of 3.
    for part in (slice(0, 4), slice(4, 12)):
        t_stream.accumulate({k: v[part] for k, v in batch.items()}, micro_batch_size=3)
    assert _params_close(m_stream, tiny_model(tok, seed=0)) == 0  # no step before the end
    r_stream = t_stream.finish_accumulation()
    assert r_stream["steps"] == 1 and t_stream.steps == 1
    assert r_stream["grad_norm"] == pytest.approx(r_full["grad_norm"], rel=1e-4)
    for k in ("loss", "pg_loss", "clip_frac", "ratio_mean"):
        assert r_stream[k] == pytest.approx(r_full[k], abs=1e-6), k
    assert _params_close(m_full, tiny_model(tok, seed=0)) > 0.5e-3  # the update is not empty
    assert _params_close(m_full, m_stream) < 1e-5


def test_finish_without_parts_takes_no_step(tok):
    t = PolicyTrainer(tiny_model(tok, seed=0))
    assert t.finish_accumulation() == {"steps": 0} and t.steps == 0
    assert all(p.grad is None for p in t.model.parameters())
    assert torch.is_grad_enabled()
