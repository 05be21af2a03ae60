"""Tiny local LLM building blocks: a character tokenizer and a Qwen2 model built from config."""

from .model import ModelConfig, build_model, load_checkpoint, save_checkpoint
from .tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

__all__ = [
    "DEFAULT_ALPHABET",
    "ModelConfig",
    "build_char_tokenizer",
    "build_model",
    "load_checkpoint",
    "save_checkpoint",
]
