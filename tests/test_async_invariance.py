"""Invariance of asynchronous rollouts (issue 32 item 7): with the exact engine and a fixed
version schedule, a trajectory cut by a weight update (pause -> update_weights -> resume in the
middle of a generate call) or by a preemption (the spot pool's manager moves the request, with
its tokens, to another instance) and continued elsewhere gives the same per-token versions, the
same behaviour logprobs and the same GRPO loss with the ``tis`` correction as an uninterrupted
trajectory whose weights switch at the same token index.

The cut is placed by an order of events, not a clock: a forward pre-hook on the real model holds
decode iteration :data:`CUT` until the pause is asked, so the pause lands at that iteration's end.
The loss is computed as the actor does (:func:`~m2flow.workers.algos.logprobs.sequence_logprobs`
under a third weight version, the trainer's, then the registered ``grpo`` loss with
``actor.off_policy.correction=tis``), once from each trajectory's rollout batch.
"""

from __future__ import annotations

import asyncio
import pickle
import threading

import pytest
import torch
from helpers import wait_until
from m2flow.workers.algos.grpo import grpo_advantages
from m2flow.workers.algos.logprobs import sequence_logprobs
from m2flow.workers.algos.losses import make_loss
from m2flow.workers.algos.off_policy import off_policy_metrics
from m2flow.workers.llm import ModelConfig, build_char_tokenizer, build_model
from m2flow.workers.rollout.continuous import ContinuousRollout
from m2flow.workers.rollout.exact import ExactEngine, GenRequest, to_generation_output

from m2flow.core.elastic import Member

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64}  # fmt: skip
ALPHABET = "0123456789+-="
SEED, T = 7, 1.0
PROMPTS = ["1+2=", "3+4=", "5-1=", "9+9="]  # one length: one forward per decode iteration
SAMPLES, MAX_NEW, ROWS = 4, 16, 16
CUT = 5  # the decode iteration (token index) after which weights switch 0 -> 1
TRAINER = 2  # the trainer's weight version (pi_old, pi_theta)
TIS = {"correction": "tis", "clip": 2.0, "level": "token"}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def weights(tok):
    """Three weight versions (seeds 0, 1, 2): the rollout's 0 and 1, the trainer's 2."""
    return {v: build_model(ModelConfig(**TINY), tok, seed=v).state_dict() for v in (0, 1, 2)}


def model(tok, weights, version: int):
    m = build_model(ModelConfig(**TINY), tok, seed=0).eval()
    m.load_state_dict(weights[version])
    return m


def engine(tok, weights, version: int) -> ExactEngine:
    return ExactEngine(model(tok, weights, version), tok.eos_token_id, T, seed=SEED,
                       batch_rows=ROWS, version=version)  # fmt: skip


def requests(tok) -> list[GenRequest]:
    return [GenRequest(f"1:{p}:{j}", tok(text).input_ids, (1, p, j), MAX_NEW)
            for p, text in enumerate(PROMPTS) for j in range(SAMPLES)]  # fmt: skip


def uninterrupted(tok, weights, switch: bool) -> list[GenRequest]:
    """The reference: one engine, no pause; weights 0 up to token :data:`CUT`, then 1 (or 0
    throughout without ``switch``)."""
    eng, reqs = engine(tok, weights, 0), requests(tok)
    eng.step(reqs, CUT)
    if switch:
        eng.update_weights(1, weights[1])
    eng.step(reqs, MAX_NEW)
    return reqs


def loss_of(tok, weights, reqs: list[GenRequest]) -> tuple[float, dict]:
    """The actor's GRPO loss (``tis``) on the trajectories' rollout batch, and its off-policy
    metrics (staleness from the per-token versions)."""
    b = to_generation_output(reqs, tok.pad_token_id, SAMPLES)
    ones = tok.convert_tokens_to_ids("1")
    rewards = ((b["response_ids"] == ones) & b["response_mask"].bool()).sum(1).float()
    trainer = model(tok, weights, TRAINER)
    args = (b["prompt_ids"], b["prompt_mask"], b["response_ids"], b["response_mask"])
    with torch.no_grad():
        old = sequence_logprobs(trainer, *args, temperature=T)
    new = sequence_logprobs(trainer, *args, temperature=T)
    mb = {"advantages": grpo_advantages(rewards, b["group_index"]), "old_logprobs": old,
          "behav_logprobs": b["logprobs"], "response_mask": b["response_mask"]}  # fmt: skip
    loss, _ = make_loss("grpo", off_policy=TIS)(new, mb, float(b["response_mask"].sum()))
    mask = b["response_mask"]
    stats = off_policy_metrics(old, b["logprobs"], mask, versions=b["versions"],
                               trained_version=TRAINER, **TIS)  # fmt: skip
    return float(loss.detach()), stats


def assert_same(got: list[GenRequest], ref: list[GenRequest]) -> None:
    key = {r.key: r for r in ref}
    assert sorted(r.key for r in got) == sorted(key)
    for r in got:
        f = key[r.key]
        assert (r.tokens, r.logprobs, r.versions) == (f.tokens, f.logprobs, f.versions), r.key


def hold(module, at: int, until):
    """Hold ``module``'s ``at``-th forward (1-based) until ``until()``; returns the event set
    when it is reached and the hook's handle."""
    reached, calls = threading.Event(), [0]

    def hook(mod, args, kwargs):
        calls[0] += 1
        if calls[0] == at:
            reached.set()
            wait_until(until, 120, "the test's pause")

    return reached, module.register_forward_pre_hook(hook, with_kwargs=True)


