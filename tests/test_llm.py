"""CPU tests of the pure-torch LLM pieces in ``m2flow.workers`` (no Ray).

Tiny Qwen2 models (hidden 32, 2 layers) built from fixed seeds; the whole module runs in
seconds on 2 CPU cores.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from m2flow.workers.actor.sft import run_sft, sft_batch, sft_step
from m2flow.workers.algos.grpo import grpo_advantages, grpo_loss
from m2flow.workers.algos.logprobs import sequence_logprobs
from m2flow.workers.algos.losses import make_loss
from m2flow.workers.batch import concat, num_tokens, to_batch
from m2flow.workers.data.reasoning_gym import task_items
from m2flow.workers.engines.torch_engine import TorchEngine
from m2flow.workers.engines.update import minibatch_update
from m2flow.workers.llm import (
    DEFAULT_ALPHABET,
    ModelConfig,
    build_char_tokenizer,
    build_model,
    load_checkpoint,
    save_checkpoint,
)
from m2flow.workers.llm.generation import eos_mask, generate, left_pad
from m2flow.workers.llm.tokenizer import decode_responses
from m2flow.workers.scoring.evaluation import evaluate
from m2flow.workers.scoring.functions import RewardFunction
from m2flow.workers.tasks import TaskDataset, TaskItem, accuracy, compact_prompt, score

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
CHAIN_SUM = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
PROMPTS = ["12+3=", "1-1=", "99+1-5="]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: intra-op threads only add overhead, and on a loaded 2-core machine they
    make this module ~10x slower (spinning workers). Restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def tiny_model(tok, seed: int = 0, **overrides):
    return build_model(ModelConfig(**{**TINY, **overrides}), tok, seed=seed)


@pytest.fixture(scope="module")
def train_ds():
    return TaskDataset("chain_sum", CHAIN_SUM, seed=0, size=64)


def policy(model, **optim) -> TorchEngine:
    """A one-rank torch engine training ``model`` (AdamW and clip defaults as the engine's)."""
    return TorchEngine.from_module(model, **optim)


def train_on_batch(engine, batch, mini=None, micro=None, epochs=1, generator=None,
                   clip=(0.2, 0.2), kl_coef=0.0) -> dict:  # fmt: skip
    """The actor's GRPO update of ``engine`` on ``batch`` with the ``grpo`` loss: behaviour
    logprobs (if absent) computed first, then mini-batches (shuffled epochs when > 1). Returns
    its metrics (``{}`` for an empty batch, as the actor)."""
    if not len(batch["response_ids"]):
        return {}
    loss = make_loss("grpo", "policy", clip_eps_low=clip[0], clip_eps_high=clip[1],
                     kl_coef=kl_coef)  # fmt: skip
    data = {k: batch[k] for k in batch.keys()}
    if "old_logprobs" not in data:
        data["old_logprobs"] = engine.infer(data, None, micro)
    return minibatch_update(engine, data, loss, mini, micro, epochs, generator)


def loss_args(trainer: dict) -> dict:
    """:func:`train_on_batch`'s loss arguments from a dict of the actor's settings
    (``clip_eps_low``, ``clip_eps_high``, ``kl_coef``; defaults 0.2, 0.2, 0)."""
    clip = (trainer.get("clip_eps_low", 0.2), trainer.get("clip_eps_high", 0.2))
    return {"clip": clip, "kl_coef": trainer.get("kl_coef", 0.0)}


def _params_close(m1, m2, atol=0.0) -> float:
    """Max abs parameter difference (asserting same parameter names)."""
    p1, p2 = dict(m1.named_parameters()), dict(m2.named_parameters())
    assert p1.keys() == p2.keys()
    return max((p1[k] - p2[k]).abs().max().item() for k in p1)


def _rollout_batch(tok, model, n_samples=4, max_new_tokens=5, seed=0):
    torch.manual_seed(seed)
    out = generate(
        model,
        tok,
        [tok(p).input_ids for p in PROMPTS],
        n_samples=n_samples,
        max_new_tokens=max_new_tokens,
    )
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (len(out["group_index"]),), generator=g).float()
    batch = {k: out[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
    batch["advantages"] = grpo_advantages(rewards, out["group_index"])
    return batch


def _optim_state_equal(sd1, sd2) -> bool:
    if sd1["state"].keys() != sd2["state"].keys():
        return False
    for i in sd1["state"]:
        s1, s2 = sd1["state"][i], sd2["state"][i]
        if s1.keys() != s2.keys():
            return False
        for k in s1:
            if not torch.equal(torch.as_tensor(s1[k]), torch.as_tensor(s2[k])):
                return False
    return sd1["param_groups"] == sd2["param_groups"]


# ---------------------------------------------------------------------------- tokenizer


def test_tokenizer_special_ids_and_vocab(tok):
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 4 + len(DEFAULT_ALPHABET)
    assert tok.padding_side == "left"
    # Each alphabet character is exactly one token, in alphabet order after the specials.
    for i, c in enumerate(DEFAULT_ALPHABET):
        assert tok(c, add_special_tokens=False).input_ids == [4 + i]
    # Characters outside the alphabet map to <unk>.
    assert tok("1a", add_special_tokens=False).input_ids == [
        tok.convert_tokens_to_ids("1"),
        tok.unk_token_id,
    ]


def test_tokenizer_round_trip_with_bos(tok):
    prompt, answer = "98+93-77=", "114"
    ids = tok(prompt + answer).input_ids
    assert ids[0] == tok.bos_token_id
    assert len(ids) == 1 + len(prompt + answer)
    assert tok.bos_token_id not in ids[1:]
    # Decoding fuses characters back (no spaces); special tokens dropped on request.
    assert tok.decode(ids, skip_special_tokens=True) == prompt + answer
    assert tok.decode(ids[1:]) == prompt + answer
    # Answer + EOS without BOS, as sft_batch builds responses.
    a = tok(answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert a[-1] == tok.eos_token_id and tok.bos_token_id not in a
    assert tok.decode(a, skip_special_tokens=True) == answer


def test_tokenizer_batch_left_padding(tok):
    enc = tok(["1+2=", "12+34-5="], padding=True, return_tensors="pt")
    assert enc.input_ids.shape == (2, 9)
    assert enc.input_ids[0, :4].tolist() == [tok.pad_token_id] * 4
    assert enc.attention_mask[0].tolist() == [0] * 4 + [1] * 5
    assert enc.input_ids[0, 4].item() == tok.bos_token_id


def test_tokenizer_custom_alphabet_dedup():
    t = build_char_tokenizer("ab a")
    assert len(t) == 4 + 3
    assert t("ba", add_special_tokens=False).input_ids == [5, 4]
    assert t.decode(t("a b").input_ids, skip_special_tokens=True) == "a b"


def test_checkpoint_round_trip(tok, tmp_path):
    model = tiny_model(tok, seed=3)
    save_checkpoint(tmp_path / "ckpt", model, tok)
    m2, tok2 = load_checkpoint(tmp_path / "ckpt")
    assert not m2.training
    sd1, sd2 = model.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    # Tokenizer: same ids (BOS prepended), same specials, same padding side, same decoding.
    text = "12+3-45=57"
    assert tok2(text).input_ids == tok(text).input_ids
    specials = ("pad_token_id", "eos_token_id", "bos_token_id")
    assert [getattr(tok2, a) for a in specials] == [getattr(tok, a) for a in specials]
    assert tok2.padding_side == "left"
    assert tok2.decode(tok2(text).input_ids, skip_special_tokens=True) == text
    assert len(tok2) == len(tok)
    # Generation config ids survive, so generate() stops on EOS after loading.
    assert m2.generation_config.eos_token_id == tok.eos_token_id
    assert m2.generation_config.pad_token_id == tok.pad_token_id
    # Same function: identical greedy rollouts.
    prompts = [tok(p).input_ids for p in PROMPTS]
    o1 = generate(model, tok, prompts, max_new_tokens=4, greedy=True)
    o2 = generate(m2, tok2, prompts, max_new_tokens=4, greedy=True)
    assert torch.equal(o1["response_ids"], o2["response_ids"])


def test_build_model_reproducible_and_sized(tok):
    m1, m2, m3 = tiny_model(tok, seed=0), tiny_model(tok, seed=0), tiny_model(tok, seed=1)
    assert _params_close(m1, m2) == 0.0
    assert _params_close(m1, m3) > 0.0
    cfg = m1.config
    assert cfg.vocab_size == len(tok) and cfg.hidden_size == 32 and cfg.num_hidden_layers == 2
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id) == (0, 1, 2)
    assert _params_close(m1, build_model(TINY, tok, seed=0)) == 0.0  # dict config
    # Tied embeddings: one parameter for embedding and LM head.
    assert m1.lm_head.weight is m1.model.embed_tokens.weight
    with pytest.raises(ValueError):
        build_model(ModelConfig(**TINY))  # no tokenizer, no vocab_size


# ---------------------------------------------------------------------------- tasks


def test_chain_sum_items_are_compact(tok, train_ds):
    assert len(train_ds) == 64
    for it in train_ds.items:
        assert isinstance(it, TaskItem)
        assert it.prompt.endswith("=") and " " not in it.prompt
        assert set(it.prompt) <= set(DEFAULT_ALPHABET)
        assert set(it.answer) <= set(DEFAULT_ALPHABET)
        assert it.prompt == compact_prompt(it.entry)
        # The compact prompt is the same expression: evaluating it gives the answer.
        assert eval(it.prompt[:-1]) == int(it.answer)  # noqa: S307 (digits and +/- only)
        # No <unk> when tokenised.
        assert tok.unk_token_id not in tok(it.prompt + it.answer).input_ids


def test_score_and_accuracy(train_ds):
    items = train_ds.items[:8]
    right = train_ds.score([it.answer for it in items], items)
    assert right == [1.0] * 8
    wrong = train_ds.score([str(int(it.answer) + 1) for it in items], items)
    assert all(s < 1.0 for s in wrong)
    # Whitespace is stripped; entries (dicts) work as well as TaskItems.
    assert train_ds.score([" " + items[0].answer + " "], [items[0].entry]) == [1.0]
    # The module-level scorer (reward workers) agrees with the dataset's.
    assert score([it.answer for it in items], items) == right
    assert score([str(int(it.answer) + 1) for it in items], [it.entry for it in items]) == wrong
    with pytest.raises(ValueError):
        train_ds.score(["1"], items[:2])
    # Partial credit is not accuracy.
    partial = train_ds.score([items[0].answer + "1"], items[:1])[0]
    assert 0.0 < partial < 1.0
    assert accuracy([1.0, partial, 0.0, 1.0]) == 0.5
    assert accuracy([0.99, 0.75]) == 0.0
    assert accuracy([]) == 0.0


def test_splits_differ_and_are_reproducible(train_ds):
    again = TaskDataset("chain_sum", CHAIN_SUM, seed=0, size=64)
    held_out = TaskDataset("chain_sum", CHAIN_SUM, seed=1, size=64)
    assert [it.prompt for it in again.items] == [it.prompt for it in train_ds.items]
    train_prompts = [it.prompt for it in train_ds.items]
    held_prompts = [it.prompt for it in held_out.items]
    assert train_prompts != held_prompts
    # Not just a reordering: most prompts differ position by position.
    assert sum(a != b for a, b in zip(train_prompts, held_prompts)) > 32


# ---------------------------------------------------------------------------- generation


def test_left_pad_and_eos_mask():
    ids, mask = left_pad([[5, 6], [7], [8, 9, 10]], pad_id=0)
    assert ids.tolist() == [[0, 5, 6], [0, 0, 7], [8, 9, 10]]
    assert mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long
    r = torch.tensor([[4, 1, 0, 0], [4, 5, 6, 7], [1, 1, 0, 0], [4, 5, 1, 5]])
    assert eos_mask(r, 1).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]


@pytest.fixture(scope="module")
def sampled(tok):
    """A sampled rollout at T = 2 (makes EOS likely enough that some rows stop early)."""
    model = tiny_model(tok, seed=0)
    torch.manual_seed(1)
    prompts = [tok(p).input_ids for p in PROMPTS]
    out = generate(model, tok, prompts, n_samples=8, max_new_tokens=6, temperature=2.0)
    return model, prompts, out


def test_generate_layout(tok, sampled):
    _, prompts, out = sampled
    n, B = 8, 8 * len(PROMPTS)
    P = max(len(p) for p in prompts)
    assert out["prompt_ids"].shape == out["prompt_mask"].shape == (B, P)
    R = out["response_ids"].shape[1]
    assert R <= 6
    assert out["response_mask"].shape == out["logprobs"].shape == (B, R)
    assert out["logprobs"].dtype == torch.float32
    for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_index"):
        assert out[k].dtype == torch.long, k
    # Contiguous groups of n_samples, one per prompt.
    assert out["group_index"].tolist() == [g for g in range(len(PROMPTS)) for _ in range(n)]
    # Prompts left padded, row i answers prompt group_index[i].
    for i in range(B):
        p = prompts[out["group_index"][i]]
        assert out["prompt_ids"][i, P - len(p) :].tolist() == p
        assert out["prompt_ids"][i, : P - len(p)].eq(tok.pad_token_id).all()
        assert out["prompt_mask"][i].tolist() == [0] * (P - len(p)) + [1] * len(p)
    # Response mask: a prefix of ones ending at (and including) the first EOS.
    rid, rmask = out["response_ids"], out["response_mask"]
    assert torch.equal(rmask, eos_mask(rid, tok.eos_token_id))
    ended, truncated = 0, 0
    for i in range(B):
        m = rmask[i].tolist()
        length = sum(m)
        assert m == [1] * length + [0] * (R - length)
        row = rid[i].tolist()
        if tok.eos_token_id in row:
            first = row.index(tok.eos_token_id)
            assert length == first + 1
            ended += first + 1 < R
        else:
            assert length == R  # truncated at max_new_tokens (R == max_new_tokens then)
            truncated += 1
        assert all(t == tok.pad_token_id for t in row[length:])
    # The fixture exercises both cases (otherwise this test would check little).
    assert ended > 0 and truncated > 0
    assert R == 6  # some row ran to max_new_tokens
    # Logprobs: 0 where masked, < 0 (a real log-probability) where not.
    assert out["logprobs"][rmask == 0].eq(0).all()
    assert (out["logprobs"][rmask == 1] < 0).all()
    texts = decode_responses(tok, rid, rmask)
    assert len(texts) == B and all("<" not in t for t in texts)


def test_rollout_logprobs_match_recomputed(tok, sampled):
    model, _, out = sampled
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    with torch.no_grad():
        lp = sequence_logprobs(model, *(out[k] for k in keys), temperature=2.0)
        lp_t1 = sequence_logprobs(model, *(out[k] for k in keys), temperature=1.0)
    assert torch.allclose(lp, out["logprobs"], atol=1e-4), (lp - out["logprobs"]).abs().max()
    # The temperature matters: T = 1 gives different numbers.
    assert (lp_t1 - out["logprobs"]).abs().max() > 1e-2
    # The engine recomputes the same old logprobs (micro-batched too).
    engine = policy(model, temperature=2.0)
    assert torch.allclose(engine.infer(out, None, micro_batch_size=5), out["logprobs"], atol=1e-4)


def test_greedy_deterministic_and_argmax(tok):
    model = tiny_model(tok, seed=2)
    prompts = [tok(p).input_ids for p in PROMPTS]
    torch.manual_seed(0)
    o1 = generate(model, tok, prompts, n_samples=2, max_new_tokens=5, greedy=True)
    torch.manual_seed(123)
    o2 = generate(model, tok, prompts, n_samples=2, max_new_tokens=5, greedy=True)
    for k in o1:
        assert torch.equal(o1[k], o2[k]), k
    # Samples of one group are identical under greedy decoding.
    assert torch.equal(o1["response_ids"][0::2], o1["response_ids"][1::2])
    # Each greedy token is the argmax of the full-forward distribution at its position.
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    with torch.no_grad():
        ids = torch.cat([o1["prompt_ids"], o1["response_ids"]], 1)
        am = torch.cat([o1["prompt_mask"], o1["response_mask"]], 1)
        logits = model(
            input_ids=ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0)
        ).logits
        P = o1["prompt_ids"].shape[1]
        pred = logits[:, P - 1 : -1].argmax(-1)
        lp = sequence_logprobs(model, *(o1[k] for k in keys))
    m = o1["response_mask"].bool()
    assert torch.equal(pred[m], o1["response_ids"][m])
    assert torch.allclose(lp, o1["logprobs"], atol=1e-4)
    # Mode restored.
    model.train()
    generate(model, tok, prompts, max_new_tokens=2, greedy=True)
    assert model.training


