"""The agent loop on rollout.engine=vllm (issue 33 item 5): multi-turn episodes through
:func:`run_episodes` with :class:`VllmEngine`'s ``generate``. The loss mask is 1 exactly on the
tokens vLLM sampled and the observation ids sit between them; vLLM's behaviour logprobs of the
kept tokens equal the actor's ``sequence_logprobs`` of the concatenated episode; each turn's
prompt is the previous turn's prompt, vLLM's tokens as returned and the observation ids (never
re-tokenized text: with Qwen2's tokenizer, re-rendering the decoded conversation gives other
ids).

Needs vLLM's CPU build (the ``vllm`` extra, docs/results/vllm.md); skipped without it. A vLLM
engine start costs 5-130 s (import, profiling): the module starts two, one shared by the char
tokenizer's tests (a module fixture) and one for Qwen2's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from m2flow.workers.agent.chat import ChatTokens  # noqa: E402
from m2flow.workers.agent.env import EnvStep  # noqa: E402
from m2flow.workers.agent.loop import (  # noqa: E402
    SAMPLE_CODES,
    TURN_CODES,
    AgentLimits,
    episodes_batch,
    run_episodes,
)
from m2flow.workers.algos.logprobs import sequence_logprobs  # noqa: E402
from m2flow.workers.llm import build_model, build_tokenizer  # noqa: E402
from m2flow.workers.rollout.vllm_engine import VllmEngine  # noqa: E402

ALPHABET = "0123456789+-*=()" + '{}[]":,_ ' + "abcdefghijklmnopqrstuvwxyz"
TEMPERATURE = 0.9
#: vLLM's logprob tolerance against the actor in fp32 (tests/test_vllm_engine.py's)
LOGPROB_ATOL = 1e-4
OBS = "42"
#: vLLM's CPU attention needs head_dim >= 64: hidden 128 over 2 heads.
TINY = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=256,
)  # fmt: skip


def turn_ending_model(tok, shape: dict, end_logit: float):
    """A tiny Qwen2 model whose turns end after a few tokens. A random model rarely samples its
    turn end, and vLLM's Qwen2 has no output bias (tests/test_agent_loop.py's trick), so the
    weights carry one: hidden dimension 0 is a constant 1 in every token's embedding that no
    layer writes (row 0 of each ``o_proj`` and ``down_proj`` zeroed), so after the final
    RMSNorm it is nearly constant, and only the turn end's output row reads it
    (``end_logit`` on that row, 0 on the others)."""
    m = build_model(shape, tok, seed=0).eval()
    end = tok.convert_tokens_to_ids(tok.eos_token)
    head = torch.nn.Linear(m.lm_head.in_features, m.lm_head.out_features, bias=False)
    with torch.no_grad():
        for p in m.parameters():  # the small init is near-uniform: sharpen it
            if p.dim() >= 2:
                p.mul_(3.0)
        head.weight.copy_(m.lm_head.weight)
        m.model.embed_tokens.weight[:, 0] = 1.0
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        head.weight[:, 0] = 0.0
        head.weight[end, 0] = end_logit
    m.config.tie_word_embeddings = False  # the embedding keeps its own dimension 0
    m.lm_head = head
    return m


class Scripted:
    """A test environment: answers each turn with the tool message ``obs``; done after
    ``turns`` turns (reward 1)."""

    tools: list = []

    def __init__(self, turns: int, obs: str = OBS):
        self.turns, self.obs, self.seen = turns, obs, []

    def reset(self, item):
        return [{"role": "user", "content": item["prompt"]}]

    def step(self, message):
        self.seen.append(message["content"])
        done = len(self.seen) >= self.turns
        return EnvStep([{"role": "tool", "content": self.obs}], float(done), done, {})


class Recorder:
    """The engine's ``generate``, recording each call's prompts and output per episode
    (``calls[episode]``: ``(turn, prompt ids, response ids, logprobs, versions)``), the
    episode and turn read back from the loop's sample key."""

    def __init__(self, engine):
        self.engine, self.calls = engine, {}

    def __call__(self, prompt_ids, n_samples, max_new_tokens, sample_keys):
        out = self.engine.generate(prompt_ids, n_samples, max_new_tokens, sample_keys)
        assert n_samples == 1 and out["response_ids"].shape[0] == len(prompt_ids)
        for row, (ids, (_, code)) in enumerate(zip(prompt_ids, sample_keys)):
            n = int(out["response_mask"][row].sum())
            # keys (1, i, 0): episode i is the group, its sample 0
            episode, turn = code // TURN_CODES // SAMPLE_CODES, code % TURN_CODES
            self.calls.setdefault(episode, []).append((
                turn, list(ids), out["response_ids"][row, :n].tolist(),
                out["logprobs"][row, :n].tolist(), out["versions"][row, :n].tolist(),
            ))  # fmt: skip
        return out


