"""Off-policy corrections (issue 32 item 3): TIS, MIS and AReaL's decoupled PPO as weights the
policy losses apply, their metrics, the ``actor.off_policy`` options, and a smoke run that logs
them. The formulas are checked against hand-computed tiny tensors; no Ray but in the last
test."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from m2flow.workers.actor.config import ActorOptions, OffPolicyOptions
from m2flow.workers.algos.grpo import grpo_loss, k3_kl
from m2flow.workers.algos.losses import LOSSES, make_loss, off_policy_weights
from m2flow.workers.algos.off_policy import (
    CORRECTIONS,
    OffPolicyStats,
    correction_weights,
    decoupled_ppo_loss,
    decoupled_weights,
    mis_weights,
    off_policy_metrics,
    tis_weights,
)
from m2flow.workers.engines.torch_engine import TorchEngine
from m2flow.workers.engines.update import StreamedStep, minibatch_update
from m2flow.workers.llm import build_char_tokenizer
from test_async import TIS, _smoke
from test_llm import _params_close, _rollout_batch, tiny_model

from m2flow.core.config import ConfigError
from m2flow.run.workflow import prepare

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "workflows" / "grpo.py"
LN2, LN3 = math.log(2.0), math.log(3.0)


def _case():
    """Two responses of 4 slots. Row 0: token ratios pi_old / pi_behav = 1, 3, 1/2, and a
    padding slot (a huge log ratio there must count nowhere). Row 1: ratios 2/5, 1, padding x2."""
    old = torch.tensor([[0.0, LN3, -LN2, 50.0], [math.log(0.4), 0.0, 0.0, 0.0]])
    behav = torch.zeros(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return old, behav, mask


def _close(a, b):
    torch.testing.assert_close(a, torch.tensor(b), rtol=0, atol=1e-6)


# -- weights against hand computation ------------------------------------------------------


def test_tis_token_truncates_at_c():
    old, behav, mask = _case()
    w = tis_weights(old, behav, mask, clip=2.0, level="token")
    _close(w.rho, [[1, 3, 0.5, 0], [0.4, 1, 0, 0]])
    _close(w.weights, [[1, 2, 0.5, 0], [0.4, 1, 0, 0]])  # min(rho, 2); 0 on padding
    assert w.truncated.tolist() == [[False, True, False, False], [False] * 4]
    assert not w.masked.any()


def test_tis_sequence_is_the_product_of_token_ratios():
    """veRL's sequence-level TIS: exp of the masked sum of log ratios (the product, not the
    geometric mean), truncated, broadcast over the response's tokens."""
    old, behav, mask = _case()
    w = tis_weights(old, behav, mask, clip=2.0, level="sequence")
    _close(w.rho, [[1.5, 1.5, 1.5, 0], [0.4, 0.4, 0, 0]])  # 1 * 3 * 0.5; 0.4 * 1
    w = tis_weights(old, behav, mask, clip=1.2, level="sequence")
    _close(w.weights, [[1.2, 1.2, 1.2, 0], [0.4, 0.4, 0, 0]])
    assert w.truncated.tolist() == [[True, True, True, False], [False] * 4]


def test_mis_masks_exactly_the_out_of_bound_tokens():
    """IcePop: the weight kept inside [1/C, C] (bounds included), 0 outside."""
    old, behav, mask = _case()
    w = mis_weights(old, behav, mask, clip=2.0)  # bounds [0.5, 2]
    _close(w.weights, [[1, 0, 0.5, 0], [0, 1, 0, 0]])
    assert w.masked.tolist() == [[False, True, False, False], [True, False, False, False]]
    w = mis_weights(old, behav, mask, clip=2.0, low=0.3, high=5.0)  # given bounds
    _close(w.weights, [[1, 3, 0.5, 0], [0.4, 1, 0, 0]])
    assert not w.masked.any()
    w = mis_weights(old, behav, mask, clip=2.0, level="sequence")  # 1.5 kept; 0.4 masked
    _close(w.weights, [[1.5, 1.5, 1.5, 0], [0, 0, 0, 0]])
    assert w.masked.tolist() == [[False] * 4, [True, True, False, False]]


