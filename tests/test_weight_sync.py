"""``sync_weights(..., transport="collective")`` on a real (embedded) Ray session: bitwise
delivery of mixed dtypes to two destination ranks, the cached link reused and rebuilt, errors
(an unknown transport, a failing source, a dead receiver) instead of hangs."""

from __future__ import annotations

import threading
import time

import pytest
import ray
import torch

from m2flow import Worker, WorkerError, group_method, sync_weights
from m2flow.core import weight_ipc
from m2flow.core.weight_transport import close_links, plan_buckets

pytestmark = pytest.mark.e2e

VIRTUAL_DEVICES = 3  # the source on device 0, the two receiving ranks on 1 and 2
BUCKET = 4096  # bytes: small tensors share buckets, "big" (>= 2 KiB) go alone


def make_weights(seed: int) -> dict:
    """fp32, bf16 and int64 tensors: packed, direct, empty, 0-dim and non-contiguous ones, and
    one non-tensor value."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(64, 16, generator=g),  # 4 KiB: direct
        "norm": torch.randn(16, generator=g).to(torch.bfloat16),
        "proj": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "proj_t": torch.randn(8, 12, generator=g).t(),  # non-contiguous
        "ids": torch.randint(-(2**40), 2**40, (33,), generator=g, dtype=torch.int64),
        "scale": torch.tensor(float(seed)),  # 0-dim
        "empty": torch.zeros(0, 4),
        "big_bf16": torch.randn(40, 40, generator=g).to(torch.bfloat16),  # 3.2 KiB: direct
        "meta": {"seed": seed},
    }


def same_bytes(a, b) -> bool:
    if not isinstance(a, torch.Tensor):
        return a == b
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


class Source(Worker):
    def __init__(self, fail: bool = False) -> None:
        self.seed, self.fail, self.weight_version = 0, fail, 0

    @group_method
    def step(self) -> int:
        self.seed += 1
        self.weight_version += 1
        return self.weight_version

    def get_weights(self) -> dict:
        if self.fail:
            raise RuntimeError("source-cannot-read-weights-xyz")
        return make_weights(self.seed)

    @group_method
    def link_uid(self, dst: str):
        link = getattr(self, "_m2flow_weight_links", {}).get(("to", dst))
        return None if link is None else link.uid


class Sink(Worker):
    def __init__(self) -> None:
        self.got, self.loaded = None, []

    def load_weights(self, weights: dict, version: int) -> None:
        self.got = weights
        self.loaded.append(version)
        # every tensor has its own storage (a receiver may keep or pickle them)
        storages = [t.untyped_storage().data_ptr() for t in weights.values() if torch.is_tensor(t)]
        storages = [p for p in storages if p]
        assert len(set(storages)) == len(storages)

    @group_method
    def nap(self, seconds: float) -> None:
        time.sleep(seconds)

    @group_method
    def state(self) -> dict:
        return {"weights": self.got, "loaded": self.loaded, "version": self.weight_version}

    @group_method
    def link_uid(self, src: str):
        link = getattr(self, "_m2flow_weight_links", {}).get(("from", src, 0))
        return None if link is None else link.uid


@pytest.fixture(scope="module")
def groups(cluster):
    src = Source.launch(cluster, [0], name="wsrc")
    dst = Sink.launch(cluster, [1, 2], name="wdst")
    return src, dst


def check_delivered(dst, seed: int, version: int) -> None:
    expected = make_weights(seed)
    for st in dst.state().wait():
        assert st["version"] == version and st["loaded"][-1] == version
        assert list(st["weights"]) == list(expected)  # the source's order
        for name, value in expected.items():
            assert same_bytes(st["weights"][name], value), name


def test_plan_buckets():
    # Large tensors go alone as they come; small ones fill buckets in order.
    assert plan_buckets([100, 0, 3000, 900, 1200, 50], 2048) == [
        ("direct", 2),
        ("direct", 4),
        ("packed", [(0, 0), (3, 100), (5, 1000)], 1050),
    ]
    assert plan_buckets([800, 800, 800], 2048) == [
        ("packed", [(0, 0), (1, 800)], 1600),
        ("packed", [(2, 0)], 800),
    ]


def test_ipc_pack_is_one_buffer_per_dtype_and_views_alias_it():
    """CUDA IPC's packing (the part that runs without a GPU): every tensor lands bitwise in its
    dtype's buffer, and the receiver's views alias that buffer (no copy on the receiving
    side)."""
    tensors = {k: v for k, v in make_weights(3).items() if torch.is_tensor(v)}
    buffers, layout = weight_ipc.pack(tensors, torch.device("cpu"))
    assert sorted(buffers) == ["bfloat16", "float32", "int64"]
    assert sum(b.numel() for b in buffers.values()) == sum(t.numel() for t in tensors.values())
    views = weight_ipc.unpack(buffers, layout)
    assert list(views) == list(tensors)
    assert all(same_bytes(views[k], t) for k, t in tensors.items())
    buffers["float32"].zero_()
    assert float(views["embed"].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="CUDA"):
        weight_ipc.share(buffers)


def test_collective_twice_reuses_link(groups):
    src, dst = groups
    t0 = time.monotonic()
    assert sync_weights(src, dst, transport="collective", bucket_bytes=BUCKET) == 0
    check_delivered(dst, 0, 0)
    uid = src.link_uid("wdst").wait()[0]
    assert uid is not None and dst.link_uid("wsrc").wait() == [uid, uid]

    assert src.step().wait() == [1]
    assert sync_weights(src, dst, transport="collective", bucket_bytes=BUCKET) == 1
    check_delivered(dst, 1, 1)
    assert src.link_uid("wdst").wait() == [uid]  # the cached link, not a new one
    assert dst.link_uid("wsrc").wait() == [uid, uid]
    assert time.monotonic() - t0 < 30


def test_object_store_and_collective_agree(groups):
    src, dst = groups
    src.step().wait()
    version = sync_weights(src, dst)  # default transport: the object store
    check_delivered(dst, 2, version)
    v2 = sync_weights(src, dst, transport="collective")  # default buckets: all in one
    assert v2 == version == 2
    check_delivered(dst, 2, version)


def test_collocated_receiver(cluster, groups):
    """A receiving rank on the source's device (a temporal plan): the device locks do not
    deadlock the broadcast (the source releases them after get_weights)."""
    src, _ = groups
    col = Sink.launch(cluster, [0, 1], name="wcol")
    for _ in range(2):
        version = src.step().wait()[0]
        assert sync_weights(src, col, transport="collective", bucket_bytes=BUCKET) == version
        check_delivered(col, version, version)
    assert close_links(src, col) == 3  # the source's end and both receivers'
    col.shutdown()


def test_close_then_new_link(groups):
    src, dst = groups
    old = src.link_uid("wdst").wait()[0]
    assert close_links(src, dst) == 3
    assert src.link_uid("wdst").wait() == [None]
    version = src.step().wait()[0]
    assert sync_weights(src, dst, transport="collective", bucket_bytes=BUCKET) == version
    check_delivered(dst, version, version)
    new = src.link_uid("wdst").wait()[0]
    assert new not in (None, old) and dst.link_uid("wsrc").wait() == [new, new]


def test_unknown_transport(groups):
    src, dst = groups
    with pytest.raises(ValueError, match="unknown weight transport 'carrier_pigeon'"):
        sync_weights(src, dst, transport="carrier_pigeon")
    with pytest.raises(ValueError, match="bucket_bytes"):
        sync_weights(src, dst, transport="collective", bucket_bytes=0)


def test_ipc_refused_off_gpu_before_anything_is_sent(groups):
    src, dst = groups
    before = [st["loaded"] for st in dst.state().wait()]
    with pytest.raises(ValueError, match="cuda_ipc.*object_store"):
        sync_weights(src, dst, transport="cuda_ipc")
    assert [st["loaded"] for st in dst.state().wait()] == before


def test_failing_source_fails_fast(cluster, groups):
    _, dst = groups
    before = [s["version"] for s in dst.state().wait()]
    bad = Source.launch(cluster, [0], name="wbad", fail=True)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="source-cannot-read-weights-xyz"):
        sync_weights(bad, dst, transport="collective")
    # the receivers heard of it and are free again (not waiting out their timeout)
    assert [s["version"] for s in dst.state().wait(timeout=20)] == before
    assert time.monotonic() - t0 < 20
    bad.shutdown()


def test_receiver_dies_while_source_waits(cluster):
    """The source waits for a receiver to join a new link; the receiver dies meanwhile."""
    src = Source.launch(cluster, [0], name="wsrc2")
    dst = Sink.launch(cluster, [1], name="wdst2")
    dst.nap(60)  # busy: it would join only after this
    threading.Timer(2.0, ray.kill, (dst.actors[0],), {"no_restart": True}).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="'wdst2' rank 0"):
        sync_weights(src, dst, transport="collective")
    dst.shutdown()
    assert src.link_uid("wdst2").wait(timeout=20) == [None]  # the source gave up and dropped it
    assert time.monotonic() - t0 < 30
    src.shutdown()


def test_dead_receiver_is_named(cluster, groups):
    """Last in the module: it kills a rank (a death the rest of the run would hear of)."""
    src, dst = groups
    ray.kill(dst.actors[1], no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="'wdst' rank 1"):
        sync_weights(src, dst, transport="collective", bucket_bytes=BUCKET)
    # The source's side ends too (it pings its peers), dropping the link: asked directly,
    # as every wait through the group now reports the death.
    call = src.actors[0]._m2flow_call.remote("link_uid", (("wdst",), {}, None))
    assert ray.get(call, timeout=20)[0] is None
    # and so does the surviving receiver's (the source aborted the sync for it)
    call = dst.actors[0]._m2flow_call.remote("link_uid", (("wsrc",), {}, None))
    assert ray.get(call, timeout=20)[0] is None
    assert time.monotonic() - t0 < 30
    dst.shutdown()
    src.shutdown()
