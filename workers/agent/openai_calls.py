"""The calls of the agent endpoint (:mod:`.openai_server`): batching them to the caller's
``generate``, their records, the messages they carry, and the merge of a conversation's records
into trajectories (:func:`merge_calls`)."""

from __future__ import annotations

import concurrent.futures
import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .chat import Trajectory

#: ``generate(prompt_ids, max_tokens, temperature, keys) -> [(ids, logprobs, versions)]``: one
#: row per prompt row; ``keys[i] = (conversation_id, call_index, choice_index)``.
GenerateFn = Callable[
    [list[list[int]], int, "float | None", list[tuple[str, int, int]]],
    Sequence[tuple[Sequence[int], Sequence[float], Sequence[int]]],
]


class RequestError(ValueError):
    """A bad request (answered with HTTP 400 and this message)."""


@dataclass
class CallRecord:
    """One choice of one call: what the model saw and sampled.

    Attributes:
        conversation_id: the conversation (the URL's ``/c/<id>``).
        call: index of the call in the conversation (0, 1, ...; arrival order).
        choice: index of the choice (``n`` > 1 gives several records per call).
        prompt_ids: the prompt's token ids as the model saw them.
        completion_ids: the sampled ids (the stop token included when one ended the turn).
        logprobs: per completion token, under the engine's sampling temperature.
        versions: per completion token, the weight version that sampled it.
        finish_reason: ``stop``, ``length`` or ``tool_calls``.
        endpoint: ``chat`` or ``completions``.
    """

    conversation_id: str
    call: int
    choice: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    endpoint: str
    # What a later call is matched against to reuse these exact ids (see the module docstring).
    history: Any = field(default=None, repr=False)
    reply: Any = field(default=None, repr=False)
    truncated: bool = False

    @property
    def ids(self) -> list[int]:
        """Prompt + completion ids."""
        return self.prompt_ids + self.completion_ids


@dataclass
class Job:
    """One request's rows (``n`` per prompt) for :class:`Batcher`; ``future`` gets one
    ``(ids, logprobs, versions)`` per row."""

    rows: list[list[int]]
    keys: list[tuple[str, int, int]]
    max_tokens: int
    temperature: float | None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class Batcher:
    """A thread that gathers jobs arriving within ``window_s`` and calls ``generate`` once per
    (max_tokens, temperature) among them."""

    def __init__(self, generate: GenerateFn, window_s: float, max_rows: int):
        self.generate, self.window_s, self.max_rows = generate, window_s, max_rows
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(
            target=self._loop, name="agent-endpoint-batcher", daemon=True
        )
        self.thread.start()

    def submit(self, job: Job) -> concurrent.futures.Future:
        self.jobs.put(job)
        return job.future

    def close(self, timeout_s: float = 30.0) -> None:
        self.jobs.put(None)
        self.thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            first = self.jobs.get()
            if first is None:
                return
            batch, rows, closing = [first], len(first.rows), False
            deadline = time.monotonic() + self.window_s
            while rows < self.max_rows:
                try:
                    job = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if job is None:
                    closing = True
                    break
                batch.append(job)
                rows += len(job.rows)
            groups: dict[tuple, list[Job]] = {}
            for job in batch:
                groups.setdefault((job.max_tokens, job.temperature), []).append(job)
            for (max_tokens, temperature), jobs in groups.items():
                self._run(jobs, max_tokens, temperature)
            if closing:
                return

    def _run(self, jobs: list[Job], max_tokens: int, temperature: float | None) -> None:
        # A request that timed out has cancelled its future: its rows are not generated.
        jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        if not jobs:
            return
        rows = [r for job in jobs for r in job.rows]
        keys = [k for job in jobs for k in job.keys]
        try:
            out = list(self.generate(rows, max_tokens, temperature, keys))
            if len(out) != len(rows):
                raise RuntimeError(f"generate returned {len(out)} rows for {len(rows)} prompts")
            out = [_check_row(row) for row in out]
        except Exception as e:  # every waiting request gets the error, the thread lives on
            for job in jobs:
                job.future.set_exception(e)
            return
        start = 0
        for job in jobs:
            job.future.set_result(out[start : start + len(job.rows)])
            start += len(job.rows)


