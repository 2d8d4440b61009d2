"""Suite-wide fixtures and hooks: a sandbox config per test module; `gpu` tests skip without a GPU."""

import pytest

from kiln.config import SandboxConfig
from kiln.sandbox.service import stop_service


@pytest.fixture(scope="module")
def tcfg(tmp_path_factory):
    """A small sandbox config with a state dir (and so a sandbox service) of the module's own."""
    state = str(tmp_path_factory.mktemp("state"))
    yield SandboxConfig(state_dir=state, memory_mb=512, disk_mb=64, tmp_mb=64)
    stop_service(state)


@pytest.fixture(scope="module")
def calc_box(tcfg, tmp_path_factory):
    """A sandbox over a one-file repository (calc.py, whose add() subtracts), for policy rollouts."""
    from kiln.sandbox import Snapshot, create

    repo = tmp_path_factory.mktemp("repo")
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    sb = create(Snapshot.from_dir(repo, tcfg.state_dir), tcfg)
    yield sb
    sb.close()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return  # don't pay for importing torch when nothing needs it
    import torch

    if not torch.cuda.is_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A real (untrained) checkpoint directory: tokenizer, MoE weights and MTP (tests/tiny_model.py)."""
    from tests.tiny_model import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One Ray for the whole pytest run (it takes ~30-40 s to start on 2 loaded cores), made on first
    use: two nodes on loopback, the head with the custom resource trainer_node, the other with
    rollout_node. The process is its driver (ray.init(address=...)); kiln's own connect() then finds
    Ray initialised and uses it. Folders shipped to the second node unpack under a tmp cache."""
    import os

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every node on 127.0.0.1 (kiln/cluster.py)
    os.environ["KILN_SHIP_CACHE"] = str(tmp_path_factory.mktemp("shipped"))
    os.environ["RAY_worker_niceness"] = "0"  # as kiln's local Ray: actors keep the test's priority
    import ray
    from ray.cluster_utils import Cluster

    small = {"object_store_memory": 128 << 20}
    for attempt in range(3):  # Ray gives a raylet 30 s to register: a machine busy with other work can miss it
        c = Cluster()
        try:
            c.add_node(num_cpus=2, resources={"trainer_node": 1}, include_dashboard=False, **small)
            c.add_node(num_cpus=2, resources={"rollout_node": 4}, **small)
            break
        except Exception:
            c.shutdown()
            if attempt == 2:
                raise
    ray.init(address=c.address, log_to_driver=True)
    yield c
    ray.shutdown()
    c.shutdown()
