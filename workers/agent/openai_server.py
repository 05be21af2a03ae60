"""An OpenAI-compatible endpoint over the rollout engine that records every call's tokens.

``agent.mode=openai``: an agent written against the ``openai`` client (``module:function(client,
item) -> reward``) talks to this endpoint as it would to any OpenAI-compatible server, and
trains unchanged. Each episode gets a conversation id carried in the URL path
(:meth:`AgentEndpoint.client_for`: ``http://host:port/c/<conversation_id>/v1``), so
``openai.OpenAI(base_url=endpoint.client_for(cid), api_key="none")`` needs no header plumbing.
Every call is recorded under its conversation: prompt ids, completion ids, the sampled tokens'
logprobs and weight versions (:class:`CallRecord`). :meth:`AgentEndpoint.trajectories` merges a
conversation's calls into samples: a call whose prompt ids start with an earlier call's prompt
+ completion ids extends that call's trajectory (the prompt tokens in between are observations:
tool results, template tokens, loss mask 0); a call that extends none starts a new trajectory
and is counted as a *split* (an agent that rewrote or summarised its history).

Token-in, token-out. Re-rendering an assistant message through the chat template does not in
general give back the tokens the model sampled (a BPE text has many tokenisations; templates
reformat tool calls), which would split every multi-turn conversation. So when a chat call's
messages start with an earlier call's messages followed by the assistant message that call
returned (compared by role, content and tool calls' names and arguments), its prompt is that
call's exact prompt + completion ids (the turn-ending stop token added when the completion was
cut at ``max_tokens``) followed by :meth:`~.chat.ChatTokens.observation_ids` of the new
messages; otherwise the whole conversation goes through the chat template. ``/v1/completions``
does the same with text: a prompt that starts with an earlier prompt + completion text reuses
those ids and encodes only the rest.

Serving it from a rollout worker: the worker builds one endpoint per process with a
``generate`` callable that takes the worker's device lock (the same lock its batch generation
and weight updates take) and runs its rollout engine on the rows, with the worker's sampling
settings (``temperature=None``: the config's; top-p fixed by the config), and returns each
row's token ids, logprobs and per-token weight versions (``versions`` of the engine's output;
a weight update between two calls of a conversation shows in them). ``keys`` (conversation,
call, choice) can key the engine's counter-based sampling. :meth:`AgentEndpoint.start` runs
uvicorn in a daemon thread of that process; the agent functions run in threads (or other
processes) with :meth:`AgentEndpoint.client_for`'s URL, and whatever waits for them must not
hold the device lock (``generate`` takes it). After an agent returns its reward the worker
takes :meth:`AgentEndpoint.pop` of the conversation to build the rollout batch's samples
(conversations never popped stay in memory).

Batching (:class:`~.openai_calls.Batcher`): requests arriving within ``batch_window_s`` of each
other go to ``generate`` in one call (rows of equal ``max_tokens`` and ``temperature``; one
call per distinct pair), up to ``max_batch_rows`` rows; ``n`` choices are ``n`` rows of the
same prompt. The plain ``/v1/...`` routes serve too, with the conversation id in an
``X-Conversation-Id`` header.

Choices where OpenAI's API says nothing about a local server: any ``model`` name is accepted
(the first use of a name other than ``model_name`` is logged) since agents written for a hosted
model pass its name; ``stream=true``, ``top_p < 1``, ``stop`` strings and a forced
``tool_choice`` are refused with a 400 (the engine's sampling cannot honour them and silently
ignoring them would train on something else than the agent asked for); other unknown fields
are ignored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..llm.generation import stop_token_ids
from .chat import ChatTokens, Trajectory
from .openai_calls import (
    Batcher,
    CallRecord,
    GenerateFn,
    Job,
    RequestError,
    merge_calls,
    message_key,
    request_messages,
    template_message,
)
from .parsers import parse_tool_calls, parser_for

log = logging.getLogger(__name__)

#: Tool-call markers kept when the completion is decoded (other special tokens are dropped).
TOOL_MARKERS = ("<tool_call>", "</tool_call>", "<|python_tag|>")


class AgentEndpoint:
    """``/v1/chat/completions`` and ``/v1/completions`` over a caller's ``generate``, every
    call recorded per conversation (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer (chat template, decoding, stop tokens).
        generate: ``generate(prompt_ids, max_tokens, temperature, keys)`` -> one ``(ids,
            logprobs, versions)`` per row of ``prompt_ids`` (``[rows][len]`` token lists): the
            sampled ids (ending with a stop token when one ended the turn; at most
            ``max_tokens``), each token's logprob and weight version. ``temperature`` None:
            the engine's default. ``keys[i] = (conversation_id, call, choice)`` of row ``i``
            (for keyed sampling). Called from one thread at a time.
        model_name: the name ``/v1/models`` lists.
        parser: tool-call format (``hermes``, ``llama3_json``, or ``auto``: from the chat
            template, :func:`~.parsers.parser_for`; ``auto`` on a tokenizer with no known format
            leaves tool calls unparsed and requests with ``tools`` are refused).
        default_max_tokens: completion length when a request sets none.
        batch_window_s: how long the first request waits for others to join its batch.
        max_batch_rows: rows per ``generate`` call at most (a request's rows are never split).
        request_timeout_s: a request waiting longer for ``generate`` gets a 504.

    Raises:
        ValueError: an explicit ``parser`` that :func:`~.parsers.parser_for` rejects.
    """

    def __init__(
        self,
        tokenizer,
        generate: GenerateFn,
        model_name: str = "m2flow",
        parser: str = "auto",
        default_max_tokens: int = 256,
        batch_window_s: float = 0.005,
        max_batch_rows: int = 256,
        request_timeout_s: float = 600.0,
    ):
        self.tokenizer, self.model_name = tokenizer, model_name
        self.default_max_tokens, self.request_timeout_s = default_max_tokens, request_timeout_s
        try:
            self.parser: str | None = parser_for(tokenizer, parser)
        except ValueError:
            if parser != "auto":
                raise
            self.parser = None
            log.info("the chat template names no tool format: tool calls are not parsed")
        self.stop_ids = set(stop_token_ids(tokenizer))
        self._chats: dict[str, ChatTokens] = {}  # per tools list (its JSON)
        try:
            chat = self._chat_tokens(None)
            self.stop_ids |= set(chat.stop_ids)
            self._turn_end_id: int | None = chat.turn_end_id
        except RequestError:  # no chat template: /v1/completions only
            self._turn_end_id = None
        specials = set(tokenizer.all_special_ids) | {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special
        }
        vocab = tokenizer.get_vocab()
        markers = {vocab[t] for t in TOOL_MARKERS if t in vocab}
        self._dropped = specials - markers
        self._generate, self._window_s, self._max_rows = generate, batch_window_s, max_batch_rows
        self._batcher: Batcher | None = None
        self._lock = threading.Lock()
        self._records: dict[str, list[CallRecord]] = {}
        self._next_call: dict[str, int] = {}
        self._tool_calls: dict[str, int] = {}  # tool calls returned so far (unique call ids)
        self._models_seen: set[str] = {model_name}
        self._server = None
        self._thread: threading.Thread | None = None
        self.base_url: str | None = None
        self.app = self._build_app()

    # ---- serving ---------------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0) -> str:
        """Serve on ``host:port`` (0: a free port) from a daemon thread; returns the base URL
        ``http://host:port``. ``host`` is also the URLs' host: the node's address when agents
        run on other nodes.

        Raises:
            RuntimeError: already started, or uvicorn exited while starting (port in use).
            TimeoutError: not listening after ``timeout_s``.
        """
        import uvicorn

        if self._thread is not None:
            raise RuntimeError(f"the endpoint already serves {self.base_url}")
        config = uvicorn.Config(
            self.app, host=host, port=port, log_level="warning", access_log=False, lifespan="off"
        )
        self._batcher = Batcher(self._generate, self._window_s, self._max_rows)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, name="agent-endpoint", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive():
                self._batcher.close()
                raise RuntimeError(f"the endpoint did not start on {host}:{port} (port in use?)")
            if time.monotonic() > deadline:
                server.should_exit = True
                self._batcher.close()
                raise TimeoutError(f"the endpoint was not listening after {timeout_s:g} s")
            time.sleep(0.01)
        self._server, self._thread = server, thread
        bound = server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://{host}:{bound}"
        return self.base_url

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop serving and the batching thread (records are kept; :meth:`start` serves
        again, on a new port when ``port=0``)."""
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout_s)
            self._server = self._thread = self.base_url = None
        if self._batcher is not None:
            self._batcher.close(timeout_s)
            self._batcher = None

    def client_for(self, conversation_id: str) -> str:
        """The base URL of one conversation (``openai.OpenAI(base_url=...)``).

        Raises:
            RuntimeError: not started.
            ValueError: an id with ``/`` or empty.
        """
        if self.base_url is None:
            raise RuntimeError("the endpoint is not serving: call start() first")
        if not conversation_id or "/" in conversation_id:
            raise ValueError(f"conversation id {conversation_id!r}: non-empty, without '/'")
        return f"{self.base_url}/c/{conversation_id}/v1"

    # ---- records ---------------------------------------------------------------------------

    def calls(self, conversation_id: str) -> list[CallRecord]:
        """The conversation's records in (call, choice) order (empty when unknown)."""
        with self._lock:
            records = list(self._records.get(conversation_id, ()))
        return sorted(records, key=lambda r: (r.call, r.choice))

    def conversations(self) -> list[str]:
        with self._lock:
            return list(self._records)

    def trajectories(self, conversation_id: str) -> tuple[list[Trajectory], int]:
        """The conversation's calls merged into trajectories, and the number of splits
        (:func:`~.openai_calls.merge_calls`); ``([], 0)`` for an unknown conversation."""
        return merge_calls(self.calls(conversation_id))

    def pop(self, conversation_id: str) -> tuple[list[Trajectory], int]:
        """:meth:`trajectories` of the conversation, then forget it."""
        result = self.trajectories(conversation_id)
        with self._lock:
            self._records.pop(conversation_id, None)
            self._next_call.pop(conversation_id, None)
            self._tool_calls.pop(conversation_id, None)
        return result

    # ---- generation ------------------------------------------------------------------------

    def _sampling(self, body: dict) -> tuple[int, float | None, int]:
        if body.get("stream"):
            raise RequestError("stream=true is not supported: call without streaming")
        if body.get("top_p") not in (None, 1, 1.0):
            raise RequestError("top_p is fixed by the rollout config: send no top_p (or 1)")
        if body.get("stop"):
            raise RequestError("stop sequences are not supported: send no 'stop'")
        if body.get("echo"):
            raise RequestError("echo=true is not supported")
        model = body.get("model")
        if model is not None and model not in self._models_seen:
            self._models_seen.add(model)
            log.warning("requests name model %r; serving %r", model, self.model_name)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        max_tokens = self.default_max_tokens if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        temperature = body.get("temperature")
        if temperature is not None and (
            not isinstance(temperature, (int, float)) or temperature < 0
        ):
            raise RequestError(f"temperature must be a number >= 0, got {temperature!r}")
        n = body.get("n") or 1
        if not isinstance(n, int) or n < 1:
            raise RequestError(f"n must be a positive integer, got {n!r}")
        return max_tokens, None if temperature is None else float(temperature), n

    async def _sample(
        self, cid: str, prompts: list[list[int]], n: int, max_tokens: int, temperature
    ) -> tuple[int, list[tuple[list[int], list[float], list[int]]]]:
        """Generate ``n`` rows per prompt; returns the call index and the rows."""
        with self._lock:
            call = self._next_call.get(cid, 0)
            self._next_call[cid] = call + 1
        rows = [p for p in prompts for _ in range(n)]
        keys = [(cid, call, j) for j in range(len(rows))]
        future = self._batcher.submit(Job(rows, keys, max_tokens, temperature))
        out = await asyncio.wait_for(asyncio.wrap_future(future), self.request_timeout_s)
        return call, out

    def _record(self, records: list[CallRecord]) -> None:
        with self._lock:
            for r in records:
                self._records.setdefault(r.conversation_id, []).append(r)

    def _finish(self, ids: list[int], max_tokens: int) -> tuple[list[int], bool]:
        """The ids without the turn-ending stop token; whether the turn was cut at the cap."""
        if ids and ids[-1] in self.stop_ids:
            return ids[:-1], False
        return ids, len(ids) >= max_tokens

    def _decode(self, ids: list[int]) -> str:
        kept = [i for i in ids if i not in self._dropped]
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def _chat_tokens(self, tools) -> ChatTokens:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._chats:
            try:
                self._chats[key] = ChatTokens(self.tokenizer, tools=tools)
            except ValueError as e:
                raise RequestError(f"/v1/chat/completions: {e}") from e
        return self._chats[key]

    def _chat_prompt(self, cid: str, messages: list[dict], tools) -> list[int]:
        """The prompt ids: an earlier call's exact ids + the new messages' observation ids
        where the messages extend that call's messages and reply, else the template's."""
        chat = self._chat_tokens(tools)
        keys = [message_key(m) for m in messages]
        tkey = json.dumps(tools, sort_keys=True)
        best = None
        for r in self.calls(cid):
            if r.endpoint != "chat" or r.history is None or r.history[0] != tkey:
                continue
            k = len(r.history[1])
            # At least one new message after the reply (observation_ids needs one).
            if len(keys) > k + 1 and keys[:k] == r.history[1] and keys[k] == r.reply:
                if best is None or k > len(best.history[1]):
                    best = r
        if best is not None:
            closing = [self._turn_end_id] if best.truncated else []
            rest = [template_message(m) for m in messages[len(best.history[1]) + 1 :]]
            try:
                return best.ids + closing + list(chat.observation_ids(rest))
            except ValueError:  # a template that re-renders earlier turns: the whole render
                log.debug("conversation %s: observation ids unavailable, re-rendering", cid)
        return list(chat.prompt_ids([template_message(m) for m in messages]))

    async def chat(self, cid: str, body: dict) -> dict:
        """Answer a ``/v1/chat/completions`` body (a dict) for conversation ``cid``.

        Raises:
            RequestError: a bad request (the message says what to fix).
        """
        messages = request_messages(body)
        max_tokens, temperature, n = self._sampling(body)
        tools = body.get("tools") or None
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "auto", "none"):
            raise RequestError(f"tool_choice={tool_choice!r}: only 'auto' and 'none' are served")
        prompt = self._chat_prompt(cid, messages, tools)
        if tools and self.parser is None:
            raise RequestError(
                "the tokenizer's chat template names no tool-call format: build the endpoint "
                "with parser='hermes' or 'llama3_json' (agent.tool_parser)"
            )
        call, rows = await self._sample(cid, [prompt], n, max_tokens, temperature)
        history = (json.dumps(tools, sort_keys=True), [message_key(m) for m in messages])
        choices, records, used = [], [], 0
        for j, (ids, logprobs, versions) in enumerate(rows):
            body_ids, truncated = self._finish(ids, max_tokens)
            text = self._decode(body_ids)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = "length" if truncated else "stop"
            if self.parser is not None and tools and tool_choice != "none":
                with self._lock:
                    start = self._tool_calls.get(cid, 0)
                    parsed = parse_tool_calls(text, self.parser, start)
                    self._tool_calls[cid] = start + len(parsed.calls)
                if parsed.calls:
                    message["content"] = parsed.content or None
                    message["tool_calls"] = [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                        }
                        for c in parsed.calls
                    ]
                    finish = "tool_calls"
            choice: dict[str, Any] = {"index": j, "message": message, "finish_reason": finish}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": self._token_logprobs(ids, logprobs)}
            choices.append(choice)
            used += len(ids)
            records.append(
                CallRecord(
                    cid,
                    call,
                    j,
                    prompt,
                    ids,
                    logprobs,
                    versions,
                    finish,
                    "chat",
                    history=history,
                    reply=message_key(message),
                    truncated=truncated,
                )
            )
        self._record(records)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": used,
                "total_tokens": len(prompt) + used,
            },
        }

    def _token_logprobs(self, ids: list[int], logprobs: list[float]) -> list[dict]:
        out = []
        for i, lp in zip(ids, logprobs):
            token = self.tokenizer.decode([i], skip_special_tokens=False)
            out.append(
                {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}
            )
        return out

    def _completion_prompts(self, cid: str, prompt) -> list[tuple[list[int], str | None]]:
        """``prompt``: a text, token ids, or a list of either -> (ids, text or None) each."""
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        ):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("'prompt' is required: a string, token ids, or a list of them")
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((self._text_prompt(cid, p), p))
            elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                vocab = len(self.tokenizer)
                if not all(0 <= t < vocab for t in p):
                    raise RequestError(f"prompt token ids must lie in [0, {vocab})")
                out.append((list(p), None))
            else:
                raise RequestError(f"prompt entry {p!r}: a non-empty string or list of token ids")
        return out

    def _text_prompt(self, cid: str, text: str) -> list[int]:
        best, best_len = None, -1
        for r in self.calls(cid):
            if r.endpoint == "completions" and r.history is not None:
                done = r.history + r.reply
                if text.startswith(done) and len(done) > best_len:
                    best, best_len = r, len(done)
        if best is None:
            return list(self.tokenizer(text)["input_ids"])
        rest = text[best_len:]
        extra = self.tokenizer.encode(rest, add_special_tokens=False) if rest else []
        return best.ids + list(extra)

    async def completions(self, cid: str, body: dict) -> dict:
        """Answer a ``/v1/completions`` body for conversation ``cid``.

        Raises:
            RequestError: a bad request.
        """
        prompts = self._completion_prompts(cid, body.get("prompt"))
        max_tokens, temperature, n = self._sampling(body)
        call, rows = await self._sample(cid, [p for p, _ in prompts], n, max_tokens, temperature)
        choices, records, used = [], [], 0
        for k, (ids, logprobs, versions) in enumerate(rows):
            prompt, text_prompt = prompts[k // n]
            body_ids, truncated = self._finish(ids, max_tokens)
            text = self._decode(body_ids)
            finish = "length" if truncated else "stop"
            choice: dict[str, Any] = {"index": k, "text": text, "finish_reason": finish}
            if body.get("logprobs") is not None:
                tokens = [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": logprobs}
            choices.append(choice)
            used += len(ids)
            # A text continuation reuses these ids only when the text shows every token.
            reusable = text_prompt is not None and body_ids == ids
            records.append(
                CallRecord(
                    cid,
                    call,
                    k,
                    prompt,
                    ids,
                    logprobs,
                    versions,
                    finish,
                    "completions",
                    history=text_prompt if reusable else None,
                    reply=text,
                )
            )
        self._record(records)
        n_prompt = sum(len(p) for p, _ in prompts)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": used,
                "total_tokens": n_prompt + used,
            },
        }

    # ---- HTTP ------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="m2flow agent endpoint", docs_url=None, redoc_url=None)

        async def handle(request: Request, cid: str | None, fn) -> JSONResponse:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                return _error(400, "the request body must be a JSON object")
            if not isinstance(body, dict):
                return _error(400, "the request body must be a JSON object")
            if cid is None:
                cid = request.headers.get("x-conversation-id")
                if not cid:
                    return _error(
                        400,
                        "no conversation id: use the base URL client_for(id) gives "
                        "(/c/<conversation_id>/v1) or send an X-Conversation-Id header",
                    )
            try:
                return JSONResponse(await fn(cid, body))
            except RequestError as e:
                return _error(400, str(e))
            except TimeoutError:
                return _error(504, f"no completion within {self.request_timeout_s:g} s", "timeout")
            except Exception as e:  # the engine's failure, reported to the agent and logged
                log.exception("agent endpoint: generation failed for conversation %s", cid)
                return _error(500, f"generation failed: {type(e).__name__}: {e}", "server_error")

        @app.post("/c/{cid}/v1/chat/completions")
        async def chat_c(cid: str, request: Request):
            return await handle(request, cid, self.chat)

        @app.post("/c/{cid}/v1/completions")
        async def completions_c(cid: str, request: Request):
            return await handle(request, cid, self.completions)

        @app.post("/v1/chat/completions")
        async def chat_h(request: Request):
            return await handle(request, None, self.chat)

        @app.post("/v1/completions")
        async def completions_h(request: Request):
            return await handle(request, None, self.completions)

        def models() -> dict:
            entry = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "m2flow"}
            return {"object": "list", "data": [entry]}

        app.get("/v1/models")(models)
        app.get("/c/{cid}/v1/models")(models)
        return app


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """OpenAI's error body (the ``openai`` client raises ``BadRequestError`` with it)."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)