def play(engine, tok, envs, limits):
    """Run ``envs``' episodes on ``engine``; returns ``(chat, episodes, recorder)``."""
    chat = ChatTokens(tok)
    items = [{"prompt": "12+34=", "index": i} for i in range(len(envs))]
    keys = [(1, i, 0) for i in range(len(envs))]
    rec = Recorder(engine)
    with ThreadPoolExecutor(4) as pool:
        eps = run_episodes(rec, chat, tok, envs, items, keys, limits, pool)
    return chat, eps, rec


def actor_logprobs(model, batch) -> torch.Tensor:
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    with torch.no_grad():
        return sequence_logprobs(model, *(batch[k] for k in keys), temperature=TEMPERATURE)


@pytest.fixture(scope="module")
def char_run():
    """Six 3-turn episodes of the char chat model on one vLLM engine (weight version 0)."""
    tok = build_tokenizer({"name": "char", "alphabet": ALPHABET, "chat": True})
    model = turn_ending_model(tok, TINY, end_logit=1.3)
    engine = VllmEngine(model, tok, temperature=TEMPERATURE, seed=5)
    try:
        engine.update_weights(0, None)  # the weights it was built with are version 0
        limits = AgentLimits(max_turns=3, max_episode_tokens=200, max_turn_tokens=12)
        chat, eps, rec = play(engine, tok, [Scripted(turns=3) for _ in range(6)], limits)
    finally:
        engine.close()
    return tok, model, chat, eps, rec


def test_loss_mask_is_one_exactly_on_vllms_tokens(char_run):
    """Each episode's response is vLLM's turns as returned (stop token kept) with the
    observation's template ids between them: loss mask 1 on the former, 0 on the latter, the
    behaviour logprobs and versions (0) those vLLM reported."""
    tok, _, chat, eps, rec = char_run
    obs = chat.observation_ids([{"role": "tool", "content": OBS}])
    assert sum(ep.end == "done" for ep in eps) >= 3, [ep.end for ep in eps]
    for i, ep in enumerate(eps):
        t, calls = ep.traj, rec.calls[i]
        assert [c[0] for c in calls] == list(range(ep.turns))
        want_ids, want_mask, want_lp, want_v = [], [], [], []
        for k, (_, _, ids, lps, vers) in enumerate(calls):
            if k:
                want_ids += obs
                want_mask += [0] * len(obs)
                want_lp += [0.0] * len(obs)
                want_v += [0] * len(obs)
            want_ids += ids
            want_mask += [1] * len(ids)
            want_lp += lps
            want_v += vers
        assert t.response_ids == want_ids and t.loss_mask == want_mask
        assert t.logprobs == want_lp and t.versions == want_v
        if ep.end == "done":  # every turn ended with vLLM's stop token
            assert all(c[2][-1] in chat.stop_ids for c in calls)
            assert tok.decode(calls[0][2][:-1], skip_special_tokens=False) == ep.env.seen[0]
    assert all(v == 0 for ep in eps for v in ep.traj.versions)


