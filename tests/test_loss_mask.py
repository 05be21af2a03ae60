"""The loss mask (issue 33): a multi-turn episode trains on the model's own tokens only.

``loss_mask`` ``[B, R]`` is 1 on sampled tokens, 0 on tool output and template tokens; the
forward still attends to every response token (``response_mask``). Checked on the losses'
gradients (no gradient reaches a tool token, for grpo, gspo, sft and with an off-policy
correction), on their sameness with the old path when ``loss_mask == response_mask``, on the
actor's update of a tiny model (Ray) and on the supervised warm start from traces.
"""

from __future__ import annotations

import copy

import pytest
import torch
from m2flow.workers.actor.config import ActorOptions
from m2flow.workers.actor.sft import check_traces, trace_batch, warm_start
from m2flow.workers.actor.worker import ActorWorker
from m2flow.workers.algos.grpo import grpo_advantages
from m2flow.workers.algos.logprobs import sequence_logprobs
from m2flow.workers.algos.losses import make_loss
from m2flow.workers.batch import to_batch
from m2flow.workers.chunk import RolloutChunk
from m2flow.workers.engines.torch_engine import TorchEngine
from m2flow.workers.llm import ModelConfig, build_char_tokenizer, build_model
from m2flow.workers.llm.generation import generate
from test_actor_dp import Feeder
from test_llm import tiny_model
from test_workflow import ALPHABET, TINY_MODEL, TOKENIZER

from m2flow import Channel

# -- the losses' gradients ------------------------------------------------------------------

RESPONSE = [[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]]
# model turn, tool output, model turn (interior zeros), and one episode ending on a tool turn
LOSS = [[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 1, 0]]

CASES = {
    "grpo": ("grpo", {}),
    "grpo_kl_tis": ("grpo", {"kl_coef": 0.1, "off_policy": {"correction": "tis", "clip": 2.0}}),
    "grpo_tis_sequence": (
        "grpo", {"off_policy": {"correction": "tis", "clip": 2.0, "level": "sequence"}},
    ),
    "gspo": ("gspo", {"clip_eps_low": 0.2, "clip_eps_high": 0.2}),
    "gspo_kl_tis": ("gspo", {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "kl_coef": 0.1,
                             "off_policy": {"correction": "tis", "clip": 2.0}}),
    "sft": ("sft", {}),
}  # fmt: skip


def _micro_batch(seed: int = 0) -> dict:
    """A policy micro-batch as the actor builds one for 3 episodes: the engine's logprobs are
    0 off the response; the rollout's (behaviour) logprobs are 0 on tool tokens."""
    g = torch.Generator().manual_seed(seed)
    rm = torch.tensor(RESPONSE)
    lm = torch.tensor(LOSS)
    lp = -2 * torch.rand(rm.shape, generator=g) * rm
    noise = lambda: 0.05 * torch.randn(rm.shape, generator=g) * rm  # noqa: E731
    old = lp + noise()
    return {
        "prompt_ids": torch.ones(3, 2, dtype=torch.long),
        "prompt_mask": torch.ones(3, 2, dtype=torch.long),
        "response_ids": torch.ones_like(rm),
        "response_mask": rm,
        "loss_mask": lm,
        "logprobs": lp,  # the trained policy's (a leaf below)
        "advantages": torch.tensor([1.0, -0.5, 0.7]),
        "old_logprobs": old,
        "behav_logprobs": (old + noise()) * lm,
        "ref_logprobs": lp + noise(),
    }


def _run(case: str, mb: dict):
    """``(loss, metrics, d loss / d logprobs, units)`` of ``case`` on ``mb`` (the logprobs
    masked by ``response_mask`` as the engine's forward gives them)."""
    name, settings = CASES[case]
    loss_fn = make_loss(name, **settings)
    lp = mb["logprobs"].clone().requires_grad_(True)
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", *loss_fn.keys)
    part = {k: mb[k] for k in keys if k in mb}
    units = loss_fn.units(part)
    value, metrics = loss_fn(lp * mb["response_mask"], part, units)
    (grad,) = torch.autograd.grad(value, lp)
    return value.detach(), metrics, grad, units


