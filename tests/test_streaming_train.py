"""Streaming GRPO training (elastic pipelining's consumer side) is the one-batch update."""

from __future__ import annotations

import copy

import pytest
import torch
from m2flow.workers.algos.losses import make_loss
from m2flow.workers.engines.torch_engine import TorchEngine
from m2flow.workers.engines.update import StreamedStep, minibatch_update
from m2flow.workers.llm import build_char_tokenizer
from test_llm import _params_close, _rollout_batch, tiny_model

LOSS = make_loss("grpo", "policy", clip_eps_low=0.2, clip_eps_high=0.2)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_accumulated_parts_equal_one_batch_update(tok):
    model = tiny_model(tok, seed=0)
    batch = _rollout_batch(tok, model)  # 3 prompts x 4 samples
    assert batch["advantages"].abs().sum() > 0
    batch["old_logprobs"] = TorchEngine.from_module(model).infer(batch)
    m_full, m_stream = model, copy.deepcopy(model)
    t_full = TorchEngine.from_module(m_full, lr=1e-3)
    t_stream = TorchEngine.from_module(m_stream, lr=1e-3)
    r_full = minibatch_update(t_full, batch, LOSS, None, None)
    # Chunks of whole GRPO groups arriving one by one: 4 + 8 samples, micro-batches of 3.
    step = StreamedStep(t_stream, LOSS, micro_batch_size=3)
    for part in (slice(0, 4), slice(4, 12)):
        step.add({k: v[part] for k, v in batch.items()})
    assert _params_close(m_stream, tiny_model(tok, seed=0)) == 0  # no step before the end
    r_stream = step.finish()
    assert r_stream["steps"] == 1 and t_stream.steps == 1
    assert r_stream["grad_norm"] == pytest.approx(r_full["grad_norm"], rel=1e-4)
    for k in ("loss", "pg_loss", "clip_frac", "ratio_mean"):
        assert r_stream[k] == pytest.approx(r_full[k], abs=1e-6), k
    assert _params_close(m_full, tiny_model(tok, seed=0)) > 0.5e-3  # the update is not empty
    assert _params_close(m_full, m_stream) < 1e-5


def test_finish_without_parts_takes_no_step(tok):
    t = TorchEngine.from_module(tiny_model(tok, seed=0))
    out = StreamedStep(t, LOSS, None).finish()
    assert out["steps"] == 0 and t.steps == 0
    assert all(p.grad is None for p in t.model.parameters())
    assert torch.is_grad_enabled()
