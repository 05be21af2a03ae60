"""Batched sampling with Hugging Face ``model.generate`` (KV cache, stop on EOS, left padding).

Output layout (veRL-style), with ``B = num_prompts * n_samples`` responses:

- ``prompt_ids``     ``[B, P]`` int64, left padded with ``pad_token_id``; ``P`` = longest prompt.
- ``prompt_mask``    ``[B, P]`` int64, 1 on real prompt tokens.
- ``response_ids``   ``[B, R]`` int64, right padded; ``R`` <= ``max_new_tokens`` (the longest
  response of the batch).
- ``response_mask``  ``[B, R]`` int64, 1 up to and including the first EOS (or on every
  generated token if the response was truncated at ``max_new_tokens``).
- ``logprobs``       ``[B, R]`` float32, log-probability of each sampled token under
  ``log_softmax(logits / T)`` (raw logits scaled by the sampling temperature ``T``; ``T = 1`` for
  greedy), 0 where ``response_mask`` is 0. This is what the actor recomputes with
  :func:`workers.actor.losses.sequence_logprobs` at the same temperature. Note that top-p
  truncation is *not* reflected: with ``top_p < 1`` the sampler draws from a truncated
  distribution, so keep ``top_p = 1`` for exact on-policy ratios.
- ``group_index``    ``[B]`` int64, index of the prompt each response answers; the ``n_samples``
  responses of one prompt are contiguous (one GRPO group).

Concatenating ``prompt_ids`` and ``response_ids`` (and the masks) gives the actor's input;
positions are ``cumsum(mask) - 1``, which is also what ``generate`` uses under left padding.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .sampling import CounterSampler, counter_uniforms


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(ids [N, L], mask [N, L])`` int64 tensors."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, length - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, length - len(s) :] = 1
    return ids, mask


def eos_mask(response_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``[B, R]`` mask that is 1 up to and including the first ``eos_id`` of each row."""
    is_eos = (response_ids == eos_id).long()
    # Number of EOS strictly before each position: 0 up to and including the first EOS.
    before = torch.cumsum(is_eos, dim=1) - is_eos
    return (before == 0).long()


@torch.no_grad()
def prefill_shared(
    model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> DynamicCache | None:
    """KV cache of ``[G, P]`` left-padded prompts without their last column (``P - 1`` tokens).

    ``generate`` given this cache (expanded to the samples) and the full prompts feeds only the
    last prompt token in its first forward, with the same positions (``cumsum(mask) - 1``) and
    mask it would use for the whole prompt, so each prompt is prefilled once per group instead
    of once per sample: the HF "reuse a prefix cache" pattern. Returns None when ``P < 2``.
    """
    if prompt_ids.shape[1] < 2:
        return None
    ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]
    cache = DynamicCache(config=model.config)
    model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return cache


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[list[int]],
    n_samples: int = 1,
    max_new_tokens: int = 8,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    shared_prefix: bool = True,
    sample_keys: list[tuple[int, int]] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Sample ``n_samples`` responses for each prompt; see the module docstring for the output.

    Args:
        model: a causal LM; put in eval mode for the call, its mode is restored afterwards.
        tokenizer: gives ``pad_token_id`` and ``eos_token_id``.
        prompt_ids: ``num_prompts`` token lists (already with BOS if the model expects it).
        n_samples: responses per prompt (GRPO group size).
        max_new_tokens: response length cap, in tokens (EOS included).
        temperature: sampling temperature ``T`` (ignored when ``greedy``).
        top_p: nucleus sampling threshold (1.0 = off).
        greedy: argmax decoding; logprobs are then under ``T = 1``.
        shared_prefix: with ``n_samples > 1``, prefill each prompt once (see
            :func:`prefill_shared`) instead of ``n_samples`` times.
        sample_keys: per prompt, ``(step, prompt id)``: draw every token from
            :func:`~.sampling.counter_uniforms` keyed by ``(seed, step, prompt id, sample,
            position)`` (a response is then the same wherever and whenever it is generated);
            ``None``: torch's global RNG.
        seed: the run seed for ``sample_keys``.

    Returns:
        dict of tensors on CPU: ``prompt_ids``, ``prompt_mask``, ``response_ids``,
        ``response_mask``, ``logprobs``, ``group_index``.
    """
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    device = next(model.parameters()).device
    ids, mask = left_pad(prompt_ids, pad_id)
    # Expand the prompts ourselves rather than via num_return_sequences: same layout
    # (contiguous groups), and the returned prompt tensors line up row by row.
    ids = ids.repeat_interleave(n_samples, dim=0)
    mask = mask.repeat_interleave(n_samples, dim=0)
    group_index = torch.arange(len(prompt_ids)).repeat_interleave(n_samples)

    processors = []
    seeded = sample_keys is not None and not greedy
    if seeded:
        if len(sample_keys) != len(prompt_ids):
            raise ValueError(f"{len(sample_keys)} sample keys for {len(prompt_ids)} prompts")
        keys = np.array(
            [(s, p, j) for s, p in sample_keys for j in range(n_samples)], dtype=np.int64
        ).reshape(-1, 3)
        u = torch.from_numpy(counter_uniforms(seed, keys, np.arange(max_new_tokens)))
        processors.append(CounterSampler(u, ids.shape[1], temperature, top_p))
    gen_cfg = GenerationConfig(
        do_sample=not greedy,
        temperature=None if greedy else (1.0 if seeded else temperature),
        top_p=None if greedy else (1.0 if seeded else top_p),
        # transformers 5 replaces top_k=None by its global default 50; 0 really disables it.
        top_k=None if greedy else 0,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        return_dict_in_generate=True,
        output_logits=True,  # raw logits, before temperature / top-p processing
    )
    was_training = model.training
    model.eval()
    try:
        cache = None
        if shared_prefix and n_samples > 1:
            cache = prefill_shared(model, ids[::n_samples].to(device), mask[::n_samples].to(device))
            if cache is not None:
                cache.batch_repeat_interleave(n_samples)
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            past_key_values=cache,
            generation_config=gen_cfg,
            logits_processor=LogitsProcessorList(processors),
        )
    finally:
        model.train(was_training)

    response_ids = out.sequences[:, ids.shape[1] :].cpu()
    response_mask = eos_mask(response_ids, eos_id)
    # Tokens after EOS are pad already; make sure they stay pad under our mask too.
    response_ids = response_ids.masked_fill(response_mask == 0, pad_id)
    logits = torch.stack(out.logits, dim=1).float().cpu()  # [B, R, V]
    scale = 1.0 if greedy else temperature
    logprobs = (
        torch.log_softmax(logits / scale, dim=-1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    )
    logprobs = logprobs * response_mask
    return {
        "prompt_ids": ids,
        "prompt_mask": mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "logprobs": logprobs,
        "group_index": group_index,
    }


def decode_responses(
    tokenizer: PreTrainedTokenizerBase, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> list[str]:
    """Decode ``[B, R]`` responses to text, dropping masked positions and special tokens."""
    texts = []
    for row, m in zip(response_ids.tolist(), response_mask.tolist()):
        toks = [t for t, keep in zip(row, m) if keep]
        texts.append(tokenizer.decode(toks, skip_special_tokens=True))
    return texts
