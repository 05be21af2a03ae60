"""The agent loop: multi-turn episodes over a rollout engine, keeping the tokens the model
sampled (token-in, token-out).

One call of :func:`run_episodes` plays a batch of episodes (a step's GRPO groups: ``n_samples``
episodes per prompt) turn by turn. Each turn batches every live episode's sequence so far into
one ``generate`` call of the engine (one sample each), cuts each response at the episode's
token budget, and hands the decoded assistant message to the episode's environment
(:class:`~.env.Environment`). The environment's observation messages are tokenized alone with
the chat template's turn delimiters (:meth:`~.chat.ChatTokens.observation_ids`) and appended:
the model's own tokens are never re-tokenized, so the behaviour logprob and weight version of
every sampled token stay those the engine reported (what the off-policy corrections read,
issue 32), and the loss mask is 1 exactly on them (:class:`~.chat.Trajectory`).

An episode ends (:data:`~.env.END_REASONS`, each counted):

- ``done``: the environment said so (a final answer);
- ``max_turns``: ``agent.max_turns`` assistant turns without ``done``;
- ``max_tokens``: the episode's response (model and observation tokens) would pass
  ``agent.max_episode_tokens`` (a turn cut at the budget, or an observation that does not fit:
  not appended), or a turn reached ``agent.max_turn_tokens`` without its stop token;
- ``error``: the environment raised or did not answer within ``agent.env_timeout_s`` (named in
  the log with the item; the episode keeps the tokens it has, and its reward so far).

Environment steps run on a thread pool of ``agent.concurrency`` threads, so slow tools of
several episodes overlap (veRL's agent loop and RLinf's AgentLoopWorker run episodes as
concurrent tasks for the same reason). The model turns are batched by turn: an episode
waiting on a slow tool holds its batch-mates' next turn (synchronous turns; the field's
asynchronous per-episode scheduling is a known gap, docs/concepts/agents.md).

The engine is anything with ``generate(prompt_ids, n_samples, max_new_tokens, sample_keys) ->
dict`` (:func:`~m2flow.workers.llm.generation.generate`'s layout): the ``hf`` and ``vllm``
engines, the spot pool (a preempted turn migrates token by token with its prefix), and
:class:`BlockGenerate` over a block engine (``exact``, ``emulated``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from ..llm.generation import left_pad
from .chat import ChatTokens, Trajectory
from .env import END_REASONS, Environment, EnvStep

log = logging.getLogger(__name__)

#: episode turns are coded into the sampling key's prompt id (:func:`episode_code`)
TURN_CODES = 1024
#: samples a prompt that :func:`episode_code` keeps apart
SAMPLE_CODES = 65536


def episode_code(group: int, sample: int, turn: int) -> int:
    """The sampling counter's prompt id of an episode's turn: unique per ``(group, sample <
    65536, turn < TURN_CODES)``, so every turn draws its own uniforms and a rerun (or another
    engine) draws the same ones (:mod:`m2flow.workers.llm.sampling`)."""
    return ((group * SAMPLE_CODES + sample) * TURN_CODES + turn) % 2**62


@dataclass
class AgentLimits:
    """The ``agent`` section's limits (:class:`~.config.AgentConfig`).

    Attributes:
        max_turns: assistant turns per episode.
        max_episode_tokens: response tokens per episode (model turns and observations).
        max_turn_tokens: tokens of one assistant turn (its stop token included).
        env_timeout_s: longest wait for one ``env.step`` or ``env.reset`` (seconds).
        concurrency: threads that run environment steps.
    """

    max_turns: int = 4
    max_episode_tokens: int = 256
    max_turn_tokens: int = 64
    env_timeout_s: float = 60.0
    concurrency: int = 8


@dataclass
class Episode:
    """One episode's state. ``key``: ``(step, group, sample)``; ``reward``: the sum of its
    turns' rewards; ``end``: one of :data:`~.env.END_REASONS` once over."""

    env: Environment
    item: dict
    key: tuple[int, int, int]
    traj: Trajectory | None = None
    turns: int = 0
    reward: float = 0.0
    end: str | None = None
    tool_calls: int = 0
    tool_errors: Counter = field(default_factory=Counter)
    tool_latency_s: list[float] = field(default_factory=list)
    env_info: dict[str, float] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.end is None


