"""Local LLM building blocks: tokenizers (character, Qwen2 BPE, a model directory's), the
policy model (loaded from a Hugging Face directory, or a tiny Qwen2 built from a config), and
Hugging Face generation with counter-based sampling (:mod:`.generation`, :mod:`.sampling`).

Exports are lazy: ``m2flow.workers.llm.config`` (the model shape) imports no torch.
"""

from importlib import import_module

_EXPORTS = {
    "ModelConfig": ".config",
    "build_model": ".model",
    "compute_dtype": ".model",
    "load_backbone": ".model",
    "load_model": ".model",
    "build_pretrained_tokenizer": ".tokenizer",
    "load_checkpoint": ".model",
    "save_checkpoint": ".model",
    "DEFAULT_ALPHABET": ".tokenizer",
    "build_char_tokenizer": ".tokenizer",
    "build_qwen2_tokenizer": ".tokenizer",
    "build_tokenizer": ".tokenizer",
    "tokenizer_spec": ".tokenizer",
    "TOKENIZERS": ".tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
