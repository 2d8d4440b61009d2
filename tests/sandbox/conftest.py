"""Fixtures for sandbox tests: real namespaces, a private state dir, a small repository."""
from __future__ import annotations

import os

import pytest

from kiln.config import SandboxConfig
from kiln.sandbox import Snapshot, create
from kiln.sandbox.service import stop_service


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kiln-state"))
    yield path
    stop_service(path)


def built_root() -> list[str]:
    """The Debian base the install step builds (`kiln env build-base`): tests never download it."""
    from kiln.tasks import env_base
    cache = env_base.cache_dir()
    layer = env_base.base_id(env_base.DEFAULT_SUITE)
    if not env_base.have_layer(cache, layer):
        why = f"no Debian base in {cache}: run `kiln env build-base` (.ci/run does)"
        pytest.fail(why) if os.environ.get("CI") else pytest.skip(why)
    return [env_base.layer_tree(cache, layer)]


# Every sandbox test runs twice: over the host's system (kiln's default) and over a built Debian root
# (a task environment), where each isolation property must hold just the same.
@pytest.fixture(scope="session", params=["host", "built"])
def cfg(request, state_dir):
    root = built_root() if request.param == "built" else []
    return SandboxConfig(state_dir=state_dir, memory_mb=256, max_procs=64, file_size_mb=8, disk_mb=32,
                         tmp_mb=32, output_bytes=4096, timeout_s=30, idle_timeout_s=20, pool_size=2, rootfs=root)


@pytest.fixture(scope="session")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_calc.py").write_text("from pkg.calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    (root / "README.md").write_text("hello\n")
    (root / "data.bin").write_bytes(bytes(range(256)))
    return root


@pytest.fixture(scope="session")
def base(repo, state_dir):
    return Snapshot.from_dir(repo, state_dir)


@pytest.fixture
def box(base, cfg):
    sb = create(base, cfg)
    yield sb
    sb.close()


def host_mounts() -> str:
    with open(f"/proc/{os.getpid()}/mountinfo") as f:
        return f.read()
