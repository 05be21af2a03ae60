"""The OpenAI-compatible agent endpoint (workers/agent/openai_server.py), called with the real
``openai`` client over HTTP: a tiny random Qwen2 with Qwen2's tokenizer behind it
(:func:`m2flow.workers.llm.generation.generate`), or a scripted ``generate`` where the test
needs a given output (tool-call parsing, batching)."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import torch
from m2flow.workers.agent.openai_server import AgentEndpoint
from m2flow.workers.llm import build_tokenizer
from m2flow.workers.llm.config import ModelConfig
from m2flow.workers.llm.generation import generate
from m2flow.workers.llm.model import build_model

from tests.helpers import wait_until

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer({"name": "qwen2"})


@pytest.fixture(scope="module")
def model(tok):
    return build_model(ModelConfig(**TINY), tok, seed=0)


class EngineGenerate:
    """The rollout engine's sampler as a ``generate`` callable; keeps every row it sampled."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok
        self.sampled: list[tuple[list[int], list[int], list[float]]] = []  # prompt, ids, logprobs
        self.lock = threading.Lock()  # a rollout worker's device lock

    def __call__(self, prompts, max_tokens, temperature, keys):
        with self.lock:
            out = generate(
                self.model, self.tok, prompts, max_new_tokens=max_tokens,
                temperature=1.0 if temperature is None else temperature,
                greedy=temperature == 0,
            )  # fmt: skip
        rows = []
        for i, prompt in enumerate(prompts):
            m = out["response_mask"][i].bool()
            ids, lps = out["response_ids"][i][m].tolist(), out["logprobs"][i][m].tolist()
            self.sampled.append((list(prompt), ids, lps))
            rows.append((ids, lps, out["versions"][i][m].tolist()))
        return rows


@pytest.fixture
def engine(model, tok):
    gen = EngineGenerate(model, tok)
    endpoint = AgentEndpoint(tok, gen)
    endpoint.start()
    yield endpoint, gen
    endpoint.stop()


def client(endpoint, cid):
    return openai.OpenAI(base_url=endpoint.client_for(cid), api_key="none", max_retries=0)


def template_ids(tok, messages, **kw):
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, **kw)["input_ids"])


