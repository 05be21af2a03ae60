"""Rollout engines pause, resume and take new weights between decode steps (issue 31 item 3;
the engine side of issue 32's partial rollouts): a call in flight stops at a decode-step
boundary, keeps its sequences, and continues them with the new weights, every token labelled
with the version that sampled it.

The pause is asked from another thread while the engine is inside a known decode step: a
forward pre-hook on the real model holds that step until the pause has been asked, so the pause
lands at the step's end -- an order of events, not a race against the clock. The emulated
engine (no model) is paused while it sleeps a block's modelled time.
"""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest
import torch
from helpers import wait_until
from m2flow.workers.llm import ModelConfig, build_char_tokenizer, build_model
from m2flow.workers.llm.gate import DecodeGate
from m2flow.workers.rollout.emulated import EmulatedEngine, ResponseLengths, throughput_preset
from m2flow.workers.rollout.engines import HfEngine
from m2flow.workers.rollout.exact import ExactEngine, GenRequest, to_generation_output

from m2flow import Channel

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64}  # fmt: skip
ALPHABET = "0123456789+-="
SEED, T = 7, 1.0
PROMPTS = ["1+2=", "3+4=", "5-1=", "9+9="]  # one length: one forward per decode iteration
SAMPLES, MAX_NEW = 2, 16
PAUSE_AT = 3  # the decode step (forward) the pause lands after


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


def model(tok, seed: int):
    return build_model(ModelConfig(**TINY), tok, seed=seed).eval()


@pytest.fixture(scope="module")
def weights(tok):
    """Two weight versions: 0 (seed 0) and 1 (seed 1)."""
    return {v: model(tok, v).state_dict() for v in (0, 1)}


def requests(tok) -> list[GenRequest]:
    return [GenRequest(f"0:{p}:{j}", tok(text).input_ids, (0, p, j), MAX_NEW)
            for p, text in enumerate(PROMPTS) for j in range(SAMPLES)]  # fmt: skip


def exact(tok, weights, version: int = 0, **kw) -> ExactEngine:
    m = model(tok, 0)
    m.load_state_dict(weights[version])
    return ExactEngine(m, tok.eos_token_id, T, seed=SEED, batch_rows=len(PROMPTS) * SAMPLES,
                       version=version, **kw)  # fmt: skip


def hold_forward(module, at: int, engine, until=None):
    """A pre-hook on ``module``'s forward: its ``at``-th call (1-based) signals ``reached`` and
    waits until ``until()`` (default: ``engine`` is asked to pause), so what the test asks
    meanwhile lands when that decode step ends."""
    reached, calls = threading.Event(), [0]
    until = until or (lambda: engine.gate.paused)

    def hook(mod, args, kwargs):
        calls[0] += 1
        if calls[0] == at:
            reached.set()
            wait_until(until, 120, "the test's request")

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    return reached, handle


def run_paused(engine, call, new_weights, version: int):
    """Run ``call()`` in a thread, pause it after decode step :data:`PAUSE_AT`, update the
    weights while it waits, resume it. Returns what ``call`` returned and a snapshot (a
    deep copy) taken while it was paused."""
    reached, handle = hold_forward(engine.model, PAUSE_AT, engine)
    result, errors = {}, []

    def run():
        try:
            result["out"] = call()
        except BaseException as e:  # noqa: BLE001 (reported by the test thread)
            errors.append(e)

    th = threading.Thread(target=run)
    th.start()
    try:
        assert reached.wait(120), errors
        engine.pause()  # returns once the held step has ended
        handle.remove()
        assert th.is_alive()  # paused, not finished
        result["paused"] = engine.gate.boundaries
        engine.update_weights(version, new_weights)
    finally:
        handle.remove()
        engine.resume()
        th.join(300)
    assert not errors, errors
    return result


# -- the gate ----------------------------------------------------------------------------------


