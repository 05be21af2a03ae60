"""The throughput model of :mod:`.emulated`'s engine: seconds of a decode iteration, of a
prefill and of a weight transfer for one inference engine of ``tp`` GPUs, from the model's shape
and the accelerator's datasheet (:class:`ThroughputModel`; presets: :data:`PRESETS`). Pure
arithmetic, no engine and no clock. Model, calibration and limits:
``docs/results/emulation.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One accelerator. Peak figures from the vendor's datasheet (H100 SXM5: HBM3 3.35 TB/s,
    dense BF16 989.4 TFLOP/s, dense FP8 1978.9 TFLOP/s, 80 GB)."""

    name: str
    hbm_bytes_per_s: float
    flops_bf16: float
    flops_fp8: float
    hbm_bytes: float


H100_SXM = Hardware("H100 SXM5 80GB", 3.35e12, 989.4e12, 1978.9e12, 80 * GB)


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder-only transformer (GQA, SwiGLU MLP), as its ``config.json`` states it."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False

    @property
    def params(self) -> int:
        """Parameters (norms left out: < 0.01 %)."""
        h, q, kv = self.hidden, self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate
        return self.layers * layer + self.vocab * h * (1 if self.tied_embeddings else 2)

    def kv_elems_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim  # K and V, every layer


