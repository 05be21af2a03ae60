"""Checkpoint conversion between the Hugging Face Qwen2 / Llama / Mistral layout and Megatron-core's
GPT layout.

The three families share their Hugging Face names (``model.embed_tokens``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, ``lm_head``); only Qwen2 has
``{q,k,v}_proj.bias`` (``MegatronShape.qkv_bias``). :func:`megatron_to_hf` gives exactly the
keys of the family's ``state_dict()``, so it loads with ``strict=True`` into the original class.

Megatron layout (local spec, one tensor-parallel rank ``r`` of ``tp``):

- ``embedding.word_embeddings.weight`` / ``output_layer.weight``: ``[V_pad / tp, H]``, vocab
  rows ``r * V_pad/tp ...`` (VocabParallelEmbedding / column-parallel head); rows past the HF
  vocabulary are zero padding.
- ``decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}``: column parallel, rows grouped
  by query group: for each KV group ``g`` its ``q_per_group`` query heads, then its key head,
  then its value head (``[ng * (q_per_group + 2) * d, H]``). Rank ``r`` holds groups
  ``r * ng/tp ... (r+1) * ng/tp - 1``, i.e. a contiguous block of rows.
- ``...self_attention.linear_proj.weight``: row parallel ``[H, nh*d / tp]`` (input columns split).
- ``...mlp.linear_fc1.weight``: column parallel with the gated unit fused: rank ``r`` holds
  ``[gate_r; up_r]`` (its slice of ``gate_proj`` rows, then the same slice of ``up_proj``), which
  is what Megatron's ``glu`` (``chunk(2)`` then ``silu(x1) * x2``) expects per rank.
- ``...mlp.linear_fc2.weight``: row parallel ``[H, F / tp]``.
- ``input_layernorm``, ``pre_mlp_layernorm``, ``decoder.final_layernorm``: replicated.

Layers are numbered from 0 within a pipeline stage's module: :func:`hf_to_megatron` takes the
stage's first global layer (``layer_offset``) and number of layers.
"""

from __future__ import annotations

import torch

from .model import MegatronShape

_LAYER_HF = "model.layers.{i}."
_LAYER_MG = "decoder.layers.{i}."


def _split(t: torch.Tensor, tp: int, rank: int, dim: int) -> torch.Tensor:
    return torch.chunk(t, tp, dim=dim)[rank].clone()


def _fuse_qkv(q, k, v, shape: MegatronShape) -> torch.Tensor:
    ng, d = shape.num_query_groups, shape.head_dim
    qpg = shape.num_attention_heads // ng
    tail = q.shape[1:]  # (H,) for weights, () for biases
    parts = [q.reshape(ng, qpg * d, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)]
    return torch.cat(parts, dim=1).reshape(ng * (qpg + 2) * d, *tail)


def _unfuse_qkv(qkv, shape: MegatronShape):
    ng, d = shape.num_query_groups, shape.head_dim
    qpg = shape.num_attention_heads // ng
    tail = qkv.shape[1:]
    grouped = qkv.reshape(ng, (qpg + 2) * d, *tail)
    q, k, v = torch.split(grouped, [qpg * d, d, d], dim=1)
    return (
        q.reshape(ng * qpg * d, *tail).clone(),
        k.reshape(ng * d, *tail).clone(),
        v.reshape(ng * d, *tail).clone(),
    )


def _pad_vocab(w: torch.Tensor, shape: MegatronShape) -> torch.Tensor:
    pad = shape.padded_vocab_size - w.shape[0]
    return torch.cat([w, w.new_zeros(pad, *w.shape[1:])]) if pad else w