def test_gate_pause_waits_for_the_step_in_flight_and_holds_the_next():
    gate = DecodeGate(version=4, timeout_s=60)
    log, inside, go = [], threading.Event(), threading.Event()

    def decoder():
        with gate.step() as v:
            inside.set()
            go.wait(60)
            log.append(("step", v))
        with gate.step() as v:  # held by the pause, computes with the update's version
            log.append(("step", v))

    th = threading.Thread(target=decoder)
    th.start()
    assert inside.wait(60)
    pauser = threading.Thread(target=lambda: (gate.pause(), log.append("paused")))
    pauser.start()
    wait_until(lambda: gate.paused, 60, "the pause to be asked")
    assert log == []  # pause() waits for the step in flight
    go.set()
    pauser.join(60)
    assert log == [("step", 4), "paused"]
    gate.update(5)
    assert log == [("step", 4), "paused"]  # nothing ran while paused
    gate.resume()
    th.join(60)
    assert log == [("step", 4), "paused", ("step", 5)] and gate.boundaries == 2


def test_a_paused_decoder_gives_up_after_its_timeout():
    gate = DecodeGate(timeout_s=0.2)
    gate.pause()
    with pytest.raises(TimeoutError, match="resume"), gate.step():
        pass


# -- exact: the invariance -------------------------------------------------------------------


def test_exact_paused_mid_response_equals_a_switch_of_weights_at_that_token(tok, weights):
    """Paused after decode iteration k from another thread, updated to version 1, resumed:
    tokens 0..k-1 carry version 0 and the rest version 1, and tokens, logprobs and versions
    equal, bit for bit, an uninterrupted run that switches weights at token k -- and a copy
    of the paused requests continued on another engine holding version 1 (a migration)."""
    engine = exact(tok, weights, min_new_tokens=MAX_NEW)  # full length: k is the same for all
    reqs = requests(tok)
    moved = {}

    def call():
        return engine.step(reqs, MAX_NEW)

    reached, handle = hold_forward(engine.model, PAUSE_AT, engine)
    th = threading.Thread(target=call)
    th.start()
    try:
        assert reached.wait(120)
        engine.pause()
        handle.remove()
        assert th.is_alive() and {len(r.tokens) for r in reqs} == {PAUSE_AT}
        moved["reqs"] = pickle.loads(pickle.dumps(reqs))  # what a manager holds
        engine.update_weights(1, weights[1])
    finally:
        handle.remove()
        engine.resume()
        th.join(300)
    assert not th.is_alive()

    # the reference: no pause; k iterations on version 0, the update, the rest on version 1
    ref_engine = exact(tok, weights, min_new_tokens=MAX_NEW)
    ref = requests(tok)
    ref_engine.step(ref, PAUSE_AT)
    ref_engine.update_weights(1, weights[1])
    ref_engine.step(ref, MAX_NEW)
    # the migration: the paused requests continue elsewhere, in another batch shape's order
    other = exact(tok, weights, version=1, min_new_tokens=MAX_NEW)
    other.step(moved["reqs"][::-1], MAX_NEW)
    # and what no update would give (the switch must show)
    stay = requests(tok)
    exact(tok, weights, min_new_tokens=MAX_NEW).step(stay, MAX_NEW)

    for r, f, m, s in zip(reqs, ref, moved["reqs"], stay):
        assert r.versions == [0] * PAUSE_AT + [1] * (MAX_NEW - PAUSE_AT), r.versions
        for o in (f, m):
            assert (r.tokens, r.logprobs, r.versions) == (o.tokens, o.logprobs, o.versions)
        assert r.logprobs[:PAUSE_AT] == s.logprobs[:PAUSE_AT]
        assert r.logprobs[PAUSE_AT:] != s.logprobs[PAUSE_AT:]
    out = to_generation_output(reqs, tok.pad_token_id, SAMPLES)
    assert out["versions"][:, :PAUSE_AT].eq(0).all() and out["versions"][:, PAUSE_AT:].eq(1).all()


# -- hf: KV cache, recomputed after the update --------------------------------------------------


