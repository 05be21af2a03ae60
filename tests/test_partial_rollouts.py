"""Partial rollouts that refill the tail (issue 32 item 2): a rollout rank decodes its share of
step m block by block and, as responses end, starts the next steps' queued prompts in the freed
slots; the started requests are carried (tokens, behaviour logprobs, per-token versions) into
the next ``generate`` call, which counts them against its share.

The exact engine's tokens are a function of ``(seed, step, prompt, sample, t)`` and the weights
that sampled token t (:mod:`m2flow.workers.rollout.exact`), so "refill changes when, not what"
is an equality: every step's responses, generated with refill across two calls, are token for
token and logprob for logprob those of the step generated alone.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from m2flow.workers.llm import ModelConfig, build_char_tokenizer, build_model
from m2flow.workers.rollout.continuous import ContinuousRollout, ShareLedger
from m2flow.workers.rollout.exact import ExactEngine, GenRequest

from m2flow import Channel

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64}  # fmt: skip
ALPHABET = "0123456789+-="
SEED, T = 7, 1.0
PROMPTS = ["1+2=", "3+4=", "5-1=", "9+9=", "12+3=", "7-7="]
SAMPLES, MAX_NEW, ROWS = 2, 20, 8
CAPACITY = 8  # 4 groups at once: the step's 6 groups queue, then later steps refill


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def weights(tok):
    """Two weight versions: 0 (seed 0) and 1 (seed 1)."""
    return {v: build_model(ModelConfig(**TINY), tok, seed=v).state_dict() for v in (0, 1)}


def engine(tok, weights, version: int = 0) -> ExactEngine:
    m = build_model(ModelConfig(**TINY), tok, seed=0).eval()
    m.load_state_dict(weights[version])
    return ExactEngine(m, tok.eos_token_id, T, seed=SEED, batch_rows=ROWS, version=version)


def items(tok, step: int) -> list[dict]:
    return [{"prompt_ids": tok(p).input_ids, "group": g, "entry": {"i": g}, "step": step}
            for g, p in enumerate(PROMPTS)]  # fmt: skip


class Queue:
    """The prompts channel as the rank sees it: FIFO, a blocking take of the share and a
    non-blocking take of what is queued."""

    def __init__(self, *steps: list[dict]) -> None:
        self.q = deque(it for s in steps for it in s)
        self.shared = 0

    def take_share(self, n: int) -> list[dict]:
        assert len(self.q) >= n, "would block forever"
        self.shared += n
        return [self.q.popleft() for _ in range(n)]

    def take_ready(self, n: int) -> list[dict]:
        return [self.q.popleft() for _ in range(min(n, len(self.q)))]


def reference(tok, weights, step: int) -> dict:
    """The step's requests generated alone, uninterrupted: (group, sample) -> request."""
    reqs = [GenRequest(f"{step}:{g}:{j}", it["prompt_ids"], (step, g, j), MAX_NEW)
            for g, it in enumerate(items(tok, step)) for j in range(SAMPLES)]  # fmt: skip
    engine(tok, weights).step(reqs, MAX_NEW)
    return {r.key[1:]: r for r in reqs}


def run(cr: ContinuousRollout, q: Queue, num_prompts: int = len(PROMPTS)):
    out: list = []
    stats = cr.run(num_prompts, q.take_share, q.take_ready, out.append)
    return out, stats