@pytest.mark.parametrize("max_new_tokens", [1, 3])
def test_max_new_tokens_respected(tok, max_new_tokens):
    model = tiny_model(tok, seed=0)
    torch.manual_seed(0)
    out = generate(
        model, tok, [tok(p).input_ids for p in PROMPTS], n_samples=4, max_new_tokens=max_new_tokens
    )
    assert 1 <= out["response_ids"].shape[1] <= max_new_tokens
    assert (out["response_mask"].sum(1) <= max_new_tokens).all()
    assert (out["response_mask"].sum(1) >= 1).all()


# ---------------------------------------------------------------------------- losses


def test_grpo_advantages_hand_checked():
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 0.5, 0, 0.3])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 7])
    adv = grpo_advantages(rewards, groups)
    # Group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 1/sqrt(3).
    s = math.sqrt(3) / 2
    expected = torch.tensor([s, -s, -s, s, 0, 0, 1 / math.sqrt(2), -1 / math.sqrt(2), 0])
    assert torch.allclose(adv, expected, atol=1e-5)
    # Group 1 (identical rewards) and group 7 (a single member): exactly 0.
    assert adv[4:6].eq(0).all() and adv[8] == 0
    # Group ids need not be contiguous or sorted.
    perm = torch.tensor([8, 3, 6, 0, 5, 1, 7, 2, 4])
    assert torch.allclose(grpo_advantages(rewards[perm], groups[perm]), expected[perm], atol=1e-5)
    # Known mean/std: rewards 1, 2, 3, 6 -> mean 3, std sqrt((4 + 1 + 0 + 9) / 3).
    adv2 = grpo_advantages(torch.tensor([1.0, 2, 3, 6]), torch.zeros(4, dtype=torch.long))
    std = math.sqrt(14 / 3)
    assert torch.allclose(adv2, torch.tensor([-2, -1, 0, 3]) / std, atol=1e-5)
    assert abs(adv2.sum().item()) < 1e-5


