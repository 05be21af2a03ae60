"""The losses behind ``actor.loss`` (issue 31: the loss is the algorithm's) and the engine's
finite checks before every optimizer step (issue 35): no Ray, tiny models."""

from __future__ import annotations

import copy
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from m2flow.workers.algos.losses import LOSSES, gspo_loss, make_loss
from m2flow.workers.engines.base import NonFiniteError
from m2flow.workers.engines.torch_engine import TorchEngine
from m2flow.workers.engines.update import StreamedStep, minibatch_update
from m2flow.workers.llm import build_char_tokenizer
from test_llm import _params_close, _rollout_batch, tiny_model

ROOT = Path(__file__).resolve().parent.parent
SQRT2 = math.sqrt(2.0)


def _gspo_case(adv: list[float]):
    """Two responses: 2 tokens with log-ratios (ln 2, 0), so s_1 = exp(ln 2 / 2) = sqrt 2;
    1 token (and a masked one) with log-ratio 0, so s_2 = 1."""
    old = torch.zeros(2, 2)
    lp = torch.tensor([[math.log(2.0), 0.0], [0.0, 5.0]], requires_grad=True)
    mb = {
        "old_logprobs": old,
        "advantages": torch.tensor(adv),
        "response_mask": torch.tensor([[1, 1], [1, 0]]),
    }
    return lp, mb


def test_gspo_sequence_ratio_by_hand():
    """GSPO (Zheng et al., 2025): one length-normalised ratio per sequence, clipped whole,
    each sequence's tokens averaged before the mean over sequences."""
    lp, mb = _gspo_case([-1.0, 2.0])
    loss, m = gspo_loss(lp, mb, normalizer=2.0, clip_eps_low=0.2, clip_eps_high=0.2)
    # Sequence 1: A = -1, s = sqrt 2 > 1.2 but min(sA, clip(s)A) = sA: unclipped, 1.414 a
    # token. Sequence 2: A = 2, s = 1: -2. Mean over the 2 sequences.
    assert loss.item() == pytest.approx((SQRT2 - 2.0) / 2.0, abs=1e-6)
    assert m["ratio_mean"] == pytest.approx((SQRT2 + 1.0) / 2.0, abs=1e-6)
    # clip_frac counts ratios outside the clip range (as the grpo loss does): sequence 1
    assert m["clip_frac"] == 0.5 and m["pg_loss"] == pytest.approx(loss.item(), abs=1e-6)
    loss.backward()
    # d/d lp_t of -s_t A / |y| / N with d s_t / d lp_t = s: the sequence's ratio, not the
    # token's, scales every token's gradient; the masked token gets none.
    want = torch.tensor([[SQRT2 / 2 / 2, SQRT2 / 2 / 2], [-2.0 / 1 / 2, 0.0]])
    torch.testing.assert_close(lp.grad, want, rtol=0, atol=1e-6)
    # A = +1 on sequence 1: s = sqrt 2 is clipped to 1.2, the whole sequence (no gradient).
    lp, mb = _gspo_case([1.0, 2.0])
    loss, m = gspo_loss(lp, mb, normalizer=2.0, clip_eps_low=0.2, clip_eps_high=0.2)
    assert loss.item() == pytest.approx((-1.2 - 2.0) / 2.0, abs=1e-6)
    assert m["clip_frac"] == 0.5
    loss.backward()
    torch.testing.assert_close(lp.grad[0], torch.zeros(2), rtol=0, atol=0)
    # Token-level GRPO on the same numbers is another loss (a token mean, token ratios).
    lp, mb = _gspo_case([-1.0, 2.0])
    grpo, _ = make_loss("grpo", "policy", clip_eps_low=0.2, clip_eps_high=0.2)(lp, mb, 3.0)
    assert abs(grpo.item() - (SQRT2 - 2.0) / 2.0) > 0.05


def test_registry_and_a_loss_by_import_path():
    gspo = make_loss("gspo", "policy", clip_eps_low=3e-4, clip_eps_high=4e-4)
    assert gspo.unit == "sequences" and gspo.output == "logprobs" and "advantages" in gspo.keys
    assert gspo.units({"response_mask": torch.ones(3, 5)}) == 3.0
    assert make_loss("grpo", "policy", kl_coef=0.1).metrics[-1] == "kl"
    assert {"grpo", "gspo", "sft", "value", "score_bce"} <= set(LOSSES)
    with pytest.raises(ValueError, match="loss 'sft': pick one of grpo, gspo"):
        make_loss("sft", "policy")  # a registered loss of another kind
    path = make_loss("m2flow.workers.algos.losses:gspo_loss", "policy")
    assert path.entry.fn is gspo_loss and path.kind == "policy"
    with pytest.raises(ValueError, match="cannot import"):
        make_loss("no_such_module:fn", "policy")


