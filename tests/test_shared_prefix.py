"""The shared-prefix paths compute what the plain full-sequence paths compute.

A GRPO group's samples share one prompt. Training and logprob inference forward each distinct
prompt once and the responses on top of its KV cache (``shared_prefix_logprobs``); rollout
prefills each prompt once and expands the cache to the samples (``prefill_shared``). Masks and
positions are the full forward's, so only float rounding may differ:

- in float64 the two paths agree to ~1e-12: logprobs, loss and every gradient. That is the
  proof of the math (a wrong mask, position or cache row shows as an O(0.01-1) difference).
  One caveat, measured: Hugging Face's ``Qwen2RMSNorm`` normalises in float32 even in a float64
  model, so gradients carry float32 rounding (~1e-7 relative) that depends on how rows are
  summed. The float64 gradient tests therefore run with the norm computed in the model's own
  dtype (``exact_norm``: same function, no float32 cast); the forward agrees bit for bit
  either way.
- in float32 (what runs) they agree to float32 rounding.

Real parts only: tiny Qwen2 models built from config, the character tokenizer, reasoning-gym
style prompts of mixed lengths (so prompts are left padded by different amounts). Eager
attention is checked in float32 only: in float64 it yields NaN on left padding in transformers
itself (plain path included).
"""

from __future__ import annotations

import copy

import pytest
import torch
from m2flow.workers.algos.grpo import grpo_advantages, grpo_loss
from m2flow.workers.algos.logprobs import sequence_logprobs, shared_prefix_logprobs
from m2flow.workers.engines.torch_engine import TorchEngine
from m2flow.workers.llm import ModelConfig, build_char_tokenizer, build_model
from m2flow.workers.llm.generation import generate, left_pad, prefill_shared
from test_llm import train_on_batch

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# Mixed lengths: 5, 9, 8 and 4 tokens with BOS.
PROMPTS = ["1+2=", "12+34-56=", "99+1-5=", "7-3"]
KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture
def exact_norm(monkeypatch):
    """RMSNorm in the model's dtype (transformers casts to float32 inside; see the module
    docstring). Same formula as ``Qwen2RMSNorm.forward``."""
    from transformers.models.qwen2 import modeling_qwen2

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", forward)


def tiny(tok, seed=0, dtype=torch.float32, attn="sdpa"):
    model = build_model(ModelConfig(**TINY, attn_implementation=attn), tok, seed=seed)
    return model.to(dtype)


def rollout(tok, model, n_samples=6, max_new_tokens=6, temperature=2.0, seed=0, **kw):
    """Real sampled rollouts; T = 2 so that some rows stop early and others run to the cap."""
    torch.manual_seed(seed)
    prompts = [tok(p).input_ids for p in PROMPTS]
    return generate(model, tok, prompts, n_samples, max_new_tokens, temperature=temperature, **kw)


def test_fixture_has_mixed_padding(tok):
    out = rollout(tok, tiny(tok))
    lengths = out["prompt_mask"].sum(1).unique()
    assert len(lengths) == len(PROMPTS)  # every prompt padded differently
    resp = out["response_mask"].sum(1)
    assert resp.min() < resp.max() == out["response_ids"].shape[1]  # early stops and truncation


@pytest.mark.parametrize(
    "attn, dtype, atol",
    [("sdpa", torch.float64, 1e-12), ("sdpa", torch.float32, 2e-6), ("eager", torch.float32, 2e-6)],
)
def test_logprobs_equal_full_forward(tok, attn, dtype, atol):
    model = tiny(tok, dtype=dtype, attn=attn).eval()
    batch = [rollout(tok, model)[k] for k in KEYS]
    with torch.no_grad():
        full = sequence_logprobs(model, *batch, temperature=0.7)
        shared = shared_prefix_logprobs(model, *batch, temperature=0.7)
    assert full.dtype == shared.dtype == dtype
    assert (full != 0).sum() > 20  # real tokens were compared
    torch.testing.assert_close(shared, full, rtol=0, atol=atol)


