"""Token-streaming generation whose every token is a function of its request alone.

The engine behind spot rollout instances (RLBoost section 4.2): requests are advanced a block of
tokens at a time, any request can leave with its partial response (prompt + tokens + their
logprobs) and continue on another engine, and a request's tokens and logprobs come out the
same, bit for bit, whichever engine generated which block, in whatever batch:

- sampling is counter-based (:mod:`~..llm.sampling`): token ``t`` of sample ``j`` of prompt ``p`` in
  step ``s`` is drawn with ``u = U(seed, s, p, j, t)``;
- the logits are computed the same way for every token: a full forward over the request's
  whole sequence (no KV cache, so a continuation's "prefill" is the same computation as an
  uninterrupted decode step), in a batch of exactly ``batch_rows`` rows of sequences of one
  length (no padding; empty rows repeat a real one). With the batch shape fixed, a row's result
  does not depend on the other rows on this CPU (checked in ``tests/test_spot.py``); a batch
  shape that varied, or a KV cache, changes the last bits (measured: up to 6e-7).

The price is O(length) work per token instead of O(1) with a KV cache: this engine is for
exactness (migration you can prove exact) on small models; a fast engine (KV cache, vLLM)
behind the same interface migrates correctly but not bit for bit.

Pause, resume and weight updates (:class:`~..llm.gate.DecodeGate`) take effect between decode
iterations (one token for every live request), also in the middle of a :meth:`ExactEngine.step`
call: the call keeps its requests and continues them with the new weights. Nothing is cached,
so nothing is stale: every token after the update is computed from the whole sequence with the
new weights, and a request paused at token ``k`` and continued after an update is, token for
token and logprob for logprob, the request stepped ``k`` tokens, updated, then stepped on (or
continued by another engine holding the new weights: migration keeps the per-token versions).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..llm.gate import PAUSE_TIMEOUT_S, DecodeGate
from ..llm.generation import left_pad
from ..llm.sampling import counter_uniforms_at, sample_tokens


@dataclass
class GenRequest:
    """One response being generated, with everything another engine needs to continue it.

    Attributes:
        id: unique in the step (``"{step}:{prompt}:{sample}"``).
        prompt_ids: the prompt's tokens.
        key: ``(step, prompt id, sample index)``: the sampling counter's key.
        max_new_tokens: response cap (EOS included).
        owner: the rollout rank that collects the response.
        tokens, logprobs: the response so far (logprobs of ``log_softmax(logits / T)``: the
            behaviour logprob of each token, under the weights that sampled it).
        versions: per token, the weight version that sampled it (a response continued across
            a weight update carries two or more).
        done: ended with EOS or at ``max_new_tokens``.
        weight_version: weights its last token came from (-1 before the first token).
        moves: times it changed engine (preemption or rebalancing).
        by: engine label -> tokens it generated (reserved vs spot accounting).
    """

    id: str
    prompt_ids: list[int]
    key: tuple[int, int, int]
    max_new_tokens: int
    owner: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False
    weight_version: int = -1
    moves: int = 0
    by: dict[str, int] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)


class ExactEngine:
    """Advances :class:`GenRequest` s block by block (see the module docstring).

    Args:
        model: a causal LM (eval mode is set); its device is used.
        eos_id: the end-of-sequence token, or the stop tokens
            (:func:`~..llm.generation.stop_token_ids`); EOS masking (``min_new_tokens``) takes them
            all.
        temperature, top_p: sampling parameters (logprobs under ``logits / temperature``).
        seed: the run seed of the sampling counter.
        batch_rows: rows of every forward (fixed: part of what makes tokens exact).
        min_new_tokens: EOS is masked out before this many response tokens (vLLM's
            ``min_tokens``; fixed-length responses for measurements).
        delay_s: seconds slept after each decode iteration (one token for every live
            request): a slower device's pace for a tiny model; the tokens do not change.
        version: the weight version ``model`` holds (-1: not set; :meth:`update_weights` and
            ``step(version=...)`` set it).
        pause_timeout_s: longest wait of a paused :meth:`step` for :meth:`resume`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        eos_id: int | list[int],
        temperature: float,
        top_p: float = 1.0,
        seed: int = 0,
        batch_rows: int = 16,
        min_new_tokens: int = 0,
        delay_s: float = 0.0,
        version: int = -1,
        pause_timeout_s: float = PAUSE_TIMEOUT_S,
    ) -> None:
        self.model = model.eval()
        self.gate = DecodeGate(version, pause_timeout_s)
        self.delay_s = delay_s
        self.min_new_tokens = min_new_tokens
        self.stop_ids = [eos_id] if isinstance(eos_id, int) else sorted(eos_id)
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.batch_rows = batch_rows
        self.device = next(model.parameters()).device

    # -- weights and control (the RolloutEngine protocol) ---------------------------------

    @property
    def version(self) -> int:
        """The weight version the next decode iteration computes with."""
        return self.gate.version

    def update_weights(self, version: int, weights=None) -> None:
        """Load ``weights`` (a Hugging Face ``state_dict``; ``None``: they are in ``model``
        already, e.g. loaded by the host sharing it) as ``version``, between decode iterations
        (waits for the one in flight). Nothing to recompute: the engine caches nothing."""
        apply = None if weights is None else (lambda: self.model.load_state_dict(weights))
        self.gate.update(version, apply)

    def pause(self) -> None:
        """Stop :meth:`step` at its next decode-iteration boundary (returns once there)."""
        self.gate.pause()

    def resume(self) -> None:
        self.gate.resume()

    # -- generation ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(
        self, requests: list[GenRequest], tokens: int, version: int | None = None, label: str = ""
    ) -> int:
        """Generate up to ``tokens`` more tokens for every unfinished request (EOS or the cap
        ends one early). Each decode iteration runs with the weights and version current when
        it starts: a pause holds the call between two iterations, an update in the middle of
        the call labels the later tokens with the new version.

        Args:
            requests: mutated in place (``tokens``, ``logprobs``, ``versions``, ``done``, ...).
            tokens: decode iterations at most.
            version: the version of the weights in ``model`` (declared before the call, as a
                weight-less :meth:`update_weights`); ``None``: the engine's :attr:`version`.
            label: engine name for the per-engine token accounting (``by``).

        Returns:
            the tokens generated.

        Raises:
            TimeoutError: paused longer than ``pause_timeout_s``.
        """
        if version is not None and version != self.gate.version:
            self.gate.update(version)
        made = 0
        for _ in range(tokens):
            live = [r for r in requests if not r.done]
            if not live:
                break
            with self.gate.step() as current:
                by_len: dict[int, list[GenRequest]] = defaultdict(list)
                for r in live:
                    by_len[r.length].append(r)
                for group in by_len.values():
                    for i in range(0, len(group), self.batch_rows):
                        self._advance(group[i : i + self.batch_rows], current, label)
                        made += len(group[i : i + self.batch_rows])
                if self.delay_s:
                    time.sleep(self.delay_s)
        return made

    def _advance(self, rows: list[GenRequest], version: int, label: str) -> None:
        seqs = [r.prompt_ids + r.tokens for r in rows]
        seqs += [seqs[0]] * (self.batch_rows - len(rows))  # fixed shape (see module doc)
        ids = torch.tensor(seqs, dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1]
        logits = logits[: len(rows)].float().cpu()
        early = torch.tensor([len(r.tokens) < self.min_new_tokens for r in rows], device="cpu")
        if early.any():
            for stop in self.stop_ids:
                logits[early, stop] = float("-inf")
        keys = np.array([r.key for r in rows], dtype=np.int64)
        pos = np.array([len(r.tokens) for r in rows])
        u = torch.from_numpy(counter_uniforms_at(self.seed, keys, pos))
        tok = sample_tokens(logits, u, self.temperature, self.top_p)
        lp = torch.log_softmax(logits / self.temperature, dim=-1).gather(1, tok[:, None])[:, 0]
        for r, t, p in zip(rows, tok.tolist(), lp.tolist()):
            r.tokens.append(t)
            r.logprobs.append(p)
            r.versions.append(version)
            r.weight_version = version
            r.by[label] = r.by.get(label, 0) + 1
            r.done = t in self.stop_ids or len(r.tokens) >= r.max_new_tokens


