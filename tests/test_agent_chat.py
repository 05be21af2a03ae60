"""Token-in, token-out (issue 33, item 2): an episode's ids built from the prompt, the model's
turns as sampled and each observation's own template ids equal ``apply_chat_template`` over
the whole conversation, for Qwen2 ChatML (ours and Qwen2.5's template with tools), Llama 3.1
(its template over a local tokenizer with Llama 3's special tokens) and the chat character
tokenizer; the documented differences (Llama's ``trim``, templates that re-render earlier
turns) are tested as such.

Checks that could fail: a wrong cut of the observation (a missing or doubled newline or
header), a turn-end token that is not the template's, a trajectory whose mask, logprobs or
versions are misplaced on observation tokens, a char chat tokenizer that does not round-trip
or whose eos is not ``<|end|>``.
"""

from __future__ import annotations

import json

import pytest
from m2flow.workers.agent.chat import ChatTokens, Trajectory
from m2flow.workers.llm import build_tokenizer, tokenizer_spec
from m2flow.workers.llm.tokenizer import _qwen2_backend
from tokenizers import AddedToken, Tokenizer
from transformers import PreTrainedTokenizerFast

# Qwen2.5-Instruct's chat template, written out to render the same text as the published one
# (tools in the system turn, <tool_call> blocks in assistant turns, consecutive tool results
# as <tool_response> blocks of one user turn).
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}"
    "{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n"
    "<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and"
    " arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
    "<|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    "{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3.1's chat template (JSON tool calling, tools in the first user message by default),
# written out to render the same text as the published one; builtin tools left out.
LLAMA31_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}"
    "{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}"
    "{%- endif %}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{%- if tools is not none and not tools_in_user_message %}"
    "{{- 'You have access to the following functions. To call a function, please respond with "
    "JSON for a function call.' }}"
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.' }}{{- 'Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- if tools_in_user_message and not tools is none %}"
    "{%- if messages | length != 0 %}"
    "{%- set first_user_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{{- raise_exception('Cannot put tools in the first user message when there is "
    "no first user message!') }}{%- endif %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}"
    "{{- 'Given the following functions, please respond with a JSON for a function call ' }}"
    "{{- 'with its proper arguments that best answers the given prompt.\\n\\n' }}"
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.' }}{{- 'Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in "
    "message) %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}' }}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message.content is mapping or message.content is iterable %}"
    "{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}"
    "{{- '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

LLAMA3_SPECIALS = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|eom_id|>",
)

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 2*(3+4)"}},
            "required": ["expression"],
        },
    },
}
CHAR_ALPHABET = "0123456789+-*/()=.,:;{}[]\"' abcdefghijklmnopqrstuvwxyzA?"


def hermes(expr: str) -> str:
    call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
    return f"<tool_call>\n{call}\n</tool_call>"


@pytest.fixture(scope="module")
def qwen():
    return build_tokenizer({"name": "qwen2"})


