"""GPU-only paths: per-rank CUDA_VISIBLE_DEVICES and real offload of GPU memory.

Marked ``gpu``: skipped without CUDA; run on a GPU machine with ``scripts/gpu_tests.sh``.
"""

from __future__ import annotations

import os

import pytest

from m2flow import Worker

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
        def memory(self) -> int:
            import torch

            return torch.cuda.memory_allocated()

        def cycle(self) -> tuple[int, int, int]:
            import torch

            before = torch.cuda.memory_allocated()
            self.offload()
            during = torch.cuda.memory_allocated()
            self.onload()
            return before, during, torch.cuda.memory_allocated()

    group = MemActor.launch(
        cluster, [0], name="mem_actor", model=TINY_MODEL, alphabet="0123456789+-=", threads=1
    )
    try:
        ((before, during, after),) = group.cycle().wait()
        assert before > 0 and during < before // 10 and after == before
    finally:
        group.shutdown()
