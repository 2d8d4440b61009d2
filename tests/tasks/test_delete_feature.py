"""Feature deletion: source edits (pure) and generated tasks validated in real sandboxes."""
from __future__ import annotations

import ast
import os

import pytest

from kiln.grading.correctness import grade_correctness
from kiln.sandbox import Snapshot, create
from kiln.tasks.builtin import materialize_toolz
from kiln.tasks.delete_feature import generate_feature_deletions
from kiln.tasks.pyedit import strip_name
from kiln.tasks.record import load_suite
from kiln.tasks.validate import apply_patch_in

INIT = "from .core import add, clamp, total, window\n\n__all__ = ('add', 'clamp', 'total', 'window')\n"
CORE = '''\
def add(a, b):
    """Sum of a and b.

    More words.
    """
    return a + b


def clamp(x, lo, hi):
    """Clamp x into [lo, hi]."""
    return max(lo, min(x, hi))


def window(seq, n):
    """Consecutive windows of width n over seq."""
    return [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]


def total(seq):
    out = 0
    for x in seq:
        out = add(out, x)  # an internal caller of add
    return out


def unused():
    """Nothing tests this."""
'''
TESTS = '''\
from mini import add, clamp, total, window


def test_add():
    assert add(2, 3) == 5


def test_clamp():
    assert clamp(5, 0, 3) == 3


class TestWindow:
    def test_pairs(self):
        assert window([1, 2, 3], 2) == [(1, 2), (2, 3)]

    def test_whole(self):
        assert window([1, 2], 2) == [(1, 2)]


def test_total():
    assert total([1, 2, 3]) == 6
'''


def make_repo(root) -> str:
    (root / "mini").mkdir(parents=True)
    (root / "mini" / "__init__.py").write_text(INIT)
    (root / "mini" / "core.py").write_text(CORE)
    (root / "tests").mkdir()
    (root / "tests" / "test_core.py").write_text(TESTS)
    return str(root)


def test_strip_name_edits_imports_all_and_reexports():
    src = (b"import x\nfrom .core import (\n    add,\n    clamp,\n)\nfrom itertools import count\n"
           b"from .core import window\n\n__all__ = ['add', 'clamp', 'window']\nwindow2 = wrap(x.window)\n"
           b"window = wrap(x.window)\n")
    out, changed = strip_name("mini/__init__.py", src, "window", "mini", drop_all=False)
    assert changed and out == (b"import x\nfrom .core import (\n    add,\n    clamp,\n)\nfrom itertools import count\n"
                               b"__all__ = ['add', 'clamp']\nwindow2 = wrap(x.window)\n")
    out, _ = strip_name("mini/__init__.py", src, "count", "mini", drop_all=True)
    assert b"from itertools import count" in out  # not the package's name
    out, _ = strip_name("mini/__init__.py", src, "clamp", "mini", drop_all=True)
    assert b"from .core import (\n    add,\n)\n" in out and b"['add', 'window']" in out
    out, _ = strip_name("m/__init__.py", b"from .a import f, g\n__all__ = ('f', 'g')\n", "f", "m", drop_all=True)
    assert out == b"from .a import g\n__all__ = ('g',)\n" and ast.literal_eval(out.split(b"= ")[1].decode()) == ("g",)


def test_generate_feature_deletions(tmp_path, tcfg):
    repo = make_repo(tmp_path / "src")
    out = tmp_path / "out"
    y = generate_feature_deletions(repo, str(out), tcfg, seed=0, progress=False)
    assert y.kept == 4 and y.rejected == {"no test uses the feature": 1}, str(y)
    tasks = {t.provenance["name"]: t for t in load_suite(str(out))}
    assert sorted(tasks) == ["mini.core.add", "mini.core.clamp", "mini.core.total", "mini.core.window"]

    win = tasks["mini.core.window"]
    assert win.category == "feature"
    assert win.prompt == ("Add `mini.window(seq, n)` to `mini/core.py`: Consecutive windows of width n over seq. "
                          "Also import or export it in `mini/__init__.py`.")
    assert win.fail_to_pass == ["tests/test_core.py::TestWindow::test_pairs", "tests/test_core.py::TestWindow::test_whole"]
    assert "tests/test_core.py::test_add" in win.pass_to_pass  # failed only at the hidden file's import
    visible = open(os.path.join(win.repo_dir, "tests/test_core.py")).read()
    assert "TestWindow" not in visible and "window" not in visible and "def test_add" in visible
    assert win.hidden_tests() == {"tests/test_core.py": TESTS.encode()}
    assert "def window" not in open(os.path.join(win.repo_dir, "mini/core.py")).read()
    assert open(os.path.join(win.repo_dir, "mini/__init__.py")).read() == (
        "from .core import add, clamp, total\n\n__all__ = ('add', 'clamp', 'total')\n")
    assert win.gold["files"] == ["mini/__init__.py", "mini/core.py"]

    add = tasks["mini.core.add"]  # test_total uses add through its internal caller: a feature test too
    assert add.fail_to_pass == ["tests/test_core.py::test_add", "tests/test_core.py::test_total"]
    assert add.prompt.startswith("Add `mini.add(a, b)` to `mini/core.py`: Sum of a and b.")

    for t in (win, add):
        with create(Snapshot.from_dir(t.repo_dir, tcfg.state_dir), tcfg) as sb:
            assert grade_correctness(sb, t)["resolved"] is False
            apply_patch_in(sb, t.solution)
            assert sb.read_text("mini/core.py") == CORE and sb.read_text("mini/__init__.py") == INIT
            assert grade_correctness(sb, t)["resolved"] is True


