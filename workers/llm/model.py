"""The policy's causal LM: loaded from a local Hugging Face directory (``model.path``), or a tiny
Qwen2 built from a config with random weights (CPU smoke runs; no model hub either way).

:func:`load_model` is the one loading path every role uses (actor, reference, rollout, critic
trunk, spot instances), so a model transformers loads works in all of them. Checkpoints are
plain Hugging Face directories (``config.json``, ``model.safetensors``, tokenizer files), so
``AutoModelForCausalLM.from_pretrained`` and vLLM read them as well.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict
from dataclasses import fields as dataclass_fields
from pathlib import Path

import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from ..checkpoint import unpickling_refused
from .config import DTYPES, LOADING_FIELDS, ModelConfig
from .model_dir import check_model_directory

# transformers >= 5.2x renames the forward's past_key_values to cache, warning on every call
# (once per step per worker in a run's log); the old name is what 5.17-5.19 (vLLM, the GPU
# image) accept, so it stays, quietly.
warnings.filterwarnings(
    "ignore", message=r"`past_key_values` is deprecated", category=FutureWarning
)


def quiet_loading() -> None:
    """Turn off transformers' progress bars in this process (``from_pretrained``'s "Loading
    weights", one per worker process, would land between the run's console lines; the run
    shows its own phases). Called where a model is loaded from a directory."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_config(cfg: ModelConfig | dict) -> ModelConfig:
    """``cfg`` as a :class:`ModelConfig` (a dict may carry other keys of the model section,
    e.g. the tokenizer's: they are dropped)."""
    if isinstance(cfg, ModelConfig):
        return cfg
    names = {f.name for f in dataclass_fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in cfg.items() if k in names})


def compute_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """``model.dtype`` on ``device``: ``auto`` is bfloat16 on CUDA, float32 elsewhere.

    Raises:
        ValueError: a name outside :data:`~.config.DTYPES`.
    """
    if name not in DTYPES:
        raise ValueError(f"model.dtype={name!r}: pick one of {', '.join(DTYPES)}")
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return _TORCH_DTYPES[name]


def load_model(
    cfg: ModelConfig | dict,
    tokenizer: PreTrainedTokenizerBase | None,
    device: torch.device | str = "cpu",
    *,
    trainable: bool = False,
    seed: int | None = None,
) -> PreTrainedModel:
    """The policy's causal LM for one role, on ``device``.

    With ``cfg.path``: ``AutoModelForCausalLM.from_pretrained`` from the local directory (any
    architecture transformers loads; no hub access, no remote code). Without: a random-weight
    Qwen2 of the configured shape (:func:`build_model`, seeded by ``seed``).

    Args:
        cfg: the model section (:class:`~.config.ModelConfig` or a dict of it).
        tokenizer: fills a built model's vocabulary size and special ids; unused with a path.
        device: where the weights go.
        trainable: weights the role trains (actor, critic): float32 master weights, whatever
            ``cfg.dtype`` says (the trainer runs forward/backward under autocast to it;
            :func:`compute_dtype`), and gradient checkpointing if ``cfg.gradient_checkpointing``.
            Otherwise (rollout, reference) the weights are held in the compute dtype.

    Raises:
        FileNotFoundError: ``cfg.path`` is not a model directory.
        ValueError: a bad ``dtype``; a directory whose model transformers cannot load as a
            causal LM, or whose config and weights are damaged or disagree
            (:func:`~.model_dir.check_model_directory`); a pickled weights file holding
            objects besides tensors (refused unloaded).
    """
    cfg = model_config(cfg)
    dtype = torch.float32 if trainable else compute_dtype(cfg.dtype, device)
    if cfg.path:
        check_model_directory(cfg.path)
        quiet_loading()
        with unpickling_refused(f"model.path={cfg.path}"):
            model = AutoModelForCausalLM.from_pretrained(
                Path(cfg.path).expanduser(),
                dtype=dtype,
                attn_implementation=cfg.attn_implementation,
                local_files_only=True,
            )
    else:
        model = build_model(cfg, tokenizer, seed=seed).to(dtype)
    if trainable and cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device)


def checkpointing(model: torch.nn.Module) -> bool:
    """Whether ``model`` recomputes activations in its backward (transformers renamed the flag
    ``is_gradient_checkpointing`` -> ``is_activation_checkpointing`` in 5.2x; read either). A
    PEFT model answers for its base model."""
    if hasattr(model, "peft_config"):
        model = model.get_base_model()
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def load_backbone(
    cfg: ModelConfig | dict,
    tokenizer: PreTrainedTokenizerBase | None,
    seed: int | None = None,
) -> PreTrainedModel:
    """The policy's transformer without its LM head, float32 on the CPU: the trunk of a critic
    or reward model (a value head goes on top). From ``cfg.path`` by ``AutoModel`` (the
    directory's own weights), else the trunk of :func:`build_model`."""
    cfg = model_config(cfg)
    if not cfg.path:
        return build_model(cfg, tokenizer, seed=seed).model
    check_model_directory(cfg.path)
    quiet_loading()
    with unpickling_refused(f"model.path={cfg.path}"):
        return AutoModel.from_pretrained(
            Path(cfg.path).expanduser(),
            dtype=torch.float32,
            attn_implementation=cfg.attn_implementation,
            local_files_only=True,
        )


def shape_config(
    cfg: ModelConfig | dict, tokenizer: PreTrainedTokenizerBase | None = None
) -> Qwen2Config:
    """The ``Qwen2Config`` of a built (random-weight) model: ``cfg``'s shape, with the
    vocabulary size and pad/eos/bos ids that ``cfg`` leaves unset from ``tokenizer`` (if given;
    without one, ``cfg`` must set ``vocab_size``).

    Raises:
        ValueError: no vocabulary size (neither ``cfg.vocab_size`` nor a tokenizer).
    """
    fields = asdict(model_config(cfg))
    attn = fields["attn_implementation"]
    for name in LOADING_FIELDS:
        fields.pop(name)
    if tokenizer is not None:
        fields["vocab_size"] = fields["vocab_size"] or len(tokenizer)
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            if fields[name] is None:
                fields[name] = getattr(tokenizer, name)
    if fields["vocab_size"] is None:
        raise ValueError("vocab_size is unset: pass a tokenizer or set cfg.vocab_size")
    config = Qwen2Config(**fields)
    config._attn_implementation = attn
    return config


def build_model(
    cfg: ModelConfig | dict,
    tokenizer: PreTrainedTokenizerBase | None = None,
    seed: int | None = None,
) -> Qwen2ForCausalLM:
    """Build a randomly initialised ``Qwen2ForCausalLM`` from ``cfg`` (fp32, on CPU).

    Args:
        cfg: a :class:`ModelConfig` or a dict of its fields.
        tokenizer: if given, fills ``vocab_size`` and the pad/eos/bos ids that ``cfg`` leaves
            unset.
        seed: if given, seeds torch before initialisation so the weights are reproducible.
    """
    config = shape_config(cfg, tokenizer)
    if seed is not None:
        torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # The stop tokens are read from the generation config (:func:`.generation.stop_token_ids`).
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    return model


def save_checkpoint(
    directory: str | Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> Path:
    """Save model weights/config and tokenizer into ``directory`` (created if missing)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_checkpoint(
    directory: str | Path, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` from a Hugging Face directory (e.g. :func:`save_checkpoint`'s
    or an actor checkpoint): float32, in eval mode, on ``device``."""
    from .tokenizer import build_tokenizer

    model = load_model(ModelConfig(path=str(directory), dtype="float32"), None, device)
    return model.eval(), build_tokenizer({"name": "pretrained", "path": str(directory)})
