"""A user's Hugging Face model directory, checked before anything loads it (in the driver,
before Ray starts; no tensor is read): what transformers would otherwise fail on deep inside
a worker, or not fail on at all (a config of a million layers grows a worker for minutes; a
config that disagrees with the weights loads randomly initialised layers).

:func:`check_model_directory` runs every check, each problem one line naming the file:

- ``config.json`` is a JSON object, needs no custom code, is a causal LM transformers ships;
- its sizes are integers in ``[1, bound]`` (:data:`SIZES`; the bounds are 8-400x the largest
  published models', so no real model is refused and no absurd one starts);
- the weights are regular files (never a FIFO or ``/dev/zero``, which a reader would wait on
  or read forever) and complete safetensors files: their headers, read by
  ``safetensors.safe_open`` (bounded header, offsets checked against the file's size; the
  tensors stay on disk), give every tensor's shape;
- those shapes agree with the config: the embedding is ``[vocab_size, hidden_size]``, the
  layers ``0 .. num_hidden_layers - 1`` are present, an untied LM head exists and has the
  embedding's shape.

Pickle weights (``*.bin`` only) are not opened here (their shapes would need unpickling).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from .config import hf_config, read_json_object

#: size -> (the names architectures give it in config.json, largest accepted, largest in a
#: published model). The largest are Llama 3.1 405B's (126 layers, hidden 16,384, MLP 53,248,
#: 128 heads), Gemma 3's vocabulary (262,208), a 256-wide head (Gemma) and Llama 4 Scout's 10M
#: positions: bounds far above them refuse only what no model has.
SIZES: dict[str, tuple[tuple[str, ...], int, str]] = {
    "num_hidden_layers": (("num_hidden_layers", "n_layer", "num_layers", "n_layers"), 1024, "126"),
    "hidden_size": (("hidden_size", "n_embd", "d_model"), 65536, "16,384"),
    "intermediate_size": (("intermediate_size", "n_inner", "ffn_dim"), 2**20, "53,248"),
    "num_attention_heads": (("num_attention_heads", "n_head", "num_heads"), 4096, "128"),
    "num_key_value_heads": (("num_key_value_heads", "num_kv_heads", "n_head_kv"), 4096, "128"),
    "head_dim": (("head_dim",), 4096, "256"),
    "vocab_size": (("vocab_size",), 2**22, "262,208"),
    "max_position_embeddings": (
        ("max_position_embeddings", "n_positions", "max_sequence_length"),
        2**24,
        "10,485,760",
    ),
}

#: weight names of the input embedding across architectures (Llama/Qwen/Mistral, GPT-2,
#: BLOOM/Falcon, GPT-NeoX, Mistral's consolidated files)
EMBEDDINGS = (
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "embed_in.weight",
    "tok_embeddings.weight",
)
#: ``<prefix>.<index>.`` of a transformer layer's weights (``model.layers.3.mlp...``,
#: ``transformer.h.3...``); the earliest such component of a name is its layer
_LAYER = re.compile(r"^((?:[^.]+\.)*?(?:layers|layer|h|blocks|block))\.(\d+)\.")

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def check_model_directory(path: str, key: str = "model.path") -> None:
    """Everything about the model directory ``path`` that loading it would otherwise fail on
    after Ray starts (or never), as one-line errors (module docstring).

    Args:
        key: the config key ``path`` came from (``model.path``, ``reward_model.path``);
            messages start with ``key=path``.

    Raises:
        FileNotFoundError: no directory, ``config.json`` or weight files.
        ValueError: an unreadable config, custom code (``auto_map``), not a causal LM, a size
            out of bounds, a damaged or irregular weight file, or weights of another shape.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = read_config(path, key)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"{key}={path}: model_type {config.model_type!r} is not a causal LM "
            "transformers loads (AutoModelForCausalLM)"
        )
    check_weights(path, config, key)