@pytest.mark.parametrize("case", list(CASES))
def test_no_gradient_reaches_a_tool_token(case):
    mb = _micro_batch()
    lm = mb["loss_mask"].bool()
    value, _, grad, units = _run(case, mb)
    assert "loss_mask" in make_loss(*CASES[case][:1], **CASES[case][1]).keys
    assert torch.isfinite(value)
    assert (grad[~lm] == 0).all(), grad  # tool output, template tokens and padding
    assert (grad[lm] != 0).all(), grad  # every model token is trained on
    # token units count model tokens only (gspo's unit is the sequence)
    assert units == (3.0 if CASES[case][0] == "gspo" else float(lm.sum()))


@pytest.mark.parametrize("case", list(CASES))
def test_a_tool_tokens_logprobs_change_nothing(case):
    mb = _micro_batch()
    value, metrics, grad, _ = _run(case, mb)
    tool = (mb["response_mask"] == 1) & (mb["loss_mask"] == 0)
    assert tool.sum() == 7
    moved = dict(mb)
    for k, shift in (("logprobs", -3.0), ("old_logprobs", 2.0), ("behav_logprobs", -7.0),
                     ("ref_logprobs", 1.5)):  # fmt: skip
        moved[k] = torch.where(tool, mb[k] + shift, mb[k])
    value2, metrics2, grad2, _ = _run(case, moved)
    assert torch.equal(value, value2)
    assert metrics == metrics2
    assert torch.equal(grad, grad2)
    # the same shift on a model token does change the loss (the check can fail)
    model_tok = mb["loss_mask"] == 1
    changed = dict(mb, logprobs=torch.where(model_tok, mb["logprobs"] - 0.3, mb["logprobs"]))
    assert not torch.equal(_run(case, changed)[0], value)


@pytest.mark.parametrize("case", list(CASES))
def test_a_loss_mask_equal_to_the_response_mask_is_the_old_path(case):
    mb = _micro_batch(seed=1)
    mb["loss_mask"] = mb["response_mask"].clone()
    without = {k: v for k, v in mb.items() if k != "loss_mask"}
    a, b = _run(case, mb), _run(case, without)
    assert torch.equal(a[0], b[0])
    assert a[1] == b[1]
    assert torch.equal(a[2], b[2])
    assert a[3] == b[3]


def test_loss_mask_shape_and_value_loss_units():
    mb = _micro_batch()
    grpo = make_loss("grpo", "policy")
    with pytest.raises(ValueError, match="loss_mask .* must have response_mask's shape"):
        grpo(mb["logprobs"], dict(mb, loss_mask=mb["loss_mask"][:, :3]), 1.0)
    # the value loss reads no loss mask: its units stay the response tokens
    value = make_loss("value", "value")
    assert "loss_mask" not in value.keys
    assert value.units(mb) == float(mb["response_mask"].sum()) != float(mb["loss_mask"].sum())


# -- supervised warm start on multi-turn traces -----------------------------------------------


def _traces(tok) -> list[dict]:
    """Episodes ``prompt | model turn | tool output | model turn``: the model's turns are the
    answer and its echo; the tool output is a fixed string the model should not learn."""
    out = []
    for a, b in ((1, 2), (3, 4), (5, 1), (2, 6)):
        ids = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731
        model1, tool, model2 = ids(f"{a}+{b}"), ids("9-9-9-9"), ids(f"{a + b}")
        model2 = model2 + [tok.eos_token_id]
        out.append({
            "prompt_ids": ids(f"{a}+{b}="),
            "response_ids": model1 + tool + model2,
            "loss_mask": [1] * len(model1) + [0] * len(tool) + [1] * len(model2),
        })  # fmt: skip
    return out


