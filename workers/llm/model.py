"""Tiny Qwen2 causal LM built from a config (no model hub), plus checkpoint save/load.

The checkpoint directory is a plain Hugging Face layout (``config.json``,
``model.safetensors``, tokenizer files), so ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` (or vLLM) can read it as well.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
from transformers import (
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from .config import ModelConfig


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
    if isinstance(cfg, dict):
        cfg = ModelConfig(**cfg)
    fields = asdict(cfg)
    attn = fields.pop("attn_implementation")
    if tokenizer is not None:
        fields["vocab_size"] = fields["vocab_size"] or len(tokenizer)
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            if fields[name] is None:
                fields[name] = getattr(tokenizer, name)
    if fields["vocab_size"] is None:
        raise ValueError("vocab_size is unset: pass a tokenizer or set cfg.vocab_size")
    config = Qwen2Config(**fields)
    config._attn_implementation = attn
    if seed is not None:
        torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # generate() reads its defaults (eos/pad ids) from the generation config.
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    return model


def save_checkpoint(
    directory: str | Path, model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase
) -> Path:
    """Save model weights/config and tokenizer into ``directory`` (created if missing)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_checkpoint(
    directory: str | Path, device: str | torch.device = "cpu"
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` saved by :func:`save_checkpoint`; the model is in eval mode."""
    directory = Path(directory)
    model = Qwen2ForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device)
    model.eval()
    # Not AutoTokenizer: it picks Qwen2Tokenizer from the model type, a BPE class we don't use.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    return model, tokenizer