def read_config(path: str, key: str = "model.path") -> Any:
    """The directory's ``config.json`` as transformers reads it (``AutoConfig``), after the
    checks that need no transformers: a JSON object, no custom code, sizes in bounds.

    Raises:
        FileNotFoundError: no directory or ``config.json``.
        ValueError: the first problem (names the file, the key and the fix).
    """
    from transformers import AutoConfig

    raw = hf_config(path, key)  # FileNotFoundError names the fix
    where = f"{key}={Path(path).expanduser()}"
    if raw.get("auto_map"):
        raise ValueError(
            f"{where}: the model needs custom code (auto_map in config.json); "
            "m2flow does not run remote code: use an architecture transformers ships"
        )
    check_sizes(raw, where)
    try:
        return AutoConfig.from_pretrained(Path(path).expanduser(), local_files_only=True)
    except Exception as e:  # noqa: BLE001 (transformers' config errors are many: one line)
        why = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(
            f"{where}: transformers cannot read its config.json ({type(e).__name__}: "
            f"{why[:300]}): fix config.json, or save the model again"
        ) from None


def check_sizes(raw: dict, where: str) -> None:
    """Every size of :data:`SIZES` that ``config.json`` (``raw``, and its ``text_config``)
    gives is an integer (or a list of them, per layer) in ``[1, bound]``; absent or null
    sizes are left to the architecture's defaults.

    Raises:
        ValueError: the first size that is not (names it, its value and the bound).
    """
    sections = [raw] + [raw[k] for k in ("text_config",) if isinstance(raw.get(k), dict)]
    for section in sections:
        for names, bound, largest in SIZES.values():
            for name in names:
                value = section.get(name)
                if value is None:
                    continue
                values = value if isinstance(value, list) and value else [value]
                if not all(
                    isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= bound
                    for v in values
                ):
                    raise ValueError(
                        f"{where}: config.json says {name}={_short(value)}: a size must be an "
                        f"integer in [1, {bound}] (the largest published models have "
                        f"{largest}): fix config.json, or save the model again"
                    )


def weight_files(path: str, key: str = "model.path") -> list[Path] | None:
    """The safetensors files transformers would load from ``path``: the shards of
    ``model.safetensors.index.json``, else ``model.safetensors``; ``None`` when the directory
    has pickle weights only (``*.bin``; not opened here).

    Raises:
        FileNotFoundError: no weights, or a shard the index names is missing.
        ValueError: an index that is not a JSON object with a ``weight_map``.
    """
    d = Path(path).expanduser()
    where = f"{key}={d}"
    index = d / "model.safetensors.index.json"
    if os.path.lexists(index):
        _regular(index, where)
        weight_map = read_json_object(index, where).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ValueError(
                f"{where}: {index.name} has no weight_map of tensor name -> file: replace it "
                "with the original"
            )
        files = [d / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not os.path.lexists(f)]
        if missing:
            raise FileNotFoundError(
                f"{where}: {index.name} names {len(missing)} missing weight file(s) "
                f"({', '.join(missing[:3])}): download or save the model again"
            )
        return files
    if os.path.lexists(d / "model.safetensors"):
        return [d / "model.safetensors"]
    if any(p.suffix == ".bin" for p in d.iterdir()):
        return None
    raise FileNotFoundError(
        f"{where}: no weights (model.safetensors): save the model there with save_pretrained"
    )


def weight_shapes(files: list[Path], where: str) -> dict[str, list[int]]:
    """Tensor name -> shape over the safetensors ``files``, from their headers only.

    Raises:
        ValueError: a file that is not a regular file, or not a complete safetensors file
            (truncated, a header length or offsets beyond the file, not safetensors).
    """
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for f in files:
        _regular(f, where)
        try:
            with safe_open(str(f), framework="numpy") as h:
                shapes.update({k: list(h.get_slice(k).get_shape()) for k in h.keys()})
        except Exception as e:  # noqa: BLE001 (SafetensorError, OSError: the same advice)
            raise ValueError(
                f"{where}: {f.name} is not a complete safetensors file ({e}): download or "
                "save the model again"
            ) from None
    return shapes


