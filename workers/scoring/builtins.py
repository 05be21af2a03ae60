"""Built-in reward functions, with veRL's signature ``fn(data_source, solution_str,
ground_truth, extra_info) -> float``.

- ``math``: the response's answer is the content of its last ``\\boxed{...}``, else the value
  after its last GSM8K marker ``#### ``; math-verify decides whether it equals the ground truth
  (which may itself be a GSM8K solution ending in ``#### 42``, or hold a ``\\boxed{}``).
  1.0 or 0.0; a response with neither form scores 0.0.
- ``exact``: stripped string equality of the response's answer -- the content of its last
  ``<answer>...</answer>`` (reasoning-gym's extractor), else the whole response -- with the
  ground truth (a list of ground truths: any of them). 1.0 or 0.0.
- ``reasoning_gym``: the task's own scorer on the entry in ``extra_info["entry"]``
  (reasoning-gym items carry it): partial credit in [0, 1].

``auto`` (:func:`dispatch`) picks one by ``data_source``, as veRL's ``default_compute_score``
does: ``reasoning_gym/<task>`` -> ``reasoning_gym``; the math datasets veRL names
(:data:`MATH_SOURCES`, ``aime*``, ``numina_*``) -> ``math``; anything else has no built-in.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from ..tasks import extract_answer, score_fn

#: veRL's math data sources (its ``default_compute_score``), scored by ``math``
MATH_SOURCES = frozenset(
    {
        "openai/gsm8k",
        "lighteval/MATH",
        "DigitalLearningGmbH/MATH-lighteval",
        "HuggingFaceH4/MATH-500",
        "math_dapo",
    }
)
_GSM8K = re.compile(r"####\s*\$?\s*([^\s$]+)")


class _NoTimeoutNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutNotice())


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (nested braces matched), or
    ``None``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def math_answer(text: str) -> str | None:
    """A response's final answer for ``math``: the last ``\\boxed{}``'s content, else the
    value after the last ``#### `` (commas and a trailing period removed), else ``None``."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    found = _GSM8K.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def _timeout() -> int | None:
    # math-verify times out with SIGALRM, which only the main thread may set (reward workers
    # run calls on other threads): there, no timeout.
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info=None) -> float:
    """``math`` (module docstring): 1.0 if the response's answer equals the ground truth
    under math-verify, else 0.0."""
    from math_verify import parse, verify

    pred = math_answer(solution_str)
    if pred is None:
        return 0.0
    gold = str(ground_truth)
    if "####" in gold or "\\boxed{" in gold:  # a GSM8K or MATH solution, not a bare answer
        gold = math_answer(gold) or gold
    t = _timeout()
    gold_p, pred_p = parse(f"${gold}$", parsing_timeout=t), parse(f"${pred}$", parsing_timeout=t)
    return 1.0 if gold_p and pred_p and verify(gold_p, pred_p, timeout_seconds=t) else 0.0


def exact_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info=None) -> float:
    """``exact`` (module docstring): 1.0 if the answer equals the ground truth, else 0.0."""
    answer = extract_answer(solution_str)
    golds = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    return 1.0 if any(answer == str(g).strip() for g in golds) else 0.0


def reasoning_gym_reward(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """``reasoning_gym`` (module docstring): the task's ``score_answer`` in [0, 1].

    Raises:
        ValueError: no reasoning-gym entry in ``extra_info["entry"]``.
    """
    entry = (extra_info or {}).get("entry")
    if not isinstance(entry, dict) or "source_dataset" not in entry.get("metadata", {}):
        raise ValueError(
            "the reasoning_gym reward needs the task's entry in extra_info['entry'] (items of "
            "the reasoning-gym source carry it): pick reward.function=math|exact|file.py:fn"
        )
    fn = score_fn(entry["metadata"]["source_dataset"])
    return float(fn(extract_answer(solution_str), entry))


#: the built-in reward functions by name
BUILTINS: dict[str, Callable[..., float]] = {
    "math": math_reward,
    "exact": exact_reward,
    "reasoning_gym": reasoning_gym_reward,
}


def dispatch(data_source: str) -> str | None:
    """The built-in that ``auto`` uses for ``data_source`` (module docstring), or ``None``."""
    if data_source.startswith("reasoning_gym/"):
        return "reasoning_gym"
    if data_source in MATH_SOURCES or data_source.startswith(("aime", "numina_")):
        return "math"
    return None