def test_refill_across_two_calls_gives_each_steps_tokens_unchanged(tok, weights):
    """Step 1's tail refilled with step 2's prompts: the call returns step 1 alone, carries
    step 2's started requests with their tokens, and the next call finishes them; every
    response of both steps equals (tokens, logprobs, versions) the step generated alone."""
    cr = ContinuousRollout(engine(tok, weights), SAMPLES, MAX_NEW, CAPACITY, block_tokens=2)
    q = Queue(items(tok, 1), items(tok, 2))
    out1, st1 = run(cr, q)
    assert [g.step for part in out1 for g in part] == [1] * len(PROMPTS)
    assert st1.refilled > 0 and st1.carried_out == st1.refilled == len(cr.carry)
    assert all(g.step == 2 and g.started for g in cr.carry)
    assert any(r.tokens for g in cr.carry for r in g.requests)  # begun, not only taken
    out2, st2 = run(cr, q)
    assert st2.carried_in == st1.refilled and not cr.carry and not q.q
    for step, out in ((1, out1), (2, out2)):
        ref = reference(tok, weights, step)
        got = {r.key[1:]: r for part in out for g in part for r in g.requests}
        assert got.keys() == ref.keys()
        for k, r in got.items():
            assert (r.tokens, r.logprobs, r.versions) == (ref[k].tokens, ref[k].logprobs,
                                                          ref[k].versions), k  # fmt: skip
    # the refill changed when: both steps took fewer blocks than without it
    plain = ContinuousRollout(engine(tok, weights), SAMPLES, MAX_NEW, CAPACITY, block_tokens=2)
    q = Queue(items(tok, 1), items(tok, 2))
    blocks = [plain.run(len(PROMPTS), q.take_share, lambda n: [], list).blocks for _ in "12"]
    assert st1.blocks + st2.blocks < sum(blocks), (st1.blocks, st2.blocks, blocks)


def test_carried_groups_count_against_the_next_share(tok, weights):
    """Over four steps queued at once, every (step, prompt) is emitted exactly once, by the
    call of its step; a call takes from the channel only its share minus what it carried."""
    cr = ContinuousRollout(engine(tok, weights), SAMPLES, MAX_NEW, CAPACITY, block_tokens=2)
    q = Queue(*(items(tok, s) for s in range(4)))
    seen: list[tuple[int, int]] = []
    for step in range(4):
        before = q.shared
        out, st = run(cr, q)
        assert {g.step for part in out for g in part} == {step}
        seen += [(g.step, g.item["group"]) for part in out for g in part]
        assert q.shared - before == len(PROMPTS) - st.carried_in
        assert st.carried_in > 0 or step == 0
    assert sorted(seen) == [(s, g) for s in range(4) for g in range(len(PROMPTS))]
    assert not q.q and not cr.carry


def test_a_carry_holds_per_token_versions(tok, weights):
    """A weight update between two calls: the carried requests' tokens keep version 0, the
    rest is sampled with version 1, and each equals the request stepped to its carried
    length on version 0 then continued on version 1."""
    eng = engine(tok, weights)
    cr = ContinuousRollout(eng, SAMPLES, MAX_NEW, CAPACITY, block_tokens=2)
    q = Queue(items(tok, 1), items(tok, 2))
    run(cr, q)
    carried = {r.key: len(r.tokens) for g in cr.carry for r in g.requests if not r.done}
    assert carried and any(carried.values())
    eng.update_weights(1, weights[1])
    out, _ = run(cr, q)
    got = {r.key: r for part in out for g in part for r in g.requests}
    mixed = 0
    for key, k in carried.items():
        r = got[key]
        assert r.versions == [0] * k + [1] * (len(r.tokens) - k)
        mixed += 0 < k < len(r.tokens)
        ref = GenRequest("ref", r.prompt_ids, key, MAX_NEW)
        engine(tok, weights, 0).step([ref], k)
        engine(tok, weights, 1).step([ref], MAX_NEW)
        assert (r.tokens, r.logprobs, r.versions) == (ref.tokens, ref.logprobs, ref.versions)
    assert mixed > 0
    # a group not carried was sampled with version 1 only
    assert all(set(r.versions) == {1} for key, r in got.items() if key not in carried)


def test_a_smaller_next_step_than_was_refilled_is_refused(tok, weights):
    """The refill assumes the next step has this step's num_prompts: a call whose share is
    smaller than what was started for it raises, naming the assumption."""
    cr = ContinuousRollout(engine(tok, weights), SAMPLES, MAX_NEW, CAPACITY, block_tokens=2)
    q = Queue(items(tok, 1), items(tok, 2))
    _, st = run(cr, q)
    assert st.refilled > 1
    with pytest.raises(ValueError, match="num_prompts"):
        run(cr, q, num_prompts=1)


def test_capacity_below_a_group_is_refused(tok, weights):
    with pytest.raises(ValueError, match="max_batch"):
        ContinuousRollout(engine(tok, weights), SAMPLES, MAX_NEW, SAMPLES - 1, block_tokens=2)


# -- the role, on a real local Ray ----------------------------------------------------------------


VIRTUAL_DEVICES = 1