def hf_keys(shape: MegatronShape) -> set[str]:
    """The keys of the HF model's ``state_dict()`` (``lm_head.weight`` listed tied or not, as
    transformers lists it)."""
    keys = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    kinds = ("weight", "bias") if shape.qkv_bias else ("weight",)
    for i in range(shape.num_layers):
        h = _LAYER_HF.format(i=i)
        keys |= {f"{h}self_attn.{p}_proj.{k}" for p in "qkv" for k in kinds}
        keys |= {f"{h}self_attn.o_proj.weight", f"{h}input_layernorm.weight"}
        keys |= {f"{h}post_attention_layernorm.weight"}
        keys |= {f"{h}mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return keys


def hf_to_megatron(
    hf: dict[str, torch.Tensor],
    shape: MegatronShape,
    tp_rank: int = 0,
    tp_size: int = 1,
    layer_offset: int = 0,
    num_layers: int | None = None,
    pre_process: bool = True,
    post_process: bool = True,
) -> dict[str, torch.Tensor]:
    """The Megatron state dict of TP rank ``tp_rank`` (of ``tp_size``) from an HF Qwen2 / Llama /
    Mistral one (``shape.qkv_bias``: whether q/k/v biases are read).

    For a pipeline stage pass its first global layer ``layer_offset``, its ``num_layers`` and
    whether it is the first (``pre_process``: embedding) / last (``post_process``: final norm,
    output layer) stage. With tied embeddings on a multi-stage pipeline the last stage's
    ``output_layer.weight`` is the embedding (Megatron keeps a copy there).

    Raises:
        KeyError: ``hf`` holds a key the model has no place for (e.g. biases a Llama does not
            have: nothing is dropped silently) or lacks one it needs.
    """
    unexpected = sorted(set(hf) - hf_keys(shape))
    if unexpected:
        raise KeyError(
            f"HF weights that {shape.architecture} with this config has no place for: "
            f"{unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}"
        )
    r, tp = tp_rank, tp_size
    kinds = ("weight", "bias") if shape.qkv_bias else ("weight",)
    n = shape.num_layers - layer_offset if num_layers is None else num_layers
    out: dict[str, torch.Tensor] = {}
    embed = _pad_vocab(hf["model.embed_tokens.weight"], shape)
    if pre_process:
        out["embedding.word_embeddings.weight"] = _split(embed, tp, r, 0)
    for i in range(n):
        h, m = _LAYER_HF.format(i=i + layer_offset), _LAYER_MG.format(i=i)
        a = h + "self_attn."
        for kind in kinds:
            qkv = _fuse_qkv(
                hf[f"{a}q_proj.{kind}"], hf[f"{a}k_proj.{kind}"], hf[f"{a}v_proj.{kind}"], shape
            )
            out[f"{m}self_attention.linear_qkv.{kind}"] = _split(qkv, tp, r, 0)
        out[f"{m}self_attention.linear_proj.weight"] = _split(hf[f"{a}o_proj.weight"], tp, r, 1)
        out[f"{m}input_layernorm.weight"] = hf[f"{h}input_layernorm.weight"].clone()
        out[f"{m}pre_mlp_layernorm.weight"] = hf[f"{h}post_attention_layernorm.weight"].clone()
        gate = _split(hf[f"{h}mlp.gate_proj.weight"], tp, r, 0)
        up = _split(hf[f"{h}mlp.up_proj.weight"], tp, r, 0)
        out[f"{m}mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[f"{m}mlp.linear_fc2.weight"] = _split(hf[f"{h}mlp.down_proj.weight"], tp, r, 1)
    if post_process:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not shape.tie_word_embeddings:
            head = _pad_vocab(hf["lm_head.weight"], shape)
            out["output_layer.weight"] = _split(head, tp, r, 0)
        elif not pre_process:
            out["output_layer.weight"] = _split(embed, tp, r, 0)
    return out


def megatron_to_hf(
    shards: list[dict[str, torch.Tensor]], shape: MegatronShape
) -> dict[str, torch.Tensor]:
    """Gather the TP shards (``shards[r]`` is rank ``r``'s state dict, all layers, i.e. after
    :func:`merge_pipeline_stages` for PP > 1) into one HF state dict of ``shape.architecture``:
    exactly :func:`hf_keys` (no q/k/v biases for Llama / Mistral), so it loads with
    ``strict=True``.

    ``_extra_state`` entries are ignored. With tied embeddings ``lm_head.weight`` is the
    embedding (HF's ``state_dict()`` lists it too).
    """
    shards = [{k: v for k, v in s.items() if not k.endswith("_extra_state")} for s in shards]

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    v = shape.vocab_size
    out: dict[str, torch.Tensor] = {}
    out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)[:v].clone()
    for i in range(shape.num_layers):
        h, m = _LAYER_HF.format(i=i), _LAYER_MG.format(i=i)
        a = h + "self_attn."
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            q, k, vv = _unfuse_qkv(cat(f"{m}self_attention.linear_qkv.{kind}", 0), shape)
            out[f"{a}q_proj.{kind}"], out[f"{a}k_proj.{kind}"], out[f"{a}v_proj.{kind}"] = q, k, vv
        out[f"{a}o_proj.weight"] = cat(f"{m}self_attention.linear_proj.weight", 1)
        out[f"{h}input_layernorm.weight"] = shards[0][f"{m}input_layernorm.weight"].clone()
        out[f"{h}post_attention_layernorm.weight"] = shards[0][
            f"{m}pre_mlp_layernorm.weight"
        ].clone()
        halves = [torch.chunk(s[f"{m}mlp.linear_fc1.weight"], 2, dim=0) for s in shards]
        out[f"{h}mlp.gate_proj.weight"] = torch.cat([g for g, _ in halves], dim=0)
        out[f"{h}mlp.up_proj.weight"] = torch.cat([u for _, u in halves], dim=0)
        out[f"{h}mlp.down_proj.weight"] = cat(f"{m}mlp.linear_fc2.weight", 1)
    out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
    if shape.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    else:
        out["lm_head.weight"] = cat("output_layer.weight", 0)[:v].clone()
    return out


def merge_pipeline_stages(
    stages: list[dict[str, torch.Tensor]], layers_per_stage: list[int]
) -> dict[str, torch.Tensor]:
    """One TP rank's full-model state dict from its pipeline stages' (layers renumbered from the
    stage's offset; the last stage's copy of a tied output layer dropped)."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for stage, n in zip(stages, layers_per_stage):
        for key, t in stage.items():
            if key.startswith("decoder.layers."):
                rest = key[len("decoder.layers.") :]
                idx, tail = rest.split(".", 1)
                key = f"decoder.layers.{int(idx) + offset}.{tail}"
            out.setdefault(key, t)  # replicated entries: the first stage's copy
        offset += n
    return out


def load_megatron_state(model, state: dict[str, torch.Tensor]) -> None:
    """``model.load_state_dict(state)`` that tolerates only missing ``_extra_state`` entries."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"Megatron state mismatch: missing {missing}, unexpected {unexpected}")


def megatron_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors (detached clones), without ``_extra_state`` entries."""
    return {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
    }