class BlockGenerate:
    """``generate`` over a block engine (:class:`~m2flow.workers.rollout.exact.ExactEngine`,
    the emulated engine): one :class:`~m2flow.workers.rollout.exact.GenRequest` per prompt,
    stepped until every one ends (stop token or cap). ``pad_id``: the tokenizer's."""

    def __init__(self, engine, pad_id: int) -> None:
        self.engine, self.pad_id = engine, pad_id

    def generate(self, prompt_ids, n_samples, max_new_tokens, sample_keys) -> dict:
        from ..rollout.exact import GenRequest, to_generation_output

        reqs = [
            GenRequest(f"{s}:{p}:{j}", list(ids), (s, p, j), max_new_tokens)
            for ids, (s, p) in zip(prompt_ids, sample_keys)
            for j in range(n_samples)
        ]
        while any(not r.done for r in reqs):
            self.engine.step(reqs, max_new_tokens)
        out = to_generation_output(reqs, self.pad_id, n_samples)
        # to_generation_output sorts by prompt id: back to the callers' order
        order = {p: i for i, (_, p) in enumerate(sample_keys)}
        rank = torch.tensor([order[int(g)] for g in out["group_index"]])
        perm = torch.argsort(rank, stable=True)
        out = {k: v[perm] for k, v in out.items()}
        out["group_index"] = rank[perm]
        return out


def run_episodes(
    generate: Callable[..., dict],
    chat: ChatTokens,
    tokenizer,
    envs: list[Environment],
    items: list[dict],
    keys: list[tuple[int, int, int]],
    limits: AgentLimits,
    pool: ThreadPoolExecutor,
) -> list[Episode]:
    """Play ``len(envs)`` episodes to their end (module docstring).

    Args:
        generate: the engine's ``generate(prompt_ids, n_samples, max_new_tokens,
            sample_keys)``; called with one sample per episode, keys ``(step, episode code)``.
        chat: the tokenizer's template (:class:`~.chat.ChatTokens`), built with the
            environments' tools.
        tokenizer: decodes the model's turns for the environments.
        envs, items, keys: per episode, its environment (fresh), its prompt item (the entry,
            ``prompt``, ``messages``) and ``(step, group, sample)``.
        limits: :class:`AgentLimits`.
        pool: runs ``env.reset`` / ``env.step`` (``limits.concurrency`` threads).

    Returns:
        the episodes, in ``envs`` order, every one ended.

    Raises:
        ValueError: an opening prompt longer than ``limits.max_episode_tokens`` allows nothing
            (none raised for environments: their failures end their episode as ``error``).
    """
    episodes = [Episode(e, it, k) for e, it, k in zip(envs, items, keys)]
    opened = _call_envs(pool, [(ep, ep.env.reset, ep.item) for ep in episodes], limits)
    for ep, messages in zip(episodes, opened):
        if ep.live:
            ep.traj = Trajectory(chat.prompt_ids(messages))
        else:
            ep.traj = Trajectory(list(ep.item.get("prompt_ids", [])))
    turn = 0
    while any(ep.live for ep in episodes):
        live = [ep for ep in episodes if ep.live]
        budgets = [
            min(limits.max_turn_tokens, limits.max_episode_tokens - len(ep.traj.response_ids))
            for ep in live
        ]
        cap = max(budgets)
        codes = [(ep.key[0], episode_code(ep.key[1], ep.key[2], turn)) for ep in live]
        out = generate([ep.traj.ids for ep in live], 1, cap, codes)
        stepping = []
        for row, (ep, budget) in enumerate(zip(live, budgets)):
            n = int(out["response_mask"][row].sum())
            ids = out["response_ids"][row, :n].tolist()[:budget]
            lps = out["logprobs"][row, :n].tolist()[:budget]
            vers = out["versions"][row, :n].tolist()[:budget] if "versions" in out else [0] * n
            ep.traj.add_model(ids, lps, vers[: len(ids)])
            ep.turns += 1
            if not ids or ids[-1] not in chat.stop_ids:
                ep.end = "max_tokens"  # cut at the episode's or the turn's budget
                continue
            text = tokenizer.decode(ids[:-1], skip_special_tokens=False)
            stepping.append((ep, ep.env.step, {"role": "assistant", "content": text}))
        results = _call_envs(pool, stepping, limits)
        for (ep, _, _), res in zip(stepping, results):
            if not ep.live:
                continue  # the step raised or timed out
            _count(ep, res)
            if res.done:
                ep.end = "done"
            elif ep.turns >= limits.max_turns:
                ep.end = "max_turns"
            else:
                obs = chat.observation_ids(res.messages)
                if len(ep.traj.response_ids) + len(obs) >= limits.max_episode_tokens:
                    ep.end = "max_tokens"  # no room for the observation and a reply
                else:
                    ep.traj.add_observation(obs)
        turn += 1
    return episodes


