"""A Megatron-core ``GPTModel`` equivalent to a Hugging Face Qwen2 / Llama / Mistral causal LM,
its parallel state, and logprobs.

The model is megatron-core's own GPT with its local (non Transformer-Engine) layer spec
(``get_gpt_layer_local_spec``): RMSNorm (``rms_norm_eps``), SwiGLU (``gated_linear_unit`` +
SiLU), rotary embeddings (non-interleaved, i.e. HF's ``rotate_half``) with the config's
``rope_theta`` and, for ``linear`` / ``llama3`` RoPE scaling, transformers' own inverse
frequencies, grouped query attention (``num_query_groups``), ``head_dim`` as the config sets
it (``kv_channels``), bias on Q/K/V for Qwen2 only (no family here has biases on ``o_proj`` or
the MLP), tied or untied output embeddings as the HF config says. Which configs map exactly is
:mod:`.arch`'s call (others raise :class:`~.arch.UnsupportedModel` before anything is built).

Parallelism: :func:`init_parallel` calls ``parallel_state.initialize_model_parallel`` for the
given tensor (TP) and pipeline (PP) sizes over whatever ``torch.distributed`` backend is
initialised (gloo on CPU, NCCL on GPU); data parallel size is ``world / (TP * PP)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .shims import CPU_CONFIG_FLAGS, apply_cpu_shims


@dataclass(frozen=True)
class MegatronShape:
    """What conversion and logprobs need to know about a Megatron model."""

    vocab_size: int  # the HF (true) vocabulary
    padded_vocab_size: int  # Megatron's, a multiple of ``vocab_multiple * tp``
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool = True  # Qwen2: q/k/v biases; Llama, Mistral: none
    architecture: str = "Qwen2ForCausalLM"  # the HF class the weights load into


def padded_vocab(vocab_size: int, tp: int, multiple: int = 8) -> int:
    """Smallest multiple of ``multiple * tp`` >= ``vocab_size`` (Megatron splits rows evenly)."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def megatron_shape(
    hf_config, tp: int = 1, vocab_multiple: int = 8, role: str = "actor"
) -> MegatronShape:
    """The :class:`MegatronShape` of an HF config (Qwen2, Llama, Mistral) at tensor-parallel
    size ``tp``.

    Raises:
        UnsupportedModel: the config has no exact Megatron mapping (:func:`~.arch.architecture`;
            the message names ``<role>.engine=torch``).
    """
    from .arch import architecture

    arch = architecture(hf_config, role)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return MegatronShape(
        vocab_size=hf_config.vocab_size,
        padded_vocab_size=padded_vocab(hf_config.vocab_size, tp, vocab_multiple),
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_query_groups=hf_config.num_key_value_heads,
        head_dim=head_dim,
        tie_word_embeddings=bool(hf_config.tie_word_embeddings),
        qkv_bias=arch.qkv_bias,
        architecture=arch.name,
    )


def transformer_config(hf_config, tp: int = 1, pp: int = 1, dtype=torch.float32):
    """Megatron ``TransformerConfig`` equivalent to an HF Qwen2 / Llama / Mistral config.

    fp32 everywhere, no dropout (so TP ranks need no forked RNG), and on CPU the fused kernels
    off (:data:`~.shims.CPU_CONFIG_FLAGS`).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = megatron_shape(hf_config, tp)
    cpu = not torch.cuda.is_available()
    flags = dict(CPU_CONFIG_FLAGS) if cpu else {}
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,  # no bias on o_proj, gate/up/down (arch.py refuses others)
        add_qkv_bias=shape.qkv_bias,  # Qwen2: bias on q/k/v; Llama, Mistral: none
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        **flags,
    )


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    seed: int = 0,
    timeout_s: float | None = None,
) -> None:
    """``parallel_state.initialize_model_parallel(tp, pp)`` on the initialised process group.

    ``torch.distributed`` must already be initialised (gloo on CPU, NCCL on GPU) with
    ``world = tp * pp * dp``; ``dp`` (if given) is checked against it. ``timeout_s``: the
    timeout of every collective of Megatron's groups (rounded up to whole minutes, Megatron's
    unit; default Megatron's 30 minutes). Applies the CPU shims; on a CUDA host seeds
    Megatron's CUDA RNG tracker with ``seed`` instead.
    """
    from megatron.core import parallel_state

    apply_cpu_shims()
    if not dist.is_initialized():
        raise RuntimeError("init torch.distributed (gloo/nccl) before init_parallel")
    world = dist.get_world_size()
    if world % (tp * pp) or (dp is not None and world != tp * pp * dp):
        raise ValueError(f"world size {world} is not tp={tp} * pp={pp} * dp={dp}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    minutes = 30 if timeout_s is None else max(1, math.ceil(timeout_s / 60))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        distributed_timeout_minutes=minutes,
    )
    if torch.cuda.is_available():  # GPU init draws from the CUDA RNG tracker (untested here)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_gpt_model(hf_config, vocab_multiple: int = 8, dtype=torch.float32):
    """The Megatron ``GPTModel`` for this rank's pipeline stage (after :func:`init_parallel`).

    Logits come out gathered over TP (``parallel_output=False``) and cover the padded vocabulary;
    :func:`megatron_sequence_logprobs` drops the padding columns. A ``linear`` / ``llama3``
    RoPE gets transformers' inverse frequencies (:func:`~.arch.rope_inv_freq`) in place of
    Megatron's unscaled ones, on every stage.

    Raises:
        UnsupportedModel: the config has no exact mapping (:func:`~.arch.architecture`).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from .arch import rope_inv_freq, rope_parameters

    apply_cpu_shims()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    config = transformer_config(hf_config, tp=tp, pp=pp, dtype=dtype)  # refuses, or maps
    shape = megatron_shape(hf_config, tp, vocab_multiple)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.padded_vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=float(rope_parameters(hf_config)["rope_theta"]),
    )
    inv_freq = rope_inv_freq(hf_config)
    if inv_freq is not None:  # before the first forward (RotaryEmbedding caches its output)
        rotary = model.rotary_pos_emb
        rotary.inv_freq = inv_freq.to(rotary.inv_freq.device, rotary.inv_freq.dtype)
    pad = getattr(hf_config, "pad_token_id", None)
    if pad is not None and model.pre_process:
        model.embedding.word_embeddings.register_forward_hook(_padding_idx_hook(pad))
    model.m2flow_shape = shape
    return model


