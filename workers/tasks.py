"""reasoning-gym task wrapper: prompts for the model's tokenizer, scoring by the task's scorer.

Two prompt formats, chosen by the tokenizer:

- A tokenizer with a chat template (``model.tokenizer=qwen2``): the prompt is the entry's
  ``question`` as the user turn (after an optional system turn, ``system_prompt``), through
  ``apply_chat_template(..., add_generation_prompt=True)``. Any reasoning-gym task works. The
  supervised warm start's target is ``<answer>{answer}</answer>``.
- Otherwise (the character tokenizer; or no tokenizer): :func:`compact_prompt`, a short prompt
  the tiny model can read (``chain_sum``: ``"4-1="``; other tasks: the question itself, which
  a small alphabet cannot encode: refused, see below). The warm-start target is the answer.
  The character tokenizer with its chat template (``model.chat_template=true``, the agent
  workflow's) puts the compact prompt in a user turn of that template.

Scoring: the response's answer is :func:`extract_answer`'s (reasoning-gym's own extractor:
the last ``<answer>...</answer>``, as reasoning-gym's system prompts ask; without the tags the
stripped response), scored by ``dataset.score_answer(answer, entry)`` (partial credit in [0,1]).
A character tokenizer without ``<`` never emits the tags, so its responses are scored as-is.

Checks when a tokenizer is given (:class:`ConfigError`, naming the item and the fix): a prompt
or target with characters the tokenizer cannot encode (a ``<unk>`` token), and a prompt longer
than ``max_prompt_tokens`` tokens (never truncated or dropped silently; the workflows apply
``data.max_prompt_tokens`` through :mod:`m2flow.workers.data`, which can also drop them).

Train and held-out splits are the same generator with different seeds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from m2flow.core.config import ConfigError

#: ``task.system_prompt`` default: reasoning-gym's "direct" prompt (answer in <answer> tags).
DEFAULT_SYSTEM_PROMPT = "direct"


def compact_prompt(entry: dict[str, Any], name: str = "chain_sum") -> str:
    """Short prompt for an entry: for ``chain_sum`` the bare expression (``98+93-77=``)."""
    if name == "chain_sum":
        return entry["metadata"]["expression"].replace(" ", "") + "="
    # Generic fallback: the question text itself (needs a tokenizer alphabet that covers it).
    return entry["question"]


def system_prompt_text(system_prompt: str) -> str:
    """``task.system_prompt`` as text: a name of reasoning-gym's ``SYSTEM_PROMPTS``
    (``default``, ``direct``, ``simple``, ...) gives that prompt; ``""`` none (the chat
    template's own default system turn, if it has one); anything else is used verbatim."""
    from reasoning_gym.utils import SYSTEM_PROMPTS  # heavy (~2 s): imported when data is built

    return SYSTEM_PROMPTS.get(system_prompt, system_prompt)


def chat_prompt(tokenizer, question: str, system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> str:
    """``question`` as a chat prompt: ``[system?, user]`` through ``tokenizer``'s chat template
    with the assistant turn opened (``add_generation_prompt=True``); returns the text."""
    system = system_prompt_text(system_prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def extract_answer(response: str) -> str:
    """The answer in a response: the last ``<answer>...</answer>`` (reasoning-gym's
    ``extract_answer``, inner whitespace stripped), else the whole response stripped."""
    from reasoning_gym.utils import extract_answer as _rg_extract_answer  # heavy: on first use

    found = _rg_extract_answer(response, tag_name="answer")
    return response.strip() if found is None else found


@dataclass
class TaskItem:
    """One task instance: ``prompt`` is what the model sees (text; the tokenizer's encoding
    gives its ids), ``entry`` what the scorer needs, ``target`` the warm start's response."""

    prompt: str
    question: str
    answer: str
    entry: dict[str, Any]
    target: str = ""


class TaskDataset:
    """A reasoning-gym procedural dataset with prompts in the tokenizer's format.

    Args:
        name: reasoning-gym dataset name, e.g. ``"chain_sum"``, ``"leg_counting"``.
        config: generator config, e.g. ``{"min_terms": 2, "max_terms": 3, "min_digits": 1,
            "max_digits": 2}``.
        seed: generator seed; use different seeds for train and held-out splits.
        size: number of items.
        tokenizer: the model's tokenizer: with a chat template, chat prompts (module
            docstring); ``None`` or no template: compact prompts. Given, it also checks every
            prompt and target (below).
        system_prompt: chat prompts' system turn (:func:`system_prompt_text`).
        max_prompt_tokens: longest prompt in tokens (0: no limit; needs ``tokenizer``).

    Raises:
        ConfigError: a prompt or target the tokenizer cannot encode, or a prompt over
            ``max_prompt_tokens`` (the message names the item, its length and the fix).
    """

    def __init__(
        self,
        name: str = "chain_sum",
        config: dict | None = None,
        seed: int = 0,
        size: int = 1000,
        tokenizer=None,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        max_prompt_tokens: int = 0,
    ):
        self.name = name
        self.config = dict(config or {})
        self.seed = seed
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        self.chat = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
        # the character tokenizer's alphabet has no room for questions: compact ones, in its
        # chat template when it has one (model.chat_template=true)
        self.compact = getattr(tokenizer, "m2flow_char", False) or not self.chat
        import reasoning_gym  # heavy (~2 s): imported when a dataset is built

        self.dataset = reasoning_gym.create_dataset(name, seed=seed, size=size, **self.config)
        # Items are generated once: reasoning-gym regenerates on every __getitem__.
        self.items = [self._item(self.dataset[i]) for i in range(size)]
        if tokenizer is not None:
            self._check(tokenizer, max_prompt_tokens)

    def _item(self, entry: dict[str, Any]) -> TaskItem:
        answer = "" if entry["answer"] is None else str(entry["answer"])
        if self.chat and self.compact:
            messages = [{"role": "user", "content": compact_prompt(entry, self.name)}]
            prompt = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            target = answer
        elif self.chat:
            prompt = chat_prompt(self.tokenizer, entry["question"], self.system_prompt)
            target = f"<answer>{answer}</answer>"
        else:
            prompt, target = compact_prompt(entry, self.name), answer
        return TaskItem(prompt, entry["question"], entry["answer"], entry, target)

    def _check(self, tokenizer, max_prompt_tokens: int) -> None:
        where = f"task.name={self.name} (seed {self.seed})"
        prompts = tokenizer([it.prompt for it in self.items]).input_ids
        unk = tokenizer.unk_token_id
        if unk is not None:
            targets = tokenizer([it.target for it in self.items], add_special_tokens=False)
            for i, (p, t) in enumerate(zip(prompts, targets.input_ids)):
                if unk in p or unk in t:
                    it = self.items[i]
                    bad = sorted({c for c in it.prompt + it.target if c not in tokenizer.vocab})
                    raise ConfigError(
                        f"{where}: item {i} has characters the tokenizer cannot encode "
                        f"({''.join(bad)[:40]!r}; prompt {it.prompt[:60]!r}): use "
                        "model.tokenizer=qwen2 (any reasoning-gym task), or add them to "
                        "model.alphabet"
                    )
        if max_prompt_tokens > 0:
            for i, p in enumerate(prompts):
                if len(p) > max_prompt_tokens:
                    raise ConfigError(
                        f"{where}: item {i}'s prompt is {len(p)} tokens > data.max_prompt_tokens"
                        f"={max_prompt_tokens}: raise data.max_prompt_tokens (and "
                        "model.max_position_embeddings >= it + rollout.max_new_tokens), pick a "
                        "task.config with shorter questions, or set data.overlong_prompts=drop"
                    )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> TaskItem:
        return self.items[idx]

    def score(
        self, responses: Sequence[str], entries: Sequence[dict[str, Any] | TaskItem]
    ) -> list[float]:
        """Per-response reward in [0, 1] from the dataset's own ``score_answer``.

        ``responses[i]`` is the decoded response text (special tokens removed); its answer is
        :func:`extract_answer`'s; ``entries[i]`` the matching entry or :class:`TaskItem`.
        reasoning-gym gives partial credit (e.g. 0.75 if the true answer is a substring), so the
        mean reward is not the accuracy.
        """
        if len(responses) != len(entries):
            raise ValueError(f"{len(responses)} responses for {len(entries)} entries")
        out = []
        for text, e in zip(responses, entries):
            entry = e.entry if isinstance(e, TaskItem) else e
            out.append(float(self.dataset.score_answer(extract_answer(text), entry)))
        return out


@functools.cache
def score_fn(source_dataset: str):
    import reasoning_gym  # heavy (~2 s): imported when a task is scored

    return reasoning_gym.get_score_answer_fn(source_dataset)


def score(responses: Sequence[str], entries: Sequence[dict[str, Any] | TaskItem]) -> list[float]:
    """Per-response reward in [0, 1] without a dataset object at hand.

    Each entry names its generator in ``entry["metadata"]["source_dataset"]``; the score is that
    reasoning-gym dataset's own ``score_answer(response, entry)`` (see :meth:`TaskDataset.score`).
    Useful in a reward worker that only receives entries.
    """
    if len(responses) != len(entries):
        raise ValueError(f"{len(responses)} responses for {len(entries)} entries")
    out = []
    for text, e in zip(responses, entries):
        entry = e.entry if isinstance(e, TaskItem) else e
        fn = score_fn(entry["metadata"]["source_dataset"])
        out.append(float(fn(extract_answer(text), entry)))
    return out


def accuracy(scores: Sequence[float]) -> float:
    """Fraction of responses that are fully correct (score == 1.0), not the mean partial credit."""
    return sum(1 for s in scores if s == 1.0) / max(len(scores), 1)


def task_dataset(task: dict, split: str, tokenizer=None) -> TaskDataset:
    """The ``split`` (``"train"``, ``"val"`` or ``"heldout"``) of a ``task`` config section
    (:class:`~m2flow.workers.recipe.TaskConfig` fields: ``name``, ``config``,
    ``{split}_seed``, ``{split}_size``, ``system_prompt``; and ``max_prompt_tokens``, the
    resolved ``data.max_prompt_tokens``). The workflows build prompt items instead:
    :func:`m2flow.workers.data.reasoning_gym.task_split`."""
    return TaskDataset(
        task["name"],
        dict(task["config"]),
        seed=task[f"{split}_seed"],
        size=task[f"{split}_size"],
        tokenizer=tokenizer,
        system_prompt=task.get("system_prompt", DEFAULT_SYSTEM_PROMPT),
        max_prompt_tokens=task.get("max_prompt_tokens", 0),
    )
