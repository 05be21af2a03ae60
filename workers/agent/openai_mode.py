"""``agent.mode=openai``: episodes played by an agent written against the ``openai`` client,
through the rollout worker's :class:`~.openai_server.AgentEndpoint`.

Per episode the worker opens a conversation (id ``"<step>-<group>-<sample>"``), hands the agent
function an ``openai.OpenAI`` client whose base URL carries that id, and waits for the reward
it returns (on the worker's thread pool, at most ``agent.env_timeout_s`` each). The
conversation's calls, merged by the endpoint (:meth:`~.openai_server.AgentEndpoint.pop`), are
the episode's samples: one when every call extended the previous one's tokens, more when the
agent rewrote its history (each a sample with the episode's reward, in the prompt's GRPO
group; counted in ``openai_splits``). An agent that raises or times out ends its episode as
``error`` with reward 0, its calls so far kept as samples (none: one empty sample, so the
group keeps its size).

Sampling: every call samples with the run's ``rollout.temperature`` (the trainer's logprobs
are at that temperature); a request's own ``temperature`` is ignored, and the first such
request is logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from .builtin import load_callable, question
from .chat import Trajectory
from .loop import Episode, episode_code

log = logging.getLogger(__name__)


class OpenAIEpisodes:
    """The endpoint, the agent function and the engine behind them, for one rollout rank.

    Args:
        tokenizer: the rollout's tokenizer (its chat template serves the chat calls).
        engine_generate: the engine's ``generate(prompt_ids, n_samples, max_new_tokens,
            sample_keys)``.
        agent: ``agent.agent``; parser: the tool-call parser (``agent.tool_parser``).
        max_turn_tokens: a call's default ``max_tokens``.
        timeout_s: one agent call (an episode) at most, in seconds.
        compact: the item's ``prompt`` is the compact question (a character tokenizer).

    The agent is called as ``agent(client, item)`` with ``item`` the prompt's entry plus
    ``prompt`` (the question: :func:`~.builtin.question`) and returns the episode's reward.
    """

    def __init__(
        self, tokenizer, engine_generate, agent: str, parser: str, max_turn_tokens: int,
        timeout_s: float, compact: bool = False,
    ) -> None:  # fmt: skip
        from .openai_server import AgentEndpoint

        self.agent = load_callable(agent, "agent.agent")
        self.timeout_s, self.compact = timeout_s, compact
        self._engine = engine_generate
        self._lock = threading.Lock()  # one engine call at a time (the endpoint batches)
        self._keys: dict[str, tuple[int, int, int]] = {}
        self._warned = False
        self.greedy: Callable | None = None  # set during evaluation: greedy decoding
        self.endpoint = AgentEndpoint(tokenizer, self._generate, parser=parser,
                                      default_max_tokens=max_turn_tokens)  # fmt: skip
        self.endpoint.start()

    def _generate(self, prompt_ids, max_tokens, temperature, keys):
        """The endpoint's ``generate``: the engine's rows, keys ``(conversation, call,
        choice)`` mapped to the counter keys of the episode's ``(step, group, sample)``."""
        if temperature is not None and not self._warned:
            self._warned = True
            log.warning("agent.mode=openai: a request's temperature is ignored; calls sample "
                        "at rollout.temperature (the trainer's)")  # fmt: skip
        codes = []
        for cid, call, choice in keys:
            step, group, sample = self._keys.get(cid, (0, 0, 0))
            code = (episode_code(group, sample, call) * 8 + choice) % 2**62
            codes.append((step, code))
        fn = self.greedy or self._engine
        with self._lock:
            out = fn(prompt_ids, 1, max_tokens, codes)
        rows = []
        for r in range(len(prompt_ids)):
            n = int(out["response_mask"][r].sum())
            vers = out["versions"][r, :n].tolist() if "versions" in out else [0] * n
            rows.append((out["response_ids"][r, :n].tolist(), out["logprobs"][r, :n].tolist(),
                         vers))  # fmt: skip
        return rows

    def run(
        self, items: list[dict], n_samples: int, pool: ThreadPoolExecutor, concurrency: int
    ) -> list[Episode]:
        """Play ``n_samples`` episodes per item (``{"entry", "group", "step"}``) on ``pool``
        (``concurrency`` threads); returns one :class:`~.loop.Episode` per sample (a split
        episode gives several)."""
        import openai

        jobs = []
        for it in items:
            for j in range(n_samples):
                key = (it.get("step", 0), it["group"], j)
                cid = "-".join(map(str, key))
                self._keys[cid] = key
                client = openai.OpenAI(base_url=self.endpoint.client_for(cid), api_key="none",
                                       timeout=self.timeout_s, max_retries=0)  # fmt: skip
                item = {**it["entry"], "prompt": question(it["entry"], self.compact)}
                jobs.append((cid, key, it["entry"], pool.submit(self.agent, client, item)))
        out = []
        # episodes run agent.concurrency at a time: each gets timeout_s from its wave's start
        waves = -(-len(jobs) // max(1, concurrency))
        deadline = time.monotonic() + self.timeout_s * waves
        for cid, key, entry, fut in jobs:
            end, reward = "done", 0.0
            try:
                reward = float(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                end = "error"
                log.warning("agent %s: episode %s did not return within agent.env_timeout_s=%g s",
                            self.agent.__name__, cid, self.timeout_s)  # fmt: skip
            except Exception as e:  # the agent's failure: its episode's, not the run's
                end = "error"
                log.warning("agent %s raised %s: %s (episode %s)", self.agent.__name__,
                            type(e).__name__, e, cid)  # fmt: skip
            calls = len(self.endpoint.calls(cid))
            trajs, splits = self.endpoint.pop(cid)
            self._keys.pop(cid, None)
            for k, traj in enumerate(trajs or [Trajectory([self._pad_prompt()])]):
                ep = Episode(None, entry, key, traj, turns=_turns(traj), reward=reward, end=end)
                ep.env_info["openai_splits"] = float(splits) if k == 0 else 0.0
                ep.env_info["openai_calls"] = float(calls) if k == 0 else 0.0
                out.append(ep)
        return out

    def _pad_prompt(self) -> int:
        return self.endpoint.tokenizer.pad_token_id

    def close(self) -> None:
        self.endpoint.stop()


def _turns(traj: Trajectory) -> int:
    """Model turns of a trajectory: runs of loss-mask 1."""
    runs, prev = 0, 0
    for m in traj.loss_mask:
        runs += int(m == 1 and prev == 0)
        prev = m
    return runs