def _nll(model, batch) -> tuple[float, float]:
    """Mean NLL (nats) of the loss-mask tokens and of the masked (tool) response tokens."""
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    with torch.no_grad():
        lp = sequence_logprobs(model, *(batch[k] for k in keys))
    lm = batch["loss_mask"].bool()
    tool = batch["response_mask"].bool() & ~lm
    return float(-lp[lm].mean()), float(-lp[tool].mean())


def test_trace_batch_layout_and_errors():
    tok = build_char_tokenizer()
    traces = _traces(tok)
    b = trace_batch(traces, tok.pad_token_id)
    n = [len(t["response_ids"]) for t in traces]
    assert b["response_mask"].sum(dim=1).tolist() == n  # the forward attends to tool output
    assert b["loss_mask"].sum().item() == sum(sum(t["loss_mask"]) for t in traces)
    assert (b["loss_mask"] <= b["response_mask"]).all()
    assert b["prompt_mask"][:, -1].all()  # left padded
    bad = dict(traces[0], loss_mask=traces[0]["loss_mask"][:-1])
    with pytest.raises(ValueError, match="trace 1: loss_mask has .* give one 0/1"):
        check_traces([traces[1], bad])
    with pytest.raises(ValueError, match="trace 0: missing loss_mask"):
        check_traces([{"prompt_ids": [1], "response_ids": [2]}])
    with pytest.raises(ValueError, match="at least one 1"):
        check_traces([dict(traces[0], loss_mask=[0] * len(traces[0]["response_ids"]))])


def test_sft_on_traces_lowers_the_nll_of_the_model_tokens_only():
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    traces = _traces(tok)
    batch = trace_batch(traces, tok.pad_token_id)
    model = tiny_model(tok, seed=0)
    before = _nll(model, batch)
    runs = {}
    unmasked = [dict(t, loss_mask=[1] * len(t["loss_mask"])) for t in traces]
    for name, tr in (("masked", traces), ("all", unmasked)):
        engine = TorchEngine.from_module(copy.deepcopy(model), lr=1e-3)
        out = warm_start(engine, tok, None, steps=40, lr=1e-2, rl_lr=1e-3, traces=tr,
                         batch_size=4, seed=0)  # fmt: skip
        assert out["steps"] == 40 and out["val_accuracy"] is None
        runs[name] = _nll(engine.model, batch)
    print("nll (model tokens, tool tokens): before", before, runs)
    # the model's tokens are learnt ...
    assert runs["masked"][0] < 0.5 * before[0]
    # ... and the tool output is not: trained on, it would have been learnt too
    assert runs["all"][1] < 0.5 * before[1]
    assert runs["masked"][1] > runs["all"][1] + 1.0


# -- the actor's update (Ray) -------------------------------------------------------------------

VIRTUAL_DEVICES = 2
PROMPTS = ["1+2=", "3+4=", "5+6=", "7+1="]


