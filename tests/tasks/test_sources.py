"""The registry of real-code sources: pins, offline materialisation, and every source's own suite
passing in a kiln sandbox. Tests never download: a source the cache lacks skips, saying how to
fetch it (scripts/setup.sh does)."""
from __future__ import annotations

import os
import re

import pytest
from typer.testing import CliRunner

from kiln.cli import app
from kiln.tasks import sources as S
from kiln.tasks.gen import RepoSource, python_files
from kiln.tasks.record import DEFAULT_TEST_COMMAND

runner = CliRunner()


def need(name: str) -> None:
    why = S.missing_reason(name)
    if why:
        pytest.skip(why)


def test_registry_pins():
    assert len(S.SOURCES) >= 5 and S.BUILTIN[0] == "toolz"
    for s in S.SOURCES.values():
        assert re.fullmatch(r"[0-9a-f]{64}", s.sha256) and s.sdist.endswith(".tar.gz") and s.version in s.sdist
        assert s.license in ("MIT", "BSD-3-Clause", "Apache-2.0") and s.split in ("train", "eval")
        assert s.testpaths and all(t == "." or any(t == dst or t.startswith(dst + "/") for dst in s.copy.values())
                                   for t in s.testpaths)
    assert {S.split_of(n) for n in S.BUILTIN} == {"train", "eval"}


def test_missing_source_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(S.SOURCES_ENV, str(tmp_path / "empty"))
    assert "kiln tasks sources --fetch" in S.missing_reason("parse")
    assert S.missing_reason("toolz") is None  # installed with kiln
    with pytest.raises(S.SourceError, match="not in the sources cache"):
        S.materialize("parse", str(tmp_path / "r"))
    with pytest.raises(S.SourceError, match="unknown source"):
        S.get("nosuch")
    r = runner.invoke(app, ["tasks", "mutate", "--repo", "builtin:nosuch", "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and "unknown source" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["tasks", "sources", "--no-count"])
    assert r.exit_code == 0 and "parse" in r.output and "no" in r.output.split("parse")[1].splitlines()[0]


def test_a_corrupt_cached_file_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv(S.SOURCES_ENV, str(tmp_path))
    (tmp_path / S.get("parse").sdist).write_bytes(b"not the pinned file")
    assert S.cached("parse") is None and S.missing_reason("parse")


@pytest.mark.parametrize("name", S.BUILTIN)
def test_source_materialises_and_passes_in_a_sandbox(name, tmp_path, tcfg):
    need(name)
    repo = S.materialize(name, str(tmp_path / "repo"))
    src, tests = python_files(repo)
    assert src and tests and os.path.isfile(os.path.join(repo, "pyproject.toml"))
    if name != "toolz":
        assert os.path.isfile(os.path.join(repo, "LICENSE"))
        assert not os.path.exists(os.path.join(repo, "src")) and not os.path.exists(os.path.join(repo, "setup.py"))
        again = S.materialize(name, str(tmp_path / "again"))
        for p in src + tests:  # deterministic: the same bytes every time
            assert open(os.path.join(repo, p), "rb").read() == open(os.path.join(again, p), "rb").read()
    r = RepoSource(repo, str(tmp_path / "out"), tcfg, DEFAULT_TEST_COMMAND, f"builtin:{name}", 0)
    try:
        assert r.n_tests > 50  # the baseline raised if any failed
    finally:
        r.close()


def test_sources_command_lists_files_lines_and_tests():
    need("parse")
    r = runner.invoke(app, ["tasks", "sources"])
    assert r.exit_code == 0, r.output
    row = next(ln for ln in r.output.splitlines() if ln.startswith("parse "))
    assert row.split()[1:4] == ["1.22.4", "MIT", "eval"] and int(row.split()[8]) >= 100