def to_generation_output(requests: list[GenRequest], pad_id: int, n_samples: int) -> dict:
    """The rollout batch layout of :func:`.generation.generate` from finished requests of whole
    GRPO groups (``n_samples`` per prompt, in prompt then sample order): ``prompt_ids``,
    ``prompt_mask`` ``[B, P]`` left padded; ``response_ids``, ``response_mask``, ``logprobs``,
    ``versions`` (int64: the weight version of each token; 0 on padding) ``[B, R]`` right
    padded; ``group_index [B]`` (prompt ids).

    Raises:
        ValueError: a request not finished, or a group not complete.
    """
    reqs = sorted(requests, key=lambda r: (r.key[1], r.key[2]))
    if any(not r.done for r in reqs) or len(reqs) % n_samples:
        raise ValueError("to_generation_output needs finished requests of whole groups")
    ids, mask = left_pad([r.prompt_ids for r in reqs], pad_id)
    width = max(len(r.tokens) for r in reqs)
    resp = torch.full((len(reqs), width), pad_id, dtype=torch.long, device="cpu")
    rmask = torch.zeros((len(reqs), width), dtype=torch.long, device="cpu")
    lps = torch.zeros((len(reqs), width), dtype=torch.float32, device="cpu")
    vers = torch.zeros((len(reqs), width), dtype=torch.long, device="cpu")
    for i, r in enumerate(reqs):
        n = len(r.tokens)
        resp[i, :n] = torch.tensor(r.tokens, device="cpu")
        rmask[i, :n] = 1
        lps[i, :n] = torch.tensor(r.logprobs, device="cpu")
        vers[i, :n] = torch.tensor(token_versions(r), device="cpu")
    return {
        "prompt_ids": ids,
        "prompt_mask": mask,
        "response_ids": resp,
        "response_mask": rmask,
        "logprobs": lps,
        "versions": vers,
        "group_index": torch.tensor([r.key[1] for r in reqs], device="cpu"),
    }


def token_versions(r: GenRequest) -> list[int]:
    """The weight version of each of ``r``'s tokens. A request whose tokens came without
    per-token versions (an engine that only sets ``weight_version``) has that one version for
    all of them."""
    if len(r.versions) == len(r.tokens):
        return list(r.versions)
    return [r.weight_version] * len(r.tokens)