@pytest.mark.e2e
def test_rollout_role_refills_with_the_next_steps_prompts(cluster, tok):
    """``RolloutWorker.generate`` with ``rollout.partial`` and the exact engine, one rank:
    step 1's call starts step 2's queued prompts and returns step 1's chunks; step 2's call
    continues them (``partial_carried_in``) and takes only the rest from the channel. The
    responses equal, bit for bit, those of the same steps with nothing queued ahead (no
    refill), and ``partial=False`` keeps the exact engine refused as the role's own."""
    from m2flow.workers.rollout.config import RolloutOptions
    from m2flow.workers.rollout.engines import check_rollout
    from m2flow.workers.rollout.worker import RolloutWorker

    spec = {"name": "char", "alphabet": ALPHABET}
    spot = {"max_batch": CAPACITY, "block_tokens": 2, "batch_rows": ROWS}
    opts = RolloutOptions(n_samples=SAMPLES, max_new_tokens=MAX_NEW, temperature=T, threads=1,
                          engine="exact", partial=True, spot=spot)  # fmt: skip
    with pytest.raises(ValueError, match="rollout.partial"):
        check_rollout({**RolloutOptions(engine="exact").engine_check(TINY)})
    rollout = RolloutWorker.launch(cluster, [0], name="rollout", model=TINY, tokenizer=spec,
                                   options=opts, seed=SEED)  # fmt: skip
    inp, out = Channel.create("prompts"), Channel.create("rollouts")
    try:

        def step(s: int) -> tuple[dict, dict]:
            """One generate call; its responses by (group, sample order of the sort)."""
            (res,) = rollout.generate(inp, out, len(PROMPTS)).wait(timeout=300)
            got: dict[int, list] = {}
            n = 0
            while n < len(PROMPTS) * SAMPLES:
                c = out.get(timeout=60)
                assert c.step == s and c.step_samples == len(PROMPTS) * SAMPLES
                b = c.batch
                for i in range(len(b)):
                    m = int(b["response_mask"][i].sum())
                    got.setdefault(int(b["group_index"][i]), []).append(
                        (b["response_ids"][i, :m].tolist(), b["logprobs"][i, :m].tolist())
                    )
                n += len(b)
            return res, {g: sorted(v) for g, v in got.items()}

        inp.put_many(items(tok, 1) + items(tok, 2))
        res1, a1 = step(1)
        res2, a2 = step(2)
        assert res1["partial_refilled"] > 0 and res1["partial_carried_out"] > 0
        assert res2["partial_carried_in"] == res1["partial_refilled"]
        assert res2["partial_carried_out"] == 0 and inp.qsize() == 0
        for s, ref in ((1, a1), (2, a2)):  # again, with nothing queued ahead
            inp.put_many(items(tok, s))
            res, b = step(s)
            assert res["partial_refilled"] == 0 and res["partial_carried_in"] == 0
            assert b == ref
    finally:
        inp.close()
        out.close()
        rollout.shutdown()


def test_two_ranks_refill_only_once_every_rank_took_the_step(tok, weights):
    """Two ranks share the channel and a ledger: a rank does not refill while the other has
    not taken its share of the current step (a FIFO take would be that share), and refills
    once it has; over two steps every (step, prompt) is emitted once, each rank's share of a
    step (3 prompts) counts its carried groups, and the responses are the step's alone."""
    ledger = ShareLedger(2)
    ranks = [ContinuousRollout(engine(tok, weights), SAMPLES, MAX_NEW, CAPACITY, block_tokens=2,
                               rank=r, world_size=2, ledger=ledger) for r in (0, 1)]  # fmt: skip
    q = Queue(items(tok, 1), items(tok, 2))
    outs = {}
    for step, order in ((1, (0, 1)), (2, (0, 1))):
        for r in order:
            before = q.shared
            outs[step, r], st = run(ranks[r], q)
            assert q.shared - before == 3 - st.carried_in
            if (step, r) == (1, 0):  # rank 1 had not taken step 1: no refill
                assert st.refilled == 0 and len(q.q) == 9
            if (step, r) == (1, 1):
                assert st.refilled > 0
    for step in (1, 2):
        got = {r.key[1:]: r for rank in (0, 1) for part in outs[step, rank] for g in part
               for r in g.requests}  # fmt: skip
        assert sum(len(g.requests) for rank in (0, 1) for p in outs[step, rank] for g in p) == (
            len(PROMPTS) * SAMPLES
        )
        ref = reference(tok, weights, step)
        assert got.keys() == ref.keys()
        assert all(got[k].tokens == ref[k].tokens for k in ref)
    assert not q.q and not ranks[0].carry and not ranks[1].carry