def test_grpo_loss_ratio_one():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, 3.0])
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    lp = old.clone().requires_grad_(True)
    loss, m = grpo_loss(lp, old, adv, mask)
    # ratio 1: loss = -sum(mask * A) / sum(mask) = -(1 + 1 + 3) / 3.
    assert loss.item() == pytest.approx(-5 / 3)
    assert m["pg_loss"] == pytest.approx(-5 / 3)
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["clip_frac"] == 0.0
    assert "kl" not in m
    loss.backward()
    # d loss / d logprob_t = -mask_t * A / N (the policy gradient).
    assert torch.allclose(lp.grad, torch.tensor([[-1 / 3, -1 / 3, 0], [-1.0, 0, 0]]))
    # num_tokens overrides the denominator (gradient accumulation).
    loss6, _ = grpo_loss(old, old, adv, mask, num_tokens=6)
    assert loss6.item() == pytest.approx(-5 / 6)
    # [B, R] advantages are used per token.
    loss_tok, _ = grpo_loss(old, old, torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]]), mask)
    assert loss_tok.item() == pytest.approx(-(1 + 2 + 3) / 3)


@pytest.mark.parametrize(
    "ratio, adv, clipped",
    [
        (1.5, 1.0, True),  # above 1 + high with A > 0: clipped, no gradient
        (1.5, -1.0, False),  # above 1 + high with A < 0: unclipped (pessimistic min)
        (0.5, 1.0, False),  # below 1 - low with A > 0: unclipped
        (0.5, -1.0, True),  # below 1 - low with A < 0: clipped
        (1.25, 1.0, False),  # inside [1 - 0.2, 1 + 0.28]
        (0.85, -1.0, False),  # inside
    ],
)
def test_grpo_loss_clipping(ratio, adv, clipped):
    low, high = 0.2, 0.28
    old = torch.tensor([[-1.0]])
    lp = (old + math.log(ratio)).requires_grad_(True)
    loss, m = grpo_loss(
        lp, old, torch.tensor([adv]), torch.ones(1, 1), clip_eps_low=low, clip_eps_high=high
    )
    loss.backward()
    if clipped:
        bound = 1 + high if ratio > 1 else 1 - low
        assert loss.item() == pytest.approx(-bound * adv)
        assert lp.grad.item() == 0.0
    else:
        assert loss.item() == pytest.approx(-ratio * adv, rel=1e-5)
        assert lp.grad.item() == pytest.approx(-ratio * adv, rel=1e-5)  # d(-r A)/d lp = -r A
    assert m["ratio_mean"] == pytest.approx(ratio, rel=1e-5)
    if clipped:
        assert m["clip_frac"] == 1.0
    elif 1 - low <= ratio <= 1 + high:
        assert m["clip_frac"] == 0.0