def check_weights(path: str, config: Any, key: str = "model.path", causal_lm: bool = True) -> None:
    """The weight files of ``path`` are complete safetensors files whose shapes agree with
    ``config`` (a transformers config; its text config for a multimodal one).

    Args:
        causal_lm: the weights are a causal LM's, so an untied one has ``lm_head.weight``
            (``False`` for a sequence classifier, whose head is ``score``).

    Raises:
        FileNotFoundError: no weights (:func:`weight_files`).
        ValueError: a damaged weight file, or a shape that disagrees (names the tensor, its
            shape and the config's sizes).
    """
    files = weight_files(path, key)
    if files is None:
        return
    where = f"{key}={Path(path).expanduser()}"
    shapes = weight_shapes(files, where)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab, hidden = getattr(text, "vocab_size", None), getattr(text, "hidden_size", None)
    # an embedding narrower than the model (ALBERT's embedding_size, OPT's projection)
    dims = {hidden, *(getattr(text, k, None) for k in ("embedding_size", "word_embed_proj_dim"))}
    embeddings = {n: s for n, s in shapes.items() if n.endswith(EMBEDDINGS) and len(s) == 2}
    if embeddings and vocab is not None and hidden is not None:
        if not any(s[0] == vocab and s[1] in dims for s in embeddings.values()):
            name, shape = next(iter(embeddings.items()))
            raise ValueError(
                f"{where}: config.json says vocab_size={vocab}, hidden_size={hidden}, but the "
                f"weights' {name} is {shape}: the config is another model's; use the config "
                "the weights were saved with"
            )
    _check_layers(shapes, text, where)
    tied = getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", True))
    heads = {n: s for n, s in shapes.items() if n.endswith("lm_head.weight")}
    llama_like = any(n.endswith("embed_tokens.weight") for n in shapes)
    if causal_lm and not tied and not heads and llama_like:
        raise ValueError(
            f"{where}: config.json says tie_word_embeddings=false, but the weights have no "
            "lm_head.weight (it would start random): use the config the weights were saved "
            "with"
        )
    for name, shape in heads.items():
        if vocab is not None and shape[:1] != [vocab]:
            raise ValueError(
                f"{where}: config.json says vocab_size={vocab}, but the weights' {name} is "
                f"{shape}: use the config the weights were saved with"
            )


def _check_layers(shapes: dict[str, list[int]], text: Any, where: str) -> None:
    """The layers ``0 .. num_hidden_layers - 1`` (plus a DeepSeek multi-token-prediction
    layer, ``num_nextn_predict_layers``) are those of one layer stack of the weights."""
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return
    stacks: dict[str, set[int]] = {}
    for name in shapes:
        m = _LAYER.match(name)
        if m:
            stacks.setdefault(m.group(1), set()).add(int(m.group(2)))
    if not stacks:  # a naming this does not know: transformers will say
        return
    extra = getattr(text, "num_nextn_predict_layers", 0) or 0
    wanted = (set(range(layers)), set(range(layers + int(extra))))
    if any(found in wanted for found in stacks.values()):
        return
    prefix, found = max(stacks.items(), key=lambda kv: len(kv[1]))
    raise ValueError(
        f"{where}: config.json says num_hidden_layers={layers}, but the weights hold "
        f"{len(found)} layers ({prefix}.{min(found)} .. {prefix}.{max(found)}): the config is "
        "another model's; use the config the weights were saved with"
    )


def _regular(f: Path, where: str) -> None:
    """``f`` (after symlinks) is a regular file: a FIFO, a device or a socket is never
    opened (a reader would wait on it, or read ``/dev/zero`` forever)."""
    try:
        mode = os.stat(f).st_mode
    except OSError as e:
        raise FileNotFoundError(f"{where}: {f.name}: {e.strerror} (a broken link?)") from None
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise ValueError(
            f"{where}: {f.name} is {kind}, not a file of weights: put the model's "
            "safetensors file there"
        )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
