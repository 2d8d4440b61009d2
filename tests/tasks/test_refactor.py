"""Move refactors: the new module and the re-export (pure), and a generated task whose hidden test
fails before the gold change and passes after it, validated in real sandboxes."""
from __future__ import annotations

import os

import pytest

from kiln.grading.correctness import grade_correctness
from kiln.sandbox import Snapshot, create
from kiln.tasks.record import load_suite
from kiln.tasks.refactor import generate_moves, snake
from kiln.tasks.sources import materialize, missing_reason
from kiln.tasks.validate import apply_patch_in, write_hidden_tests

INIT = "from .geometry import area, scale\n"
GEOMETRY = '''\
"""Shapes."""
import math
from functools import reduce

_UNIT = 1.0


def scale(x, k):
    return x * k * _UNIT


def _sq(r):
    return r * r


def area(r):
    """Area of a circle of radius r."""
    return math.pi * _sq(r)


def product(xs):
    return reduce(lambda a, b: a * b, xs, _UNIT)
'''
TESTS = '''\
import math

from mini import area, scale
from mini.geometry import product


def test_area():
    assert area(2) == math.pi * 4


def test_scale():
    assert scale(2, 3) == 6


def test_product():
    assert product([2, 3]) == 6
'''


def test_snake():
    assert snake("FunctionBuilder") == "function_builder" and snake("area") == "area" and snake("LRU") == "lru"


def test_move_hidden_test_fails_before_and_passes_after_gold(tmp_path, tcfg):
    root = tmp_path / "src"
    (root / "mini").mkdir(parents=True)
    (root / "mini" / "__init__.py").write_text(INIT)
    (root / "mini" / "geometry.py").write_text(GEOMETRY)
    (root / "tests").mkdir()
    (root / "tests" / "test_geometry.py").write_text(TESTS)
    y = generate_moves(str(root), str(tmp_path / "out"), tcfg, seed=0, progress=False)
    tasks = {t.provenance["name"]: t for t in load_suite(str(tmp_path / "out"))}
    # scale and product use _UNIT, which stays behind: moving them would import the old module back
    assert sorted(tasks) == ["mini.geometry.area"] and y.rejected == {"moved code uses other code of its module": 2}
    t = tasks["mini.geometry.area"]
    assert t.category == "refactor" and t.provenance["units"] == ["_sq", "area"]
    assert t.provenance["new_file"] == "mini/area.py" and ("mini.area" in t.prompt or "mini/area.py" in t.prompt)
    assert sorted(t.gold["files"]) == ["mini/area.py", "mini/geometry.py"]
    hidden = "tests/test_area_moved.py"
    assert list(t.hidden_tests()) == [hidden] and all(i.startswith(hidden) for i in t.fail_to_pass)
    assert "tests/test_geometry.py::test_area" in t.pass_to_pass  # the old behaviour is kept
    assert open(os.path.join(t.repo_dir, "mini/geometry.py")).read() == GEOMETRY  # the agent starts from it
    with create(Snapshot.from_dir(t.repo_dir, tcfg.state_dir), tcfg) as sb:
        before = grade_correctness(sb, t)
        assert before["resolved"] is False and before["f2p_passed"] == 0 and before["p2p_kept"] == before["p2p_total"]
        apply_patch_in(sb, t.solution)
        new = sb.read_text("mini/area.py")
        assert new.startswith('"""area (moved here from mini.geometry)."""\n\nimport math\n\n\ndef _sq(r):')
        old = sb.read_text("mini/geometry.py")
        assert "def area" not in old and "def _sq" not in old and "from .area import area" in old
        after = grade_correctness(sb, t)
        assert after["resolved"] is True and after["f2p_passed"] == len(t.fail_to_pass) == 2
        # A re-export in the other direction (the code left where it was) does not pass the hidden test.
        sb.write("mini/geometry.py", GEOMETRY)
        sb.write("mini/area.py", "from .geometry import area  # noqa: F401\n")
        write_hidden_tests(sb, t)
        assert grade_correctness(sb, t)["resolved"] is False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_moves_of_a_real_source(tmp_path, tcfg):
    why = missing_reason("boltons")
    if why:
        pytest.skip(why)
    repo = materialize("boltons", str(tmp_path / "boltons"))
    y = generate_moves(repo, str(tmp_path / "out"), tcfg, max_tasks=2, seed=0, progress=False, source="builtin:boltons",
                       min_lines=40)
    assert y.kept == 2, str(y)
    assert all(t.gold["lines_added"] + t.gold["lines_removed"] >= 80 for t in load_suite(str(tmp_path / "out")))
