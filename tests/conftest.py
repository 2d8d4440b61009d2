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