def test_logprobs_rows_in_any_order(tok):
    """Prompts are matched by value: shuffled rows (groups interleaved) give the same rows."""
    model = tiny(tok, dtype=torch.float64).eval()
    batch = [rollout(tok, model)[k] for k in KEYS]
    perm = torch.randperm(len(batch[0]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = sequence_logprobs(model, *batch)
        shuffled = shared_prefix_logprobs(model, *(t[perm] for t in batch))
    torch.testing.assert_close(shuffled, full[perm], rtol=0, atol=1e-12)


def test_logprobs_single_response_token(tok):
    """R = 1: only the prompt forward runs (its last logit scores the one token)."""
    model = tiny(tok, dtype=torch.float64).eval()
    out = rollout(tok, model, max_new_tokens=1)
    assert out["response_ids"].shape[1] == 1
    with torch.no_grad():
        full = sequence_logprobs(model, *(out[k] for k in KEYS))
        shared = shared_prefix_logprobs(model, *(out[k] for k in KEYS))
    torch.testing.assert_close(shared, full, rtol=0, atol=1e-12)


def shorten(out: dict, tok) -> dict:
    """The rollout with every response cut to one token + EOS, padded to the same ``R``
    (columns past every response, as a micro-batch of a wider batch has)."""
    out = dict(out)
    ids, mask = out["response_ids"].clone(), out["response_mask"].clone()
    ids[:, 1], ids[:, 2:] = tok.eos_token_id, tok.pad_token_id
    mask[:, :2], mask[:, 2:] = 1, 0  # also where the sampled first token was EOS
    out["response_ids"], out["response_mask"] = ids, mask
    return out


@pytest.mark.parametrize("short", [False, True])
def test_forwards_fewer_tokens(tok, short):
    """The point of it: each distinct prompt is forwarded once (``U * P`` positions), the
    responses as far as the longest has tokens to score (``B * W``, ``W`` = its length - 1);
    the full forward takes ``B * (P + R)``."""
    model = tiny(tok).eval()
    out = rollout(tok, model, n_samples=8)
    if short:
        out = shorten(out, tok)
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    with torch.no_grad():
        sequence_logprobs(model, *(out[k] for k in KEYS))
        full, seen[:] = sum(seen), []
        shared_prefix_logprobs(model, *(out[k] for k in KEYS))
    hook.remove()
    (b, p), r = out["prompt_ids"].shape, out["response_ids"].shape[1]
    width = 1 if short else r - 1
    assert full == b * (p + r)
    assert seen == [len(PROMPTS) * p, b * width]


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_logprobs_equal_when_padded_past_every_response(tok, dtype, atol):
    model = tiny(tok, dtype=dtype).eval()
    batch = [shorten(rollout(tok, model), tok)[k] for k in KEYS]
    with torch.no_grad():
        full = sequence_logprobs(model, *batch, temperature=0.7)
        shared = shared_prefix_logprobs(model, *batch, temperature=0.7)
    assert full.shape == shared.shape and shared.shape[1] == 6
    assert (full != 0).sum() == 2 * len(full)  # token + EOS per row
    torch.testing.assert_close(shared, full, rtol=0, atol=atol)


@pytest.mark.parametrize("short", [False, True])
@pytest.mark.parametrize(
    "dtype, rtol, atol", [(torch.float64, 1e-10, 1e-12), (torch.float32, 1e-4, 1e-6)]
)
def test_loss_and_gradients_equal_full_forward(tok, exact_norm, dtype, rtol, atol, short):
    """Gradients reach the prompt forward through the gathered cache: same loss, same grads
    (also with columns past every response)."""
    model = tiny(tok, dtype=dtype)
    out = rollout(tok, model.eval())
    if short:
        out = shorten(out, tok)
    batch = [out[k] for k in KEYS]
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (len(out["group_index"]),), generator=g).to(dtype)
    adv = grpo_advantages(rewards, out["group_index"]).to(dtype)
    assert adv.abs().sum() > 0
    # Old logprobs a little off the current ones, so some ratios clip (both branches run).
    old = out["logprobs"].to(dtype) + 0.3 * torch.randn(out["logprobs"].shape, generator=g)
    model.train()
    grads, losses = [], []
    for fn in (sequence_logprobs, shared_prefix_logprobs):
        model.zero_grad()
        lp = fn(model, *batch, temperature=2.0)
        loss, metrics = grpo_loss(lp, old, adv, out["response_mask"], 0.2, 0.28)
        loss.backward()
        losses.append((loss.detach(), metrics))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    (l_full, m_full), (l_shared, m_shared) = losses
    assert m_full["clip_frac"] > 0
    torch.testing.assert_close(l_shared, l_full, rtol=rtol, atol=atol)
    assert m_shared == pytest.approx(m_full, rel=rtol, abs=atol)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert grads[0][name].abs().max() > 0, name  # every parameter gets a gradient
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=rtol, atol=atol)


