"""GPU-only paths: per-rank CUDA_VISIBLE_DEVICES, real offload of GPU memory, and the
NCCL weight-sync transport.

Marked ``gpu``: skipped without CUDA; run on a GPU machine with ``scripts/gpu_tests.sh``.
"""

from __future__ import annotations

import os

import pytest

from m2flow import Worker, group_method

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}


class CudaProbe(Worker):
    @group_method
    def visible(self) -> tuple[str, int]:
        import torch

        return os.environ.get("CUDA_VISIBLE_DEVICES", ""), torch.cuda.device_count()


def test_cuda_devices_and_visibility(cluster):
    assert all(d.kind == "cuda" for d in cluster.devices)
    group = CudaProbe.launch(cluster, [0], name="cuda_probe")
    try:
        ((visible, count),) = group.visible().wait()
        assert visible == str(cluster.device(0).local_id) and count == 1
    finally:
        group.shutdown()


def test_actor_offload_releases_gpu_memory(cluster):
    from m2flow.workers.actor.worker import ActorWorker

    class MemActor(ActorWorker):
        @group_method
        def memory(self) -> int:
            import torch

            return torch.cuda.memory_allocated()

        @group_method
        def cycle(self) -> tuple[int, int, int]:
            import torch

            before = torch.cuda.memory_allocated()
            self.offload()
            during = torch.cuda.memory_allocated()
            self.onload()
            return before, during, torch.cuda.memory_allocated()

    group = MemActor.launch(
        cluster,
        [0],
        name="mem_actor",
        model=TINY_MODEL,
        tokenizer={"name": "char", "alphabet": "0123456789+-="},
        threads=1,
    )
    try:
        ((before, during, after),) = group.cycle().wait()
        assert before > 0 and during < before // 10 and after == before
    finally:
        group.shutdown()


class CudaWeights(Worker):
    """A weight source/receiver whose weights live on its GPU."""

    def __init__(self) -> None:
        self.weights: dict = {}
        self.weight_version = 0

    @group_method
    def make(self, seed: int) -> None:
        import torch

        g = torch.Generator(device="cuda").manual_seed(seed)
        self.weights = {
            "w": torch.randn(2048, 2048, device="cuda", generator=g),  # 16 MiB: sent alone
            "b": torch.randn(33, device="cuda", generator=g).to(torch.bfloat16),  # packed
        }
        self.weight_version += 1

    def get_weights(self) -> dict:
        return self.weights

    def load_weights(self, weights: dict, version: int) -> None:
        self.weights = weights

    @group_method
    def digest(self) -> dict:
        return {k: (v.device.type, str(v.dtype), float(v.float().sum()))
                for k, v in self.weights.items()}  # fmt: skip


def test_collective_weight_sync_over_nccl(cluster):
    """Two GPUs: the NCCL link delivers the source's CUDA tensors, bitwise, onto the receiver's
    GPU, twice (the cached link reused)."""
    from m2flow import sync_weights

    if len(cluster.devices) < 2:
        pytest.skip("NCCL weight sync needs a GPU per member (2 GPUs); this machine has 1")
    src = CudaWeights.launch(cluster, [0], name="nccl_src")
    dst = CudaWeights.launch(cluster, [1], name="nccl_dst")
    try:
        for seed in (1, 2):
            src.make(seed).wait()
            version = sync_weights(src, dst, transport="collective")
            assert version == seed
            assert dst.digest().wait() == src.digest().wait()
            assert dst.digest().wait()[0]["w"][0] == "cuda"
    finally:
        src.shutdown()
        dst.shutdown()


def test_collective_weight_sync_refuses_one_gpu_for_both(cluster):
    """Source and receiver on one GPU cannot share an NCCL group: a clear error naming the
    transports that serve it (cuda_ipc, object_store), before anything is sent."""
    from m2flow import sync_weights

    src = CudaWeights.launch(cluster, [0], name="ipc_src")
    dst = CudaWeights.launch(cluster, [0], name="ipc_dst")
    try:
        src.make(1).wait()
        with pytest.raises(ValueError, match="cuda_ipc.*object_store"):
            sync_weights(src, dst, transport="collective")
        assert sync_weights(src, dst) == 1  # the object store serves it
        assert dst.digest().wait() == src.digest().wait()
    finally:
        src.shutdown()
        dst.shutdown()


