"""``benchmarks/async_cluster.py`` at tiny scale on the real runtime (local Ray, WorkerGroups,
Channels, ``sync_weights``, :class:`~m2flow.run.pipeline.StepPipeline`): on a disaggregated
placement where rollout and training take similar modelled time, K = 1 overlaps them, so its
measured samples/s beat K = 0's on the same devices; the staleness the trainer sees is the
bound's; the planner's prediction for K = 0 (the profile of the same workload) is close."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import async_cluster as ac  # noqa: E402

VIRTUAL_DEVICES = 3  # rollout ranks on devices 0 and 1, the disaggregated trainer on 2

# 8 GPUs = 4 TP-2 pairs: rollout on 2, training on 2; short responses keep it fast
TINY = ac.Workload("tiny", 256.0, 0.3, 512, per_pair=64)


@pytest.fixture(scope="module")
def groups(cluster):
    g = ac.Groups.launch(cluster, colocated=False, ranks=1)
    yield g
    g.shutdown()


def test_overlap_beats_sequential_on_the_same_split(groups):
    place = "split 2+2"
    r = ac.predict(TINY, 8, place, 0, 0.0)
    sync = ac.predict(TINY, 8, place, 0, 0.0)["step_s"]
    ts = sync / 0.4  # ~0.4 real s a synchronous step
    k0 = ac.run_config(groups, TINY, 8, place, 0, False, 3, ts, "k0")
    k1 = ac.run_config(groups, TINY, 8, place, 1, False, 4, ts, "k1")
    # rollout and training of similar length: the overlap must pay (ideal ~1.6x)
    assert k1["samples_per_s"] > 1.25 * k0["samples_per_s"], (k0, k1)
    assert k0["staleness_max"] == 0 and k1["staleness_max"] == 1
    assert k0["samples_per_step"] == k1["samples_per_step"] == 2 * 16 * 8  # 2 engines
    # K = 0: measured within the runtime's overhead of the planner's prediction
    assert 0.6 < r["samples_per_s"] / k0["samples_per_s"] < 1.4
