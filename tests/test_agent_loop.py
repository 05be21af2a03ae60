"""The agent loop (issue 33 items 1-2): episodes on a real tiny model keep the sampled tokens,
their behaviour logprobs are the actor's logprobs of the concatenated sequence, the loss mask
is 1 exactly on them, and every end reason is reached and counted."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from m2flow.workers.agent.chat import ChatTokens
from m2flow.workers.agent.env import EnvStep
from m2flow.workers.agent.loop import (
    AgentLimits,
    BlockGenerate,
    episode_metrics,
    episodes_batch,
    merge_episode_metrics,
    run_episodes,
)
from m2flow.workers.algos.logprobs import sequence_logprobs
from m2flow.workers.llm import build_model, build_tokenizer
from m2flow.workers.llm.generation import generate, stop_token_ids
from m2flow.workers.rollout.exact import ExactEngine

ALPHABET = "0123456789+-*=()" + '{}[]":,_ ' + "abcdefghijklmnopqrstuvwxyz"
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer({"name": "char", "alphabet": ALPHABET, "chat": True})


@pytest.fixture(scope="module")
def model(tok):
    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256,
    )  # fmt: skip
    m = build_model(shape, tok, seed=0).eval()
    # a random model rarely samples its turn end: an output bias on it makes turns end after a
    # few tokens (the weights stay a real model's; only their values are chosen)
    head = torch.nn.Linear(m.lm_head.in_features, m.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(m.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.convert_tokens_to_ids("<|end|>")] = 3.0
    m.config.tie_word_embeddings = False
    m.lm_head = head
    return m


class Scripted:
    """A test environment: answers each turn with a fixed observation; done after ``turns``
    turns (reward 1); ``fail`` at turn ``fail_at``: ``raise`` or ``hang`` (until released)."""

    tools: list = []

    def __init__(self, turns=2, fail=None, fail_at=1, release=None, obs="42"):
        self.turns, self.fail, self.fail_at, self.release, self.obs = (
            turns,
            fail,
            fail_at,
            release,
            obs,
        )
        self.seen: list[str] = []

    def reset(self, item):
        return [{"role": "user", "content": item["prompt"]}]

    def step(self, message):
        self.seen.append(message["content"])
        n = len(self.seen)
        if n == self.fail_at and self.fail == "raise":
            raise RuntimeError("environment failed")
        if n == self.fail_at and self.fail == "hang":
            self.release.wait(120)
        done = n >= self.turns
        info = {"tool_calls": 1, "tool_latency_s": [0.01], "tool_errors": {"raised": n % 2}}
        return EnvStep([{"role": "tool", "content": self.obs}], float(done), done, info)


def hf(model, tok):
    def gen(prompt_ids, n_samples, max_new_tokens, sample_keys):
        return generate(model, tok, prompt_ids, n_samples=n_samples,
                        max_new_tokens=max_new_tokens, temperature=TEMPERATURE,
                        sample_keys=sample_keys, seed=7)  # fmt: skip

    return gen


def play(model, tok, envs, limits, generate_fn=None):
    chat = ChatTokens(tok)
    items = [{"prompt": "12+34=", "index": i} for i in range(len(envs))]
    keys = [(1, i, 0) for i in range(len(envs))]
    pool = ThreadPoolExecutor(4)
    try:
        eps = run_episodes(generate_fn or hf(model, tok), chat, tok, envs, items, keys, limits,
                           pool)  # fmt: skip
    finally:
        pool.shutdown(wait=False)  # a hung environment's thread is left behind, as in a run
    return chat, eps


def test_tokens_as_sampled_and_the_loss_mask(model, tok):
    """Each episode's model tokens are the engine's, its observation ids the template's, and
    the behaviour logprobs equal the actor's logprobs of the concatenated sequence under the
    same weights (token-in, token-out: nothing was re-tokenized)."""
    limits = AgentLimits(max_turns=3, max_episode_tokens=200, max_turn_tokens=12)
    chat, eps = play(model, tok, [Scripted(turns=3) for _ in range(4)], limits)
    obs = chat.observation_ids([{"role": "tool", "content": "42"}])
    batch = episodes_batch(eps, tok.pad_token_id)
    assert sum(ep.end == "done" for ep in eps) >= 2, [ep.end for ep in eps]
    for i, ep in enumerate(eps):
        t = ep.traj
        assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
        # the observation's ids appear, masked out, after every model turn but the last
        runs, cur = [], []
        for tid, m in zip(t.response_ids, t.loss_mask):
            if m == 0:
                cur.append(tid)
            elif cur:
                runs.append(cur)
                cur = []
        if ep.end == "done":
            assert runs == [obs] * (ep.turns - 1)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m == 0)
        assert batch["loss_mask"][i].sum() == sum(t.loss_mask)
    with torch.no_grad():
        lp = sequence_logprobs(
            model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"],
            batch["response_mask"], TEMPERATURE,
        )  # fmt: skip
    m = batch["loss_mask"].bool()
    assert m.sum() > 0 and (~m & batch["response_mask"].bool()).sum() > 0
    assert torch.allclose(lp[m], batch["logprobs"][m], atol=1e-4)


def test_end_reasons_are_counted(model, tok):
    """done, max_turns, max_tokens, error (raised) and error (hung past env_timeout_s), each
    reached; the hung environment does not hold the others."""
    release = threading.Event()
    envs = [Scripted(turns=1), Scripted(turns=99), Scripted(turns=99, obs="7" * 150),
            Scripted(fail="raise"), Scripted(fail="hang", release=release)]  # fmt: skip
    # the hung one is released only after the loop gave up on it; the others answer at once,
    # well inside a timeout generous enough for a loaded machine
    limits = AgentLimits(max_turns=2, max_episode_tokens=120, max_turn_tokens=8,
                         env_timeout_s=15.0)  # fmt: skip
    try:
        _, eps = play(model, tok, envs, limits)
    finally:
        release.set()
    ends = [ep.end for ep in eps]
    # a turn without its stop token within max_turn_tokens ends as max_tokens too: the tiny
    # random model may; then turns say where it stopped
    for ep, want in zip(eps, ["done", "max_turns", "max_tokens", "error", "error"]):
        assert ep.end == want or (ep.end == "max_tokens" and ep.turns <= 1), ends
    m = merge_episode_metrics([episode_metrics(eps)])
    assert sum(m[f"end/{r}"] for r in ("done", "max_turns", "max_tokens", "error")) == 5
    assert m["end/error"] == 2
    assert 0.0 < m["masked_share"] < 1.0


def test_block_engine_gives_the_hf_engines_tokens(model, tok):
    """The exact block engine (no KV cache, fixed rows) samples the same episode tokens as the
    KV-cached decode loop: the same counter keys, the same weights."""
    limits = AgentLimits(max_turns=2, max_episode_tokens=100, max_turn_tokens=10)
    _, a = play(model, tok, [Scripted(turns=2) for _ in range(3)], limits)
    engine = ExactEngine(model, stop_token_ids(tok, model.generation_config), TEMPERATURE,
                         seed=7, batch_rows=4)  # fmt: skip
    block = BlockGenerate(engine, tok.pad_token_id).generate
    _, b = play(model, tok, [Scripted(turns=2) for _ in range(3)], limits, block)
    same = sum(x.traj.response_ids == y.traj.response_ids for x, y in zip(a, b))
    assert same >= 2  # float rounding may move a token at a CDF boundary (llm/sampling.py)
