"""Bug injection: mutation operators (pure) and generated tasks validated in real sandboxes."""
from __future__ import annotations

import os

import pytest

from kiln.grading.correctness import grade_correctness
from kiln.sandbox import Snapshot, create
from kiln.tasks.builtin import materialize_toolz
from kiln.tasks.gen import GeneratorError
from kiln.tasks.mutants import find_mutants
from kiln.tasks.mutate import generate_mutants
from kiln.tasks.record import load_suite
from kiln.tasks.testrun import run_tests
from kiln.tasks.validate import apply_patch_in

CORE = '''\
def clamp(x, lo, hi):
    """Clamp x into [lo, hi]."""
    if x < lo:  # below
        return lo
    if x > hi:
        return hi
    return x


def window(seq, n):
    """Consecutive windows of width n over seq."""
    return [tuple(seq[i:i + n]) for i in range(0, len(seq) - n + 1)]


def total(seq):
    out = 0
    for x in seq:
        out += x
    return out
'''
TESTS = '''\
from mini.core import clamp, total, window


def test_clamp():
    assert clamp(5, 0, 3) == 3 and clamp(-1, 0, 3) == 0 and clamp(2, 0, 3) == 2


def test_clamp_edges():
    assert clamp(0, 0, 3) == 0 and clamp(3, 0, 3) == 3


def test_window():
    assert window([1, 2, 3], 2) == [(1, 2), (2, 3)]


def test_total():
    assert total([1, 2, 3]) == 6
'''


def make_repo(root, tests=TESTS) -> str:
    (root / "mini").mkdir(parents=True)
    (root / "mini" / "__init__.py").write_text("")
    (root / "mini" / "core.py").write_text(CORE)
    (root / "tests").mkdir()
    (root / "tests" / "test_core.py").write_text(tests)
    return str(root)


def test_mutants_are_single_surgical_edits():
    src = CORE.encode()
    muts = find_mutants("mini/core.py", src)
    kinds = {m.kind for m in muts}
    assert {"comparison", "operator", "constant", "return value", "index off-by-one", "arguments swapped",
            "statement removed"} <= kinds
    for m in muts:
        out = m.apply(src)
        assert out[:m.start] == src[:m.start] and out[m.start + len(m.replacement):] == src[m.end:]
        compile(out, "x", "exec")
    lt = next(m for m in muts if m.kind == "comparison" and m.line == 3)
    assert lt.apply(src).decode().splitlines()[2] == "    if x <= lo:  # below"  # comment and spacing kept
    assert not any(m.line in (2, 11) for m in muts)  # docstrings are not mutated
    assert len({m.apply(src) for m in muts}) == len(muts)  # deduplicated


def test_generate_mutants_validated_tasks(tmp_path, tcfg):
    repo = make_repo(tmp_path / "src")
    y = generate_mutants(repo, str(tmp_path / "out"), tcfg, max_tasks=3, seed=1, progress=False)
    assert y.kept == 3 and y.candidates == 3 + sum(y.rejected.values()), str(y)
    tasks = load_suite(str(tmp_path / "out"))
    assert len(tasks) == 3 and not os.path.exists(tmp_path / "out" / ".staging")
    for t in tasks:
        assert t.category == "bugfix" and t.fail_to_pass and t.provenance["generator"] == "mutate"
        assert t.provenance["file"] == "mini/core.py" and t.provenance["function"].startswith("mini.core.")
        assert t.prompt.startswith(f"`{t.provenance['function']}` misbehaves: ")
        assert list(t.hidden_tests()) == ["tests/test_core.py"]  # hidden, and kept visible unchanged
        assert open(os.path.join(t.repo_dir, "tests/test_core.py")).read() == TESTS
        assert open(os.path.join(t.repo_dir, "mini/core.py")).read() != CORE
        assert not os.path.exists(os.path.join(t.repo_dir, ".git"))
    for t in tasks[:2]:
        with create(Snapshot.from_dir(t.repo_dir, tcfg.state_dir), tcfg) as sb:
            assert grade_correctness(sb, t)["resolved"] is False
            apply_patch_in(sb, t.solution)
            assert sb.read_text("mini/core.py") == CORE
            assert grade_correctness(sb, t)["resolved"] is True
    generate_mutants(repo, str(tmp_path / "out2"), tcfg, max_tasks=3, seed=1, workers=1, progress=False)
    assert sorted(os.listdir(tmp_path / "out2")) == [t.id for t in tasks]  # the seed fixes the sample