def test_grpo_loss_kl():
    old = torch.tensor([[-1.0, -1.0]])
    mask = torch.tensor([[1, 0]])
    adv = torch.tensor([0.0])
    ref = old + math.log(2.0)  # ref - logprobs = log 2 -> k3 = 2 - log 2 - 1
    k3 = 1 - math.log(2.0)
    loss, m = grpo_loss(old, old, adv, mask, ref_logprobs=ref, kl_coef=0.5)
    assert m["kl"] == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.5 * k3)
    loss0, m0 = grpo_loss(old, old, adv, mask, ref_logprobs=old, kl_coef=0.5)
    assert m0["kl"] == 0.0 and loss0.item() == 0.0
    with pytest.raises(ValueError):
        grpo_loss(old, old, adv, mask, kl_coef=0.1)


def test_sequence_logprobs_ignores_left_padding(tok):
    """A prompt's logprobs do not depend on how much left padding the batch adds."""
    model = tiny_model(tok, seed=0)
    short, long = tok("1+2=").input_ids, tok("12+34-56=").input_ids
    resp = torch.tensor([[5, 6, 1]])
    rmask = torch.ones(1, 3, dtype=torch.long)
    with torch.no_grad():
        one_mask = torch.ones(1, len(short), dtype=torch.long)
        alone = sequence_logprobs(model, torch.tensor([short]), one_mask, resp, rmask)
        ids, mask = left_pad([short, long], tok.pad_token_id)
        both = sequence_logprobs(model, ids, mask, resp.repeat(2, 1), rmask.repeat(2, 1))
    assert torch.allclose(alone[0], both[0], atol=1e-5)
    assert not torch.allclose(both[0], both[1], atol=1e-3)