def _call_envs(pool: ThreadPoolExecutor, calls: list, limits: AgentLimits) -> list[Any]:
    """Run ``fn(arg)`` for each ``(episode, fn, arg)`` on ``pool``; an exception or a call past
    ``limits.env_timeout_s`` ends that episode as ``error`` (logged with its item) and gives
    ``None``."""
    futures = [pool.submit(fn, arg) for _, fn, arg in calls]
    deadline = time.monotonic() + limits.env_timeout_s
    out = []
    for (ep, fn, _), fut in zip(calls, futures):
        try:
            out.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            continue
        except FutureTimeout:
            why = f"did not answer within agent.env_timeout_s={limits.env_timeout_s:g} s"
            fut.cancel()
        except Exception as e:  # an environment's own failure: the episode's, not the run's
            why = f"raised {type(e).__name__}: {e}"
        log.warning(
            "agent environment %s.%s %s (item %s, episode %s): episode ended as error",
            type(ep.env).__name__, getattr(fn, "__name__", "call"), why,
            ep.item.get("index"), ep.key,
        )  # fmt: skip
        ep.end = "error"
        out.append(None)
    return out


def _count(ep: Episode, res: EnvStep) -> None:
    """Add one step's reward and counters to its episode."""
    if not isinstance(res, EnvStep):
        raise TypeError(
            f"{type(ep.env).__name__}.step returned {type(res).__name__}: an Environment's step "
            "must return m2flow.workers.agent.env.EnvStep"
        )
    ep.reward += float(res.reward)
    info = res.info or {}
    ep.tool_calls += int(info.get("tool_calls", 0))
    ep.tool_errors.update(info.get("tool_errors", {}))
    ep.tool_latency_s += list(info.get("tool_latency_s", []))
    for k, v in info.items():
        if k not in ("tool_calls", "tool_errors", "tool_latency_s") and isinstance(v, int | float):
            ep.env_info[k] = ep.env_info.get(k, 0.0) + float(v)