def test_hf_engine_pauses_between_decode_steps_and_recomputes_its_cache(tok, weights):
    """The ``hf`` engine's generate, paused from another thread after its 3rd decode step,
    updated, resumed: versions 0 then 1 per token, and the tokens and logprobs are those of
    the exact engine switching weights at the same token (the cache computed with version 0
    was recomputed with version 1: with the stale cache the logprobs would differ)."""
    m = model(tok, 0)
    m.load_state_dict(weights[0])
    engine = HfEngine(m, tok, {"temperature": T, "top_p": 1.0, "seed": SEED, "version": 0,
                               "shared_prefix": False})  # fmt: skip
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    keys = [(0, p) for p in range(len(PROMPTS))]
    got = run_paused(engine, lambda: engine.generate(prompt_ids, SAMPLES, MAX_NEW, keys),
                     weights[1], 1)  # fmt: skip
    assert got["paused"] == PAUSE_AT  # the prefill and two decode steps
    out = got["out"]
    mask = out["response_mask"].bool()
    assert mask[:, PAUSE_AT:].any(), "every response ended before the update"
    assert out["versions"][:, :PAUSE_AT][mask[:, :PAUSE_AT]].eq(0).all()
    assert out["versions"][:, PAUSE_AT:][mask[:, PAUSE_AT:]].eq(1).all()
    assert out["versions"][~mask].eq(0).all()

    ref_engine = exact(tok, weights)
    ref = requests(tok)
    ref_engine.step(ref, PAUSE_AT)
    ref_engine.update_weights(1, weights[1])
    ref_engine.step(ref, MAX_NEW)
    want = to_generation_output(ref, tok.pad_token_id, SAMPLES)
    assert torch.equal(out["response_ids"], want["response_ids"])
    assert torch.equal(out["response_mask"], want["response_mask"])
    assert torch.equal(out["versions"], want["versions"])
    assert torch.allclose(out["logprobs"], want["logprobs"], atol=1e-5)


def test_an_update_without_a_pause_waits_for_the_decode_step_in_flight(tok, weights):
    """Unpaused, an update from another thread waits for the step in flight (it never changes
    weights under a forward) and the generation goes on with the new version."""
    m = model(tok, 0)
    m.load_state_dict(weights[0])
    engine = HfEngine(m, tok, {"temperature": T, "top_p": 1.0, "seed": SEED, "version": 0})
    seen = []

    def held_until_the_update_waits():
        if engine.gate.updating:
            seen.append(engine.version)  # the update waits: the weights have not moved
            return True
        return False

    reached, handle = hold_forward(m, PAUSE_AT, engine, held_until_the_update_waits)
    result = {}
    th = threading.Thread(target=lambda: result.update(out=engine.generate(
        [tok(p).input_ids for p in PROMPTS], 1, MAX_NEW, [(0, g) for g in range(4)])))  # fmt: skip
    th.start()
    try:
        assert reached.wait(120)
        engine.update_weights(1, weights[1])  # returns once applied, at the step's end
        assert seen == [0] and engine.version == 1
    finally:
        handle.remove()
        th.join(300)
    out = result["out"]
    mask = out["response_mask"].bool()
    assert mask[:, PAUSE_AT:].any(), "every response ended before the update"
    assert out["versions"][:, :PAUSE_AT][mask[:, :PAUSE_AT]].eq(0).all()
    assert out["versions"][:, PAUSE_AT:][mask[:, PAUSE_AT:]].eq(1).all()


# -- emulated: the same, in modelled time --------------------------------------------------------


def emulated(**kw) -> EmulatedEngine:
    tm = throughput_preset("qwen3-8b")
    return EmulatedEngine(tm, ResponseLengths(median=4000, sigma=0.1, cap=8000), 2, 7, seed=3,
                          version=0, **kw)  # fmt: skip


def emu_requests() -> list[GenRequest]:
    return [GenRequest(f"0:{g}:{j}", [1] * 100, (0, g, j), 8000)
            for g in range(4) for j in range(4)]  # fmt: skip


