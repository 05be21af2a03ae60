"""Which Hugging Face causal LMs the Megatron engine maps exactly, read from their config.

The engine builds megatron-core's ``GPTModel`` with its local layer spec (:mod:`.model`):
pre-norm RMSNorm decoder layers, SwiGLU MLP, rotary attention with grouped query heads. Three
Hugging Face families are that model with the same weights (:func:`architecture`):

- ``Qwen2ForCausalLM`` (``model_type="qwen2"``: Qwen2, Qwen2.5): biases on q/k/v only;
- ``LlamaForCausalLM`` (``"llama"``: Llama 2, Llama 3, 3.1, 3.2): no biases;
- ``MistralForCausalLM`` (``"mistral"``): no biases; only without a sliding window.

A config of one of them is still refused where the conversion would not be exact: another
activation than SiLU, Llama's ``attention_bias`` / ``mlp_bias`` (Megatron biases all linear
layers or none but q/k/v), attention windows shorter than the model's positions (Qwen2's
``use_sliding_window``, Mistral's ``sliding_window``), dropout (Megatron runs without it here),
partial rotary embeddings, and RoPE variants other than ``default``, ``linear`` and ``llama3``
(YaRN, dynamic NTK, LongRoPE scale the attention or change with the sequence length). Anything
else (GPT-2, Qwen3's q/k norms, mixture-of-experts families, ...) is refused by name. Every
refusal is one :class:`UnsupportedModel` line naming the supported architectures and the torch
engine as the way to train the model anyway.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from types import SimpleNamespace

#: model_type -> (its causal-LM class, who it covers)
SUPPORTED = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2, Qwen2.5"),
    "llama": ("LlamaForCausalLM", "Llama 2/3/3.1/3.2"),
    "mistral": ("MistralForCausalLM", "Mistral without sliding window"),
}
#: rope_type -> how it maps: ``default`` is Megatron's ``rotary_base``; the scaled ones change
#: only the inverse frequencies (attention factor 1), which :mod:`.model` copies from transformers
ROPE_TYPES = ("default", "linear", "llama3")
#: why some nearby families are refused (the message says it)
_WHY = {
    "qwen3": "its per-head q/k RMSNorms (q_norm, k_norm) are not mapped",
    "qwen2_moe": "mixture-of-experts layers are not mapped",
    "qwen3_moe": "mixture-of-experts layers are not mapped",
    "mixtral": "mixture-of-experts layers are not mapped",
    "gemma": "its (1 + weight) RMSNorm, GeLU MLP and scaled embedding are not mapped",
    "gemma2": "its (1 + weight) RMSNorm, soft-capping and sliding windows are not mapped",
}


class UnsupportedModel(ValueError):
    """A Hugging Face model the Megatron engine cannot map exactly (one line: what, why, the
    supported architectures, and ``<role>.engine=torch``)."""


@dataclass(frozen=True)
class Architecture:
    """What :mod:`.model` and :mod:`.convert` need to know about a supported family."""

    name: str  # the causal-LM class, e.g. "LlamaForCausalLM"
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2)
    rope_type: str  # one of ROPE_TYPES


def supported_text() -> str:
    return ", ".join(f"{cls} ({who})" for cls, who in SUPPORTED.values())


def _refuse(what: str, why: str, role: str) -> UnsupportedModel:
    return UnsupportedModel(
        f"{what} is not supported by {role}.engine=megatron ({why}); it supports "
        f"{supported_text()}: set {role}.engine=torch to train this model with the torch engine"
    )


def rope_parameters(hf_config) -> dict:
    """The config's RoPE parameters (transformers 5: ``config.rope_parameters``; older configs:
    ``rope_theta`` / ``rope_scaling``), with ``rope_type`` and ``rope_theta`` always set."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    return params