def test_no_loss_is_defined_under_engines():
    """Issue 31: the engines are mechanics; every loss lives in workers/algos. No function
    named for a loss is defined under workers/engines, and none computes one of the
    algorithm's losses, but the Megatron parity harness (a test's reference computation,
    spawned ranks import it from there), which calls the algorithm's own ``grpo_loss``."""
    engines = ROOT / "workers" / "engines"
    math_calls = r"grpo_loss\(|gspo_loss\(|clipped_value_loss\(|binary_cross_entropy|sft_loss\("
    found = []
    for f in engines.rglob("*.py"):
        harness = f.name == "parity.py"
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if re.match(r"\s*def \w*loss\w*\(", line) or (
                not harness and re.search(math_calls, line)
            ):
                found.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_gspo_trains_through_the_engine_and_the_actor_option():
    """``actor.loss=gspo``: the same engine, another loss; a streamed step and a mini-batch
    step agree (GSPO's normalizer counts sequences, summed over parts)."""
    tok = build_char_tokenizer()
    model = tiny_model(tok, seed=0)
    batch = _rollout_batch(tok, model)
    batch["old_logprobs"] = TorchEngine.from_module(model).infer(batch) + 0.01
    loss = make_loss("gspo", "policy", clip_eps_low=0.2, clip_eps_high=0.2)
    a, b = TorchEngine.from_module(model, lr=1e-3), TorchEngine.from_module(copy.deepcopy(model))
    full = minibatch_update(a, batch, loss, None, 5)
    step = StreamedStep(b, loss, 3)
    for part in (slice(0, 4), slice(4, 12)):
        step.add({k: v[part] for k, v in batch.items()})
    streamed = step.finish()
    assert streamed["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5)
    assert streamed["pg_loss"] == pytest.approx(full["pg_loss"], abs=1e-6)
    assert _params_close(a.model, b.model) < 1e-5
    assert _params_close(a.model, tiny_model(tok, seed=0)) > 0.5e-3


# -- non-finite values before an optimizer step (issue 35) -----------------------------------


def _engine_and_batch(nonfinite: str):
    tok = build_char_tokenizer()
    model = tiny_model(tok, seed=0)
    batch = _rollout_batch(tok, model)
    batch["old_logprobs"] = TorchEngine.from_module(model).infer(batch)
    return TorchEngine.from_module(model, lr=1e-2, nonfinite=nonfinite), batch


def test_nan_loss_stops_naming_the_step_and_the_cause():
    engine, batch = _engine_and_batch("stop")
    loss = make_loss("grpo", "policy")
    minibatch_update(engine, batch, loss, None, None)  # one good step
    before = copy.deepcopy(engine.model)
    batch["advantages"] = batch["advantages"].clone()
    batch["advantages"][0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"non-finite loss nan before optimizer step 2"):
        minibatch_update(engine, batch, loss, None, 4)
    assert _params_close(engine.model, before) == 0.0 and engine.steps == 1


def test_nan_loss_skipped_leaves_weights_and_counts():
    engine, batch = _engine_and_batch("skip")
    before = copy.deepcopy(engine.model)
    batch["advantages"] = batch["advantages"].clone()
    batch["advantages"][5] = float("inf")  # mini-batch 1's second micro-batch poisoned
    out = minibatch_update(engine, batch, make_loss("grpo", "policy"), 6, 4)
    # Mini-batch 1 (rows 0-5) holds the poisoned micro-batch: skipped; mini-batch 2 steps.
    assert out["nonfinite_skips"] == 1 and out["steps"] == 2
    assert engine.skipped == 1 and engine.steps == 1
    assert _params_close(engine.model, before) > 0  # the second step moved it
    fresh, _ = _engine_and_batch("skip")
    poisoned = {k: v[:6] for k, v in batch.items()}
    minibatch_update(fresh, poisoned, make_loss("grpo", "policy"), None, None)
    assert _params_close(fresh.model, before) == 0.0 and fresh.skipped == 1
    assert all(p.grad is None for p in fresh.model.parameters())  # nothing left over


def test_infinite_gradient_norm_is_checked():
    engine, batch = _engine_and_batch("stop")
    engine.forward_backward(batch, make_loss("grpo", "policy"), None, 10.0)
    next(engine.model.parameters()).grad[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="gradient norm inf before optimizer step 1"):
        engine.optimizer_step()
    engine.nonfinite = "skip"
    engine.forward_backward(batch, make_loss("grpo", "policy"), None, 10.0)
    next(engine.model.parameters()).grad[0, 0] = float("nan")
    assert engine.optimizer_step()["skipped"] == 1 and engine.steps == 0


def test_no_checkpoint_from_nonfinite_weights(tmp_path):
    engine, _ = _engine_and_batch("stop")
    engine.save(tmp_path / "good")
    assert (tmp_path / "good" / "model.safetensors").is_file()
    with torch.no_grad():
        next(engine.model.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="no checkpoint is written"):
        engine.save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_nonfinite_key_is_validated_before_anything_starts(tmp_path):
    """``actor.nonfinite`` and ``actor.loss`` are checked with the config: one line, exit 2."""
    cases = [("actor.nonfinite=maybe", "pick stop or skip"),
             ("actor.loss=ppg", "actor.loss=ppg: pick one of grpo, gspo")]  # fmt: skip
    for override, said in cases:
        res = subprocess.run(
            [sys.executable, "-m", "m2flow.run.cli", "run", str(ROOT / "workflows" / "grpo.py"),
             override, f"trainer.run_dir={tmp_path / 'run'}"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert res.returncode == 2, res.stderr
        assert said in res.stdout + res.stderr