def test_emulated_refill_keeps_every_response_and_takes_less_modelled_time():
    """The emulated engine (Qwen3-8B on an H100, modelled seconds, no sleeping) on a long-tail
    length mix: with refill every response has its drawn length as without, and the four
    steps take less modelled time (the tail's freed slots decode the next step)."""
    from m2flow.workers.rollout.emulated import EmulatedEngine, ResponseLengths, throughput_preset

    def steps(refill: bool) -> tuple[float, dict]:
        eng = EmulatedEngine(throughput_preset("qwen3-8b"), ResponseLengths(200, 1.0, 2048),
                             eos_id=1, filler_id=2, seed=SEED, sleep=lambda s: None)  # fmt: skip
        cr = ContinuousRollout(eng, 4, 2048, capacity=32, block_tokens=16)
        q = Queue(*([{"prompt_ids": [0] * 50, "group": g, "entry": {}, "step": s}
                     for g in range(8)] for s in range(4)))  # fmt: skip
        got: dict = {}
        for _ in range(4):
            out: list = []
            cr.run(8, q.take_share, q.take_ready if refill else lambda n: [], out.append)
            got |= {r.key: len(r.tokens) for part in out for g in part for r in g.requests}
        return eng.emulated_s, got

    (t_plain, plain), (t_refill, refill) = steps(False), steps(True)
    assert refill == plain and len(plain) == 4 * 8 * 4
    assert t_refill < t_plain


@pytest.mark.e2e
def test_rollout_role_runs_the_emulated_engine_with_partial(cluster, tok):
    """``rollout.engine=emulated`` with ``rollout.partial``: the role builds the emulated
    engine from ``rollout.spot.emulated`` (no model behind it) and returns two steps whose
    every response has its drawn length (the length counter's, capped), the second step
    continuing the groups the first started."""
    from m2flow.workers.rollout.config import RolloutOptions
    from m2flow.workers.rollout.emulated import ResponseLengths
    from m2flow.workers.rollout.worker import RolloutWorker

    emulated = {"time_scale": 1e6, "length_median": 6.0, "length_sigma": 1.0, "length_cap": 64}
    spot = {"max_batch": CAPACITY, "block_tokens": 2, "emulated": emulated}
    opts = RolloutOptions(n_samples=SAMPLES, max_new_tokens=MAX_NEW, threads=1,
                          engine="emulated", partial=True, spot=spot)  # fmt: skip
    rollout = RolloutWorker.launch(cluster, [0], name="emu", model=TINY,
                                   tokenizer={"name": "char", "alphabet": ALPHABET},
                                   options=opts, seed=SEED)  # fmt: skip
    inp, out = Channel.create("emu_prompts"), Channel.create("emu_rollouts")
    try:
        inp.put_many(items(tok, 1) + items(tok, 2))
        (r1,) = rollout.generate(inp, out, len(PROMPTS)).wait(timeout=300)
        (r2,) = rollout.generate(inp, out, len(PROMPTS)).wait(timeout=300)
        assert r1["samples"] == r2["samples"] == len(PROMPTS) * SAMPLES
        assert r2["partial_carried_in"] == r1["partial_refilled"] > 0
        got = {}
        while len(got) < 2 * len(PROMPTS) * SAMPLES:
            c = out.get(timeout=60)
            b = c.batch
            for i in range(len(b)):
                got[(c.step, int(b["group_index"][i]), i)] = int(b["response_mask"][i].sum())
        for s in (1, 2):
            keys = [(s, g, j) for g in range(len(PROMPTS)) for j in range(SAMPLES)]
            want = np.minimum(ResponseLengths(6.0, 1.0, 64).lengths(SEED, keys), MAX_NEW)
            have = [n for (st, g, _), n in sorted(got.items()) if st == s]
            assert sorted(have) == sorted(np.maximum(want, 1).tolist())
    finally:
        inp.close()
        out.close()
        rollout.shutdown()