def architecture(hf_config, role: str = "actor") -> Architecture:
    """The :class:`Architecture` of a Hugging Face config the engine maps exactly.

    Args:
        hf_config: a transformers ``PretrainedConfig`` (of a causal LM or its trunk).
        role: the config section the message names (``actor``, ``critic``).

    Raises:
        UnsupportedModel: the family or one of its settings has no exact mapping (see the
            module docstring); the message names the supported architectures and
            ``<role>.engine=torch``.
    """
    model_type = getattr(hf_config, "model_type", None)
    archs = list(getattr(hf_config, "architectures", None) or [])
    shown = f"model {archs[0] if archs else '?'} (model_type={model_type!r})"
    if model_type not in SUPPORTED:
        raise _refuse(shown, _WHY.get(model_type, "not a Qwen2/Llama/Mistral decoder"), role)
    name = SUPPORTED[model_type][0]
    prefix = name[: -len("ForCausalLM")] + "For"
    if archs and not all(a.startswith(prefix) for a in archs):
        why = f"model_type {model_type!r} says {name} but architectures says {archs}"
        raise _refuse(shown, why, role)
    shown = f"model {name}"

    def need(ok: bool, why: str) -> None:
        if not ok:
            raise _refuse(shown, why, role)

    act = getattr(hf_config, "hidden_act", "silu")
    need(act == "silu", f"hidden_act={act!r}: the SwiGLU MLP here uses silu")
    if model_type == "llama":
        need(
            not getattr(hf_config, "attention_bias", False),
            "attention_bias=true: biases on q/k/v and o_proj; Megatron biases q/k/v only or "
            "every linear layer",
        )
        need(not getattr(hf_config, "mlp_bias", False), "mlp_bias=true: MLP biases")
    # A window at least as long as the model's positions never cuts: exact.
    positions = getattr(hf_config, "max_position_embeddings", None) or 0
    window = getattr(hf_config, "sliding_window", None)
    windowed = window is not None and window < positions
    if model_type == "qwen2":
        types = getattr(hf_config, "layer_types", None) or []
        on = any(t != "full_attention" for t in types)
        windowed = windowed and (on or (not types and getattr(hf_config, "use_sliding_window", 0)))
    if model_type in ("qwen2", "mistral"):
        need(
            not windowed,
            f"sliding_window={window} < max_position_embeddings={positions}: sliding-window "
            "attention is not mapped",
        )
    dropout = float(getattr(hf_config, "attention_dropout", 0.0) or 0.0)
    need(dropout == 0.0, f"attention_dropout={dropout}: Megatron runs without dropout here")
    rope = rope_parameters(hf_config)
    partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    need(partial in (None, 1.0), f"partial_rotary_factor={partial}: partial RoPE")
    kind = rope["rope_type"]
    scaled = f"rope_type={kind!r}: only {'/'.join(ROPE_TYPES)} RoPE maps"
    need(kind in ROPE_TYPES, scaled + " (others scale attention or follow the sequence length)")
    if kind != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        _, factor = ROPE_INIT_FUNCTIONS[kind](hf_config)
        need(factor == 1.0, f"rope_type={kind!r} scales attention by {factor}")
    return Architecture(name=name, qkv_bias=model_type == "qwen2", rope_type=kind)


def rope_inv_freq(hf_config):
    """``[head_dim / 2]`` inverse frequencies of a scaled RoPE (``linear``, ``llama3``) as
    transformers computes them (``ROPE_INIT_FUNCTIONS``), or ``None`` for the default RoPE
    (Megatron's own from ``rotary_base``)."""
    kind = rope_parameters(hf_config)["rope_type"]
    if kind == "default":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[kind](hf_config)[0]


def hf_config_of(model) -> object:
    """The Hugging Face config a role's ``model`` section describes, without building a model.

    Args:
        model: a ``PretrainedConfig`` (returned as is); a section with ``path`` (a local Hugging
            Face directory: its ``config.json``, read by ``AutoConfig``; an architecture
            transformers does not know is refused first, from the raw JSON); or the built-in
            preset (:class:`~m2flow.workers.llm.ModelConfig` fields: a Qwen2, as
            ``workers/llm/model.py: build_model`` makes it).

    Raises:
        ValueError: ``path`` holds no ``config.json``.
        UnsupportedModel: ``path``'s model_type is not one :func:`architecture` maps.
    """
    from transformers import PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    if is_dataclass(model):
        model = asdict(model)
    model = dict(model or {})
    path = model.get("path")
    if path:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ValueError(
                f"model.path={path}: no config.json there (a Hugging Face model directory: "
                "config.json, safetensors, tokenizer files)"
            )
        raw = json.loads(file.read_text())
        if raw.get("model_type") not in SUPPORTED:  # before AutoConfig: it may not know it
            return SimpleNamespace(**raw)
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path)
    from ...llm.model import shape_config

    # The vocabulary comes from the tokenizer at build time; the checks here do not need it.
    return shape_config({**model, "vocab_size": model.get("vocab_size") or 1})