@pytest.fixture(scope="module")
def qwen25():
    """Qwen2's BPE with Qwen2.5-Instruct's template (a copy: the shared qwen2 object is
    read-only)."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_qwen2_backend().to_str()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = QWEN25_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def llama():
    """Qwen2's BPE plus Llama 3's special tokens, with Llama 3.1's template."""
    backend = Tokenizer.from_str(_qwen2_backend().to_str())
    backend.add_special_tokens([AddedToken(t, normalized=False) for t in LLAMA3_SPECIALS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    tok.chat_template = LLAMA31_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def char_chat():
    spec = tokenizer_spec({"tokenizer": "char", "alphabet": CHAR_ALPHABET, "chat_template": 1})
    return build_tokenizer(spec)


def run_episode(tok, chat: ChatTokens, opening: list[dict], turns: list[tuple[str, list]]):
    """Build a trajectory as the agent loop does: prompt ids, each model turn as sampled (here
    the tokenizer's own encoding of its text, then the turn-end token) and the observation's
    ids. Returns it and the whole conversation as messages."""
    traj = Trajectory(chat.prompt_ids(opening))
    conversation = list(opening)
    for version, (text, observation) in enumerate(turns, start=1):
        ids = tok.encode(text, add_special_tokens=False) + [chat.turn_end_id]
        traj.add_model(ids, [-0.5] * len(ids), version)
        conversation.append({"role": "assistant", "content": text})
        if observation:
            traj.add_observation(chat.observation_ids(observation))
            conversation += observation
    return traj, conversation


def full_ids(tok, chat: ChatTokens, conversation: list[dict]) -> list[int]:
    return list(tok.apply_chat_template(conversation, tools=chat.tools, return_dict=False))


def turn_tail(tok, chat: ChatTokens) -> list[int]:
    """The template's ids after a final assistant turn's end token (ChatML: ``\\n``), which
    the model never samples: the whole render has them, the trajectory does not."""
    ref = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    text = tok.apply_chat_template(ref, tools=chat.tools, tokenize=False)
    end = tok.convert_ids_to_tokens(chat.turn_end_id)
    return tok.encode(text[text.rindex(end) + len(end) :], add_special_tokens=False)


HERMES_TURNS = [
    ("I will multiply first.\n" + hermes("123*456"), [{"role": "tool", "content": "56088"}]),
    (
        hermes("56088+7") + "\n" + hermes("56088-7"),
        [{"role": "tool", "content": "56095"}, {"role": "tool", "content": "56081"}],
    ),
    ("Almost: which one do you want?", [{"role": "user", "content": "The sum, please."}]),
    ("The answer is 56095.", []),
]


@pytest.mark.parametrize("template", ["qwen2", "qwen25"])
def test_chatml_episode_ids_equal_the_whole_render(template, qwen, qwen25):
    """Three observation rounds (one tool result, two at once, a user's reply) then a final
    answer: the kept ids are the whole conversation's template ids (bar the template's
    newline after the last turn end, which is never sampled)."""
    tok = qwen if template == "qwen2" else qwen25
    chat = ChatTokens(tok, tools=[CALC] if template == "qwen25" else None)
    assert chat.turn_end_id == 151645 and chat.stop_ids == [151645]
    opening = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "A?"}]
    traj, conversation = run_episode(tok, chat, opening, HERMES_TURNS)
    tail = turn_tail(tok, chat)
    assert tok.decode(tail) == "\n"
    assert traj.ids + tail == full_ids(tok, chat, conversation)
    if template == "qwen25":  # the two results share one user turn of <tool_response> blocks
        obs = tok.decode(chat.observation_ids(HERMES_TURNS[1][1]))
        assert obs == (
            "\n<|im_start|>user\n<tool_response>\n56095\n</tool_response>\n<tool_response>\n"
            "56081\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
        assert "# Tools" in tok.decode(traj.prompt_ids)


def llama_call(expr: str) -> str:
    return f'{{"name": "calculator", "parameters": {{"expression": "{expr}"}}}}'


def test_llama31_episode_ids_equal_the_whole_render(llama):
    """Two JSON tool rounds then an answer over Llama 3.1's template: equal ids, no tail."""
    chat = ChatTokens(llama, tools=[CALC])
    vocab = llama.get_vocab()
    assert chat.turn_end_id == vocab["<|eot_id|>"]
    assert chat.stop_ids == [vocab["<|eot_id|>"], vocab["<|eom_id|>"]]
    opening = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "A?"}]
    turns = [
        (llama_call("123*456"), [{"role": "tool", "content": "56088"}]),
        (llama_call("56088+7"), [{"role": "tool", "content": "56095"}]),
        ("The answer is 56095.", []),
    ]
    traj, conversation = run_episode(llama, chat, opening, turns)
    assert turn_tail(llama, chat) == []
    assert traj.ids == full_ids(llama, chat, conversation)
    assert traj.ids[0] == vocab["<|begin_of_text|>"]
    # a string tool result is rendered as JSON (the template's "is iterable" branch)
    assert llama.decode(chat.observation_ids([{"role": "tool", "content": "7"}])) == (
        '<|start_header_id|>ipython<|end_header_id|>\n\n"7"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama31_trims_sampled_whitespace(llama):
    """The documented difference: Llama's template trims message content, so a turn sampled
    with surrounding whitespace renders without it; the kept ids have it, and the whole render
    equals the episode whose turns are the stripped texts."""
    chat = ChatTokens(llama, tools=None)
    opening = [{"role": "user", "content": "A?"}]
    turns = [(" 7 * 8 is 56.\n", [{"role": "user", "content": "And 7 * 9?"}]), ("63\n\n", [])]
    traj, conversation = run_episode(llama, chat, opening, turns)
    whole = full_ids(llama, chat, conversation)
    assert traj.ids != whole
    stripped, _ = run_episode(llama, chat, opening, [(t.strip(), o) for t, o in turns])
    assert stripped.ids == whole
    assert len(traj.ids) - len(whole) == sum(
        len(llama.encode(t, add_special_tokens=False))
        - len(llama.encode(t.strip(), add_special_tokens=False))
        for t, _ in turns
    )


def test_char_chat_episode_ids_equal_the_whole_render(char_chat):
    chat = ChatTokens(char_chat)
    end = char_chat.convert_tokens_to_ids("<|end|>")
    assert char_chat.eos_token == "<|end|>" and chat.turn_end_id == end == chat.stop_ids[0]
    opening = [{"role": "user", "content": "what is 123*456?"}]
    turns = [
        (hermes("123*456").replace("\n", ""), [{"role": "tool", "content": "56088"}]),
        (hermes("1+1").replace("\n", ""), [{"role": "tool", "content": "2"}]),
        ("56088", []),
    ]
    traj, conversation = run_episode(char_chat, chat, opening, turns)
    assert turn_tail(char_chat, chat) == []
    assert traj.ids == full_ids(char_chat, chat, conversation)
    assert char_chat.decode(chat.observation_ids([{"role": "tool", "content": "2"}])) == (
        "<|tool|>2<|end|><|assistant|>"
    )


def test_char_chat_tokenizer(char_chat):
    """Round trip, template, specials after the alphabet, markers kept by
    ``skip_special_tokens``; the plain char tokenizer is unchanged."""
    text = 'calculator {"expression": "12*(3+4)"} = 84.'
    ids = char_chat.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and char_chat.decode(ids) == text
    assert char_chat(text).input_ids[0] == char_chat.bos_token_id == 2
    n = 4 + len(CHAR_ALPHABET)
    roles = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
    assert char_chat.convert_tokens_to_ids(roles) == list(range(n, n + 5))
    assert char_chat.convert_tokens_to_ids(["<tool_call>", "</tool_call>"]) == [n + 5, n + 6]
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "1+2"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "1"}}}],
        },
    ]
    rendered = char_chat.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|system|>s<|end|><|user|>1+2<|end|><|assistant|><tool_call>"
        '{"name": "calculator", "arguments": {"expression": "1"}}</tool_call><|end|><|assistant|>'
    )
    ids = char_chat.apply_chat_template(msgs, return_dict=False)
    assert char_chat.decode(ids, skip_special_tokens=True).startswith("s1+2<tool_call>{")
    with pytest.raises(Exception, match="roles system, user, assistant, tool"):
        char_chat.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)
    plain = build_tokenizer(tokenizer_spec({"tokenizer": "char", "alphabet": CHAR_ALPHABET}))
    assert plain.eos_token == "<eos>" and len(plain) == n and not plain.chat_template
    assert plain.encode(text) == char_chat.encode(text)
    with pytest.raises(ValueError, match="no chat template"):
        ChatTokens(plain)