def test_chat_completion_records_what_the_model_sampled(engine, tok, model):
    endpoint, gen = engine
    messages = [{"role": "user", "content": "What is 2+3?"}]
    reply = client(endpoint, "ep0").chat.completions.create(
        model="Qwen/Qwen2.5-7B-Instruct", messages=messages, max_tokens=6, temperature=1.0
    )
    (record,) = endpoint.calls("ep0")
    (prompt, sampled, lps) = gen.sampled[-1]
    assert prompt == template_ids(tok, messages) == record.prompt_ids
    assert record.completion_ids == sampled and record.logprobs == lps
    assert record.versions == [0] * len(sampled) and record.conversation_id == "ep0"
    body = sampled[:-1] if sampled[-1] == tok.eos_token_id else sampled
    assert reply.choices[0].message.content == tok.decode(body, skip_special_tokens=True)
    assert reply.choices[0].finish_reason == ("length" if body == sampled else "stop")
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(
        sampled
    )
    # The recorded logprobs are the model's at T=1 over the recorded tokens.
    ids = torch.tensor([record.ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    again = torch.log_softmax(logits.float(), -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
    torch.testing.assert_close(again, torch.tensor(lps), atol=1e-4, rtol=0)
    trajs, splits = endpoint.pop("ep0")
    assert splits == 0 and len(trajs) == 1
    assert trajs[0].prompt_ids == prompt and trajs[0].response_ids == sampled
    assert trajs[0].loss_mask == [1] * len(sampled) and endpoint.calls("ep0") == []


def test_tool_turn_merges_into_one_trajectory(engine, tok):
    endpoint, gen = engine
    c = client(endpoint, "ep1")
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    first = c.chat.completions.create(model="m2flow", messages=messages, max_tokens=5)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": "5"})
    c.chat.completions.create(model="m2flow", messages=messages, max_tokens=4)
    r1, r2 = endpoint.calls("ep1")
    trajs, splits = endpoint.trajectories("ep1")
    assert splits == 0 and len(trajs) == 1
    (t,) = trajs
    # The second prompt holds the first call's tokens as sampled, then the tool turn.
    closing = [] if r1.completion_ids[-1] == tok.eos_token_id else [tok.eos_token_id]
    observation = closing + tok.encode(
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert r2.prompt_ids == r1.ids + observation
    assert t.prompt_ids == r1.prompt_ids
    assert t.response_ids == r1.completion_ids + observation + r2.completion_ids
    n1, n2 = len(r1.completion_ids), len(r2.completion_ids)
    assert t.loss_mask == [1] * n1 + [0] * len(observation) + [1] * n2
    assert t.logprobs == r1.logprobs + [0.0] * len(observation) + r2.logprobs
    assert gen.sampled[-1][0] == r2.prompt_ids  # what the model was given


def test_rewritten_history_is_split_and_counted(engine, tok):
    endpoint, _ = engine
    c = client(endpoint, "ep2")
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    c.chat.completions.create(model="m2flow", messages=messages, max_tokens=4)
    # The agent summarises instead of appending the model's turn.
    rewritten = messages + [
        {"role": "assistant", "content": "(summary of earlier work)"},
        {"role": "user", "content": "Go on."},
    ]
    c.chat.completions.create(model="m2flow", messages=rewritten, max_tokens=4)
    r1, r2 = endpoint.calls("ep2")
    assert r2.prompt_ids == template_ids(tok, rewritten)
    trajs, splits = endpoint.trajectories("ep2")
    assert splits == 1 and len(trajs) == 2
    assert [t.prompt_ids for t in trajs] == [r1.prompt_ids, r2.prompt_ids]
    assert [t.response_ids for t in trajs] == [r1.completion_ids, r2.completion_ids]
    assert all(set(t.loss_mask) == {1} for t in trajs)


def test_completions_endpoint_and_continuation(engine, tok):
    endpoint, gen = engine
    c = client(endpoint, "ep3")
    first = c.completions.create(model="any", prompt="Once upon", max_tokens=5, temperature=0)
    r1 = endpoint.calls("ep3")[0]
    assert r1.prompt_ids == tok("Once upon")["input_ids"]
    assert r1.completion_ids == gen.sampled[-1][1] and len(r1.completion_ids) <= 5
    body = r1.completion_ids
    if body[-1] == tok.eos_token_id:
        body = body[:-1]
    assert first.choices[0].text == tok.decode(body, skip_special_tokens=True)
    # A text continuation reuses the sampled ids (no re-tokenisation of the model's text).
    text = "Once upon" + first.choices[0].text + " a time"
    c.completions.create(model="any", prompt=text, max_tokens=3)
    r2 = endpoint.calls("ep3")[1]
    assert first.choices[0].finish_reason == "length"  # this model and prompt, greedy
    rest = tok.encode(" a time", add_special_tokens=False)
    assert r2.prompt_ids == r1.ids + rest
    trajs, splits = endpoint.trajectories("ep3")
    assert splits == 0 and len(trajs) == 1
    n1, n2 = len(r1.completion_ids), len(r2.completion_ids)
    assert trajs[0].loss_mask == [1] * n1 + [0] * len(rest) + [1] * n2
    # Token-id prompts, several at once, n choices each.
    ids = tok.encode("Hello", add_special_tokens=False)
    many = c.completions.create(model="any", prompt=[ids, ids + ids], max_tokens=2, n=2)
    assert [ch.index for ch in many.choices] == [0, 1, 2, 3]
    last = endpoint.calls("ep3")[-4:]
    assert [r.prompt_ids for r in last] == [ids, ids, ids + ids, ids + ids]
    assert many.usage.prompt_tokens == 3 * len(ids)
    # The plain route, with the conversation in a header.
    r = httpx.post(
        f"{endpoint.base_url}/v1/completions",
        json={"prompt": ids, "max_tokens": 2},
        headers={"X-Conversation-Id": "hdr"},
        timeout=60,
    )
    assert r.status_code == 200 and endpoint.calls("hdr")[0].prompt_ids == ids


def test_bad_requests_get_a_400_that_says_why(engine):
    endpoint, _ = engine
    c = client(endpoint, "bad")
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="stream=true is not supported"):
        c.chat.completions.create(model="m", messages=user, stream=True)
    with pytest.raises(openai.BadRequestError, match="'messages' is required"):
        c.chat.completions.create(model="m", messages=[])
    with pytest.raises(openai.BadRequestError, match="top_p is fixed"):
        c.chat.completions.create(model="m", messages=user, top_p=0.5)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be a positive integer"):
        c.chat.completions.create(model="m", messages=user, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="'prompt' is required"):
        c.completions.create(model="m", prompt=[])
    with pytest.raises(openai.BadRequestError, match="tool_choice="):
        c.chat.completions.create(model="m", messages=user, tool_choice="required", tools=TOOLS)
    base = endpoint.client_for("bad")
    r = httpx.post(f"{base}/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.post(f"{endpoint.base_url}/v1/chat/completions", json={"messages": user}, timeout=30)
    assert r.status_code == 400 and "/c/<conversation_id>/v1" in r.json()["error"]["message"]
    assert endpoint.calls("bad") == []  # nothing was generated or recorded


@pytest.mark.parametrize("chat", [True, False])
def test_char_tokenizer_with_and_without_a_chat_template(chat):
    tok = build_tokenizer({"name": "char", "chat": chat})
    gen = EngineGenerate(build_model(ModelConfig(**TINY), tok, seed=1), tok)
    endpoint = AgentEndpoint(tok, gen)
    endpoint.start()
    try:
        c = client(endpoint, "char")
        done = c.completions.create(model="m", prompt="12+3=", max_tokens=4)
        assert endpoint.calls("char")[0].completion_ids == gen.sampled[-1][1]
        assert done.choices[0].text == tok.decode(gen.sampled[-1][1], skip_special_tokens=True)
        messages = [{"role": "user", "content": "2+3="}]
        if not chat:
            with pytest.raises(openai.BadRequestError, match="has no chat template"):
                c.chat.completions.create(model="m", messages=messages)
            return
        assert endpoint.parser == "hermes"
        first = c.chat.completions.create(model="m", messages=messages, max_tokens=6, tools=TOOLS)
        messages += [first.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "tool", "tool_call_id": "call_0", "content": "5"}]
        c.chat.completions.create(model="m", messages=messages, max_tokens=3)
        _, r1, r2 = endpoint.calls("char")
        end = tok.convert_tokens_to_ids("<|end|>")
        closing = [] if r1.completion_ids[-1] == end else [end]
        observation = closing + tok.encode(
            "<|tool|>5<|end|><|assistant|>", add_special_tokens=False
        )
        assert r2.prompt_ids == r1.ids + observation
        trajs, splits = endpoint.trajectories("char")
        assert splits == 1  # the completions call, then a chat that does not extend it
        assert trajs[-1].loss_mask == [1] * len(r1.completion_ids) + [0] * len(observation) + [
            1
        ] * len(r2.completion_ids)
    finally:
        endpoint.stop()


class Scripted:
    """A ``generate`` that answers each call with the next scripted ids (logprob -0.5 each,
    version 3), and records the rows and keys of every call."""

    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.calls: list[tuple[list[list[int]], int, list]] = []
        self.hold, self.entered = threading.Event(), threading.Event()
        self.hold.set()

    def __call__(self, prompts, max_tokens, temperature, keys):
        self.entered.set()
        assert self.hold.wait(60)
        self.calls.append((prompts, max_tokens, keys))
        out = []
        for _ in prompts:
            ids = self.outputs.pop(0) if self.outputs else [7]
            out.append((ids, [-0.5] * len(ids), [3] * len(ids)))
        return out


def test_tool_calls_parsed_and_the_next_turn_merges(tok):
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    eos = tok.eos_token_id
    answer = tok.encode("The sum is 5.", add_special_tokens=False) + [eos]
    script = Scripted([tok.encode(call_text, add_special_tokens=False) + [eos], answer])
    endpoint = AgentEndpoint(tok, script, parser="hermes")
    endpoint.start()
    try:
        c = client(endpoint, "tools")
        messages = [{"role": "user", "content": "Add 2 and 3."}]
        first = c.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {
            "a": 2,
            "b": 3,
        }
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
        second = c.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        assert second.choices[0].finish_reason == "stop"
        assert second.choices[0].message.content == "The sum is 5."
        assert second.choices[0].message.tool_calls is None
        r1, r2 = endpoint.calls("tools")
        observation = tok.encode(
            "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )
        assert r2.prompt_ids == r1.ids + observation
        (t,), splits = endpoint.pop("tools")
        assert splits == 0 and t.response_ids == r1.completion_ids + observation + answer
        assert t.versions == [3] * (len(r1.completion_ids) + len(observation) + len(answer))
        assert [k for _, _, k in script.calls] == [[("tools", 0, 0)], [("tools", 1, 0)]]
    finally:
        endpoint.stop()


def test_sampled_tokens_kept_where_the_text_would_tokenise_otherwise(tok):
    """The model may sample a tokenisation the tokenizer would not produce ("h","e","l","l","o"
    for "hello"): the next call's prompt keeps the sampled ids, so the calls still merge."""
    eos = tok.eos_token_id
    chars = [tok.convert_tokens_to_ids(ch) for ch in "hello"]
    assert chars != tok.encode("hello", add_special_tokens=False)
    endpoint = AgentEndpoint(tok, Scripted([chars + [eos], [9, eos]]))
    endpoint.start()
    try:
        c = client(endpoint, "bpe")
        messages = [{"role": "user", "content": "Say hello."}]
        reply = c.chat.completions.create(model="m", messages=messages)
        assert reply.choices[0].message.content == "hello"
        messages += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "ok"}]
        c.chat.completions.create(model="m", messages=messages)
        r1, r2 = endpoint.calls("bpe")
        assert r2.prompt_ids[: len(r1.ids)] == r1.ids
        assert r2.prompt_ids != template_ids(tok, messages)  # the template re-tokenises
        (t,), splits = endpoint.trajectories("bpe")
        assert splits == 0 and t.response_ids[:6] == chars + [eos]
    finally:
        endpoint.stop()


def test_engine_failure_and_timeout_are_reported_and_serving_goes_on(tok):
    def failing(prompts, max_tokens, temperature, keys):
        raise RuntimeError("the engine is gone")

    script = Scripted([[5, tok.eos_token_id]])
    for gen, status, match in [
        (
            failing,
            openai.InternalServerError,
            "generation failed: RuntimeError: the engine is gone",
        ),
        (script, openai.APIStatusError, "no completion within"),
    ]:
        endpoint = AgentEndpoint(tok, gen, request_timeout_s=0.2)
        endpoint.start()
        try:
            script.hold.clear()  # the scripted engine hangs until released
            c = client(endpoint, "x")
            with pytest.raises(status, match=match) as err:
                c.completions.create(model="m", prompt=[5, 6])
            if gen is script:
                assert err.value.status_code == 504
                script.hold.set()
                endpoint.request_timeout_s = 60
                done = c.completions.create(model="m", prompt=[5, 6])
                assert done.choices[0].finish_reason == "stop"
                assert [r.call for r in endpoint.calls("x")] == [1]  # the timed-out call: none
            else:
                assert endpoint.calls("x") == []
        finally:
            script.hold.set()
            endpoint.stop()


def test_n_choices_are_trajectories_of_their_own(tok):
    eos = tok.eos_token_id
    a, b = tok.encode("yes", add_special_tokens=False), tok.encode("no", add_special_tokens=False)
    script = Scripted([a + [eos], b + [eos], [5, eos]])
    endpoint = AgentEndpoint(tok, script)
    endpoint.start()
    try:
        c = client(endpoint, "n2")
        messages = [{"role": "user", "content": "?"}]
        reply = c.chat.completions.create(model="m", messages=messages, n=2)
        assert [ch.message.content for ch in reply.choices] == ["yes", "no"]
        # The agent continues from the second choice.
        messages += [reply.choices[1].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "sure?"}]
        c.chat.completions.create(model="m", messages=messages)
        trajs, splits = endpoint.trajectories("n2")
        assert splits == 0 and len(trajs) == 2
        assert trajs[0].response_ids == a + [eos]
        assert trajs[1].response_ids[: len(b) + 1] == b + [eos]
        assert trajs[1].loss_mask[-2:] == [1, 1] and 0 in trajs[1].loss_mask
    finally:
        endpoint.stop()


def test_requests_that_arrive_together_share_a_generate_call(tok):
    script = Scripted([])
    endpoint = AgentEndpoint(tok, script, batch_window_s=0.0)
    endpoint.start()
    results = {}

    def agent(i, max_tokens):
        c = client(endpoint, f"b{i}")
        results[i] = c.completions.create(model="m", prompt=[100 + i], max_tokens=max_tokens)

    try:
        script.hold.clear()  # the first request holds the engine; the others queue up
        threads = [threading.Thread(target=agent, args=(0, 4))]
        threads[0].start()
        wait_until(script.entered.is_set, what="the first request in generate")
        for i, mt in [(1, 4), (2, 4), (3, 2)]:
            threads.append(threading.Thread(target=agent, args=(i, mt)))
            threads[-1].start()
        wait_until(lambda: endpoint._batcher.jobs.qsize() == 3, what="three requests queued")
        script.hold.set()
        for t in threads:
            t.join(60)
        assert sorted(results) == [0, 1, 2, 3]
        batches = sorted((mt, sorted(p[0] for p in prompts)) for prompts, mt, _ in script.calls)
        assert batches == [(2, [103]), (4, [100]), (4, [101, 102])]
        for i in range(4):
            assert endpoint.calls(f"b{i}")[0].prompt_ids == [100 + i]
    finally:
        script.hold.set()
        endpoint.stop()
