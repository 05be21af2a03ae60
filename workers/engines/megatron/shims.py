"""CPU/gloo shims for megatron-core 0.16.1: the only place m2flow patches Megatron.

megatron-core assumes a CUDA device: it allocates buffers on ``torch.cuda.current_device()``,
forks a CUDA RNG state around dropout/initialisation, and prefers fused (Apex/TE/Triton)
kernels. On a CPU-only torch (``torch==2.13.0+cpu`` here) those calls raise "Torch not compiled
with CUDA enabled". :func:`apply_cpu_shims` replaces exactly those pieces, and only when CUDA is
not available: on a GPU host it does nothing and Megatron runs unpatched on NCCL.

Every shim below says why it is needed and what it replaces. The transformer-config side of the
story (CPU initialisation, fused kernels off) is not a patch but a set of config flags:
:data:`CPU_CONFIG_FLAGS`, used by :func:`..model.transformer_config`.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False

#: TransformerConfig flags for the CPU path, each one turning off a CUDA-only piece.
CPU_CONFIG_FLAGS = dict(
    # Initialise master weights on the host with torch's default generator instead of on
    # ``torch.cuda.current_device()`` under the CUDA RNG tracker (layers.py
    # ``_initialize_affine_weight_gpu``).
    use_cpu_initialization=True,
    # Fused bias+SwiGLU/GeLU is a TorchScript/Triton CUDA kernel path: use the unfused python
    # activation.
    bias_activation_fusion=False,
    # FusedScaleMaskSoftmax's fused path needs the ``scaled_masked_softmax_cuda`` extension.
    masked_softmax_fusion=False,
    # Fused bias-dropout-add is a jit-scripted CUDA path; the unfused one is plain torch.
    bias_dropout_fusion=False,
    # Needs the ``fused_weight_gradient_mlp_cuda`` (Apex) extension.
    gradient_accumulation_fusion=False,
    # Apex's persistent LayerNorm kernel; irrelevant for RMSNorm but off for safety.
    persist_layer_norm=False,
    # Fused RoPE is an Apex/TE CUDA kernel; the unfused rotation is plain torch.
    apply_rope_fusion=False,
    # Pipeline p2p (``batch_isend_irecv``) is followed by ``torch.cuda.synchronize()`` "to protect
    # against a race" of NCCL batched p2p; gloo's ops are complete after ``wait()``, and the call
    # raises on CPU torch.
    batch_p2p_sync=False,
)


class _CpuRngTracker:
    """Stand-in for ``tensor_parallel.random.CudaRNGStatesTracker`` on CPU.

    Megatron forks a per-TP-rank CUDA RNG state around tensor-parallel dropout and GPU weight
    initialisation so that TP ranks draw different masks/weights. On CPU there is no CUDA
    generator to fork (``torch.cuda.get_rng_state`` raises). m2flow's CPU path runs with dropout 0
    and CPU initialisation (weights come from the HF checkpoint anyway), so the fork only needs to
    be a context manager that draws from torch's default CPU generator.
    """

    def __init__(self):
        self.states_: dict = {}
        self.seeds_: set = set()
        self._is_initialized = True

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.states_.clear()
        self.seeds_.clear()

    def get_states(self) -> dict:
        return dict(self.states_)

    def set_states(self, states) -> None:
        self.states_ = states

    def add(self, name, seed) -> None:
        self.states_[name] = seed
        self.seeds_.add(seed)

    @contextlib.contextmanager
    def fork(self, name=None):
        yield


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


@functools.lru_cache(maxsize=8)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    # True = masked, as Megatron's
    return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()


class _CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` (or ``torch.device("cuda", i)``) keyword arguments to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return func(*args, **kwargs)


def _on_cpu(schedule):
    @functools.wraps(schedule)
    def run(*args, **kwargs):
        with _CudaDeviceToCpu():
            return schedule(*args, **kwargs)

    return run


def apply_cpu_shims() -> bool:
    """Patch megatron-core for a CPU-only torch; idempotent. Returns whether shims are active.

    Call before building a Megatron model (``build_gpt_model`` does). No-op when CUDA is
    available.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    from megatron.core.tensor_parallel import random as mg_random

    # 1. ``torch.cuda.current_device()`` is Megatron's way to say "the device": rotary
    #    ``inv_freq``, tensor-parallel gather/scatter buffers (mappings.py), attention masks and
    #    the vocab-parallel cross entropy all allocate on it. On CPU torch it raises; returning
    #    ``torch.device("cpu")`` makes every ``device=torch.cuda.current_device()`` a CPU tensor.
    #    Global (torch.cuda is one module), harmless where CUDA does not exist.
    torch.cuda.current_device = _cpu_current_device

    # 2. The CUDA RNG tracker (``get_cuda_rng_tracker().fork()``, used by dropout in core
    #    attention and by GPU init) reads/writes ``torch.cuda`` generator state: replace the
    #    module's tracker singleton with a CPU no-op fork (see ``_CpuRngTracker``).
    mg_random._CUDA_RNG_STATE_TRACKER = _CpuRngTracker()
    mg_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    # 3. With pipeline parallelism and tied embeddings, ``LanguageModule.
    #    setup_embeddings_and_output_layer`` moves the shared weight with ``weight.data.cuda()``
    #    before all-reducing it over the embedding group. Make ``Tensor.cuda`` the identity for
    #    that call only (wrapped below), so the gloo all-reduce runs on the host tensor.
    from megatron.core.models.common.language_module import language_module as mg_lm

    original_setup = mg_lm.LanguageModule.setup_embeddings_and_output_layer

    def setup_on_cpu(self, *args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            return original_setup(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    mg_lm.LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu

    # 4. The unfused softmax builds its default causal mask with ``device="cuda"`` hard-coded
    #    (``transformer/utils.get_default_causal_mask``, imported by name into
    #    ``fusions/fused_softmax``): replace that name with the same mask on the host.
    #    (``megatron_sequence_logprobs`` passes its own mask anyway; this covers other callers.)
    from megatron.core.fusions import fused_softmax as mg_softmax

    mg_softmax.get_default_causal_mask = _cpu_causal_mask

    # 5. The pipeline schedules allocate their token counter with ``device="cuda"`` hard-coded
    #    (``pipeline_parallel/schedules.py``: ``total_num_tokens = torch.zeros(..., device=
    #    "cuda")`` in all three schedules). Run each schedule under a torch-function mode that
    #    rewrites an explicit CUDA ``device=`` argument to the CPU. ``get_forward_backward_func``
    #    looks the schedules up as module globals, so replacing them there is enough.
    from megatron.core.pipeline_parallel import schedules as mg_schedules

    for name in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ):
        setattr(mg_schedules, name, _on_cpu(getattr(mg_schedules, name)))
    _APPLIED = True
    return True
