"""Test-writing tasks: the hidden mutation harness and a generated task on which a weak and a
strong test file score differently (the fraction of hidden mutants they kill)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from kiln.grading.correctness import grade_correctness
from kiln.sandbox import Snapshot, create
from kiln.tasks.mutants import Mutant
from kiln.tasks.record import load_suite
from kiln.tasks.testwrite import HARNESS_NAME, generate_test_tasks, harness
from kiln.tasks.validate import apply_patch_in
from tests.tasks.test_mutate import CORE, TESTS

OTHER = "def shout(s):\n    return s.upper() + '!'\n"
OTHER_TESTS = "from mini.other import shout\n\n\ndef test_shout():\n    assert shout('a') == 'A!'\n"
STRONG = TESTS + '''

def test_more():
    assert clamp(1, 0, 3) == 1 and clamp(3, 3, 5) == 3 and clamp(9, 3, 5) == 5 and clamp(5, 3, 5) == 5
    assert window([1, 2, 3, 4], 3) == [(1, 2, 3), (2, 3, 4)] and window([1], 2) == []
    assert total([]) == 0 and total([5]) == 5 and total([-1, 1, 2]) == 2
'''
WEAK = "from mini.core import total\n\n\ndef test_total_of_nothing():\n    assert total([]) == 0\n"


def make_repo(root) -> str:
    (root / "mini").mkdir(parents=True)
    (root / "mini" / "__init__.py").write_text("")
    (root / "mini" / "core.py").write_text(CORE)
    (root / "mini" / "other.py").write_text(OTHER)
    (root / "tests").mkdir()
    (root / "tests" / "test_core.py").write_text(TESTS)
    (root / "tests" / "test_other.py").write_text(OTHER_TESTS)
    return str(root)


def test_weak_and_strong_test_files_score_differently(tmp_path, tcfg):
    repo = make_repo(tmp_path / "src")
    y = generate_test_tasks(repo, str(tmp_path / "out"), tcfg, seed=0, progress=False)
    tasks = load_suite(str(tmp_path / "out"))
    assert y.kept == len(tasks) == 1, str(y)  # test_other names too few of its module's functions
    t = tasks[0]
    assert t.category == "tests" and t.provenance["module"] == "mini/core.py"
    assert t.provenance["gold_tests"] == "tests/test_core.py" and t.gold["files"] == ["tests/test_core.py"]
    assert not os.path.exists(os.path.join(t.repo_dir, "tests/test_core.py"))  # the agent writes the tests
    assert list(t.hidden_tests()) == [f"tests/{HARNESS_NAME}"]
    n = len(t.fail_to_pass)
    assert n >= 5 and f"tests/{HARNESS_NAME}::test_new_tests_pass_on_the_code" in t.fail_to_pass
    assert t.pass_to_pass == ["tests/test_other.py::test_shout"]
    scores = {}
    with create(Snapshot.from_dir(t.repo_dir, tcfg.state_dir), tcfg) as sb:
        scores["none"] = grade_correctness(sb, t)
        for name, text in (("weak", WEAK), ("strong", STRONG)):
            with sb.fork() as f:
                f.write("tests/test_mine.py", text)
                scores[name] = grade_correctness(f, t)
        with sb.fork() as f:  # a test file that fails on the code kills every mutant, and scores nothing
            f.write("tests/test_mine.py", "def test_no():\n    assert False\n")
            scores["failing"] = grade_correctness(f, t)
        with sb.fork() as f:
            f.write("tests/test_mine.py", STRONG)
            f.write("mini/core.py", CORE.replace("out += x", "out = out + x"))
            scores["edited"] = grade_correctness(f, t)  # only tests may be added
        apply_patch_in(sb, t.solution)
        scores["gold"] = grade_correctness(sb, t)
    s = {k: v["score"] for k, v in scores.items()}
    assert s["none"] == 0 and s["failing"] == 0 and s["edited"] == 0
    assert 0 < s["weak"] < s["strong"] == 1.0 and scores["strong"]["resolved"] and not scores["weak"]["resolved"]
    assert s["gold"] == 1.0 and scores["gold"]["resolved"]


def test_a_busy_mutant_is_stopped_by_cpu_time_and_counts_as_killed(tmp_path):
    """The harness limits each nested test run's CPU time: a mutant that loops forever is stopped
    after the same work on an idle or a loaded machine (its wall timeout is only the backstop)."""
    repo = make_repo(tmp_path / "src")
    src = CORE.encode()
    at = src.index(b"out = 0")
    spin = Mutant("mini/core.py", 34, "hang", "total", at, at + len(b"out = 0"), b"out = 0",
                  b"out = 0\n    while True:\n        pass")
    (tmp_path / "src" / "tests" / "test_mine.py").write_text(STRONG)
    h = tmp_path / "src" / "tests" / HARNESS_NAME
    h.write_bytes(harness("mini/core.py", src, f"tests/{HARNESS_NAME}", ["tests/test_core.py", "tests/test_other.py",
                                                                          f"tests/{HARNESS_NAME}"], [spin], 600.0, cpu_s=2))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(h)], cwd=repo,
                       capture_output=True, text=True, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout[-2000:]
    assert time.monotonic() - t0 < 100  # stopped at 2 CPU-seconds, not the 600 s wall timeout
