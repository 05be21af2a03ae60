"""The model section as plain data (no torch import), so configs can embed it cheaply."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

#: ``model.dtype`` values; ``auto`` is bfloat16 on a GPU, float32 on the CPU.
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """The policy model: a local Hugging Face directory (``path``), or the shape of a tiny
    Qwen2 built with random weights (defaults: ~0.8M parameters, fast on 2 CPU cores).

    With ``path`` the shape fields are ignored (the directory's ``config.json`` is the shape);
    ``vocab_size`` and the special token ids of a built model come from the tokenizer
    (see :func:`~.model.build_model`).
    """

    # A local Hugging Face model directory (config.json, safetensors, tokenizer files), loaded
    # by transformers' Auto classes; None: a random-weight Qwen2 of the shape below.
    path: Optional[str] = None
    # Compute dtype: auto = bfloat16 on a GPU, float32 on the CPU. Trained models (actor,
    # critic) keep float32 weights and run their forward/backward under autocast to it;
    # inference-only copies (rollout, reference, reward model) hold their weights in it.
    dtype: str = "auto"
    # Recompute activations in the trained models' backward (less memory, ~1/3 more compute).
    gradient_checkpointing: bool = False
    # "sdpa" measured ~5% faster than "eager" for [256, 16] batches on 2 CPU cores.
    attn_implementation: str = "sdpa"
    hidden_size: int = 128  # the built model's shape (Qwen2 config names), without path
    intermediate_size: int = 384  # MLP width
    num_hidden_layers: int = 4  # transformer layers
    num_attention_heads: int = 4  # query heads (divides hidden_size)
    num_key_value_heads: int = 2  # key/value heads, grouped-query attention (divides the above)
    max_position_embeddings: int = 64  # longest prompt + response, in tokens
    rope_theta: float = 10000.0  # rotary position embedding base
    tie_word_embeddings: bool = True  # output layer shares the input embedding's weights
    vocab_size: Optional[int] = None  # None: the tokenizer's
    pad_token_id: Optional[int] = None  # None: the tokenizer's (its eos where it has none)
    eos_token_id: Optional[int] = None  # None: the tokenizer's
    bos_token_id: Optional[int] = None  # None: the tokenizer's


#: The fields that say how to load or run a model rather than its shape.
LOADING_FIELDS = ("path", "dtype", "gradient_checkpointing", "attn_implementation")


def read_json_object(file: str | Path, where: str) -> dict:
    """The JSON object in ``file`` (a model directory's ``config.json``, tokenizer files),
    with every way it can be wrong as one line naming the file.

    Args:
        where: what the message starts with (``"model.path=/models/x"``).

    Raises:
        ValueError: not UTF-8, not JSON (with the line and column), or JSON other than an
            object (a list, a number).
    """
    f = Path(file)
    try:
        data = json.loads(f.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where}: {f.name} is not text (byte {e.start} is not UTF-8): save it again, or "
            "replace it with the original"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{where}: {f.name} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}): "
            "save it again, or replace it with the original"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{where}: {f.name} holds a JSON {type(data).__name__}, not an object "
            '({"key": value, ...}): replace it with the original'
        )
    return data


def hf_config(path: str | Path, key: str = "model.path") -> dict:
    """``config.json`` of the model directory ``path`` as a dict.

    Args:
        key: the config key ``path`` came from (messages name it).

    Raises:
        FileNotFoundError: no such directory, or no ``config.json`` in it.
        ValueError: a ``config.json`` that is not a JSON object (:func:`read_json_object`).
    """
    d = Path(path).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"{key}={path}: no such directory")
    f = d / "config.json"
    if f.exists() and not f.is_file():  # a FIFO would block the read
        raise ValueError(f"{key}={path}: config.json is not a regular file")
    if not f.is_file():
        raise FileNotFoundError(
            f"{key}={path}: no config.json: give a Hugging Face model directory (what "
            "save_pretrained writes, or a downloaded snapshot)"
        )
    return read_json_object(f, f"{key}={path}")


def max_positions(model: dict) -> int:
    """Longest sequence the model takes, in tokens: the directory's
    ``max_position_embeddings`` with ``path`` (``max_sequence_length`` or ``n_positions`` if
    the architecture names it so), else the shape's."""
    if not model.get("path"):
        return int(model["max_position_embeddings"])
    cfg = hf_config(model["path"])
    cfg = cfg.get("text_config", cfg)
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions"):
        if cfg.get(key):
            return int(cfg[key])
    raise ValueError(f"model.path={model['path']}: config.json names no maximum length")


#: ``rollout.max_new_tokens`` unset, a model built from the shape: its answers are a few tokens
BUILT_MAX_NEW_TOKENS = 6
#: ``rollout.max_new_tokens`` unset with ``model.path`` and no ``max_new_tokens`` in its
#: generation_config.json: half the context, at most this (each step holds a KV cache and
#: logits per response token; 32k-token answers from a 64k context would not run on a CPU)
PRETRAINED_MAX_NEW_TOKENS_CAP = 1024


def default_max_new_tokens(model: dict) -> tuple[int, str]:
    """``rollout.max_new_tokens`` when the user left it unset (None), and where it came from
    (words for the console).

    A built model (no ``path``): :data:`BUILT_MAX_NEW_TOKENS`. With ``path``: the directory's
    ``generation_config.json`` ``max_new_tokens``; else half the context (``max_positions``,
    or the generation config's ``max_length`` when smaller: prompt plus response), at most
    :data:`PRETRAINED_MAX_NEW_TOKENS_CAP`. An unreadable generation config counts as none.

    Raises:
        ValueError, FileNotFoundError: as :func:`max_positions`.
    """
    if not model.get("path"):
        return BUILT_MAX_NEW_TOKENS, "the built-in model's default"
    gen_file = Path(model["path"]).expanduser() / "generation_config.json"
    try:
        gen = json.loads(gen_file.read_text())
    except (OSError, ValueError):
        gen = {}
    gen = gen if isinstance(gen, dict) else {}

    def count(key: str) -> int | None:
        v = gen.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None

    if count("max_new_tokens"):
        return count("max_new_tokens"), f"max_new_tokens of {gen_file}"
    context = min(max_positions(model), count("max_length") or 2**62)
    n = max(1, min(context // 2, PRETRAINED_MAX_NEW_TOKENS_CAP))
    capped = f", at most {PRETRAINED_MAX_NEW_TOKENS_CAP}" if n < context // 2 else ""
    return n, f"half the model's context of {context} tokens{capped}"


def resolved_max_new_tokens(model: dict, value: int | None) -> int:
    """``rollout.max_new_tokens`` as the run uses it: ``value``, or (None)
    :func:`default_max_new_tokens`'s."""
    return value if value is not None else default_max_new_tokens(model)[0]