def _padding_idx_hook(pad_id: int):
    """HF's ``nn.Embedding(..., padding_idx=pad_token_id)``: the lookup of the pad token sends
    no gradient to its row (a sampled pad token in a response would otherwise move it; with
    tied embeddings the output layer's gradient still does). Forward values are unchanged."""

    def hook(module, args, output):  # output: [B, S, H], TP-reduced
        is_pad = (args[0] == pad_id).unsqueeze(-1)
        return torch.where(is_pad, output.detach(), output) if is_pad.any() else output

    return hook


def rolled_inputs(prompt_ids, prompt_mask, response_ids):
    """``(tokens, position_ids, attention_mask, back)`` for a Megatron forward of
    ``[prompt | response]``: each row rotated left by its prompt's padding (see
    :func:`megatron_sequence_logprobs`), positions ``0..S-1``, a causal mask (True = masked,
    ``[1, 1, S, S]``), and ``back`` (``[B, S]``) to rotate logits back."""
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    b, length = input_ids.shape
    n_pad = (prompt_ids.shape[1] - prompt_mask.sum(dim=1)).long()
    cols = torch.arange(length, device=input_ids.device)
    fwd = (cols.unsqueeze(0) + n_pad.unsqueeze(1)) % length  # rolled[:, j] = orig[:, fwd[:, j]]
    back = (cols.unsqueeze(0) - n_pad.unsqueeze(1)) % length  # orig[:, t] = rolled[:, back[:, t]]
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=input_ids.device), 1)
    position_ids = cols.unsqueeze(0).expand(b, length)
    return input_ids.gather(1, fwd), position_ids, causal.view(1, 1, length, length), back


def logprobs_from_rolled_logits(
    logits, back, prompt_len, response_ids, response_mask, vocab_size, temperature=1.0
):
    """Per-token response logprobs ``[B, R]`` from the logits of a :func:`rolled_inputs`
    forward (``[B, S, V_pad]``): rotated back, padded vocabulary columns dropped."""
    b, length, v_pad = logits.shape
    logits = logits.gather(1, back.unsqueeze(-1).expand(b, length, v_pad))
    logits = logits[:, prompt_len - 1 : -1, :vocab_size].float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    return logprobs * response_mask


def megatron_sequence_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """:func:`~m2flow.workers.algos.logprobs.sequence_logprobs` for a single-stage (PP=1)
    Megatron model: per-token logprobs ``[B, R]``, 0 where masked.

    Megatron's local attention takes no padding mask (only the causal one) and its rotary
    positions are ``0..S-1``, so each row is rotated left by its prompt's padding first: the real
    tokens then start at position 0 (what HF's ``cumsum(mask) - 1`` positions give) and the
    padding moves after them, where causal attention keeps it from touching any scored token.
    Logits are rotated back and the padded vocabulary columns dropped.
    """
    tokens, position_ids, causal, back = rolled_inputs(prompt_ids, prompt_mask, response_ids)
    logits = model(tokens, position_ids, attention_mask=causal)  # [B, S, V_pad]
    return logprobs_from_rolled_logits(
        logits,
        back,
        prompt_ids.shape[1],
        response_ids,
        response_mask,
        model.m2flow_shape.vocab_size,
        temperature,
    )