class IpcSink(CudaWeights):
    """Copies what it receives: over CUDA IPC the tensors are views of the source's memory."""

    def load_weights(self, weights: dict, version: int) -> None:
        self.weights = {k: v.clone() for k, v in weights.items()}


class IpcSource(CudaWeights):
    @group_method
    def allocated(self) -> int:
        import torch

        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()


def test_cuda_ipc_weight_sync_on_one_gpu(cluster):
    """Source and receiver collocated on GPU 0: the receiver maps the source's packed buffers
    (CUDA IPC), copies them bitwise onto its GPU, twice; after each sync the source holds no
    extra buffer."""
    from m2flow import sync_weights

    src = IpcSource.launch(cluster, [0], name="ipc_src2")
    dst = IpcSink.launch(cluster, [0], name="ipc_dst2")
    try:
        for seed in (1, 2):
            src.make(seed).wait()
            (before,) = src.allocated().wait()
            assert sync_weights(src, dst, transport="cuda_ipc") == seed
            assert dst.digest().wait() == src.digest().wait()
            assert dst.digest().wait()[0]["w"][0] == "cuda"
            assert src.allocated().wait()[0] == before  # packed buffers released
    finally:
        src.shutdown()
        dst.shutdown()


def _tiny_llama_dir(path) -> str:
    """A tiny random Llama with the character tokenizer, saved as a Hugging Face directory."""
    import torch
    from m2flow.workers.llm import build_char_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_grpo_step_on_cuda(tmp_path):
    """The path that failed on the first GRPO step on a GPU (the sampler's host uniforms):
    a seeded rollout on CUDA from a loaded directory in bf16, then a mixed-precision actor
    step over float32 master weights; and in fp32 the rollout's logprobs equal the actor's."""
    import torch
    from m2flow.workers.algos.grpo import grpo_advantages
    from m2flow.workers.algos.losses import make_loss
    from m2flow.workers.engines.torch_engine import TorchEngine
    from m2flow.workers.engines.update import minibatch_update
    from m2flow.workers.llm import build_tokenizer, load_model, tokenizer_spec
    from m2flow.workers.llm.generation import generate

    path = _tiny_llama_dir(tmp_path / "llama")
    tok = build_tokenizer(tokenizer_spec({"path": path}))
    prompts = [tok(p).input_ids for p in ("1+2=", "12+34-5=", "7-3=")]
    keys = [(1, g) for g in range(len(prompts))]
    for dtype in ("auto", "float32"):
        rollout = load_model({"path": path, "dtype": dtype}, tok, "cuda")
        assert next(rollout.parameters()).dtype == (
            torch.bfloat16 if dtype == "auto" else torch.float32
        )
        out = generate(rollout, tok, prompts, n_samples=4, max_new_tokens=6, temperature=1.0,
                       sample_keys=keys, seed=0)  # fmt: skip
        assert all(v.device.type == "cpu" for v in out.values())
        actor = load_model({"path": path, "dtype": dtype}, tok, "cuda", trainable=True)
        compute = torch.bfloat16 if dtype == "auto" else torch.float32
        trainer = TorchEngine.from_module(actor, temperature=1.0, compute_dtype=compute)
        if dtype == "float32":
            assert (trainer.infer(out) - out["logprobs"]).abs().max() <= 1e-4
        data = {k: out[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")}
        data["advantages"] = grpo_advantages((out["response_ids"][:, 0] % 2).float(),
                                             out["group_index"])  # fmt: skip
        data["old_logprobs"] = trainer.infer(data, None, 4)
        metrics = minibatch_update(trainer, data, make_loss("grpo", "policy"), None, 4)
        assert metrics["steps"] == 1 and torch.isfinite(torch.tensor(metrics["loss"]))
        assert {p.dtype for p in actor.parameters()} == {torch.float32}
