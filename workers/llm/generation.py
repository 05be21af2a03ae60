"""Batched sampling from a Hugging Face causal LM (KV cache, stop on EOS, left padding).

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
  :func:`workers.algos.logprobs.sequence_logprobs` at the same temperature. Note that top-p
  truncation is *not* reflected: with ``top_p < 1`` the sampler draws from a truncated
  distribution, so keep ``top_p = 1`` for exact on-policy ratios.
- ``versions``       ``[B, R]`` int64, the weight version each token was sampled with (the
  :class:`~.gate.DecodeGate`'s version at its decode step; 0 without a gate), 0 where
  ``response_mask`` is 0.
- ``group_index``    ``[B]`` int64, index of the prompt each response answers; the ``n_samples``
  responses of one prompt are contiguous (one GRPO group).

Concatenating ``prompt_ids`` and ``response_ids`` (and the masks) gives the actor's input;
positions are ``cumsum(mask) - 1`` under left padding, here and in the actor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from .gate import DecodeGate
from .sampling import counter_uniforms, sample_tokens


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(ids [N, L], mask [N, L])`` int64 tensors."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(seqs), length), dtype=torch.long, device="cpu")
    for i, s in enumerate(seqs):
        if s:
            ids[i, length - len(s) :] = torch.tensor(s, dtype=torch.long, device="cpu")
            mask[i, length - len(s) :] = 1
    return ids, mask


def eos_mask(response_ids: torch.Tensor, eos_ids: int | Sequence[int]) -> torch.Tensor:
    """``[B, R]`` mask that is 1 up to and including the first stop token of each row.

    Args:
        eos_ids: the stop token, or several (a chat model may end a turn with one token and a
            document with another: see :func:`stop_token_ids`).
    """
    ids = torch.as_tensor(eos_ids, device=response_ids.device).reshape(-1)
    is_eos = torch.isin(response_ids, ids).long()
    # Number of EOS strictly before each position: 0 up to and including the first EOS.
    before = torch.cumsum(is_eos, dim=1) - is_eos
    return (before == 0).long()


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config=None) -> list[int]:
    """The tokens that end a response: the tokenizer's ``eos_token_id`` plus
    ``generation_config.eos_token_id`` (the model's; an int or a list: Qwen2.5-Instruct lists
    both ``<|im_end|>`` and ``<|endoftext|>``). Returns a sorted list of ints.

    Raises:
        ValueError: neither names a stop token (a response could never end).
    """
    ids = {tokenizer.eos_token_id} - {None}
    extra = getattr(generation_config, "eos_token_id", None)
    ids |= set(extra if isinstance(extra, (list, tuple)) else [extra]) - {None}
    if not ids:
        raise ValueError(
            "the tokenizer has no eos_token and the model's generation config no eos_token_id: "
            "set eos_token in the tokenizer files (tokenizer_config.json)"
        )
    return sorted(int(i) for i in ids)


@torch.no_grad()
def prefill_shared(
    model: PreTrainedModel, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> DynamicCache | None:
    """KV cache of ``[G, P]`` left-padded prompts without their last column (``P - 1`` tokens).

    Expanded to the samples (``cache.batch_repeat_interleave(n)``), the decode loop then feeds
    only the last prompt token, with the same positions (``cumsum(mask) - 1``) and mask it would
    use for the whole prompt, so each prompt is prefilled once per group instead of once per
    sample. Returns None when ``P < 2``.
    """
    if prompt_ids.shape[1] < 2:
        return None
    ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]
    cache = DynamicCache(config=model.config)
    model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=_positions(mask),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return cache


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Positions ``cumsum(mask) - 1`` under left padding (0 on the padding)."""
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


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
    gate: DecodeGate | None = None,
) -> dict[str, torch.Tensor]:
    """Sample ``n_samples`` responses for each prompt; see the module docstring for the output.

    A decode loop over the model's forward with a KV cache (transformers' ``DynamicCache``),
    not ``model.generate``: every token is chosen here (argmax, or the inverse CDF of
    :func:`~.sampling.sample_tokens`) and its logprob is recorded as it is drawn, so the
    distribution sampled is exactly ``softmax(logits / T)`` (``generate`` would merge a
    checkpoint's ``generation_config.json``, e.g. a repetition penalty or top-k, into the
    scores) and memory holds ``[B]`` numbers per step, not ``[B, R, V]`` logits.

    Args:
        model: a causal LM; put in eval mode for the call, its mode is restored afterwards.
            Inputs go to its device; the results come back on the CPU.
        tokenizer: gives ``pad_token_id`` and ``eos_token_id`` (with the model's generation
            config: :func:`stop_token_ids`).
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
            ``None``: uniforms from torch's global RNG.
        seed: the run seed for ``sample_keys``.
        gate: pause, resume and weight updates between decode steps (each forward, the
            prefill included, is one step of :meth:`~.gate.DecodeGate.step`), driven from
            other threads. After an update the KV cache, computed with the old weights, is
            recomputed: one forward over the prompts and the tokens so far with the new
            weights (:func:`_recompute`), so every later token and logprob is the new
            weights' (as a fresh generation continuing the same sequences would give them) and
            ``versions`` tells which weights sampled which token.

    Returns:
        dict of tensors on CPU: ``prompt_ids``, ``prompt_mask`` ``[B, P]``, ``response_ids``,
        ``response_mask``, ``logprobs``, ``versions`` ``[B, R]``, ``group_index`` ``[B]``.

    Raises:
        ValueError: ``sample_keys`` not one per prompt; no stop token (:func:`stop_token_ids`).
        TimeoutError: paused longer than the gate's ``timeout_s``.
    """
    pad_id = tokenizer.pad_token_id
    stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    device = next(model.parameters()).device
    ids, mask = left_pad(prompt_ids, pad_id)
    # Groups are contiguous: the returned prompt tensors line up row by row.
    ids = ids.repeat_interleave(n_samples, dim=0)
    mask = mask.repeat_interleave(n_samples, dim=0)
    group_index = torch.arange(len(prompt_ids), device="cpu").repeat_interleave(n_samples)
    rows = len(ids)

    uniforms = None
    if sample_keys is not None and not greedy:
        if len(sample_keys) != len(prompt_ids):
            raise ValueError(f"{len(sample_keys)} sample keys for {len(prompt_ids)} prompts")
        keys = np.array(
            [(s, p, j) for s, p in sample_keys for j in range(n_samples)], dtype=np.int64
        ).reshape(-1, 3)
        uniforms = torch.from_numpy(counter_uniforms(seed, keys, np.arange(max_new_tokens)))
        uniforms = uniforms.to(device)  # [B, T] float64, next to the logits they meet
    scale = 1.0 if greedy else temperature
    d_ids, d_mask = ids.to(device), mask.to(device)
    stop_ids = torch.tensor(stops, device=device)
    was_training = model.training
    model.eval()

    def decode_step():
        return gate.step() if gate is not None else contextlib.nullcontext(0)

    try:
        with decode_step() as version:
            cache = None
            if shared_prefix and n_samples > 1:
                cache = prefill_shared(model, d_ids[::n_samples], d_mask[::n_samples])
            if cache is not None:  # the prompts' last column, every sample
                cache.batch_repeat_interleave(n_samples)
                logits = model(
                    input_ids=d_ids[:, -1:],
                    attention_mask=d_mask,
                    position_ids=_positions(d_mask)[:, -1:],
                    past_key_values=cache,
                    use_cache=True,
                ).logits[:, -1]
            else:
                cache = DynamicCache(config=model.config)
                logits = model(
                    input_ids=d_ids,
                    attention_mask=d_mask,
                    position_ids=_positions(d_mask),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                ).logits[:, -1]
        tokens, logprobs, versions = [], [], []
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        position = _positions(d_mask)[:, -1:]
        for t in range(max_new_tokens):
            logits = logits.float()
            if greedy:
                tok = logits.argmax(dim=-1)
            else:
                u = uniforms[:, t] if uniforms is not None else torch.rand(
                    rows, dtype=torch.float64, device=device
                )  # fmt: skip
                tok = sample_tokens(logits, u, temperature, top_p)
            lp = torch.log_softmax(logits / scale, dim=-1).gather(1, tok[:, None])[:, 0]
            tok = tok.masked_fill(done, pad_id)  # a finished row only pads
            tokens.append(tok)
            logprobs.append(lp)
            versions.append(version)
            done |= torch.isin(tok, stop_ids)
            if t + 1 == max_new_tokens or bool(done.all()):
                break
            d_mask = torch.cat([d_mask, d_mask.new_ones(rows, 1)], dim=1)
            position = position + 1
            with decode_step() as current:
                if current != version:  # new weights: the cache holds the old ones' keys
                    cache, logits = _recompute(model, d_ids, torch.stack(tokens, dim=1), d_mask)
                    version = current
                else:
                    logits = model(
                        input_ids=tok[:, None],
                        attention_mask=d_mask,
                        position_ids=position,
                        past_key_values=cache,
                        use_cache=True,
                    ).logits[:, -1]
    finally:
        model.train(was_training)

    response_ids = torch.stack(tokens, dim=1).cpu()
    response_mask = eos_mask(response_ids, stops)
    # Tokens after EOS are pad already; make sure they stay pad under our mask too.
    response_ids = response_ids.masked_fill(response_mask == 0, pad_id)
    lps = torch.stack(logprobs, dim=1).float().cpu() * response_mask
    vers = torch.tensor(versions, dtype=torch.long, device="cpu").expand(rows, -1) * response_mask
    return {
        "prompt_ids": ids,
        "prompt_mask": mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "logprobs": lps,
        "versions": vers,
        "group_index": group_index,
    }


def _recompute(
    model: PreTrainedModel, prompt_ids: torch.Tensor, response_ids: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[DynamicCache, torch.Tensor]:  # fmt: skip
    """A fresh KV cache of ``[B, P]`` left-padded prompts followed by ``[B, T]`` response
    tokens (``mask`` ``[B, P + T]``, positions ``cumsum(mask) - 1``), with the model's current
    weights; and the logits ``[B, V]`` after the last token. What the decode loop would hold had
    the new weights computed every step so far."""
    cache = DynamicCache(config=model.config)
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    logits = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=_positions(mask),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    return cache, logits