def episodes_batch(episodes: list[Episode], pad_id: int) -> dict[str, torch.Tensor]:
    """The rollout batch of finished episodes (:mod:`m2flow.workers.batch`'s layout): prompt
    ``[B, P]`` left padded; ``response_ids``, ``response_mask`` (every real token: the
    attention mask), ``loss_mask`` (1 on the model's sampled tokens only), ``logprobs``,
    ``versions`` ``[B, R]`` right padded; ``group_index``, ``rewards`` ``[B]``."""
    ids, mask = left_pad([ep.traj.prompt_ids for ep in episodes], pad_id)
    width = max(1, max(len(ep.traj.response_ids) for ep in episodes))
    b = len(episodes)
    resp = torch.full((b, width), pad_id, dtype=torch.long)
    rmask = torch.zeros((b, width), dtype=torch.long)
    lmask = torch.zeros((b, width), dtype=torch.long)
    lps = torch.zeros((b, width), dtype=torch.float32)
    vers = torch.zeros((b, width), dtype=torch.long)
    for i, ep in enumerate(episodes):
        t = ep.traj
        n = len(t.response_ids)
        if n:
            resp[i, :n] = torch.tensor(t.response_ids)
            rmask[i, :n] = 1
            lmask[i, :n] = torch.tensor(t.loss_mask)
            lps[i, :n] = torch.tensor(t.logprobs)
            vers[i, :n] = torch.tensor(t.versions)
    return {
        "prompt_ids": ids,
        "prompt_mask": mask,
        "response_ids": resp,
        "response_mask": rmask,
        "loss_mask": lmask,
        "logprobs": lps,
        "versions": vers,
        "group_index": torch.tensor([ep.key[1] for ep in episodes]),
        "rewards": torch.tensor([ep.reward for ep in episodes], dtype=torch.float32),
    }


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """The step's agent metrics (sums and lists, merged over ranks by
    :func:`merge_episode_metrics`)."""
    latency = [s for ep in episodes for s in ep.tool_latency_s]
    errors: Counter = Counter()
    for ep in episodes:
        errors.update(ep.tool_errors)
    model = sum(sum(ep.traj.loss_mask) for ep in episodes)
    tokens = sum(len(ep.traj.response_ids) for ep in episodes)
    ends = Counter(ep.end for ep in episodes)
    sums: Counter = Counter()
    for ep in episodes:
        sums.update(ep.env_info)
    return {
        "env": dict(sums),
        "episodes": len(episodes),
        "turns_sum": sum(ep.turns for ep in episodes),
        "num_turns_max": max((ep.turns for ep in episodes), default=0),
        "tool_calls_sum": sum(ep.tool_calls for ep in episodes),
        "tool_errors": dict(errors),
        "tool_latency_s": latency,
        "episode_tokens_sum": tokens,
        "model_tokens_sum": model,
        "reward_sum": sum(ep.reward for ep in episodes),
        "solved": sum(ep.reward >= 1.0 for ep in episodes),
        "ends": {r: ends.get(r, 0) for r in END_REASONS},
    }


def merge_episode_metrics(parts: list[dict]) -> dict[str, float]:
    """The step's logged agent metrics from the ranks' :func:`episode_metrics`:
    ``num_turns_mean``/``num_turns_max``, ``tool_calls_mean`` (per episode), ``tool_errors``
    (all reasons) and ``tool_errors/<reason>``, ``tool_latency_s`` (mean seconds per call),
    ``episode_tokens_mean``, ``masked_share`` (share of response tokens not trained on),
    ``end/<reason>`` (episodes), ``reward_mean``, ``sample_accuracy``, and ``env/<key>``: the
    step's sum of an environment's numeric ``info`` (``agent.mode=openai``:
    ``env/openai_calls``, ``env/openai_splits``)."""
    n = max(1, sum(p["episodes"] for p in parts))
    errors: Counter = Counter()
    for p in parts:
        errors.update(p["tool_errors"])
    latency = [s for p in parts for s in p["tool_latency_s"]]
    tokens = sum(p["episode_tokens_sum"] for p in parts)
    out = {
        "reward_mean": sum(p["reward_sum"] for p in parts) / n,
        "sample_accuracy": sum(p["solved"] for p in parts) / n,
        "num_turns_mean": sum(p["turns_sum"] for p in parts) / n,
        "num_turns_max": max(p["num_turns_max"] for p in parts),
        "tool_calls_mean": sum(p["tool_calls_sum"] for p in parts) / n,
        "tool_errors": sum(errors.values()),
        **{f"tool_errors/{k}": v for k, v in sorted(errors.items())},
        "tool_latency_s": sum(latency) / len(latency) if latency else 0.0,
        "episode_tokens_mean": tokens / n,
        "masked_share": 1.0 - sum(p["model_tokens_sum"] for p in parts) / max(tokens, 1),
    }
    for r in END_REASONS:
        out[f"end/{r}"] = sum(p["ends"][r] for p in parts)
    env: Counter = Counter()
    for p in parts:
        env.update(p.get("env", {}))
    out |= {f"env/{k}": v for k, v in sorted(env.items())}
    return out


__all__ = [
    "AgentLimits",
    "BlockGenerate",
    "Episode",
    "episode_metrics",
    "episodes_batch",
    "merge_episode_metrics",
    "run_episodes",
]
