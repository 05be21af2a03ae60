"""The data-parallel torch actor (gloo): two ranks that read their shares of a step's chunks
from one channel take the optimizer step one rank takes on all of them, and stay identical."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from m2flow.workers.actor.config import ActorOptions
from m2flow.workers.actor.worker import ActorWorker
from m2flow.workers.batch import to_batch
from m2flow.workers.chunk import RolloutChunk
from m2flow.workers.llm import ModelConfig, build_char_tokenizer, build_model
from m2flow.workers.llm.generation import generate
from test_workflow import ALPHABET, TINY_MODEL, TOKENIZER

from m2flow import Channel, Worker, group_method

pytestmark = pytest.mark.e2e
VIRTUAL_DEVICES = 3
PROMPTS = ["1+2=", "3+4=", "5+6=", "7+1=", "2+2=", "9-3=", "8-8=", "4+5="]


class Feeder(Worker):
    """The step's producer: puts the given rollout chunks, one at a time."""

    @group_method
    def feed(self, out: Channel, chunks: list) -> int:
        for c in chunks:
            out.put(c)
        return len(chunks)


def _chunks() -> list[RolloutChunk]:
    """4 rollout chunks of 2 GRPO groups x 4 samples, with rewards that vary in each group."""
    tok = build_char_tokenizer(ALPHABET)
    model = build_model(ModelConfig(**TINY_MODEL), tok, seed=0)
    torch.manual_seed(0)
    chunks = []
    for k in range(4):
        prompts = PROMPTS[2 * k : 2 * k + 2]
        gen = generate(model, tok, [tok(p).input_ids for p in prompts], n_samples=4,
                       max_new_tokens=4, temperature=1.0)  # fmt: skip
        gen["group_index"] = gen["group_index"] + 2 * k
        gen["rewards"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
        chunks.append(RolloutChunk(to_batch(gen), entries={}, weight_version=0))
    return chunks


def _step(cluster, actor, chunks, name: str) -> list[dict]:
    feeder = Feeder.launch(cluster, [2], name=f"feeder_{name}")
    ch = Channel.create(f"scored_{name}")
    try:
        call = actor.train(ch)
        feeder.feed(ch, chunks).wait(60)
        return call.wait_result(120).results  # every rank's metrics
    finally:
        feeder.shutdown()
        ch.close()


def test_two_ranks_take_the_one_rank_step(cluster):
    chunks = _chunks()
    kw = dict(model=TINY_MODEL, tokenizer=TOKENIZER)
    opt = ActorOptions(lr=1e-2, threads=1, seed=0)
    one = ActorWorker.launch(cluster, [0], name="actor_one", options=opt, **kw)
    two = ActorWorker.launch(cluster, [0, 1], name="actor_dp",
                             options=replace(opt, data_parallel=True), **kw)  # fmt: skip
    try:
        assert two.world_size == 2 and one.world_size == 1
        before = one.get_weights().wait(60)[0]
        (r1,) = _step(cluster, one, chunks, "one")
        r2 = _step(cluster, two, chunks, "dp")
        # Each rank trained on its share of the chunks; together, all of them.
        # (which rank gets which chunk is a race; a rank with none adds zero gradients)
        assert sum(r["samples"] for r in r2) == r1["samples"] == 32
        print("samples per rank:", [r["samples"] for r in r2])
        for k in ("loss", "pg_loss", "clip_frac", "ratio_mean", "grad_norm"):
            assert r2[0][k] == pytest.approx(r1[k], rel=1e-4, abs=1e-6), k
            assert r2[1][k] == r2[0][k], k  # every rank reports the global step
        w1 = one.get_weights().wait(60)[0]
        w_dp = two.get_weights().wait(60)  # both ranks
        moved = max(float((w1[n] - before[n]).abs().max()) for n in w1)
        assert moved > 1e-4  # the step did something
        # = one rank's step. AdamW's first step moves an element by lr * g / (|g| + eps): where
        # |g| is within ~100x of eps (1e-8), the summation order of the all-reduced gradient
        # (rounding ~1e-9) shows, up to ~1 % of lr (2.5e-5 seen at lr 1e-2); elsewhere 1e-6.
        off = 0
        for n in w1:
            assert torch.equal(w_dp[0][n], w_dp[1][n]), n  # the ranks stay identical
            torch.testing.assert_close(w_dp[0][n], w1[n], rtol=0, atol=1e-2 * opt.lr)
            off += int(((w_dp[0][n] - w1[n]).abs() > 1e-6).sum())
        assert off <= 1e-3 * sum(w.numel() for w in w1.values()), off
    finally:
        one.shutdown()
        two.shutdown()


def test_several_ranks_need_data_parallel_and_streaming(cluster):
    """Refused at launch, before any process starts."""
    kw = dict(model=TINY_MODEL, tokenizer=TOKENIZER)
    with pytest.raises(ValueError, match="data_parallel=True"):
        ActorWorker.launch(cluster, [[0], [1]], name="actor_two",
                           options=ActorOptions(threads=1), **kw)  # fmt: skip
    with pytest.raises(ValueError, match="mini_batch_size=0"):
        ActorWorker.launch(cluster, [0, 1], name="actor_mb", **kw, options=ActorOptions(
            threads=1, data_parallel=True, mini_batch_size=8))  # fmt: skip
    assert not [g for g in cluster.groups if g.name in ("actor_two", "actor_mb")]


def test_a_new_train_engine_is_one_file(cluster):
    """tests/sgd_engine.py (plain SGD, registered by import path, no loss of its own) runs the
    actor role unchanged: its step is the SGD step on the GRPO loss the role hands it, over the
    sorted, concatenated chunks."""
    from m2flow.workers.algos.grpo import grpo_advantages, grpo_loss
    from m2flow.workers.algos.logprobs import sequence_logprobs
    from m2flow.workers.batch import concat
    from m2flow.workers.engines import registry
    from sgd_engine import KEYS, SgdEngine

    def sgd_update(model, data: dict, lr: float, temperature: float) -> dict:
        """One SGD step of ``model`` on the token-mean GRPO loss (the actor's default clip
        range) of the whole batch."""
        lp = sequence_logprobs(model, *(data[k] for k in KEYS), temperature=temperature)
        loss, _ = grpo_loss(lp, data["old_logprobs"], data["advantages"],
                            data["response_mask"], 0.2, 0.28)  # fmt: skip
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
        return {"loss": loss.item()}

    assert registry.engine_class("train", "sgd_engine:SgdEngine") is SgdEngine
    registry.register("train", "sgd", SgdEngine)  # in this process; workers resolve the path
    assert registry.engine_class("train", "sgd") is SgdEngine and registry.knows("train", "sgd")
    assert registry.knows("train", "sgd_engine:SgdEngine")
    assert not registry.knows("train", "fsdp")
    with pytest.raises(ValueError, match="actor.engine must be torch or megatron or sgd"):
        registry.engine_class("train", "fsdp", "actor")
    chunks = _chunks()
    actor = ActorWorker.launch(
        cluster,
        [0],
        name="actor_sgd",
        model=TINY_MODEL,
        tokenizer=TOKENIZER,
        options=ActorOptions(lr=0.5, threads=1, engine="sgd_engine:SgdEngine"),
    )
    try:
        before = actor.get_weights().wait(60)[0]
        (got,) = _step(cluster, actor, chunks, "sgd")
        after = actor.get_weights().wait(60)[0]
    finally:
        actor.shutdown()
    batch = concat([c.batch for c in chunks], build_char_tokenizer(ALPHABET).pad_token_id)
    data = {k: batch[k] for k in KEYS}
    data |= {"advantages": grpo_advantages(batch["rewards"], batch["group_index"]),
             "old_logprobs": batch["logprobs"]}  # fmt: skip
    model = build_model(ModelConfig(**TINY_MODEL), build_char_tokenizer(ALPHABET))
    model.load_state_dict(before)
    want = sgd_update(model, data, lr=0.5, temperature=1.0)
    assert got["steps"] == 1 and got["samples"] == got["trained_samples"] == 32
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert max(float((after[n] - before[n]).abs().max()) for n in after) > 1e-4
    for n, w in model.state_dict().items():
        torch.testing.assert_close(after[n], w, rtol=0, atol=1e-6)


def test_nonfinite_advantage_stops_or_skips_the_step(cluster):
    """Issue 35: a chunk whose reward is infinite gives non-finite advantages. By default the
    actor stops with the training step and the cause (no update); with ``nonfinite="skip"``
    the step's update is dropped (weights unchanged) and counted, and the next step trains.
    Data parallel too: the ranks skip together (a rank that got only finite chunks must not
    step alone)."""
    from m2flow.core.group import WorkerError

    chunks = _chunks()
    bad = [chunks[0], *chunks[1:]]
    poisoned = chunks[1].batch.clone()
    poisoned["rewards"][2] = float("inf")
    bad[1] = RolloutChunk(poisoned, entries={}, weight_version=0)
    kw = dict(model=TINY_MODEL, tokenizer=TOKENIZER)
    opt = ActorOptions(lr=1e-2, threads=1, seed=0)
    stop = ActorWorker.launch(cluster, [0], name="actor_stop", options=opt, **kw)
    try:
        before = stop.get_weights().wait(60)[0]
        # 4 of the samples trained on together (chunks queued together are one part)
        with pytest.raises(WorkerError, match=r"NonFiniteError: actor, training step 1: "
                           r"non-finite advantages for 4 of \d+ samples \(non-finite "
                           r"rewards: \[inf\]\); the weights are those"):  # fmt: skip
            _step(cluster, stop, bad, "stop")
    finally:
        stop.shutdown()
    opt = replace(opt, data_parallel=True, nonfinite="skip")
    skip = ActorWorker.launch(cluster, [0, 1], name="actor_skip", options=opt, **kw)
    try:
        assert skip.get_weights().wait(60)[0].keys() == before.keys()
        out = _step(cluster, skip, bad, "skip")
        assert [r["nonfinite_skips"] for r in out] == [1, 1] and out[0]["grad_norm"] == 0.0
        after = skip.get_weights().wait(60)
        for n, w in before.items():  # no rank moved
            assert torch.equal(after[0][n], w) and torch.equal(after[1][n], w), n
        out = _step(cluster, skip, chunks, "skip_then_train")  # the next step trains
        assert all("nonfinite_skips" not in r for r in out) and out[0]["grad_norm"] > 0
        assert max(float((skip.get_weights().wait(60)[0][n] - w).abs().max())
                   for n, w in before.items()) > 1e-4  # fmt: skip
    finally:
        skip.shutdown()
