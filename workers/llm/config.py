"""Model shape as plain data (no torch import), so configs can embed it cheaply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ModelConfig:
    """Shape of the tiny Qwen2. Defaults: ~0.8M parameters, fast on 2 CPU cores.

    ``vocab_size`` and the special token ids are normally taken from the tokenizer
    (see :func:`build_model`).
    """

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    # "sdpa" measured ~5% faster than "eager" for [256, 16] batches on 2 CPU cores.
    attn_implementation: str = "sdpa"
    vocab_size: Optional[int] = None
    pad_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None
