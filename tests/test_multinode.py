"""Multi-node placement on a real two-raylet Ray cluster (``ray.cluster_utils.Cluster``).

This module runs its own Ray session (it does not use the shared ``cluster`` fixture): a head
node and one worker node on this machine, each declaring one virtual device.
"""

from __future__ import annotations

import os

import pytest
import ray

import m2flow
from m2flow import Worker, group_method
from m2flow.core.cluster import VIRTUAL_DEVICE_RESOURCE

pytestmark = pytest.mark.e2e

# Same loopback address as the embedded m2flow session (see m2flow.core.cluster._LOOPBACK).
NODE_IP = "127.0.0.2"


class WhereAmI(Worker):
    @group_method
    def where(self):
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "devices": self.device_ids}


@pytest.fixture(scope="module")
def two_nodes(tmp_ray_dir_factory):
    from ray.cluster_utils import Cluster as RayCluster

    if ray.is_initialized():  # a session left by another module
        ray.shutdown()
    root = tmp_ray_dir_factory("m2mn-")
    temp_dir = str(root / "ray")
    # cluster_utils writes the cluster address under Ray's default temp dir (/tmp/ray unless
    # RAY_TMPDIR is set): keep that inside our temp dir too.
    saved_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(root)
    os.makedirs(temp_dir, exist_ok=True)
    common = {
        "num_cpus": 1,
        "resources": {VIRTUAL_DEVICE_RESOURCE: 1},
        "node_ip_address": NODE_IP,
        "temp_dir": temp_dir,
    }
    rc = RayCluster(initialize_head=True, head_node_args={**common, "include_dashboard": False})
    try:
        worker_node = rc.add_node(**common)
        rc.wait_for_nodes()
        cluster = m2flow.Cluster(address=rc.address)
        try:
            yield rc, worker_node, cluster
        finally:
            cluster.shutdown()
    finally:
        rc.shutdown()
        if saved_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved_tmpdir


def test_inventory_two_nodes_node_major(two_nodes):
    rc, worker_node, cluster = two_nodes
    assert len(cluster.nodes) == 2
    assert [d.global_id for d in cluster.devices] == [0, 1]
    head, other = cluster.nodes
    assert head.is_head and not other.is_head
    assert head.node_id == rc.head_node.node_id
    assert other.node_id == worker_node.node_id
    assert [d.global_id for d in head.devices] == [0] and [d.global_id for d in other.devices] == [
        1
    ]
    assert cluster.device(0).node_id == head.node_id and cluster.device(1).node_id == other.node_id
    assert all(d.kind == "virtual" and d.local_id == 0 for d in cluster.devices)
    desc = cluster.describe()
    assert "node 0 (head)" in desc and "node 1" in desc
    with pytest.raises(ValueError, match="out of range"):
        cluster.device(2)


def test_placement_pins_ranks_to_nodes(two_nodes):
    _, _, cluster = two_nodes
    g = WhereAmI.launch(cluster, placement=[0, 1], name="where")
    r0, r1 = g.where().wait(timeout=120)
    assert (r0["rank"], r1["rank"]) == (0, 1)
    assert r0["node_id"] == cluster.nodes[0].node_id
    assert r1["node_id"] == cluster.nodes[1].node_id
    assert (r0["devices"], r1["devices"]) == ([0], [1])
    # reversed placement: rank 0 on node 1
    rev = WhereAmI.launch(cluster, placement=[1, 0], name="where_rev")
    q0, q1 = rev.where().wait(timeout=120)
    assert q0["node_id"] == cluster.nodes[1].node_id and q1["node_id"] == cluster.nodes[0].node_id


def test_rank_spanning_nodes_rejected(two_nodes):
    _, _, cluster = two_nodes
    with pytest.raises(ValueError, match="spans several nodes"):
        WhereAmI.launch(cluster, placement=[[0, 1]], name="span")