def test_a_weight_update_mid_call_equals_a_switch_at_that_token(tok, weights):
    """The continuous rollout's call paused from another thread after decode iteration
    :data:`CUT`, updated to version 1, resumed: versions ``[0] * CUT + [1] * rest`` on every
    response that lived past the cut, and tokens, behaviour logprobs, versions and the ``tis``
    GRPO loss equal the uninterrupted switch at token CUT, bit for bit; the same trajectories
    without the switch give another loss (the switch is what the loss sees)."""
    eng = engine(tok, weights, 0)
    cr = ContinuousRollout(eng, SAMPLES, MAX_NEW, len(PROMPTS) * SAMPLES, block_tokens=4)
    queue = [{"prompt_ids": tok(p).input_ids, "group": g, "entry": {}, "step": 1}
             for g, p in enumerate(PROMPTS)]  # fmt: skip
    emitted: list = []
    reached, handle = hold(eng.model, CUT, lambda: eng.gate.paused)
    errors: list = []

    def call():
        try:
            cr.run(len(PROMPTS), lambda n: queue[:n], lambda n: [], emitted.extend)
        except BaseException as e:  # noqa: BLE001 (reported by the test thread)
            errors.append(e)

    th = threading.Thread(target=call)
    th.start()
    try:
        assert reached.wait(120), errors
        eng.pause()  # returns once decode iteration CUT has ended
        handle.remove()
        assert th.is_alive()
        eng.update_weights(1, weights[1])  # what RolloutWorker.load_weights asks of it
    finally:
        handle.remove()
        eng.resume()
        th.join(300)
    assert not errors and not th.is_alive(), errors
    got = [r for g in emitted for r in g.requests]
    ref = uninterrupted(tok, weights, switch=True)
    assert_same(got, ref)
    lived = [r for r in got if len(r.tokens) > CUT]
    assert lived and all(r.versions == [0] * CUT + [1] * (len(r.tokens) - CUT) for r in lived)
    loss, stats = loss_of(tok, weights, got)
    ref_loss, ref_stats = loss_of(tok, weights, ref)
    assert loss == ref_loss and stats == ref_stats
    assert stats["staleness_max"] == TRAINER  # version 0 tokens, trained at version 2
    assert loss != loss_of(tok, weights, uninterrupted(tok, weights, switch=False))[0]


VIRTUAL_DEVICES = 1


@pytest.mark.e2e
@pytest.mark.parametrize("switch", [True, False], ids=["update-at-cut", "same-weights"])
def test_a_preempted_trajectory_continued_elsewhere_equals_the_uninterrupted_one(
    cluster, tok, weights, switch
):
    """The spot pool's rollout manager (real, its loops running): instance ``a`` leases every
    request, generates :data:`CUT` tokens with version 0 and reports them; ``a`` is preempted
    (the manager's loss handling: its requests move on with their tokens). With ``switch``
    version 1 is staged meanwhile and instance ``b`` (another engine, another model object, the
    requests in another order) continues them on it; without, on version 0. Tokens, behaviour
    logprobs, per-token versions and the ``tis`` loss equal the uninterrupted trajectory under
    the same schedule, bit for bit."""
    from m2flow.workers.rollout.spot.manager import RolloutManager

    async def scenario():
        m = RolloutManager({"enabled": True, "theta": 64, "max_batch": 64, "t_seed_init": 0.0,
                            "rebalance": False}, n_reserved=1, instance_args={})  # fmt: skip
        try:
            await m.stage(0, [])
            await m.register("a", "spot")
            m.instances["a"].member = Member(rank=99, key="test:99", handle=None, node_id="")
            await m.submit(1, 0, requests(tok))
            await m.register("reserved:0")
            await m.leave("reserved:0")  # T_seed = 0: everything to the spot instances
            leased: list[GenRequest] = []
            while len(leased) < len(PROMPTS) * SAMPLES:
                leased += await m.lease("a", 0, 64)
            engine(tok, weights, 0).step(leased, CUT, label="a")
            moved = pickle.loads(pickle.dumps(leased))  # a report crosses Ray
            await m.report("a", moved, 0.01, len(moved), CUT * len(moved))
            m._gone(m.instances["a"], True, "a: node preempted (test)")  # the watch's verdict
            version = 1 if switch else 0
            if switch:
                await m.stage(1, [])
            await m.register("b", "spot")
            got: list[GenRequest] = []
            while len(got) < len(leased) - sum(r.done for r in leased):
                got += await m.lease("b", version, 64)
            assert all(len(r.tokens) <= CUT and r.moves == 1 for r in got)
            b = engine(tok, weights, version)
            b.step(got[::-1], MAX_NEW, label="b")
            await m.report("b", pickle.loads(pickle.dumps(got)), 0.01, len(got), 0)
            groups = await m.collect(0, len(PROMPTS), 30.0)
            return [r for g in groups for r in g], dict(m.stats)
        finally:
            await m.shutdown()

    got, stats = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert stats["preemptions"] == 1 and stats["preempted_tokens"] > 0
    assert stats["migrated_samples"] == stats["preempted_requests"] > 0
    ref = uninterrupted(tok, weights, switch)
    assert_same(got, ref)
    lived = [r for r in got if len(r.tokens) > CUT]
    assert lived and all(r.by["a"] == CUT and r.by["b"] == len(r.tokens) - CUT for r in lived)
    if switch:
        assert all(r.versions == [0] * CUT + [1] * (len(r.tokens) - CUT) for r in lived)
    assert loss_of(tok, weights, got) == loss_of(tok, weights, ref)
