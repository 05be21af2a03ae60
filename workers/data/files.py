"""Your own data: prompts from JSONL, JSON or Parquet files, read with Hugging Face
``datasets`` from local files only (no hub access).

Columns follow veRL's convention; each key is configurable and may be a dotted path into
nested columns (``reward_model.ground_truth``):

- ``prompt`` (``data.prompt_key``): a string, used as the prompt text as-is and tokenized with
  the tokenizer's special tokens (the character tokenizer's ``<bos>``); or a list of chat
  messages ``[{"role", "content"}, ...]``, put through the tokenizer's chat template with the
  assistant turn opened (``add_generation_prompt=True``) and tokenized without special tokens
  (a template that writes its own BOS does not get two).
- ``reward_model.ground_truth`` (``data.answer_key``): what the reward function compares with;
  with the default key, a top-level ``answer`` column is the fallback.
- ``data_source`` (``data.data_source_key``): the reward function dispatches on it; a row
  without it gets ``""``.
- ``extra_info`` (``data.extra_info_key``): a dict, optional (``{}``).

Each file is read on its own (``datasets.load_dataset("json"|"parquet", data_files=...)``) and
the rows of a list of files are concatenated in order; a row's ``index`` counts from 0 over
them all. A JSON/JSONL file is first read as text (UTF-8, no lone surrogate:
:func:`check_json_text`). Rows are checked as they are built: a missing prompt or ground
truth, a prompt of another type, an empty prompt, message prompts without a chat template, a
prompt too long to fit in characters (before tokenizing: :func:`char_limit`), characters the
tokenizer cannot encode: each a :class:`~m2flow.core.config.ConfigError` naming the file, the row
and the fix.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from m2flow.core.config import ConfigError

from .item import PromptItem, limit_prompts

#: file suffix -> the ``datasets`` builder that reads it
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_MISSING = object()


def file_list(files: Any, key: str) -> list[str]:
    """``files`` (one path or a list of paths, as the config gives them) as absolute paths
    (relative ones are from the current directory: workers run elsewhere).

    Raises:
        ConfigError: an empty list, a missing file or an unknown suffix (names ``key``).
    """
    paths = [files] if isinstance(files, (str, os.PathLike)) else list(files or [])
    if not paths:
        raise ConfigError(f"{key} is empty: give a file or a list of files ([a.jsonl,b.jsonl])")
    out = []
    for p in paths:
        path = Path(str(p)).expanduser()
        if path.suffix.lower() not in FORMATS:
            raise ConfigError(
                f"{key}: {str(p)!r} is not a data file this reads: use "
                f"{', '.join(FORMATS)} (JSON lines, a JSON list of rows, or Parquet)"
            )
        if path.exists() and not path.is_file():  # a FIFO or a device: never read it
            raise ConfigError(f"{key}: {str(p)!r} is not a regular file: give a data file")
        if not path.is_file():
            raise ConfigError(
                f"{key}: {str(p)!r} does not exist (relative paths are from the directory "
                f"m2flow runs in, here {os.getcwd()})"
            )
        out.append(str(path.resolve()))
    return out


def get_path(row: dict, key: str) -> Any:
    """``row``'s value at a dotted ``key`` (``"reward_model.ground_truth"``); a missing
    step gives the module's ``_MISSING`` sentinel."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def read_rows(path: str, columns: Sequence[str] = ()) -> tuple[list[dict], list[str]]:
    """The rows of one local data file as dicts (``datasets``; offline), and the file's
    column names. ``columns``: the top-level columns to keep (those present; ``()``: all).
    A JSON/JSONL file is checked first (:func:`check_json_text`); one with nothing but
    whitespace has no rows (``([], [])``).

    Raises:
        ConfigError: the file does not parse, is not UTF-8 or holds a lone surrogate (names
            the file, the line where known, and the reader's error).
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    fmt = FORMATS[Path(path).suffix.lower()]
    if fmt == "json" and not check_json_text(path):
        return [], []
    datasets.config.HF_DATASETS_OFFLINE = True  # an earlier import read the environment
    datasets.disable_progress_bars()
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its error log is a 2nd line
    try:
        ds = datasets.load_dataset(fmt, data_files=[path], split="train")
        names = list(ds.column_names)
        keep = [c for c in columns if c in names]
        if columns and keep:  # (no column at all would give no rows: keep all for the errors)
            ds = ds.select_columns(keep)
        # Arrow hands out strings unchecked: invalid UTF-8 (Parquet) fails here
        return ds.to_list(), names
    except Exception as e:  # the reader's errors are many (arrow, json, schema, decoding)
        while e.__cause__ is not None:  # DatasetGenerationError wraps what went wrong
            e = e.__cause__
        why = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"{path}: cannot read it as {fmt}: {type(e).__name__}: {why}") from None
    finally:
        datasets.logging.set_verbosity(level)


#: a \\uD800-\\uDFFF escape: UTF-16 surrogates, valid in JSON only as a high-low pair
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
#: one JSON escape: \\uXXXX (group 1: the hex digits) or \\ and one character
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)")


def check_json_text(path: str) -> bool:
    """A JSON or JSONL file is UTF-8 text without lone surrogate escapes (``"\\ud800"``), which
    Arrow's reader turns into a crash when the rows are read out (``UnicodeDecodeError``), or
    drops without a word, or misreads as a missing column. Read line by line (a JSON string
    never spans lines, so neither does a surrogate pair).

    Returns:
        whether the file has any non-blank line.

    Raises:
        ConfigError: the first line with bytes that are not UTF-8 or a lone surrogate (names
            the file, the line and the fix).
    """
    text = False
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"{path} line {n}: byte 0x{raw[e.start]:02x} (column {e.start + 1}) is not "
                    "UTF-8: save the file as UTF-8"
                ) from None
            text = text or not line.isspace()
            code = _SURROGATE.search(line) and _lone_surrogate(line)
            if code:
                raise ConfigError(
                    f"{path} line {n}: a lone surrogate \\u{code:04x} (half of a UTF-16 pair, "
                    "not a character): fix the text, or drop the row"
                )
    return text


def _lone_surrogate(line: str) -> int:
    """The first surrogate escape of a JSON ``line`` that is not half of a high-low pair
    (its code), else 0."""
    high, end = 0, -1  # a high surrogate awaiting its low half, and where its escape ends
    for m in _ESCAPE.finditer(line):
        code = int(m.group(1), 16) if m.group(1) else -1
        if high:
            if 0xDC00 <= code <= 0xDFFF and m.start() == end:
                high = 0
                continue
            return high
        if 0xD800 <= code <= 0xDBFF:
            high, end = code, m.end()
        elif 0xDC00 <= code <= 0xDFFF:
            return code
    return high


def _prompt_text(prompt: Any, tokenizer, where: str) -> tuple[str, bool]:
    """``(text, is_chat)`` of a row's prompt: a string as-is, messages through the template."""
    if isinstance(prompt, str):
        return prompt, False
    is_messages = isinstance(prompt, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    )
    if not is_messages or not prompt:
        raise ConfigError(
            f"{where}: the prompt is a {type(prompt).__name__}, not a string or a list of chat "
            'messages [{"role": ..., "content": ...}]: fix the row, or point data.prompt_key '
            "at the prompt column"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{where}: the prompt is a list of chat messages, but the tokenizer has no chat "
            "template: use a tokenizer with one (model.tokenizer=qwen2), or write the "
            "prompts as plain strings"
        )
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return text, True


