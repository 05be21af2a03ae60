"""Sampling that depends only on who is sampled, not where: counter-based random numbers.

Each token is drawn by inverse CDF from one uniform number ``u = U(seed, step, prompt, sample,
position)`` computed by a counter-based generator (splitmix64 over the five integers), instead
of the next number of a stateful RNG. So a response does not depend on which rank, batch or
chunk generated it, nor on how many samples were drawn before it: the same run seed gives the
same responses under a temporal, spatial or hybrid plan, after a resume, and after a preempted
response migrates to another engine (RLBoost's token-level migration, made exact). What can
still differ is the logits' last bits under another batch composition (kernel summation
order): a token changes only if ``u`` falls within that rounding of a CDF boundary.
"""

from __future__ import annotations

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def counter_uniforms(seed: int, keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Uniform numbers in ``(0, 1)``, one per (row key, position).

    Args:
        seed: the run seed.
        keys: ``[B, K]`` non-negative ints identifying each row (e.g. step, prompt, sample).
        positions: ``[T]`` token positions in the response.

    Returns:
        ``[B, T]`` float64.
    """
    with np.errstate(over="ignore"):
        h = _mix(np.full(len(keys), np.uint64(seed % 2**64)) + _GOLDEN)
        for col in np.asarray(keys, dtype=np.int64).T:
            h = _mix(h ^ (col.astype(np.uint64) + _GOLDEN))
        h = _mix(h[:, None] ^ (np.asarray(positions, dtype=np.uint64)[None, :] + _GOLDEN))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def counter_uniforms_at(seed: int, keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``counter_uniforms(seed, keys[b:b+1], [positions[b]])`` for every row ``b`` at once:
    ``keys [B, K]``, ``positions [B]`` -> ``[B]`` float64 (each row at its own position)."""
    with np.errstate(over="ignore"):
        h = _mix(np.full(len(keys), np.uint64(seed % 2**64)) + _GOLDEN)
        for col in np.asarray(keys, dtype=np.int64).T:
            h = _mix(h ^ (col.astype(np.uint64) + _GOLDEN))
        h = _mix(h ^ (np.asarray(positions, dtype=np.uint64) + _GOLDEN))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """Tokens by inverse CDF: ``logits [B, V]``, ``uniforms [B]`` in (0, 1) -> ``[B]`` int64
    on the logits' device (the uniforms are moved there: they are usually made on the host).

    The distribution is ``softmax(logits / temperature)`` (float64), restricted to the
    smallest set of most likely tokens whose mass reaches ``top_p`` (at least one token).
    """
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the more likely tokens
        keep_sorted = before < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
    cdf = probs.cumsum(dim=-1)
    target = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(-1)  # device and dtype of the CDF
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp(max=logits.shape[-1] - 1)