def test_observation_ids_refuse_a_template_that_rerenders(qwen):
    """A template that rewrites earlier assistant turns (as Qwen3's drops their reasoning)
    cannot be cut into per-turn ids: refused, named."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_qwen2_backend().to_str()), eos_token="<|im_end|>"
    )
    tok.chat_template = (
        "{% for m in messages %}{% set c = m['content'] %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}"
        "{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    chat = ChatTokens(tok)
    with pytest.raises(ValueError, match="re-renders the turns"):
        chat.observation_ids([{"role": "tool", "content": "5"}])
    with pytest.raises(ValueError, match="at least one message"):
        chat.observation_ids([])


def test_trajectory_masks_logprobs_versions():
    traj = Trajectory([5, 6])
    assert traj.masked_share == 0.0 and traj.n_model_tokens == 0
    traj.add_observation([1])  # before any model token: version 0
    traj.add_model([10, 11, 12], [-0.1, -0.2, -0.3], [3, 3, 4])
    traj.add_observation([20, 21])
    traj.add_model([13], [-0.4], 5)
    assert traj.ids == [5, 6, 1, 10, 11, 12, 20, 21, 13]
    assert traj.loss_mask == [0, 1, 1, 1, 0, 0, 1]
    assert traj.logprobs == [0.0, -0.1, -0.2, -0.3, 0.0, 0.0, -0.4]
    assert traj.versions == [0, 3, 3, 4, 4, 4, 5]
    assert traj.n_model_tokens == 4 and traj.masked_share == pytest.approx(3 / 7)
    with pytest.raises(ValueError, match="2 ids but 1 logprobs"):
        traj.add_model([1, 2], [-1.0], 1)