def load_items(
    files: Any,
    tokenizer,
    key: str = "data.train_files",
    prompt_key: str = "prompt",
    answer_key: str = "reward_model.ground_truth",
    data_source_key: str = "data_source",
    extra_info_key: str = "extra_info",
    max_prompt_tokens: int = 0,
    overlong_prompts: str = "error",
) -> tuple[list[PromptItem], int]:
    """The prompt items of ``files`` (one path or a list), tokenized once, the prompt limit
    applied (:func:`~.item.limit_prompts`).

    Args:
        files: the config's value (relative paths: from the current directory).
        tokenizer: the model's tokenizer (a chat template for message prompts).
        key: the config key the files came from (error messages name it).
        prompt_key, answer_key, data_source_key, extra_info_key: dotted paths of the columns
            (module docstring); ``answer_key="reward_model.ground_truth"`` falls back to a
            top-level ``answer``.
        max_prompt_tokens: the longest prompt in tokens (0: no limit). A prompt of more
            characters than :func:`char_limit` cannot fit and is never tokenized (a 50 MB
            prompt would take the tokenizer's memory, then the driver).
        overlong_prompts: ``"error"`` or ``"drop"`` (prompts over the limit).

    Returns:
        ``(items, dropped)``: one item per row kept, ``index`` = the row's position over
        all files (counted before drops); ``dropped``: rows over the limit (in characters
        or tokens).

    Raises:
        ConfigError: a missing file, an unreadable file, no rows, a bad row (module
            docstring), an empty prompt or one of no tokens, or (``"error"``) a prompt over
            the limit, each naming the file and the row.
    """
    paths = file_list(files, key)
    keys = (prompt_key, answer_key, data_source_key, extra_info_key, "answer")
    columns = sorted({k.split(".")[0] for k in keys})
    out: list[PromptItem] = []
    dropped, total = 0, 0
    unk = tokenizer.unk_token_id
    chars = char_limit(tokenizer, max_prompt_tokens)
    for path in paths:
        try:
            rows, names = read_rows(path, columns)
        except ConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
        if not rows:
            raise ConfigError(f"{key}: {path} has no rows")
        texts, chat, items, too_long = [], [], [], 0
        for r, row in enumerate(rows):
            where = f"{key}: {path} row {r}"
            prompt = get_path(row, prompt_key)
            if prompt is _MISSING or prompt is None:
                raise ConfigError(
                    f"{where} has no prompt at {prompt_key!r}: set data.prompt_key to the "
                    f"prompt column (the file's columns: {', '.join(names)})"
                )
            answer = get_path(row, answer_key)
            if (answer is _MISSING or answer is None) and answer_key == "reward_model.ground_truth":
                answer = get_path(row, "answer")
            if answer is _MISSING or answer is None:  # (null: Arrow's fill for a missing key)
                raise ConfigError(
                    f"{where} has no ground truth at {answer_key!r}"
                    + (" (nor an 'answer' column)" if answer_key == "reward_model.ground_truth"
                       else "")
                    + ": set data.answer_key to the answer's column (a dotted path for nested "
                    "ones)"
                )  # fmt: skip
            source = get_path(row, data_source_key)
            extra = get_path(row, extra_info_key)
            extra = {} if extra is _MISSING or extra is None else extra
            if not isinstance(extra, dict):
                raise ConfigError(
                    f"{where}: {extra_info_key!r} is a {type(extra).__name__}, not a dict: "
                    "fix the row, or set data.extra_info_key"
                )
            text, is_chat = _prompt_text(prompt, tokenizer, where)
            if not text:  # Qwen2's tokenizer makes it 0 tokens: the rollout fails on it
                raise ConfigError(f"{where}: the prompt is empty: fill it in, or drop the row")
            if chars and len(text) > chars:
                if overlong_prompts == "drop":
                    too_long += 1
                    continue
                raise ConfigError(
                    f"{where}: the prompt is {len(text):,} characters, more than "
                    f"data.max_prompt_tokens={max_prompt_tokens} tokens can hold ({chars:,}: "
                    "each token is at most the tokenizer's longest token): shorten it, or set "
                    "data.overlong_prompts=drop to leave such prompts out"
                )
            texts.append(text)
            chat.append(is_chat)
            items.append(
                PromptItem(
                    [], "" if source is _MISSING or source is None else str(source), answer,
                    extra, index=total + r, prompt=text,
                )
            )  # fmt: skip
        # One batched call per kind: chat text already holds the template's special tokens.
        for is_chat in (False, True):
            idx = [i for i, c in enumerate(chat) if c == is_chat]
            if not idx:
                continue
            ids = tokenizer([texts[i] for i in idx], add_special_tokens=not is_chat).input_ids
            for i, p in zip(idx, ids):
                items[i].prompt_ids = p
                row = items[i].index - total
                if not p:
                    raise ConfigError(
                        f"{key}: {path} row {row}'s prompt {texts[i][:60]!r} encodes to no "
                        "tokens: fix the row, or drop it"
                    )
                if unk is not None and unk in p:
                    bad = sorted({c for c in texts[i] if tokenizer.convert_tokens_to_ids(c) == unk})
                    raise ConfigError(
                        f"{key}: {path} row {row}'s prompt has characters the tokenizer cannot "
                        f"encode ({''.join(bad)[:40]!r}; prompt {texts[i][:60]!r}): add them to "
                        "model.alphabet, or use model.tokenizer=qwen2"
                    )
        kept, n = limit_prompts(
            items, max_prompt_tokens, overlong_prompts, f"{key}: {path}", first_row=total
        )
        out += kept
        dropped, total = dropped + n + too_long, total + len(rows)
    return out, dropped


def char_limit(tokenizer, max_prompt_tokens: int) -> int:
    """The most characters a prompt of ``max_prompt_tokens`` tokens can have:
    ``max_prompt_tokens`` x the tokenizer's longest token, in characters of its vocabulary
    entry (added tokens included; a byte-level entry has a character per byte, so it is never
    shorter than the text it stands for). 0 when ``max_prompt_tokens`` is 0 (no limit).

    Characters are counted before the tokenizer's normalizer: one that deletes characters
    (accent stripping) or composes several into one (NFC, Qwen2's: at most ~3 into one) could
    in theory fit a prompt over the bound; in practice the longest token (Qwen2's: 128
    characters, a run of spaces) is far longer than the tokens such text makes.
    """
    if max_prompt_tokens <= 0:
        return 0
    return max_prompt_tokens * max((len(t) for t in tokenizer.get_vocab()), default=1)