def _episodes(version: int, tool_version: int, seed: int) -> tuple[RolloutChunk, dict]:
    """A chunk of 2 groups x 4 sampled responses whose positions 1-2 stand for tool output:
    ``loss_mask`` 0, rollout logprob 0 (none was sampled), weight version ``tool_version``
    (the model tokens': ``version``); and the per-sample counts of model / response tokens."""
    tok = build_char_tokenizer(ALPHABET)
    model = build_model(ModelConfig(**TINY_MODEL), tok, seed=0)
    torch.manual_seed(seed)
    gen = generate(model, tok, [tok(p).input_ids for p in PROMPTS[:2]], n_samples=4,
                   max_new_tokens=6, temperature=1.0)  # fmt: skip
    rm = gen["response_mask"]
    tool = torch.zeros_like(rm)
    tool[:, 1:3] = 1
    tool = tool * rm * (rm.sum(dim=1, keepdim=True) > 3)  # a model token follows the tool's
    assert tool.sum() > 0
    gen["loss_mask"] = rm * (1 - tool)
    gen["logprobs"] = gen["logprobs"] * gen["loss_mask"]
    gen["versions"] = torch.where(tool.bool(), tool_version, version) * rm
    gen["rewards"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    counts = {"model": gen["loss_mask"].sum(dim=1).float(), "response": rm.sum(dim=1).float()}
    counts["advantages"] = grpo_advantages(gen["rewards"], gen["group_index"])
    return RolloutChunk(to_batch(gen), entries={}, weight_version=version), counts


def _train(feeder, actor, chunk, name: str) -> dict:
    ch = Channel.create(f"scored_{name}")
    try:
        call = actor.train(ch)
        feeder.feed(ch, [chunk]).wait(60)
        return call.wait_result(120).results[0]
    finally:
        ch.close()


@pytest.mark.e2e
def test_the_actor_trains_on_model_tokens_only(cluster):
    chunk, counts = _episodes(version=0, tool_version=0, seed=0)
    opt = ActorOptions(lr=1e-2, threads=1, seed=0, off_policy={"correction": "tis"})
    actor = ActorWorker.launch(cluster, [0], name="actor_lm", options=opt, model=TINY_MODEL,
                               tokenizer=TOKENIZER)  # fmt: skip
    feeder = Feeder.launch(cluster, [1], name="feeder")  # one producer process for both steps
    try:
        before = actor.get_weights().wait(60)[0]
        r = _train(feeder, actor, chunk, "one")
        print("step 1:", r)
        assert r["trained_samples"] == 8 and r["steps"] == 1
        # The rollout's logprobs are this policy's on model tokens (and 0 on tool tokens,
        # which would weigh exp(old - 0) << 1 if counted): weights ~1, no mismatch.
        assert r["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert r["mismatch_kl_k3"] < 1e-5
        # ratio 1 at the first step: the loss is -sum_i A_i n_i / sum_i n_i over the model
        # tokens n_i (the token-mean normaliser counts them), not over the response tokens
        adv = counts["advantages"]
        by_model = float(-(adv * counts["model"]).sum() / counts["model"].sum())
        by_response = float(-(adv * counts["response"]).sum() / counts["response"].sum())
        assert abs(by_model - by_response) > 1e-2
        assert r["pg_loss"] == pytest.approx(by_model, abs=1e-4)
        after = actor.get_weights().wait(60)[0]
        assert max(float((after[n] - before[n]).abs().max()) for n in after) > 1e-4

        # Step 2 (the actor is at version 1), samples older than 0 versions dropped: the tool
        # tokens carry version 0, the model tokens version 1; only model tokens count.
        actor.drop_stale_beyond(0).wait(60)
        chunk2, _ = _episodes(version=1, tool_version=0, seed=1)
        r2 = _train(feeder, actor, chunk2, "two")
        print("step 2:", r2)
        assert r2["staleness_dropped"] == 0 and r2["trained_samples"] == 8
        assert r2["staleness_max"] == 0 and r2["staleness_lag_0"] == 1.0

        # the supervised warm start on traces, through the actor
        traces = _traces(build_char_tokenizer(ALPHABET))
        ws = actor.warm_start(None, 3, 1e-2, batch_size=2, traces=traces).wait_result(120)
        assert ws.results[0]["steps"] == 3 and ws.results[0]["loss"] > 0
    finally:
        feeder.shutdown()
        actor.shutdown()


def test_pipeline_padding_rows_train_on_nothing():
    """Megatron's pipeline pads a short micro-batch with rows; their loss mask is 0 (a copy of
    row 0's would put a padding row's tokens in the loss)."""
    from m2flow.workers.engines.megatron.pipeline import pad_rows

    mb = {k: v for k, v in _micro_batch().items() if k != "logprobs"}
    padded = pad_rows(mb, 5)
    assert padded["loss_mask"].shape == (5, 7)
    assert torch.equal(padded["loss_mask"][:3], mb["loss_mask"])
    assert padded["loss_mask"][3:].sum() == 0 and padded["response_mask"][3:].sum() == 0
    assert make_loss("grpo", "policy").units(padded) == float(mb["loss_mask"].sum())