def test_emulated_engine_pauses_after_the_iteration_in_flight(tok):
    """In real time, a pause asked while the emulated engine sleeps a block cuts it after the
    decode iteration the elapsed time falls in; an update drops its KV caches; the rest of the
    block runs after the resume with the new version and one more prefill. Tokens, versions
    and modelled seconds equal a block of k iterations, the update, and a block of the rest."""
    block = 256
    # 50 real seconds per modelled one: the block would take minutes, the iteration in flight
    # when the pause comes (~10 ms modelled) half a second
    engine = emulated(time_scale=0.02)
    reqs = emu_requests()
    th = threading.Thread(target=engine.step, args=(reqs, block))
    th.start()
    wait_until(lambda: engine.gate.busy, 60, "the block to start")
    engine.pause()
    assert th.is_alive()
    k = len(reqs[0].tokens)
    assert 1 <= k < block and {len(r.tokens) for r in reqs} == {k}
    assert set(reqs[0].versions) == {0}
    engine.update_weights(1, {})  # weights arrived locally: no modelled transfer
    engine.time_scale = 1e9  # the rest of the block need not take real time
    engine.resume()
    th.join(120)
    assert not th.is_alive()

    ref_engine = emulated(sleep=lambda s: None)
    ref = emu_requests()
    ref_engine.step(ref, k)
    ref_engine.update_weights(1, {})
    ref_engine.step(ref, block - k)
    for r, f in zip(reqs, ref):
        assert list(r.versions) == [0] * k + [1] * (block - k)
        assert (list(r.tokens), list(r.versions)) == (list(f.tokens), list(f.versions))
    assert engine.emulated_s == pytest.approx(ref_engine.emulated_s, rel=1e-12)
    assert engine.tokens == ref_engine.tokens == len(reqs) * block
    # the second part paid a prefill of every request (caches dropped by the update)
    no_update = emulated(sleep=lambda s: None)
    plain = emu_requests()
    no_update.step(plain, k)
    no_update.step(plain, block - k)
    ctx = np.array([100 + k] * len(reqs))
    extra = ref_engine.emulated_s - no_update.emulated_s
    assert extra == pytest.approx(ref_engine.model.prefill_s(ctx), rel=1e-9)


# -- the role: pause and resume arrive while generate runs -----------------------------------------


VIRTUAL_DEVICES = 1


@pytest.mark.e2e
def test_rollout_role_resume_arrives_while_its_generate_waits(cluster, tok):
    """``pause`` and ``resume`` are control methods: they run while the role's ``generate``
    runs (its own concurrency group). Paused first, the role's generate parks at its first
    decode step; ``resume`` reaches it there (queued behind generate, it never would), and
    the step completes with every sample, labelled with the weights' version (-1: the
    initial weights, never synced)."""
    from m2flow.workers.rollout.config import RolloutOptions
    from m2flow.workers.rollout.worker import RolloutWorker

    spec = {"name": "char", "alphabet": ALPHABET}
    opts = RolloutOptions(n_samples=SAMPLES, max_new_tokens=MAX_NEW, threads=1)
    rollout = RolloutWorker.launch(cluster, [0], name="rollout", model=TINY, tokenizer=spec,
                                   options=opts, seed=SEED)  # fmt: skip
    try:
        rollout.pause().wait(timeout=60)
        inp, out = Channel.create("prompts"), Channel.create("rollouts")
        inp.put_many([{"prompt_ids": tok(p).input_ids, "group": g, "entry": {}, "step": 1}
                      for g, p in enumerate(PROMPTS)])  # fmt: skip
        gen = rollout.generate(inp, out, len(PROMPTS))
        rollout.resume().wait(timeout=120)
        (res,) = gen.wait(timeout=300)
        assert res["samples"] == len(PROMPTS) * SAMPLES
        chunk = out.get(timeout=60)
        assert chunk.weight_version == -1  # the version its tokens carry: none synced yet
        b = chunk.batch
        assert b["versions"][b["response_mask"].bool()].eq(-1).all()
        inp.close()
        out.close()
    finally:
        rollout.shutdown()