def _check_row(row) -> tuple[list[int], list[float], list[int]]:
    ids, logprobs, versions = row
    ids, logprobs, versions = [int(i) for i in ids], [float(x) for x in logprobs], list(versions)
    if not (len(ids) == len(logprobs) == len(versions)):
        raise RuntimeError(
            f"generate returned a row of {len(ids)} ids, {len(logprobs)} logprobs and "
            f"{len(versions)} versions: one of each per sampled token is needed"
        )
    return ids, logprobs, [int(v) for v in versions]


def message_text(content) -> str:
    """A message's content as text (None -> "", OpenAI content parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise RequestError(f"message content must be a string or a list of parts, got {content!r}")


def _arguments(args) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def template_message(m: dict) -> dict:
    """A message as chat templates expect it: text content, tool-call arguments as dicts."""
    out = {k: v for k, v in m.items() if v is not None}
    out["content"] = message_text(m.get("content"))
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            fn = dict(c.get("function") or {})
            fn["arguments"] = _arguments(fn.get("arguments", {}))
            calls.append({**c, "function": fn})
        out["tool_calls"] = calls
    return out


def message_key(m: dict) -> tuple:
    """What two messages must share to be the same turn (ids and empty fields aside)."""
    calls = []
    for c in m.get("tool_calls") or ():
        fn = c.get("function") or {}
        calls.append((fn.get("name"), json.dumps(_arguments(fn.get("arguments")), sort_keys=True)))
    return (m.get("role"), message_text(m.get("content")), tuple(calls), m.get("name"))


def request_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' is required: a non-empty list of {'role', 'content'}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise RequestError(f"messages[{i}] must be an object with a 'role', got {m!r}")
    return messages


def merge_calls(records: list[CallRecord]) -> tuple[list[Trajectory], int]:
    """Merge one conversation's records (in (call, choice) order) into trajectories; returns
    them and the number of splits.

    Each record's parent is the earlier call's record with the longest ``prompt +
    completion`` ids that its prompt ids start with. A trajectory is a chain of records
    from one without a parent to one no later record extends: its prompt is the first
    record's prompt; each record adds its completion (loss mask 1, its logprobs and
    versions) after the tokens between its parent's end and its own completion
    (observations: loss mask 0, logprob 0). ``n`` > 1 choices that are not continued give
    trajectories of their own (sharing the prefix), not splits. ``splits`` counts the
    calls after the first whose prompt extends no earlier call's tokens.
    """
    parent: dict[int, CallRecord | None] = {}
    extended: set[int] = set()
    split_calls: set[int] = set()
    for r in records:
        best = None
        for q in records:
            if q.call >= r.call:
                break
            n = len(q.prompt_ids) + len(q.completion_ids)
            if len(r.prompt_ids) >= n and r.prompt_ids[:n] == q.ids:
                if best is None or n > len(best.prompt_ids) + len(best.completion_ids):
                    best = q
        parent[id(r)] = best
        if best is not None:
            extended.add(id(best))
        elif r.call != records[0].call:
            split_calls.add(r.call)
    out = []
    for leaf in records:
        if id(leaf) in extended:
            continue
        chain = [leaf]
        while parent[id(chain[-1])] is not None:
            chain.append(parent[id(chain[-1])])
        chain.reverse()
        traj = Trajectory(list(chain[0].prompt_ids), [], [], [], [])
        end = len(chain[0].prompt_ids)
        for r in chain:
            if len(r.prompt_ids) > end:
                traj.add_observation(r.prompt_ids[end:])
            traj.add_model(r.completion_ids, r.logprobs, r.versions)
            end = len(r.prompt_ids) + len(r.completion_ids)
        out.append(traj)
    return out, len(split_calls)
