"""The agent rollout role: :class:`~m2flow.workers.rollout.worker.RolloutWorker` whose
``generate`` plays multi-turn episodes (:mod:`.loop`) instead of single responses."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

from m2flow import Channel, group_method

from ..llm.generation import generate as hf_generate
from ..llm.placement import split_evenly
from ..rollout.worker import RolloutWorker
from .builtin import make_env_factory, question
from .chat import ChatTokens
from .config import AgentConfig
from .loop import AgentLimits, BlockGenerate, episode_metrics, episodes_batch, run_episodes
from .openai_mode import OpenAIEpisodes
from .parsers import parser_for


class AgentRolloutWorker(RolloutWorker):
    drives_blocks = True  # exact / emulated stepped by the loop (loop.BlockGenerate)

    """Rollout of GRPO groups of episodes: ``n_samples`` episodes per prompt, each against a
    fresh environment of ``agent.env`` (:func:`~.builtin.make_env_factory`), turn by turn on
    the role's engine (:func:`~.loop.run_episodes`).

    Args:
        agent: the ``agent`` section (:class:`~.config.AgentConfig` fields).
        compact: the built-in environments' user turn is the compact prompt (a character
            tokenizer) instead of the question text.
        model, tokenizer, options, heldout, reward, seed: as
            :class:`~m2flow.workers.rollout.worker.RolloutWorker` (``reward``: the run's reward
            function, which the built-in environments score final answers with).

    Raises:
        ValueError: an unknown ``agent.env`` or ``agent.tool_parser`` (named, with the
            choices).
    """

    def __init__(
        self,
        model: dict,
        tokenizer: dict,
        options,
        agent: dict,
        heldout=None,
        reward: dict | None = None,
        seed: int = 0,
        compact: bool = False,
    ) -> None:
        super().__init__(model, tokenizer, options, heldout, reward, seed)
        a = self.agent = AgentConfig(**agent)
        self.compact = compact
        if getattr(type(self.engine), "generates", True):
            self.generate_fn = self.engine.generate
        else:  # a block engine (exact, emulated): the loop steps it
            self.generate_fn = BlockGenerate(self.engine, self.tokenizer.pad_token_id).generate
        self.limits = AgentLimits(
            a.max_turns, a.max_episode_tokens, a.max_turn_tokens, a.env_timeout_s, a.concurrency
        )
        self.parser = parser_for(self.tokenizer, a.tool_parser)
        self.pool = ThreadPoolExecutor(a.concurrency, thread_name_prefix="agent-env")
        self.openai = None
        if a.mode == "openai":  # the agent talks to this rank's endpoint (openai_mode.py)
            self.openai = OpenAIEpisodes(
                self.tokenizer, self.generate_fn, a.agent, self.parser, a.max_turn_tokens,
                a.env_timeout_s, compact,
            )  # fmt: skip
            return
        self.env_factory = make_env_factory(
            a.env, self._score, self.parser, a.tool_timeout_s, a.system_prompt
        )
        self.chat = ChatTokens(self.tokenizer, tools=self.env_factory().tools or None)

    def _score(self, text: str, item: dict) -> float:
        """The run's reward function on one final answer (the built-in environments')."""
        return float(self.reward([text], [item]).scores[0])

    def _episodes(self, items: list[dict], n_samples: int, generate) -> list:
        if self.openai is not None:
            return self.openai.run(items, n_samples, self.pool, self.agent.concurrency)
        envs, entries, keys = [], [], []
        for it in items:
            # what env.reset gets: the entry plus the question (Environment.reset)
            entry = {**it["entry"], "prompt": question(it["entry"], self.compact)}
            for j in range(n_samples):
                envs.append(self.env_factory())
                entries.append(entry)
                keys.append((it.get("step", 0), it["group"], j))
        return run_episodes(
            generate, self.chat, self.tokenizer, envs, entries, keys, self.limits, self.pool
        )

    @group_method
    def generate(self, prompts: Channel, out: Channel, num_prompts: int) -> dict:
        """:meth:`RolloutWorker.generate <m2flow.workers.rollout.worker.RolloutWorker.generate>`
        with episodes: each chunk's batch also holds ``loss_mask`` ``[B, R]`` (1 on the model's
        sampled tokens) and ``rewards`` ``[B]`` (the episodes' returns), so the actor trains on
        it directly. Returns ``samples``, ``tokens``, ``response_length`` and ``agent`` (the
        chunks' :func:`~.loop.episode_metrics`, merged by the runner)."""
        share = split_evenly(num_prompts, self.world_size)[self.rank]
        granularity = self.chunk_size(default=share)
        step_samples = num_prompts * self.n_samples
        done, samples, tokens, resp = [], 0, 0, 0
        while share > 0:
            size = min(granularity, share)
            items = prompts.get_batch(size, max_items=size)
            share -= len(items)
            episodes = self._episodes(items, self.n_samples, self.generate_fn)
            gen = episodes_batch(episodes, self.tokenizer.pad_token_id)
            n, n_tok, n_resp = self._put(out, gen, items, step_samples)
            samples, tokens, resp = samples + n, tokens + n_tok, resp + n_resp
            done += episodes
        extra = self.engine.last_metrics() if hasattr(self.engine, "last_metrics") else {}
        return {
            "samples": samples,
            "tokens": tokens,
            "response_length": resp / max(samples, 1),
            "agent": episode_metrics(done) if done else None,
            **extra,  # the spot pool's counters (its last turn's)
        }

    @group_method
    def evaluate(self) -> dict:
        """Greedy episodes on this rank's shard of the held-out prompts (one per prompt).

        Returns:
            ``scores`` (the episodes' returns; accuracy counts 1) and ``reward_errors`` (0).

        Raises:
            ValueError: launched without ``heldout`` prompts.
        """
        if not self.heldout:
            raise ValueError("evaluate() needs held-out prompts: launch with heldout=[...]")
        shard = self.heldout[self.rank :: self.world_size]
        items = [{"entry": it.entry(), "group": i, "step": 0} for i, it in enumerate(shard)]
        greedy = functools.partial(_greedy, self.model, self.tokenizer)
        if self.openai is not None:
            self.openai.greedy = greedy
        try:
            episodes = self._episodes(items, 1, greedy)
        finally:
            if self.openai is not None:
                self.openai.greedy = None
        return {"scores": [ep.reward for ep in episodes], "reward_errors": 0}


def _greedy(model, tokenizer, prompt_ids, n_samples, max_new_tokens, sample_keys) -> dict:
    """Greedy decoding in the engines' ``generate`` signature (the held-out evaluation)."""
    return hf_generate(
        model, tokenizer, prompt_ids, n_samples=n_samples, max_new_tokens=max_new_tokens,
        greedy=True,
    )  # fmt: skip