def test_decoupled_weight_drops_tokens_above_the_cap():
    """AReaL's behav_imp_weight_cap filters tokens out; it truncates nothing."""
    old, behav, mask = _case()
    w = decoupled_weights(old, behav, mask, clip=2.0)
    _close(w.weights, [[1, 0, 0.5, 0], [0.4, 1, 0, 0]])
    assert w.masked.tolist() == [[False, True, False, False], [False] * 4]
    w = decoupled_weights(old, behav, mask, clip=None)  # no cap
    _close(w.weights, [[1, 3, 0.5, 0], [0.4, 1, 0, 0]])


def test_extreme_log_ratios_stay_finite():
    old = torch.tensor([[400.0, -400.0]])
    for name in CORRECTIONS:
        w = correction_weights(old, torch.zeros(1, 2), torch.ones(1, 2), name, 2.0)
        assert torch.isfinite(w.weights).all() and torch.isfinite(w.rho).all(), name


def test_bad_arguments_name_the_problem():
    old, behav, mask = _case()
    with pytest.raises(ValueError, match="clip"):
        tis_weights(old, behav, mask, clip=0.0)
    with pytest.raises(ValueError, match="level"):
        tis_weights(old, behav, mask, level="word")
    with pytest.raises(ValueError, match="bounds"):
        mis_weights(old, behav, mask, low=2.0, high=1.0)
    with pytest.raises(ValueError, match="pick one of tis, mis, decoupled"):
        correction_weights(old, behav, mask, "none")
    with pytest.raises(ValueError, match="must be one"):
        tis_weights(old, behav[:, :2], mask)


# -- the losses that apply them ------------------------------------------------------------


def _mb(old, behav, mask, adv):
    return {"old_logprobs": old, "behav_logprobs": behav, "response_mask": mask,
            "advantages": torch.tensor(adv)}  # fmt: skip