# Qwen3 technical report / model cards (Hugging Face config.json of Qwen/Qwen3-8B, -14B, -32B).
QWEN3_8B = ModelShape("Qwen3-8B", 36, 4096, 12288, 32, 8, 128, 151936)
QWEN3_14B = ModelShape("Qwen3-14B", 40, 5120, 17408, 40, 8, 128, 151936)
QWEN3_32B = ModelShape("Qwen3-32B", 64, 5120, 25600, 64, 8, 128, 151936)
# The models of the published throughput table it is calibrated on (docs/results/emulation.md).
LLAMA31_8B = ModelShape("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128, 128256)
LLAMA33_70B = ModelShape("Llama-3.3-70B", 80, 8192, 28672, 64, 8, 128, 128256)


@dataclass(frozen=True)
class ThroughputModel:
    """Time of one inference engine (``tp`` GPUs, tensor parallel) in seconds.

    Decode iteration over ``b`` requests of mean context ``L`` (tokens)::

        t(b, L) = max(W / BW, 2 P b / F) + b L kv / BW + b a + t_step

    ``W``: weight bytes; ``P``: parameters; ``kv``: KV-cache bytes per token; ``BW = tp *
    HBM bandwidth * bw_eff``; ``F = tp * dense FLOP/s * flops_eff``. The GEMMs are a roofline
    (the weights read once per iteration, or compute-bound at large ``b``); attention reads
    every live request's KV cache and stays memory-bound at any batch, so it adds. With ``tp >
    1``, each layer's two all-reduces cost ``allreduce_s`` each plus ``a = 2 layers * hidden * 2
    bytes * 2 (tp - 1) / tp / tp_link_bytes_per_s`` per request; ``t_step = overhead_s + 2
    layers allreduce_s``. Hence the batching plateau: tokens/s ``= b / t(b, L)`` grows about
    linearly while the weight read dominates and flattens once the per-request terms do (at
    ``b ~ W / (L kv)``): the longer the context, the sooner.

    Prefill of ``n`` new tokens after ``c`` cached ones (a fresh request: the prompt; a
    migrated one: prompt + its tokens so far): ``max(W / BW, (2 P n + 2 layers d_q n (2c + n))
    / F) + t_step`` (GEMMs plus causal attention, compute-bound; ``a`` is a decode cost:
    decode's all-reduces are small messages, far below the link's bandwidth, while prefill's
    are large); several prefills in one call share the weight read. Weight transfer:
    ``latency_s + bytes / (net_bytes_per_s * net_eff)``.

    The efficiencies and TP costs are fitted to published H100 throughput
    (docs/results/emulation.md: within 4 % (rms) of TensorRT-LLM's Llama-3.1-8B table, 9 % of
    its Llama-3.3-70B TP-2 one).

    Attributes (beyond the formula's): ``weight_bytes_per_param``/``kv_bytes_per_elem`` (2:
    BF16; 1: FP8, which also doubles ``F``); ``mem_util``: share of the engine's HBM for
    weights + KV cache (vLLM's ``gpu_memory_utilization``), giving :attr:`kv_capacity_tokens`.
    """

    shape: ModelShape
    hw: Hardware = H100_SXM
    tp: int = 2
    weight_bytes_per_param: int = 2
    kv_bytes_per_elem: int = 2
    bw_eff: float = 0.8
    flops_eff: float = 0.6
    overhead_s: float = 1e-3
    allreduce_s: float = 25e-6
    tp_link_bytes_per_s: float = 45e9
    mem_util: float = 0.6
    net_bytes_per_s: float = 50e9 / 8
    net_eff: float = 0.8
    latency_s: float = 2.0

    # -- derived -----------------------------------------------------------------------------

    @property
    def params(self) -> int:
        return self.shape.params

    @property
    def weight_bytes(self) -> float:
        return float(self.params * self.weight_bytes_per_param)

    @property
    def kv_bytes_per_token(self) -> float:
        return float(self.shape.kv_elems_per_token() * self.kv_bytes_per_elem)

    @property
    def bandwidth(self) -> float:
        return self.tp * self.hw.hbm_bytes_per_s * self.bw_eff

    @property
    def flops(self) -> float:
        peak = self.hw.flops_fp8 if self.weight_bytes_per_param == 1 else self.hw.flops_bf16
        return self.tp * peak * self.flops_eff

    @property
    def step_overhead_s(self) -> float:
        return self.overhead_s + (2 * self.shape.layers * self.allreduce_s if self.tp > 1 else 0.0)

    @property
    def comm_s_per_token(self) -> float:
        """All-reduce seconds per token in the batch (0 without tensor parallelism)."""
        if self.tp <= 1:
            return 0.0
        nbytes = 2 * self.shape.layers * self.shape.hidden * 2 * 2 * (self.tp - 1) / self.tp
        return nbytes / self.tp_link_bytes_per_s

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the engine holds (``mem_util`` of its HBM, less the weights)."""
        free = self.tp * self.hw.hbm_bytes * self.mem_util - self.weight_bytes
        return max(int(free // self.kv_bytes_per_token), 0)

    # -- times -------------------------------------------------------------------------------

    def decode_step_s(self, batch, context):
        """Seconds of one decode iteration: ``batch`` requests of mean ``context`` tokens
        (scalars or numpy arrays)."""
        b = np.asarray(batch, dtype=np.float64)
        ctx = np.asarray(context, dtype=np.float64)
        gemm = np.maximum(self.weight_bytes / self.bandwidth, 2.0 * self.params * b / self.flops)
        per_req = ctx * self.kv_bytes_per_token / self.bandwidth + self.comm_s_per_token
        out = gemm + b * per_req + self.step_overhead_s
        return float(out) if out.ndim == 0 else out

    def decode_tokens_per_s(self, batch, context):
        """Decode throughput (tokens/s) at ``batch`` requests of mean ``context`` tokens."""
        return np.asarray(batch, dtype=np.float64) / self.decode_step_s(batch, context)

    def prefill_s(self, tokens: Sequence[int] | int, cached: Sequence[int] | int = 0) -> float:
        """Seconds to prefill ``tokens[i]`` new tokens of request ``i`` after ``cached[i]``
        tokens already in its KV cache, all in one engine call (0.0 for nothing)."""
        n = np.atleast_1d(np.asarray(tokens, dtype=np.float64))
        c = np.broadcast_to(np.asarray(cached, dtype=np.float64), n.shape)
        if not n.size or not n.sum():
            return 0.0
        d_q = self.shape.q_heads * self.shape.head_dim
        attn = 2.0 * self.shape.layers * d_q * (n * (2 * c + n)).sum()
        flops = 2.0 * self.params * n.sum() + attn
        return max(self.weight_bytes / self.bandwidth, flops / self.flops) + self.step_overhead_s

    def weight_transfer_s(self, nbytes: float | None = None) -> float:
        """Seconds to pull ``nbytes`` of weights (default: this model's) over the network."""
        size = self.weight_bytes if nbytes is None else nbytes
        return self.latency_s + size / (self.net_bytes_per_s * self.net_eff)

    # -- summaries ---------------------------------------------------------------------------

    def plateau(self, context: float, tolerance: float = 0.1, max_batch: int = 1024) -> int:
        """The smallest batch reaching ``1 - tolerance`` of the best decode throughput over
        ``1..max_batch`` at mean ``context`` (RLBoost's batching plateau ``B``)."""
        b = np.arange(1, max_batch + 1)
        tps = self.decode_tokens_per_s(b, context)
        return int(b[np.argmax(tps >= (1.0 - tolerance) * tps.max())])

    def steady_state_tps(self, isl: int, osl: int, max_batch: int = 2048) -> float:
        """Output tokens/s of the engine under a saturating load of requests with ``isl``
        prompt and ``osl`` output tokens (the setting of offline throughput benchmarks): as
        many requests run as the KV cache holds at their mean context ``isl + osl / 2`` (at
        most ``max_batch``); each iteration also prefills the requests that replace the
        ``b / osl`` finishing ones."""
        mean_ctx = isl + osl / 2
        b = max(min(max_batch, self.kv_capacity_tokens / mean_ctx), 1.0)
        new = b / osl  # requests admitted per iteration
        d_q = self.shape.q_heads * self.shape.head_dim
        pre = new * (2.0 * self.params * isl + 2.0 * self.shape.layers * d_q * isl * isl)
        return b / (self.decode_step_s(b, mean_ctx) + pre / self.flops)


#: One engine per spot instance (2 x H100, TP 2: RLBoost section 6.1 and its released launch
#: scripts), BF16 weights and KV cache. docs/results/emulation.md gives the sources of every number.
PRESETS: dict[str, ThroughputModel] = {
    "qwen3-8b": ThroughputModel(QWEN3_8B),
    "qwen3-14b": ThroughputModel(QWEN3_14B),
    "qwen3-32b": ThroughputModel(QWEN3_32B, mem_util=0.85),
}


def throughput_preset(name: str, **overrides) -> ThroughputModel:
    """The preset ``name`` (a key of :data:`PRESETS`, case-insensitive) with ``overrides``.

    Raises:
        ValueError: an unknown preset.
    """
    try:
        model = PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown throughput preset {name!r}: one of {sorted(PRESETS)}") from None
    return replace(model, **overrides) if overrides else model