# ---------------------------------------------------------------------------- trainer


def test_grad_accumulation_equals_full_minibatch(tok):
    model = tiny_model(tok, seed=0)
    batch = _rollout_batch(tok, model)
    assert batch["advantages"].abs().sum() > 0
    # Pin old logprobs so both trainers see the same batch.
    batch["old_logprobs"] = policy(model).infer(batch)
    m_full, m_micro = model, copy.deepcopy(model)
    t_full = policy(m_full, lr=1e-3)
    t_micro = policy(m_micro, lr=1e-3)
    r_full = train_on_batch(t_full, batch, mini=12, micro=12)
    r_micro = train_on_batch(t_micro, batch, mini=12, micro=5)  # 5 + 5 + 2
    assert r_full["steps"] == r_micro["steps"] == 1
    assert r_micro["grad_norm"] == pytest.approx(r_full["grad_norm"], rel=1e-4)
    assert r_micro["loss"] == pytest.approx(r_full["loss"], abs=1e-6)
    for k in ("pg_loss", "clip_frac", "ratio_mean"):
        assert r_micro[k] == pytest.approx(r_full[k], abs=1e-6), k
    # At ratio 1 the loss is -token-mean of the advantages.
    mask = batch["response_mask"].float()
    expected = -(batch["advantages"][:, None] * mask).sum() / mask.sum()
    assert r_full["loss"] == pytest.approx(expected.item(), abs=1e-5)
    assert r_full["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    # The parameters moved (Adam's first step: ~lr per element), and the same way in both. The
    # grad-norm check above catches a uniformly mis-scaled gradient, which Adam would hide; the
    # parameters catch a mis-weighted micro-batch. Adam's first step amplifies float noise on
    # near-zero gradients, hence 1% of lr.
    assert _params_close(m_full, tiny_model(tok, seed=0)) > 0.5e-3
    assert _params_close(m_full, m_micro) < 1e-5
    # Micro-batching without enough memory for a mini-batch: 3 steps of 4.
    r = train_on_batch(t_full, batch, mini=4, micro=3)
    assert r["steps"] == 3 and t_full.steps == 4


def test_grad_clip_and_set_lr(tok):
    model = tiny_model(tok, seed=0)
    batch = _rollout_batch(tok, model)
    t = policy(model, lr=1e-3, grad_clip=1e-3)
    before = copy.deepcopy(model)
    t.set_lr(0.0)
    r = train_on_batch(t, batch)
    assert r["grad_norm"] > 1e-3  # reported pre-clip
    assert _params_close(model, before) == 0.0  # lr 0: nothing moves
    assert all(g["lr"] == 0.0 for g in t.optimizer.param_groups)


def test_train_on_tensordict_batch_shuffled_epochs_with_reference(tok):
    """The layout the actor worker gets: a TensorDict from ``concat``, with reference logprobs."""
    model = tiny_model(tok, seed=0)
    plain = _rollout_batch(tok, model)
    chunks = [
        to_batch({k: v[:5] for k, v in plain.items()}),
        to_batch({k: v[5:] for k, v in plain.items()}),
    ]
    td = concat(chunks, tok.pad_token_id)
    ref = policy(model).infer(td)
    td["ref_logprobs"] = ref
    runs = []
    for _ in range(2):
        m = tiny_model(tok, seed=0)
        t = policy(m, lr=1e-3)
        gen = torch.Generator().manual_seed(7)
        r = train_on_batch(t, td, mini=4, micro=3, epochs=2, generator=gen, kl_coef=0.1)
        runs.append((m, r))
    (m1, r1), (m2, r2) = runs
    assert r1["steps"] == 6 and "kl" in r1
    assert r1["kl"] >= 0.0 and r1["kl"] < 1e-2  # starts at the reference, moves a little
    assert r1 == r2 and _params_close(m1, m2) == 0.0  # seeded shuffle is reproducible
    assert "old_logprobs" not in td.keys()  # the caller's batch is not modified


def _offload_round_trip(tok, spill_path, trained_first=True):
    model = tiny_model(tok, seed=0)
    batch = _rollout_batch(tok, model)
    trainer = policy(model, lr=1e-2)
    if trained_first:
        train_on_batch(trainer, batch, mini=6)  # non-trivial Adam state
    twin = copy.deepcopy(trainer)  # never offloaded
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    osd = copy.deepcopy(trainer.optimizer.state_dict())
    assert bool(osd["state"]) == trained_first

    trainer.offload(spill_path=spill_path)
    assert sum(p.numel() for p in model.parameters()) == 0
    assert len(trainer.optimizer.state) == 0
    if spill_path is not None:
        assert os.path.getsize(spill_path) > 0
    trainer.offload(spill_path=spill_path)  # idempotent
    trainer.onload()
    trainer.onload()  # idempotent
    if spill_path is not None:
        assert not os.path.exists(spill_path)

    assert all(torch.equal(params[k], v) for k, v in model.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert _optim_state_equal(osd, trainer.optimizer.state_dict())
    # Training goes on exactly as without the round trip.
    r1 = train_on_batch(trainer, batch, mini=6)
    r2 = train_on_batch(twin, batch, mini=6)
    assert r1 == r2
    assert _params_close(model, twin.model) == 0.0
    assert _optim_state_equal(trainer.optimizer.state_dict(), twin.optimizer.state_dict())


@pytest.mark.parametrize("trained_first", [True, False])
def test_offload_onload_in_memory(tok, trained_first):
    _offload_round_trip(tok, None, trained_first)


def test_offload_onload_spill(tok, tmp_path):
    _offload_round_trip(tok, str(tmp_path / "spill.pt"))


def test_sft_batch_layout(tok, train_ds):
    items = train_ds.items[:5]
    b = sft_batch(tok, task_items(train_ds, tok)[:5])
    P = max(len(it.prompt) for it in items) + 1
    R = max(len(it.answer) for it in items) + 1
    assert b["prompt_ids"].shape == b["prompt_mask"].shape == (5, P)
    assert b["response_ids"].shape == b["response_mask"].shape == (5, R)
    for i, it in enumerate(items):
        p = tok(it.prompt).input_ids
        assert b["prompt_ids"][i, P - len(p) :].tolist() == p and p[0] == tok.bos_token_id
        assert b["prompt_mask"][i].sum() == len(p)
        a = tok(it.answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
        assert b["response_ids"][i, : len(a)].tolist() == a
        assert b["response_ids"][i, len(a) :].eq(tok.pad_token_id).all()
        assert b["response_mask"][i].tolist() == [1] * len(a) + [0] * (R - len(a))
        assert decode_responses(
            tok, b["response_ids"][i : i + 1], b["response_mask"][i : i + 1]
        ) == [it.answer]


def test_sft_step_lowers_loss(tok, train_ds):
    model = tiny_model(tok, seed=0)
    trainer = policy(model, lr=1e-2, temperature=0.5)  # SFT forwards at T = 1 anyway
    b = sft_batch(tok, task_items(train_ds, tok)[:16])
    # Loss is the token-mean NLL of the answer tokens.
    with torch.no_grad():
        nll = -sequence_logprobs(model, **b).sum() / b["response_mask"].sum()
    first = sft_step(trainer, b, micro_batch_size=5)
    assert first == pytest.approx(nll.item(), rel=1e-4)
    assert first == pytest.approx(math.log(len(tok)), rel=0.2)  # ~uniform at init
    losses = [sft_step(trainer, b) for _ in range(15)]
    assert losses[-1] < 0.7 * first
    assert trainer.steps == 16


def test_run_sft_stops_at_target(tok, train_ds):
    val = task_items(TaskDataset("chain_sum", CHAIN_SUM, seed=2, size=4), tok)
    train = task_items(train_ds, tok)
    trainer = policy(tiny_model(tok, seed=0), lr=1e-2)
    logs: list[str] = []
    res = run_sft(
        trainer,
        tok,
        train,
        steps=5,
        batch_size=8,
        val=val,
        target_accuracy=0.0,
        eval_every=2,
        log=logs.append,
    )
    assert res.steps == 2 and trainer.steps == 2  # target reached at the first evaluation
    assert res.val_accuracy is not None and len(logs) == 1
    res = run_sft(trainer, tok, train, steps=3, batch_size=8, log=None)
    assert res.steps == 3 and res.val_accuracy is None and math.isfinite(res.last_loss)


def test_evaluate_counts_items(tok, train_ds):
    ds = task_items(TaskDataset("chain_sum", CHAIN_SUM, seed=5, size=6), tok)
    res = evaluate(
        tiny_model(tok, seed=0), tok, ds, RewardFunction(), max_new_tokens=3, batch_size=4
    )
    assert res["n"] == 6 and res["reward_errors"] == 0
    assert 0.0 <= res["accuracy"] <= res["mean_score"] <= 1.0


# ---------------------------------------------------------------------------- batch


def test_concat_pads_chunks():
    pad = 0
    a = to_batch(
        {
            "prompt_ids": torch.tensor([[7, 8], [9, 9]]),
            "prompt_mask": torch.tensor([[1, 1], [1, 1]]),
            "response_ids": torch.tensor([[4, 1, 0], [5, 5, 5]]),
            "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
            "logprobs": torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]),
            "group_index": torch.tensor([0, 0]),
            "rewards": torch.tensor([1.0, 0.0]),
        }
    )
    b = to_batch(
        {
            "prompt_ids": torch.tensor([[6, 5, 4, 3]]),
            "prompt_mask": torch.tensor([[1, 1, 1, 1]]),
            "response_ids": torch.tensor([[1]]),
            "response_mask": torch.tensor([[1]]),
            "logprobs": torch.tensor([[-0.9]]),
            "group_index": torch.tensor([1]),
            "rewards": torch.tensor([0.5]),
        }
    )
    out = concat([a, b], pad_token_id=pad)
    assert out.batch_size == torch.Size([3])
    assert out["prompt_ids"].tolist() == [[pad, pad, 7, 8], [pad, pad, 9, 9], [6, 5, 4, 3]]
    assert out["prompt_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]
    assert out["response_ids"].tolist() == [[4, 1, 0], [5, 5, 5], [1, pad, pad]]
    assert out["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert torch.allclose(
        out["logprobs"], torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5], [-0.9, 0, 0]])
    )
    assert out["group_index"].tolist() == [0, 0, 1]
    assert out["rewards"].tolist() == [1.0, 0.0, 0.5]
    for k in out.keys():
        assert out[k].dtype == a[k].dtype, k
    assert num_tokens(out) == (2 + 2 + 4) + (2 + 3 + 1)
    # Order of chunks is the order of rows; a pad id other than 0 is used for ids only.
    rev = concat([b, a], pad_token_id=3)
    assert rev["prompt_ids"].tolist() == [[6, 5, 4, 3], [3, 3, 7, 8], [3, 3, 9, 9]]
    assert rev["response_ids"].tolist() == [[1, 3, 3], [4, 1, 0], [5, 5, 5]]
    assert rev["response_mask"].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert rev["group_index"].tolist() == [1, 0, 0]
    # Same widths: plain concatenation.
    same = concat([a, a], pad_token_id=pad)
    assert torch.equal(same["response_ids"], torch.cat([a["response_ids"]] * 2))


def test_concat_of_real_rollouts_trains(tok):
    """Chunks generated separately, joined by concat, are a valid trainer batch."""
    model = tiny_model(tok, seed=0)
    torch.manual_seed(0)
    c1 = generate(model, tok, [tok("1+2=").input_ids], n_samples=2, max_new_tokens=2)
    c2 = generate(model, tok, [tok("12+34-56=").input_ids], n_samples=2, max_new_tokens=5)
    c2["group_index"] += 1
    joined = concat([to_batch(c1), to_batch(c2)], pad_token_id=tok.pad_token_id)
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    with torch.no_grad():
        lp = sequence_logprobs(model, *(joined[k] for k in keys))
    # Recomputed over the joined (re-padded) batch, logprobs still match the rollout's.
    assert torch.allclose(lp, joined["logprobs"], atol=1e-4)


def test_concat_errors():
    a = to_batch({"x": torch.zeros(2, 1)})
    with pytest.raises(ValueError):
        concat([], pad_token_id=0)
    with pytest.raises(ValueError):
        concat([a, to_batch({"y": torch.zeros(1, 1)})], pad_token_id=0)