@pytest.mark.parametrize("name", ["grpo", "gspo"])
@pytest.mark.parametrize("correction", ["tis", "mis", "decoupled"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_data_gives_the_uncorrected_loss(name, correction, level):
    """behav == old: every weight is 1, so loss, metrics and gradients are today's, bit for
    bit."""
    old = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.3, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    runs = []
    for settings in ({}, {"off_policy": {"correction": correction, "clip": 2.0, "level": level}}):
        lp = (old + torch.tensor([[0.3, -0.1, 0.05], [0.0, 0.2, 0.0]])).requires_grad_()
        loss_fn = make_loss(name, "policy", clip_eps_low=0.2, clip_eps_high=0.2, **settings)
        loss, metrics = loss_fn(lp, _mb(old, old.clone(), mask, [1.0, -1.0]), 5.0)
        loss.backward()
        runs.append((loss.detach(), metrics, lp.grad))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert torch.equal(runs[0][2], runs[1][2])


def test_tis_loss_and_gradients_by_hand():
    """grpo + tis: each token's surrogate times min(rho, C); the gradient of token t is
    -w_t A r_t / N where unclipped, 0 where clipped (and on padding)."""
    old, behav, mask = _case()
    lp = old.clone().requires_grad_()  # r = 1: nothing clipped
    fn = make_loss("grpo", "policy", clip_eps_low=0.2, clip_eps_high=0.2,
                   off_policy={"correction": "tis", "clip": 2.0, "level": "token"})  # fmt: skip
    loss, _ = fn(lp, _mb(old, behav, mask, [1.0, 2.0]), 5.0)
    w = [[1, 2, 0.5, 0], [0.4, 1, 0, 0]]
    want = -(1 * (1 + 2 + 0.5) + 2 * (0.4 + 1)) / 5.0
    assert loss.item() == pytest.approx(want, abs=1e-6)
    loss.backward()
    _close(lp.grad, [[-w[0][t] * 1 / 5 for t in range(4)], [-w[1][t] * 2 / 5 for t in range(4)]])


def test_mis_gradient_is_zero_on_masked_tokens_only():
    old, behav, mask = _case()
    lp = (old + 0.05).requires_grad_()
    behav = behav.clone().requires_grad_()  # a behaviour logprob with a graph gets no grad
    fn = make_loss("grpo", "policy", off_policy={"correction": "mis", "clip": 2.0,
                                                 "level": "token"})  # fmt: skip
    mb = _mb(old, behav, mask, [1.0, 1.0])
    loss, _ = fn(lp, mb, 5.0)
    loss.backward()
    assert behav.grad is None
    zero = lp.grad == 0
    # masked by MIS (rho 3 and 0.4) or padding: no gradient; every other token has one
    assert zero.tolist() == [[False, True, False, True], [True, False, True, True]]


def test_decoupled_ppo_reduces_to_the_clipped_loss_when_prox_is_behav():
    old, _, mask = _case()
    lp = (old + torch.tensor([[0.3, -0.4, 0.1, 0.0], [0.5, -0.05, 0, 0]])).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    a, ma = decoupled_ppo_loss(lp, old, old.clone(), adv, mask, 0.2, 0.28, cap=2.0)
    b, mb = grpo_loss(lp, old, adv, mask, 0.2, 0.28)
    assert torch.equal(a, b) and ma == mb


def test_decoupled_ppo_by_hand():
    """One token: u = pi_theta / pi_prox = 1.5 clipped to 1.2 (A > 0), w = pi_prox /
    pi_behav = 2 (under the cap 3): loss = -2 * 1.2 * A. Above the cap the token is dropped."""
    lp, prox, behav = (torch.tensor([[math.log(x)]]) for x in (1.5, 1.0, 0.5))
    mask = torch.ones(1, 1)
    loss, m = decoupled_ppo_loss(lp, prox, behav, torch.tensor([1.0]), mask, 0.2, 0.2, cap=3.0)
    assert loss.item() == pytest.approx(-2.4, abs=1e-6) and m["clip_frac"] == 1.0
    loss, _ = decoupled_ppo_loss(lp, prox, behav, torch.tensor([1.0]), mask, 0.2, 0.2, cap=1.5)
    assert loss.item() == 0.0
    # the registered grpo loss with correction=decoupled computes the same
    off = {"correction": "decoupled", "clip": 3.0, "level": "token"}
    fn = make_loss("grpo", "policy", clip_eps_low=0.2, clip_eps_high=0.2, off_policy=off)
    mb = {"old_logprobs": prox, "behav_logprobs": behav, "response_mask": mask,
          "advantages": torch.tensor([1.0])}  # fmt: skip
    assert fn(lp, mb, 1.0)[0].item() == pytest.approx(-2.4, abs=1e-6)


def test_a_correction_without_behaviour_logprobs_is_an_error():
    old, _, mask = _case()
    with pytest.raises(ValueError, match="behav_logprobs"):
        off_policy_weights({"old_logprobs": old, "response_mask": mask},
                           {"correction": "tis", "clip": 2.0, "level": "token"})  # fmt: skip
    assert off_policy_weights({}, None) is None


def test_registry_exposes_the_corrections():
    assert set(CORRECTIONS) == {"tis", "mis", "decoupled"}
    for name in ("grpo", "gspo"):
        assert LOSSES[name].off_policy and "behav_logprobs" in LOSSES[name].keys
    with pytest.raises(ValueError, match="applies no off-policy correction"):
        make_loss("math:fabs", "policy", off_policy={"correction": "tis"})


def test_corrections_train_through_the_engine_split_invariant():
    """The engine hands the loss ``behav_logprobs`` (a loss key): behaviour logprobs off by
    ln 3 on half the responses change the update; a streamed step and a mini-batch step agree
    (the weights are per row, whatever the split)."""
    tok = build_char_tokenizer()
    model = tiny_model(tok, seed=0)
    batch = _rollout_batch(tok, model)
    batch["old_logprobs"] = TorchEngine.from_module(model).infer(batch)
    shift = torch.zeros(len(batch["advantages"]), 1)
    shift[::2] = LN3  # pi_old / pi_behav = 3 on every token of every other response
    batch["behav_logprobs"] = (batch["old_logprobs"] - shift) * batch["response_mask"]
    on_policy = dict(batch, behav_logprobs=batch["old_logprobs"])
    norms = {}
    for correction in ("tis", "mis", "decoupled"):
        off = {"correction": correction, "clip": 2.0, "level": "token"}
        loss = make_loss("grpo", "policy", off_policy=off)
        a, b, c = (TorchEngine.from_module(copy.deepcopy(model), lr=1e-3) for _ in range(3))
        full = minibatch_update(a, batch, loss, None, 5)
        step = StreamedStep(b, loss, 3)
        for part in (slice(0, 4), slice(4, 12)):
            step.add({k: v[part] for k, v in batch.items()})
        streamed = step.finish()
        assert streamed["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5)
        assert _params_close(a.model, b.model) < 1e-5
        norms[correction] = full["grad_norm"]
        same = minibatch_update(c, on_policy, loss, None, 5)["grad_norm"]
        plain = minibatch_update(
            TorchEngine.from_module(copy.deepcopy(model), lr=1e-3), batch,
            make_loss("grpo", "policy"), None, 5,
        )["grad_norm"]  # fmt: skip
        assert same == pytest.approx(plain, rel=1e-6)  # behav == old: the uncorrected update
        assert abs(full["grad_norm"] - plain) > 1e-4 * plain  # the correction acts
    # tis weighs those responses 2, mis and decoupled drop them: two different updates
    assert norms["mis"] == pytest.approx(norms["decoupled"], rel=1e-6)
    assert abs(norms["tis"] - norms["mis"]) > 1e-4 * norms["tis"]


# -- metrics -------------------------------------------------------------------------------


def test_metrics_by_hand():
    old, behav, mask = _case()
    versions = torch.tensor([[5, 4, 3, 0], [5, 5, 0, 0]])
    m = off_policy_metrics(old, behav, mask, "tis", 2.0, "token", versions, trained_version=5)
    assert m["is_weight_mean"] == pytest.approx((1 + 3 + 0.5 + 0.4 + 1) / 5)
    assert m["is_weight_max"] == pytest.approx(3.0)
    assert m["is_truncated_frac"] == pytest.approx(1 / 5) and m["is_masked_frac"] == 0.0
    d = torch.tensor([0.0, LN3, -LN2, math.log(0.4), 0.0], dtype=torch.float64)  # old - behav
    assert m["mismatch_kl_k1"] == pytest.approx(float(-d.mean()))
    assert m["mismatch_kl_k3"] == pytest.approx(float((d.exp() - 1 - d).mean()))
    assert m["mismatch_kl_k3"] == pytest.approx(
        float(k3_kl(torch.zeros(5, dtype=torch.float64), d).mean())
    )
    # lags 0, 1, 2 on row 0 and 0, 0 on row 1 (padding not counted)
    assert m["staleness_max"] == 2 and m["staleness_mean"] == pytest.approx(3 / 5)
    assert [m[f"staleness_lag_{k}"] for k in range(3)] == pytest.approx([3 / 5, 1 / 5, 1 / 5])
    assert "staleness_lag_3" not in m
    m = off_policy_metrics(old, behav, mask, "mis", 2.0, "sequence")
    assert m["is_weight_mean"] == pytest.approx((1.5 + 0.4) / 2)  # per sequence
    assert m["is_masked_frac"] == 0.5 and "staleness_max" not in m


def test_metrics_accumulate_over_parts_as_over_the_whole():
    """The streaming update adds a step's parts one by one: the same metrics as one batch."""
    old, behav, mask = _case()
    versions = torch.tensor([[2, 1, 1, 0], [2, 2, 0, 0]])
    whole = off_policy_metrics(old, behav, mask, "mis", 2.0, "token", versions, 2)
    stats = OffPolicyStats("mis", 2.0, "token")
    for i in range(2):
        stats.add(old[i : i + 1], behav[i : i + 1], mask[i : i + 1], versions[i : i + 1], 2)
    assert stats.result() == pytest.approx(whole)
    stats.reset()
    assert stats.result() == {}


# -- options and config --------------------------------------------------------------------


def test_options_default_to_none_and_the_loss_settings_of_today():
    opt = ActorOptions.from_kwargs({})
    assert opt.off_policy == OffPolicyOptions() and opt.off_policy.correction == "none"
    assert opt.off_policy.clip == 2.0 and "off_policy" not in opt.loss_settings
    opt = ActorOptions.from_kwargs({"off_policy": {"correction": "mis", "level": "sequence"}})
    assert opt.loss_settings["off_policy"] == {
        "correction": "mis", "clip": 2.0, "level": "sequence", "low": None, "high": None,
    }  # fmt: skip
    assert ActorOptions(off_policy={"correction": "tis"}).off_policy.correction == "tis"


@pytest.mark.parametrize(
    "override,key",
    [
        ("actor.off_policy.correction=bogus", "actor.off_policy.correction='bogus'"),
        ("actor.off_policy.level=word", "actor.off_policy.level='word'"),
        ("actor.off_policy.clip=-1", "actor.off_policy.clip=-1"),
        ("actor.off_policy.clip=0", "actor.off_policy.clip=0"),
        ("actor.off_policy.low=-0.5", "actor.off_policy.low=-0.5"),
    ],
)
def test_bad_config_values_raise_a_config_error_naming_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError) as e:
        prepare(str(GRPO), [override, f"trainer.run_dir={tmp_path}"])
    assert key in str(e.value)


def test_options_refuse_unknown_keys_and_crossed_bounds():
    with pytest.raises(ConfigError, match="actor.off_policy has no option cap"):
        OffPolicyOptions.from_value({"cap": 2.0})
    with pytest.raises(ConfigError, match="actor.off_policy.low=3.0 > actor.off_policy.high=1.0"):
        OffPolicyOptions.from_value({"correction": "mis", "low": 3.0, "high": 1.0})
    assert OffPolicyOptions.from_value({"correction": "decoupled", "clip": 0}).clip == 0


# -- a smoke run ---------------------------------------------------------------------------


@pytest.mark.e2e
def test_smoke_run_logs_the_off_policy_metrics(tmp_path):
    """``m2flow run workflows/grpo.py -c smoke ... actor.off_policy.correction=tis``: every step
    logs the weights, the mismatch and the staleness (on-policy here: lag 0, weights ~1)."""
    # every group trains: a flat group is dropped, and a step of flat groups trains no token
    # (no metrics); the smoke warm start's 15 s budget made that depend on the machine's load.
    # test_async's smoke run: small batches and splits, in a subprocess.
    steps = _smoke(tmp_path, "trainer.steps=2", "actor.drop_flat_groups=false", TIS)
    steps = [s for s in steps if "loss" in s]
    assert len(steps) == 2
    for s in steps:
        keys = ("is_weight_mean", "is_weight_max", "is_truncated_frac", "is_masked_frac",
                "mismatch_kl_k1", "mismatch_kl_k3", "staleness_max", "staleness_mean")  # fmt: skip
        assert set(keys) <= set(s), sorted(set(keys) - set(s))
        # the same weights sampled and trained: no lag, weights 1 up to float rounding
        assert s["staleness_max"] == 0 and s["staleness_lag_0"] == 1.0
        assert s["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert 0 <= s["mismatch_kl_k3"] < 1e-6
