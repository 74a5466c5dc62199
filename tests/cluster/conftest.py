"""A real Ray cluster of two nodes on this machine for the cluster tests (ray.cluster_utils.Cluster, as
Ray's own tests make one), one CPU each, shared by the test modules in turn: the replicas' module
deploys its application and deletes it; the split's module places its stages after. Skipped where Ray
Serve is not installed (the `cluster` extra; CI installs it)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_nodes() -> Iterator[str]:
    """The cluster's address, with this process connected to it."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ember[cluster]')")
    import ray
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address, namespace="ember", log_to_driver=False)
    yield nodes.address
    ray.shutdown()
    nodes.shutdown()