def test_vllm_logprobs_equal_the_actors_on_the_whole_episode(char_run):
    """vLLM's behaviour logprob of every kept token equals the actor's ``sequence_logprobs`` of
    the concatenated episode (prompt, turns, observations) under the same weights, within
    LOGPROB_ATOL = 1e-4 (fp32, tests/test_vllm_engine.py's bound)."""
    tok, model, _, eps, _ = char_run
    batch = episodes_batch(eps, tok.pad_token_id)
    lp = actor_logprobs(model, batch)
    m = batch["loss_mask"].bool()
    assert (~m & batch["response_mask"].bool()).sum() > 0  # observations are in the sequence
    err = float((lp[m] - batch["logprobs"][m]).abs().max())
    print(
        f"agent episodes on vLLM: ends {[ep.end for ep in eps]}, turns "
        f"{[ep.turns for ep in eps]}, {int(m.sum())} model tokens, logprob max|d| {err:.2e}"
    )
    assert m.sum() > 0 and err <= LOGPROB_ATOL


def test_turns_continue_on_the_ids_vllm_returned(char_run):
    """Turn k+1's prompt to vLLM is turn k's prompt + vLLM's tokens of turn k as returned +
    the observation ids: the engine continues the episode on its own tokens."""
    _, _, chat, eps, rec = char_run
    obs = chat.observation_ids([{"role": "tool", "content": OBS}])
    multi = [i for i, ep in enumerate(eps) if ep.turns >= 2]
    assert len(multi) >= 3, [ep.turns for ep in eps]
    for i, ep in enumerate(eps):
        calls = rec.calls[i]
        assert calls[0][1] == chat.prompt_ids([{"role": "user", "content": "12+34="}])
        for (_, prompt, ids, _, _), (_, nxt, _, _, _) in zip(calls, calls[1:]):
            assert nxt == prompt + ids + obs
        assert ep.traj.ids[: len(calls[-1][1]) + len(calls[-1][2])] == calls[-1][1] + calls[-1][2]


def test_qwen2_episode_ids_are_vllms_not_the_retokenized_text():
    """With Qwen2's byte-level BPE a random model's tokens rarely re-tokenize to themselves:
    re-rendering an episode's decoded conversation with the chat template gives other ids than
    the ones vLLM was fed at its next turn, which are vLLM's own tokens; and on those the
    actor's logprobs equal vLLM's (LOGPROB_ATOL)."""
    tok = build_tokenizer({"name": "qwen2"})
    shape = dict(TINY, hidden_size=64, intermediate_size=128, num_attention_heads=1,
                 num_hidden_layers=1)  # fmt: skip
    # 151,646 tokens: the turn end needs a larger logit to be sampled within a few tokens
    model = turn_ending_model(tok, shape, end_logit=2.2)
    engine = VllmEngine(model, tok, temperature=TEMPERATURE, seed=5)
    try:
        engine.update_weights(0, None)
        limits = AgentLimits(max_turns=2, max_episode_tokens=120, max_turn_tokens=16)
        chat, eps, rec = play(engine, tok, [Scripted(turns=2) for _ in range(8)], limits)
    finally:
        engine.close()
    obs = chat.observation_ids([{"role": "tool", "content": OBS}])
    drift = 0
    multi = [i for i, ep in enumerate(eps) if ep.turns == 2]
    assert multi, [(ep.turns, ep.end) for ep in eps]
    for i in multi:
        (_, p0, ids0, _, _), (_, p1, _, _, _) = rec.calls[i]
        assert p1 == p0 + ids0 + obs
        text = tok.decode(ids0[:-1], skip_special_tokens=False)  # what the environment read
        conv = [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": text},
                {"role": "tool", "content": OBS}]  # fmt: skip
        rendered = chat.prompt_ids(conv)
        drift += rendered != p1
    print(f"qwen2 agent episodes: {drift}/{len(multi)} re-rendered prompts differ from vLLM's")
    assert drift >= 1
    batch = episodes_batch(eps, tok.pad_token_id)
    m = batch["loss_mask"].bool()
    err = float((actor_logprobs(model, batch)[m] - batch["logprobs"][m]).abs().max())
    print(f"qwen2 agent episodes on vLLM: logprob max|d| {err:.2e}")
    assert err <= LOGPROB_ATOL