def test_generate_mutants_needs_passing_tests(tmp_path, tcfg):
    repo = make_repo(tmp_path / "src", TESTS.replace("== 6", "== 7"))
    with pytest.raises(GeneratorError, match=r"own tests must pass.*test_total"):
        generate_mutants(repo, str(tmp_path / "out"), tcfg, progress=False)
    # Passes, then skips: every run passes, but validation takes the baseline for the tree after a
    # gold patch only because two runs of it agree.
    once = TESTS + "\n\ndef test_once():\n    import os, pytest\n    if os.path.exists('seen'):\n" \
                   "        pytest.skip('ran before')\n    open('seen', 'w').close()\n"
    repo = make_repo(tmp_path / "src2", once)
    with pytest.raises(GeneratorError, match=r"different outcomes on two runs.*test_once.*--deselect"):
        generate_mutants(repo, str(tmp_path / "out"), tcfg, progress=False)


def test_materialized_toolz_imports_its_own_copy(tmp_path, tcfg):
    repo = materialize_toolz(str(tmp_path / "toolz"))
    assert os.path.isfile(os.path.join(repo, "toolz", "tests", "test_itertoolz.py"))
    with create(Snapshot.from_dir(repo, tcfg.state_dir), tcfg) as sb:
        out = sb.exec("python -c 'import toolz, tlz.functoolz; print(toolz.__file__)'", cwd=tcfg.workdir)
        assert out.exit_code == 0 and out.output.strip() == f"{tcfg.workdir}/toolz/__init__.py", out.output
        sb.write("toolz/tests/test_probe.py", "import toolz\n\n\ndef test_probe():\n"
                                             f"    assert toolz.__file__.startswith('{tcfg.workdir}/')\n")
        run = run_tests(sb, "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -q -p no:cacheprovider", 120,
                        ["toolz/tests/test_probe.py", "toolz/tests/test_recipes.py"])
    assert run.passed("toolz/tests/test_probe.py::test_probe") and len(run.statuses) > 2


@pytest.mark.slow
def test_mutants_of_toolz(tmp_path, tcfg):
    import time
    repo = materialize_toolz(str(tmp_path / "toolz"))
    t0 = time.monotonic()
    y = generate_mutants(repo, str(tmp_path / "out"), tcfg, max_tasks=20, seed=0, progress=False, source="toolz")
    print(f"\n{y}\n{time.monotonic() - t0:.0f}s")
    assert y.kept >= 20
    assert len(load_suite(str(tmp_path / "out"))) == y.kept


def test_multi_site_mutants_are_caught_and_need_every_fix(tmp_path, tcfg):
    from kiln.tasks.mutate import apply_all, generate_multi_mutants, mutant_groups
    groups = mutant_groups(find_mutants("mini/core.py", CORE.encode()), seed=0)
    assert groups and all(2 <= len(g) <= 3 and len({m.function.split(".")[0] for m in g}) == 1 for g in groups)
    repo = make_repo(tmp_path / "src")
    y = generate_multi_mutants(repo, str(tmp_path / "out"), tcfg, max_tasks=2, seed=0, progress=False)
    tasks = load_suite(str(tmp_path / "out"))
    assert y.kept == len(tasks) == 2, str(y)
    for t in tasks:
        sites = t.provenance["sites"]
        assert t.category == "bugfix" and t.provenance["generator"] == "mutate_multi" and len(sites) >= 2
        assert t.fail_to_pass and len(t.prompt) > 150
        mutated = open(os.path.join(t.repo_dir, "mini/core.py")).read()
        assert mutated != CORE and all(s["mutant"] in mutated or not s["mutant"] for s in sites)
        with create(Snapshot.from_dir(t.repo_dir, tcfg.state_dir), tcfg) as sb:
            assert grade_correctness(sb, t)["resolved"] is False  # the mutant is caught
            # Fix all sites but one: still not solved (a test catches each site on its own).
            muts = find_mutants("mini/core.py", CORE.encode())
            group = [next(m for m in muts if m.line == s["line"] and m.kind == s["mutation"]
                          and m.replacement.decode() == s["mutant"]) for s in sites]
            assert apply_all(CORE.encode(), group).decode() == mutated
            sb.write("mini/core.py", apply_all(CORE.encode(), group[1:]))
            assert grade_correctness(sb, t)["resolved"] is False
            sb.write("mini/core.py", mutated)
            apply_patch_in(sb, t.solution)
            assert sb.read_text("mini/core.py") == CORE
            assert grade_correctness(sb, t)["resolved"] is True
    assert apply_all(b"abc", []) == b"abc"
