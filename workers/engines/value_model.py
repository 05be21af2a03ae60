"""A causal LM with a scalar head: the critic (a value per token) and the reward model (a score
per sequence) of RLHF-style PPO (InstructGPT, Ouyang et al., 2022, section 3.5: reward model and
value function are LMs with a scalar output head).

Layout as everywhere in ``workers``: ``[B, P]`` left-padded prompts, ``[B, R]`` right-padded
responses, positions ``cumsum(mask) - 1``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from ..algos import losses
from ..llm import ModelConfig, load_backbone
from ..llm.model import model_config, quiet_loading


class ValueModel(nn.Module):
    """The policy's transformer (no LM head) plus ``Linear(hidden, 1)``: from ``model.path``
    (the pretrained trunk, veRL's critic) or a tiny Qwen2 of the configured shape.

    ``forward`` returns one scalar per position, ``[B, L]`` float32.
    """

    def __init__(self, cfg: ModelConfig | dict, tokenizer: PreTrainedTokenizerBase, seed=None):
        super().__init__()
        cfg = model_config(cfg)
        self.backbone = load_backbone(cfg, tokenizer, seed=seed)
        if cfg.gradient_checkpointing:
            self.backbone.gradient_checkpointing_enable({"use_reentrant": False})
        self.head = nn.Linear(self.backbone.config.hidden_size, 1)
        # Start from V = 0 everywhere: no made-up values before the first update.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_classifier(cls, path: str, attn_implementation: str = "sdpa") -> ValueModel:
        """A reward model from a Hugging Face sequence-classification directory with one label
        (``AutoModelForSequenceClassification``, e.g. a ``Qwen2ForSequenceClassification``
        reward model): its transformer as the trunk and its score head as the head, float32.
        :func:`sequence_scores` then reads the head where that model scores a sequence (the
        last real token).

        Raises:
            ValueError: not a sequence classifier with one label (:func:`check_classifier`).
        """
        from transformers import AutoModelForSequenceClassification

        from ..checkpoint import unpickling_refused

        check_classifier(path)
        quiet_loading()
        with unpickling_refused(str(path)):
            clf = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=torch.float32, attn_implementation=attn_implementation,
                local_files_only=True,
            )  # fmt: skip
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model.backbone = getattr(clf, clf.base_model_prefix)
        (model.head,) = [m for n, m in clf.named_children() if n != clf.base_model_prefix]
        return model

    def load_backbone(self, lm_state: dict[str, torch.Tensor]) -> None:
        """Copy the transformer weights of a causal LM state dict (``model.*`` keys, e.g. the
        warm-started policy's); the LM head is ignored and the value head is left as it is.

        Raises:
            ValueError: the state dict does not match the backbone.
        """
        prefix = f"{self.backbone.base_model_prefix}."  # "model." for Qwen2, Llama, Mistral
        state = {k[len(prefix) :]: v for k, v in lm_state.items() if k.startswith(prefix)}
        missing, unexpected = self.backbone.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"policy weights do not fit the value model: missing {missing}, unexpected "
                f"{unexpected}; give critic/reward model the policy's model shape"
            )

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


def check_classifier(path: str) -> None:
    """``path`` is a Hugging Face sequence-classification model with one label (a reward
    model's score), loadable without custom code.

    Raises:
        FileNotFoundError: no directory, ``config.json`` or weights.
        ValueError: custom code, another kind of model, ``num_labels != 1``, or a config and
            weights that are damaged or disagree (the checks of ``model.path``:
            :mod:`~..llm.model_dir`).
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    )

    from ..llm.model_dir import check_weights, read_config

    config = read_config(path, "reward_model.path")
    if type(config) not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        raise ValueError(
            f"reward_model.path={path}: model_type {config.model_type!r} has no sequence "
            "classifier in transformers (AutoModelForSequenceClassification)"
        )
    if config.num_labels != 1:
        raise ValueError(
            f"reward_model.path={path}: {config.num_labels} labels; a reward model scores "
            "with one (num_labels=1)"
        )
    check_weights(path, config, "reward_model.path", causal_lm=False)


def position_values(model: ValueModel, prompt_ids, prompt_mask, response_ids, response_mask):
    """``[B, P + R]``: the head's scalar at every position of ``prompt | response`` (what a
    value engine's forward gives its loss; :func:`~..algos.losses.response_values` and
    :func:`~..algos.losses.sequence_scores` read it)."""
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    return model(ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0))


def response_values(
    model: ValueModel, prompt_ids, prompt_mask, response_ids, response_mask
) -> torch.Tensor:
    """``[B, R]`` values ``V(s_j)`` of the state before response token ``j`` (prompt plus
    tokens ``< j``), read where the policy's logit for token ``j`` is; 0 where masked."""
    out = position_values(model, prompt_ids, prompt_mask, response_ids, response_mask)
    return losses.response_values(out, {"prompt_ids": prompt_ids, "response_mask": response_mask})


def sequence_scores(
    model: ValueModel, prompt_ids, prompt_mask, response_ids, response_mask
) -> torch.Tensor:
    """``[B]`` head output (a logit) at the last real token of ``prompt | response`` (the EOS
    when the response has one): the reward model's score of the whole sample."""
    out = position_values(model, prompt_ids, prompt_mask, response_ids, response_mask)
    return losses.sequence_scores(out, {"prompt_ids": prompt_ids, "response_mask": response_mask})
