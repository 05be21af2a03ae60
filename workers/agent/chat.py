"""Token-in, token-out: an episode's ids built from the model's sampled tokens and each
observation's template ids, never by re-tokenizing decoded text.

Re-applying a chat template over decoded text is not invertible (a sampled token sequence may
not be the one the tokenizer would pick for its text; veRL's agent-loop docs show such drift
breaking PPO's ratios, and TRL forks a new training row when ids drift). So an episode keeps:

- the prompt: ``apply_chat_template(opening messages, tools=, add_generation_prompt=True)``
  (:meth:`ChatTokens.prompt_ids`);
- each model turn exactly as sampled, ending with its stop token (one of
  :attr:`ChatTokens.stop_ids`);
- each observation tokenized alone with the template's turn delimiters
  (:meth:`ChatTokens.observation_ids`): render a reference conversation that ends with an
  assistant turn, then the same plus the observation messages with the generation prompt;
  the text after the assistant turn's end token (e.g. ChatML's ``\\n<|im_start|>tool\\n...
  <|im_end|>\\n<|im_start|>assistant\\n``) is encoded without special tokens added.

Against ``apply_chat_template`` over the whole conversation (assistant ``content`` = the text
decoded from the sampled tokens, without the stop token). In every case the whole render may
end with the template's text after the last turn's end token (ChatML's ``\n``), which the
model never samples; the episode's ids are the render without it:

- Qwen2 ChatML (:data:`~m2flow.workers.llm.tokenizer.QWEN2_CHAT_TEMPLATE`) and Qwen2.5's
  template with tools (``<tool_call>`` in the assistant's text, ``<tool_response>`` blocks in
  a ``user`` turn): equal, when the sampled ids are the tokenizer's own encoding of their text
  (the test samples them so; a model may sample another split of the same text, and then the
  kept ids, which are what the model saw, are the right ones).
- Llama 3 / 3.1: their templates ``trim`` each message's content. Equal when the assistant's
  text has no leading or trailing whitespace; otherwise the full render lacks the whitespace
  the model sampled (the kept ids have it), and that is the only difference (tested).
- Templates that re-render or drop earlier turns (e.g. Qwen3 drops ``<think>`` reasoning of
  turns before the last user message; some templates move the tool list) differ by design:
  the kept ids are what the model was conditioned on at each turn, so they are the ones to
  train on. :meth:`ChatTokens.observation_ids` raises when the reference render of the
  observation does not extend the render before it (such a template cannot be split into
  per-turn ids), naming the template.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: The reference conversation observation ids are cut from (its content is never seen).
#: Its assistant turn holds a reasoning block so that a template that rewrites the reasoning of
#: earlier turns shows it (the render with an observation then does not extend it).
_MARK = "@@m2flow-ref@@"
_REF = [
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "<think>r</think>" + _MARK},
]

#: Other tokens that end an assistant turn in a family, by its turn-end token (Llama 3.1 ends
#: a turn that awaits a builtin tool's result with <|eom_id|>).
_ALSO_ENDS = {"<|eot_id|>": ("<|eom_id|>",)}


class ChatTokens:
    """A tokenizer's chat template cut into per-turn ids.

    Args:
        tokenizer: a ``PreTrainedTokenizerBase`` with a chat template.
        tools: the tools' JSON schemas, handed to every render (``tools=``); ``None``: none.

    Attributes:
        tools: as given.
        turn_end_id: the token the template closes an assistant turn with (found by
            rendering one: the first token after the assistant's content).
        stop_ids: tokens that end an assistant turn when sampled (``generation.stop_token_ids``):
            ``turn_end_id``, the tokenizer's ``eos_token_id`` and the family's other turn
            ends (Llama 3.1's ``<|eom_id|>`` with ``<|eot_id|>``).

    Raises:
        ValueError: the tokenizer has no chat template, or its assistant turn ends with no
            token (names the tokenizer).
    """

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{type(tokenizer).__name__} has no chat template: an agent needs one "
                "(model.tokenizer=qwen2, model.chat_template=true for the char tokenizer, or "
                "a model.path whose tokenizer files carry one)"
            )
        self.tokenizer = tokenizer
        self.tools = tools or None
        text = self._render(_REF, add_generation_prompt=False)
        after = text[text.rindex(_MARK) + len(_MARK) :]
        ids = tokenizer.encode(after, add_special_tokens=False)
        if not ids:
            raise ValueError("the chat template ends an assistant turn with no token")
        self.turn_end_id: int = ids[0]
        self._turn_end = tokenizer.convert_ids_to_tokens(self.turn_end_id)
        stop = [self.turn_end_id, tokenizer.eos_token_id]
        vocab = tokenizer.get_vocab()
        stop += [vocab[t] for t in _ALSO_ENDS.get(self._turn_end, ()) if t in vocab]
        self.stop_ids: list[int] = list(dict.fromkeys(i for i in stop if i is not None))

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The opening messages' ids, ending with the assistant header
        (``apply_chat_template(messages, tools=, add_generation_prompt=True)``)."""
        return list(
            self.tokenizer.apply_chat_template(
                messages, tools=self.tools, add_generation_prompt=True, return_dict=False
            )
        )

    def observation_ids(self, messages: list[dict]) -> list[int]:
        """The ids that follow a model turn's end token: the rest of the template after an
        assistant turn, ``messages`` (tool results, a user's reply) and the next assistant
        header (module docstring).

        Raises:
            ValueError: ``messages`` is empty, or the template re-renders the turns before
                them (the render with them does not extend the render without them).
        """
        if not messages:
            raise ValueError("observation_ids needs at least one message")
        before = self._render(_REF, add_generation_prompt=False)
        after = self._render([*_REF, *messages], add_generation_prompt=True)
        cut = before.rindex(self._turn_end) + len(self._turn_end)
        if after[:cut] != before[:cut]:
            raise ValueError(
                "the chat template re-renders the turns before an observation (the render "
                "with it does not extend the render without it): token-in, token-out needs a "
                "template that appends turns (ChatML, Llama 3, the char chat template)"
            )
        return self.tokenizer.encode(after[cut:], add_special_tokens=False)


@dataclass
class Trajectory:
    """One episode's tokens: the prompt, then every later token (model turns and
    observations) as the response, with its loss mask and behaviour logprobs / versions.

    Attributes:
        prompt_ids: the opening messages' template ids (:meth:`ChatTokens.prompt_ids`).
        response_ids: model turns as sampled and observation ids, in order.
        loss_mask: 1 on the model's sampled tokens, 0 on observation and template tokens.
        logprobs: the behaviour policy's log-probability of each model token (nats); 0.0 on
            observation tokens.
        versions: the weight version that sampled each model token; on an observation
            token, the version of the model token before it (0 when none).
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add_model(
        self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int] | int
    ) -> None:
        """Append a model turn as sampled (its stop token included), mask 1.

        Args:
            ids: the sampled token ids.
            logprobs: one behaviour logprob per id.
            versions: one weight version per id, or one int for all.

        Raises:
            ValueError: ``logprobs`` or ``versions`` of another length than ``ids``.
        """
        ids = list(ids)
        vers = [versions] * len(ids) if isinstance(versions, int) else list(versions)
        if len(logprobs) != len(ids) or len(vers) != len(ids):
            raise ValueError(
                f"add_model: {len(ids)} ids but {len(logprobs)} logprobs and {len(vers)} "
                "versions: pass one of each per sampled token"
            )
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in vers]

    def add_observation(self, ids: Sequence[int]) -> None:
        """Append observation ids (:meth:`ChatTokens.observation_ids`): mask 0, logprob 0,
        version of the last model token (0 when none)."""
        ids = list(ids)
        last = next((v for v, m in zip(reversed(self.versions), reversed(self.loss_mask)) if m), 0)
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [last] * len(ids)

    @property
    def ids(self) -> list[int]:
        """Prompt then response ids."""
        return self.prompt_ids + self.response_ids

    @property
    def n_model_tokens(self) -> int:
        """The model's sampled tokens (loss mask 1)."""
        return sum(self.loss_mask)

    @property
    def masked_share(self) -> float:
        """Share of response tokens with loss mask 0 (observations, template); 0.0 when the
        response is empty."""
        n = len(self.response_ids)
        return (n - self.n_model_tokens) / n if n else 0.0