@pytest.mark.slow
def test_feature_deletions_of_toolz(tmp_path, tcfg):
    import time
    repo = materialize_toolz(str(tmp_path / "toolz"))
    t0 = time.monotonic()
    y = generate_feature_deletions(repo, str(tmp_path / "out"), tcfg, max_tasks=20, seed=0, progress=False,
                                   source="toolz")
    print(f"\n{y}\n{time.monotonic() - t0:.0f}s")
    assert y.kept >= 20
    assert len(load_suite(str(tmp_path / "out"))) == y.kept


SPAN_INIT = "from .core import Span, add\n"
SPAN_UTIL = "def _norm(x):\n    return int(x)\n\n\ndef other(x):\n    return x * 2\n"
SPAN_CORE = '''\
from .util import _norm, other


def add(a, b):
    return other(a) // 2 + b


class Span:
    """A closed integer range."""

    def __init__(self, lo, hi):
        self.lo, self.hi = _norm(lo), _norm(hi)

    def __len__(self):
        return _width(self)

    def __contains__(self, x):
        return self.lo <= x <= self.hi


def _width(s):
    return s.hi - s.lo + 1
'''
SPAN_TESTS = '''\
from mini import Span, add
from mini.util import other


def test_add():
    assert add(2, 3) == 5


def test_other():
    assert other(4) == 8


def test_span():
    s = Span("1", 3.0)
    assert len(s) == 3 and 2 in s and 4 not in s
'''


def _feature_groups(tmp_path, tcfg, files: dict[str, str]):
    """generate_feature_groups (min_lines 8) over a project of `files` (path -> text); its Yield and tasks by name."""
    from kiln.tasks.delete_feature import generate_feature_groups
    root = tmp_path / "src"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    out = tmp_path / "out"
    y = generate_feature_groups(str(root), str(out), tcfg, seed=0, progress=False, min_lines=8)
    return y, {t.provenance["name"]: t for t in load_suite(str(out))}


def test_multi_unit_deletion_spans_files(tmp_path, tcfg):
    y, tasks = _feature_groups(tmp_path, tcfg, {"mini/__init__.py": SPAN_INIT, "mini/util.py": SPAN_UTIL,
                                                "mini/core.py": SPAN_CORE, "tests/test_core.py": SPAN_TESTS})
    assert list(tasks) == ["mini.core.Span"], str(y)  # add (3 lines) is under min_lines; other has no helper
    t = tasks["mini.core.Span"]
    assert t.provenance["generator"] == "delete_feature_multi" and t.difficulty == 3
    assert t.provenance["units"] == ["mini.core.Span", "mini.core._width", "mini.util._norm"]
    assert t.gold["files"] == ["mini/__init__.py", "mini/core.py", "mini/util.py"]  # the deletion spans files
    assert t.fail_to_pass == ["tests/test_core.py::test_span"]
    core = open(os.path.join(t.repo_dir, "mini/core.py")).read()
    assert "Span" not in core and "_width" not in core and core.startswith("from .util import other\n")
    assert open(os.path.join(t.repo_dir, "mini/util.py")).read() == "def other(x):\n    return x * 2\n"
    assert "test_span" not in open(os.path.join(t.repo_dir, "tests/test_core.py")).read()
    assert "`Span`" in t.prompt and "private helper" in t.prompt or "internal pieces" in t.prompt or "helpers" in t.prompt
    with create(Snapshot.from_dir(t.repo_dir, tcfg.state_dir), tcfg) as sb:
        assert grade_correctness(sb, t)["resolved"] is False
        apply_patch_in(sb, t.solution)
        assert sb.read_text("mini/core.py") == SPAN_CORE and sb.read_text("mini/util.py") == SPAN_UTIL
        assert grade_correctness(sb, t)["resolved"] is True


RING_CORE = '''\
def add(a, b):
    return a + b


class Ring:
    """Integers modulo n."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def wrap(self, x):
        return x % self.n
'''
RING_TESTS = '''\
import unittest

from mini.core import Ring, add


class CountingRing(Ring):
    """A test-only subclass: it goes with Ring, or the visible file would not import."""


Alias = CountingRing


class RingMixin:
    def test_size(self):
        self.assertEqual(len(self.Cls(3)), 3)


class RingCase(unittest.TestCase, RingMixin):  # no tests of its own: all inherited
    Cls = Alias


class AddCase(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)
'''


def test_deletion_with_unittest_classes_and_test_helpers(tmp_path, tcfg):
    """cachetools' shape: unittest.TestCase classes not named Test*, a test-only subclass of the
    feature and an alias of it in the test module, a test class whose tests are all inherited."""
    y, tasks = _feature_groups(tmp_path, tcfg, {"mini/__init__.py": "", "mini/core.py": RING_CORE,
                                                "tests/test_ring.py": RING_TESTS})
    assert list(tasks) == ["mini.core.Ring"], str(y)
    t = tasks["mini.core.Ring"]
    assert t.fail_to_pass == ["tests/test_ring.py::RingCase::test_size"]
    assert t.pass_to_pass == ["tests/test_ring.py::AddCase::test_add"]
    visible = open(os.path.join(t.repo_dir, "tests/test_ring.py")).read()
    assert "Ring," not in visible and "CountingRing" not in visible and "Alias" not in visible
    assert "RingCase" not in visible and "class AddCase" in visible and "class RingMixin" in visible
    assert t.hidden_tests() == {"tests/test_ring.py": RING_TESTS.encode()}
