"""LoRA on the torch engine: the options, the PEFT wrapping, and the adapter as weights that
travel (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", section 4.1:
``W = W0 + (alpha / r) * B A``, ``B`` ``[out, r]`` zero-initialised, ``A`` ``[r, in]``).

The policy is a ``peft`` ``PeftModel`` (:func:`wrap`); its frozen base ``W0`` never changes,
so a weight sync need carry the adapter alone. The sync payload stays a flat ``{name: tensor}``
dict (every transport of :func:`m2flow.sync_weights` moves it unchanged):

- ``lora::<module>.lora_A`` ``[r, in]``, ``lora::<module>.lora_B`` ``[out, r]`` and
  ``lora::<module>.scaling`` (a 0-d tensor, ``alpha / r``) for each adapted linear module,
  named as in the Hugging Face model (``model.layers.0.self_attn.q_proj``);
- on a destination's first sync, the base weights besides, in Hugging Face layout
  (:func:`base_state_dict`), so a receiver that started from other weights (a random-weight
  preset) ends with the actor's.

A receiver holding a Hugging Face model applies a payload with :func:`apply_payload`: it keeps
the base of every adapted module (from the full payload) and sets ``W = W0 + scaling * B @ A``,
the same float32 operations as PEFT's ``merge`` (``get_delta_weight``), so the merged weights
equal :func:`merged_state_dict` of the actor's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # LoraOptions and check_lora import no torch: the config checks read them
    import torch

#: key prefix of the adapter's tensors in a weight-sync payload
PREFIX = "lora::"
#: PEFT's name of the (one) adapter it trains
ADAPTER = "default"
#: attribute of a receiving model holding its adapted modules' base weights
_BASE_ATTR = "_m2flow_lora_base"


@dataclass(frozen=True)
class LoraOptions:
    """``actor.lora``: LoRA on the policy (PEFT), off at ``rank`` 0.

    Fields:
        rank: ``r``, the adapter's rank (0: full fine-tuning).
        alpha: the scale numerator: the update is ``(alpha / rank) * B A``.
        dropout: dropout on the adapter's input (0: none; > 0 makes training forwards
            stochastic, so recomputed and training logprobs differ).
        target_modules: the linear modules adapted, by name suffix (``q_proj``, ...), or
            ``["all-linear"]``: every linear layer but the LM head (PEFT's shorthand).
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("all-linear",)

    @classmethod
    def from_value(cls, value, role: str = "actor") -> LoraOptions:
        """The options from a dict (the config section) or options; checked.

        Raises:
            ValueError: an unknown key, a negative rank, ``alpha <= 0``, ``dropout`` outside
                ``[0, 1)``, or no target module (each names the key and the fix).
        """
        if isinstance(value, LoraOptions):
            opt = value
        else:
            value = dict(value or {})
            names = {"rank", "alpha", "dropout", "target_modules"}
            unknown = sorted(set(value) - names)
            if unknown:
                raise ValueError(
                    f"{role}.lora has no option {', '.join(unknown)}: its options are "
                    f"{', '.join(sorted(names))}"
                )
            targets = value.pop("target_modules", cls.target_modules)
            if isinstance(targets, str):
                targets = [targets]
            opt = cls(**value, target_modules=tuple(targets))
        if not isinstance(opt.rank, int) or opt.rank < 0:
            raise ValueError(f"{role}.lora.rank={opt.rank!r}: give an integer >= 0 (0: off)")
        if not opt.alpha > 0:
            raise ValueError(f"{role}.lora.alpha={opt.alpha!r}: give a number > 0 (e.g. 16)")
        if not 0 <= opt.dropout < 1:
            raise ValueError(f"{role}.lora.dropout={opt.dropout!r}: give a number in [0, 1)")
        if not opt.target_modules or not all(isinstance(t, str) and t for t in opt.target_modules):
            raise ValueError(
                f"{role}.lora.target_modules={list(opt.target_modules)!r}: name the linear "
                "modules to adapt (e.g. [q_proj, v_proj]) or [all-linear]"
            )
        return opt

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def wrap(model: torch.nn.Module, options: LoraOptions, role: str = "actor") -> torch.nn.Module:
    """``model`` as a PEFT ``PeftModel`` with a fresh LoRA adapter (``B = 0``: the same outputs
    as ``model``); only the adapter's parameters require gradients.

    Raises:
        ValueError: ``target_modules`` matches no linear module of the model (the message lists
            the model's linear module names).
    """
    from peft import LoraConfig, get_peft_model

    targets = list(options.target_modules)
    config = LoraConfig(
        r=options.rank, lora_alpha=options.alpha, lora_dropout=options.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        import torch  # heavy: not at module import (see the imports)

        linears = (n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
        linear = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ValueError(
            f"{role}.lora.target_modules={targets}: {e}; the model's linear modules are "
            f"{linear} (or give [all-linear])"
        ) from None


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (:func:`wrap`)."""
    return hasattr(model, "peft_config")


def _lora_modules(model: torch.nn.Module):
    """``(hf_name, layer)`` of every LoRA layer of a PEFT model, named as in the Hugging Face
    model (``base_model.model.`` stripped)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            if module.fan_in_fan_out:
                raise ValueError(f"{name}: fan-in-fan-out (Conv1D) layers are not supported")
            yield name, module


def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base of a PEFT model in Hugging Face layout (CPU copies): the adapter's
    tensors left out, ``<module>.base_layer.weight`` named ``<module>.weight``."""
    out = {}
    for k, v in model.get_base_model().state_dict().items():
        if ".lora_" in k:
            continue
        out[k.replace(".base_layer.", ".")] = v.detach().cpu().clone()
    return out


def adapter_payload(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors as a sync payload (module docstring; CPU copies)."""
    import torch  # heavy: not at module import (see the imports)

    out = {}
    for name, layer in _lora_modules(model):
        out[f"{PREFIX}{name}.lora_A"] = layer.lora_A[ADAPTER].weight.detach().cpu().clone()
        out[f"{PREFIX}{name}.lora_B"] = layer.lora_B[ADAPTER].weight.detach().cpu().clone()
        out[f"{PREFIX}{name}.scaling"] = torch.tensor(float(layer.scaling[ADAPTER]))
    return out


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The PEFT model's weights merged into Hugging Face layout (``W0 + scaling * B A`` per
    adapted module, PEFT's ``get_delta_weight``; CPU copies), the model left unchanged."""
    out = base_state_dict(model)
    for name, layer in _lora_modules(model):
        w = layer.base_layer.weight
        out[f"{name}.weight"] = (w.detach() + layer.get_delta_weight(ADAPTER)).cpu()
    return out


def save_adapter(model: torch.nn.Module, path: Path, base_path: str | None) -> None:
    """Write a PEFT model as a PEFT adapter directory at ``path`` (``adapter_config.json``,
    ``adapter_model.safetensors``). Its ``base_model_name_or_path`` is ``base_path`` (the
    pretrained ``model.path``) or, without one, ``path/base``: the frozen base written there as
    a Hugging Face directory (config and ``model.safetensors``), which
    ``AutoModelForCausalLM.from_pretrained`` loads. A checkpoint is written under
    ``step_N.partial`` and renamed ``step_N`` when complete
    (:class:`m2flow.run.recipe.Checkpoints`): the reference names the renamed directory, the
    one that will exist (PEFT's ``AutoPeftModelForCausalLM`` loads the base from it)."""
    from safetensors.torch import save_file

    if base_path is None:
        base_dir = path / "base"
        base_dir.mkdir(parents=True, exist_ok=True)
        hf = model.get_base_model()
        state = base_state_dict(model)
        if getattr(hf.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: from_pretrained ties it again
        save_file(state, base_dir / "model.safetensors", metadata={"format": "pt"})
        hf.config.save_pretrained(base_dir)
        if getattr(hf, "generation_config", None) is not None:
            hf.generation_config.save_pretrained(base_dir)
        base_ref = str(_after_rename(base_dir.resolve()))
    else:
        base_ref = str(Path(base_path).expanduser().resolve())
    model.peft_config[ADAPTER].base_model_name_or_path = base_ref
    model.save_pretrained(path)


def _after_rename(path: Path) -> Path:
    """``path`` with a ``step_N.partial`` ancestor named ``step_N``, as it is once saved."""
    parts = [p.removesuffix(".partial") if re.fullmatch(r"step_\d+\.partial", p) else p
             for p in path.parts]  # fmt: skip
    return Path(*parts)


def load_adapter(model: torch.nn.Module, path: Path) -> None:
    """Restore what :func:`save_adapter` wrote into a PEFT model built with the same options:
    the base from ``path/base`` when there is one (else it is the model's own, loaded from
    ``model.path``), the adapter from ``adapter_model.safetensors``; exact.

    Raises:
        ValueError: files that do not match the model (missing or unexpected keys).
    """
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    if (path / "base" / "model.safetensors").exists():
        saved = load_file(path / "base" / "model.safetensors")
        hf = model.get_base_model()
        names = {k.replace(".base_layer.", "."): k for k in hf.state_dict() if ".lora_" not in k}
        unexpected = sorted(set(saved) - set(names))
        missing = sorted(set(names) - set(saved) - {"lm_head.weight"})
        if unexpected or missing:
            raise ValueError(
                f"{path / 'base'} does not match the model: missing {missing}, unexpected "
                f"{unexpected}"
            )
        hf.load_state_dict({names[k]: v for k, v in saved.items()}, strict=False)
        hf.tie_weights()
    result = set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
    if result.unexpected_keys:
        raise ValueError(
            f"{path} holds adapter tensors this model lacks: {result.unexpected_keys[:5]} "
            "(other actor.lora options than the run's?)"
        )
    lora_missing = [k for k in result.missing_keys if ".lora_" in k]
    if lora_missing:
        raise ValueError(f"{path} lacks adapter tensors: {lora_missing[:5]}")


def payload_bytes(weights: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the tensors of a sync payload."""
    return sum(t.numel() * t.element_size() for t in weights.values())


def is_adapter(weights: Mapping | None) -> bool:
    """Whether a sync payload carries a LoRA adapter (:func:`adapter_payload`)."""
    return weights is not None and any(k.startswith(PREFIX) for k in weights)


def apply_payload(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Load a sync payload into a Hugging Face ``model`` in place: plain weights by
    ``load_state_dict`` (strict); an adapter payload merged (module docstring), its base weights
    (if it has them) loaded and kept for the next adapter-only payloads.

    Raises:
        ValueError: an adapter-only payload before any base weights came, or naming a module
            the model lacks.
    """
    if not is_adapter(weights):
        model.load_state_dict(weights)
        return
    plain = {k: v for k, v in weights.items() if not k.startswith(PREFIX)}
    names = sorted({k[len(PREFIX) :].rsplit(".", 1)[0] for k in weights if k.startswith(PREFIX)})
    base: dict | None = model.__dict__.get(_BASE_ATTR)
    if plain:
        model.load_state_dict(plain)
        base = {n: plain[f"{n}.weight"].detach().float().cpu().clone() for n in names}
        model.__dict__[_BASE_ATTR] = base
    if base is None:
        raise ValueError(
            "got a LoRA adapter without the base weights it applies to: the first sync to a "
            "receiver carries them (restart the receiver's group with the actor, or sync again)"
        )
    import torch  # heavy: not at module import (see the imports)

    with torch.no_grad():
        for n in names:
            if n not in base:
                raise ValueError(f"the LoRA adapter names module {n}, absent from the base")
            a, b = weights[f"{PREFIX}{n}.lora_A"], weights[f"{PREFIX}{n}.lora_B"]
            scaling = float(weights[f"{PREFIX}{n}.scaling"])
            delta = (b.float() @ a.float()) * scaling
            model.get_submodule(n).weight.copy_(base[n] + delta)


def check_lora(engine: str, lora, role: str = "actor") -> None:
    """Refuse LoRA (``lora``: options or their dict) on a train engine that cannot do it
    exactly (no ``supports_lora``: the Megatron engine), at config validation and launch.

    Raises:
        ValueError: the engine by name, and the fix.
    """
    opt = LoraOptions.from_value(lora, role)
    if not opt.enabled:
        return
    from .registry import engine_class

    if not getattr(engine_class("train", engine, role), "supports_lora", False):
        raise ValueError(
            f"{role}.lora.rank={opt.rank} with {role}.engine={engine}: that engine has no "
            f"exact LoRA (its sharded weights are not PEFT modules); use {role}.engine=torch, "
            f"or {role}.lora.rank=0 for full fine-tuning"
        )


class MergedWeights:
    """Full merged weights from sync payloads, for a receiver whose engine cannot apply an
    adapter (vLLM here, the spot pool, the emulated engine): it keeps the last base weights (a
    host copy of the whole model) and merges each adapter into them (:func:`apply_payload`'s
    arithmetic). Plain payloads pass through."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] | None = None

    def __call__(self, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The Hugging Face ``state_dict`` a payload amounts to.

        Raises:
            ValueError: an adapter-only payload before any base weights.
        """
        if not is_adapter(weights):
            return weights
        plain = {
            k: v.detach().cpu().clone() for k, v in weights.items() if not k.startswith(PREFIX)
        }
        if plain:
            self.base = plain
        if self.base is None:
            raise ValueError(
                "got a LoRA adapter without the base weights it applies to: the first sync to "
                "a receiver carries them"
            )
        out = dict(self.base)
        names = {k[len(PREFIX) :].rsplit(".", 1)[0] for k in weights if k.startswith(PREFIX)}
        for n in names:
            a, b = weights[f"{PREFIX}{n}.lora_A"], weights[f"{PREFIX}{n}.lora_B"]
            scaling = float(weights[f"{PREFIX}{n}.scaling"])
            base = self.base[f"{n}.weight"]
            out[f"{n}.weight"] = (base.float() + (b.float() @ a.float()) * scaling).to(base.dtype)
        return out
