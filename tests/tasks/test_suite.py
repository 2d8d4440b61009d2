"""Frozen suites: the plan, the errors, and a small build of kiln-bench-v1 rebuilt byte for byte."""
from __future__ import annotations

import json
import os

import pytest

from kiln.tasks import sources as S
from kiln.tasks.record import load_suite
from kiln.tasks.suite import KILN_BENCH_V1, build_suite, plan, tree_digest


def test_kiln_bench_v1_plan():
    steps = plan(KILN_BENCH_V1)
    projects = {p for p, _, _ in steps}
    assert len(projects) >= 6 and projects <= set(S.BUILTIN)
    by_cat = {}
    for _, cat, n in steps:
        by_cat[cat] = by_cat.get(cat, 0) + n
    assert set(by_cat) == {"bugfix", "feature", "refactor", "tests"} and all(n >= 20 for n in by_cat.values())
    assert sum(by_cat.values()) >= 150
    assert {S.split_of(p) for p in projects} == {"train", "eval"}
    assert plan(KILN_BENCH_V1, ["toolz"], cap=1) == [("toolz", c, 1) for c in ("bugfix", "feature", "refactor", "tests")]
    assert plan(KILN_BENCH_V1, ["toolz", "tabulate"], categories=["feature"]) == [("toolz", "feature", 3),
                                                                              ("tabulate", "feature", 1)]
    assert all(n > 0 for _, _, n in steps) and ("inflection", "refactor") not in {(p, c) for p, c, _ in steps}


def test_build_errors(tmp_path, tcfg, monkeypatch):
    with pytest.raises(ValueError, match="unknown suite"):
        build_suite("nope", str(tmp_path), tcfg)
    with pytest.raises(ValueError, match="not projects of kiln-bench-v1: nosuch"):
        build_suite("kiln-bench-v1", str(tmp_path), tcfg, projects=["nosuch"])
    with pytest.raises(ValueError, match="not categories of kiln-bench-v1: docs"):
        build_suite("kiln-bench-v1", str(tmp_path), tcfg, categories=["docs"])
    monkeypatch.setenv(S.SOURCES_ENV, str(tmp_path / "empty"))
    with pytest.raises(S.SourceError, match="kiln tasks sources --fetch"):
        build_suite("kiln-bench-v1", str(tmp_path / "out"), tcfg, projects=["parse"])


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two builds of four toolz tasks: about 3 minutes on an idle 2-core machine
def test_small_build_is_byte_identical(tmp_path, tcfg):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    m = build_suite("kiln-bench-v1", a, tcfg, projects=["toolz"], cap=1, log=lambda _: None)
    build_suite("kiln-bench-v1", b, tcfg, projects=["toolz"], cap=1, workers=1, log=lambda _: None)
    tasks = load_suite(a)
    assert {t.category for t in tasks} == {"bugfix", "feature", "refactor", "tests"}, m["yields"]
    assert all(t.provenance["split"] == "train" and t.provenance["suite"] == "kiln-bench-v1" for t in tasks)
    assert sorted(os.listdir(a)) == ["suite.json", "train"]
    assert json.load(open(os.path.join(a, "suite.json")))["splits"]["train"] == sorted(t.id for t in tasks)
    da, db = tree_digest(a), tree_digest(b)
    assert da == db and len(da) > 100  # every file of every task folder, and the manifest