def test_trainer_shared_prefix_switch(tok, exact_norm):
    """The torch engine end to end, micro-batches that split groups and shuffled mini-batches:
    the shared-prefix trainer (the default) and the full-forward one make the same update."""
    model = tiny(tok, dtype=torch.float64)
    out = rollout(tok, model.eval())
    g = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 2, (len(out["group_index"]),), generator=g).double()
    batch = {k: out[k] for k in KEYS}
    batch["advantages"] = grpo_advantages(rewards, out["group_index"]).double()
    trainers = []
    for shared in (False, True):
        t = TorchEngine.from_module(
            copy.deepcopy(model), lr=1e-2, temperature=2.0, shared_prefix=shared
        )
        metrics = train_on_batch(
            t,
            batch,
            mini=16,
            micro=5,  # groups of 6 straddle micro-batches
            epochs=2,
            generator=torch.Generator().manual_seed(2),
        )
        trainers.append((t, metrics))
    (t_full, m_full), (t_shared, m_shared) = trainers
    assert t_full.logprobs_fn is sequence_logprobs
    assert t_shared.logprobs_fn is shared_prefix_logprobs
    assert TorchEngine.from_module(model).logprobs_fn is shared_prefix_logprobs  # the default
    assert m_shared == pytest.approx(m_full, rel=1e-9, abs=1e-12)
    moved = 0.0
    for (n, p_full), (_, p_shared) in zip(
        t_full.model.named_parameters(), t_shared.model.named_parameters()
    ):
        torch.testing.assert_close(p_shared, p_full, rtol=1e-9, atol=1e-12)
        moved = max(moved, (p_full - dict(model.named_parameters())[n]).abs().max().item())
    assert moved > 1e-3  # the update did something
    torch.testing.assert_close(
        t_shared.infer(batch, micro_batch_size=7),
        t_full.infer(batch, micro_batch_size=7),
        rtol=0,
        atol=1e-12,
    )


# ---------------------------------------------------------------------------- rollout


def test_prefill_shared_cache_layout(tok):
    model = tiny(tok).eval()
    prompts = [tok(p).input_ids for p in PROMPTS]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    with torch.no_grad():
        cache = prefill_shared(model, ids, mask)
        assert prefill_shared(model, ids[:, -1:], mask[:, -1:]) is None  # nothing to share
    assert cache.get_seq_length() == ids.shape[1] - 1  # the last prompt token is left to generate
    k = cache.layers[0].keys
    assert k.shape[0] == len(PROMPTS) and k.shape[2] == ids.shape[1] - 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rollout_same_tokens_same_seed(tok, dtype):
    """Same seed, same samples. Both paths call the sampler with the same shapes in the same
    order (one ``multinomial`` over ``[B, V]`` per step; the shared prefill draws nothing), so
    they consume the same random numbers, and their probabilities agree to rounding. A draw can
    only differ if a random number falls within rounding distance (~1e-7 in float32) of a
    boundary between two tokens' cumulative probabilities: possible in principle in float32,
    not seen for these seeds; the distribution sampled from is the same either way."""
    model = tiny(tok, dtype=dtype).eval()
    for seed in range(3):
        plain = rollout(tok, model, n_samples=8, seed=seed, shared_prefix=False)
        shared = rollout(tok, model, n_samples=8, seed=seed, shared_prefix=True)
        for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_index"):
            assert torch.equal(plain[k], shared[k]), (seed, k)
        atol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(shared["logprobs"], plain["logprobs"], rtol=0, atol=atol)
    other = rollout(tok, model, n_samples=8, seed=99, shared_prefix=False)
    assert not torch.equal(other["response_ids"], plain["response_ids"])  # seeds matter
    # Greedy decoding too.
    greedy = [rollout(tok, model, greedy=True, shared_prefix=s) for s in (False, True)]
    assert torch.equal(greedy[0]["response_ids"], greedy[1]["response_ids"])


def test_rollout_one_token_prompts(tok):
    """Prompts of one token leave nothing to prefill: the plain path runs, same samples."""
    model = tiny(tok).eval()
    outs = []
    for shared in (False, True):
        torch.manual_seed(5)
        outs.append(generate(model, tok, [[tok.bos_token_id]] * 2, 4, 3, shared_prefix=shared))
    assert torch.equal(outs[0]["response_ids"], outs[1]["response_ids"])


def test_rollout_logprobs_match_shared_recompute(tok):
    """The loop closes: rollout logprobs (shared prefill) = trainer logprobs (shared forward)."""
    model = tiny(tok).eval()
    out = rollout(tok, model, temperature=0.7)
    engine = TorchEngine.from_module(model, temperature=0.7)
    torch.testing.assert_close(engine.infer(out), out["logprobs"], rtol=0, atol=1e-5)
