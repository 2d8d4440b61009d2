"""Task records, test-outcome parsing, validation by execution and correctness grading."""
from __future__ import annotations

import os
import time

import pytest

from kiln.grading.correctness import grade_correctness, is_test_path
from kiln.sandbox import Snapshot, create
from kiln.tasks.patch import make_patch
from kiln.tasks.record import Task, TaskError, load_suite, load_task, save_task
from kiln.tasks.testrun import leading_env, parse_pytest, run_tests
from kiln.tasks.validate import apply_patch_in, validate

BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FIXED = BUGGY.replace("a - b", "a + b")
TESTS = ("from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
         "def test_mul():\n    assert mul(2, 3) == 6\n")


def make_task(tmp_path, gold=make_patch("calc.py", BUGGY, FIXED), **kw) -> Task:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "calc.py").write_text(BUGGY)
    task = Task(id=kw.pop("id", "calc-1"), prompt="add is wrong", **kw)
    return save_task(task, str(tmp_path / "suite"), repo_src=str(src), hidden={"tests/test_calc.py": TESTS},
                     solution=gold)


def test_record_round_trip_and_errors(tmp_path):
    t = make_task(tmp_path, provenance={"generator": "unit", "seed": 1})
    back = load_task(t.path)
    assert back == t and back.hidden_tests() == {"tests/test_calc.py": TESTS.encode()}
    assert [x.id for x in load_suite(str(tmp_path / "suite"))] == ["calc-1"]
    (tmp_path / "suite" / "calc-1" / "task.toml").write_text('id = "calc-1"\nprompt = "x"\ncategory = "chore"\n')
    with pytest.raises(TaskError, match="category: 'chore' is not one of bugfix"):
        load_task(t.path)
    (tmp_path / "suite" / "calc-1" / "task.toml").write_text('id = "calc-1"\nprompt = "x"\ncolour = 1\n')
    with pytest.raises(TaskError, match=r"unknown field\(s\) \['colour'\]"):
        load_task(t.path)
    (tmp_path / "suite" / "calc-1" / "task.toml").write_text('prompt = "x"\n')
    with pytest.raises(TaskError, match=r"missing required field\(s\) \['id'\]"):
        load_task(t.path)


def test_parse_pytest_outcomes():
    log = ("tests/t.py::test_a PASSED [ 25%]\ntests/t.py::test_b[x y] FAILED [ 50%]\n"
           "tests/t.py::test_c SKIPPED (why) [ 75%]\ntests/t.py::test_d XFAIL [100%]\n"
           "=== short test summary info ===\nPASSED tests/t.py::test_a\nFAILED tests/t.py::test_b[x y] - assert 1\n"
           "ERROR tests/t.py::test_a - teardown boom\nERROR tests/u.py - ImportError\n")
    st = parse_pytest(log)
    assert st["tests/t.py::test_a"] == "ERROR"  # the summary's teardown error wins
    assert st["tests/t.py::test_b[x y]"] == "FAILED" and st["tests/t.py::test_d"] == "XFAIL"
    assert st["tests/u.py"] == "ERROR"


def test_the_test_commands_environment_is_the_agents(tmp_path, tcfg):
    """An agent's own `python -m pytest` runs with the grader's environment (no autoloaded plugins)."""
    assert leading_env("A=1 B='x y' python -m pytest C=2") == {"A": "1", "B": "x y"}
    assert leading_env("python -m pytest") == {} and leading_env("unclosed 'quote") == {}
    task = make_task(tmp_path)
    with create(Snapshot.from_dir(task.repo_dir, tcfg.state_dir), task.sandbox_config(tcfg)) as sb:
        assert sb.exec("echo $PYTEST_DISABLE_PLUGIN_AUTOLOAD").output.strip() == "1"
    custom = make_task(tmp_path, id="calc-2", test_command="python -m pytest -rA")
    assert custom.sandbox_config(tcfg) is tcfg


def test_validate_derives_f2p_and_p2p(tmp_path, tcfg):
    v = validate(make_task(tmp_path), tcfg)
    assert v.ok, v.reason
    assert v.fail_to_pass == ["tests/test_calc.py::test_add"]
    assert v.pass_to_pass == ["tests/test_calc.py::test_mul"]


FLIPS = ("import os\n\n\ndef test_flips():  # fails, passes, fails: each run flips a marker in the workdir\n"
         "    here = os.path.exists('marker')\n    os.remove('marker') if here else open('marker', 'w').close()\n"
         "    assert here\n")


def test_a_flaky_test_is_caught_by_the_second_run_after_the_gold_patch(tmp_path, tcfg):
    gold = make_task(tmp_path).solution
    task = save_task(Task(id="calc-2", prompt="add is wrong"), str(tmp_path / "suite"), repo_src=str(tmp_path / "src"),
                     hidden={"tests/test_calc.py": TESTS, "tests/test_flips.py": FLIPS}, solution=gold)
    assert validate(task, tcfg).reason == "flaky tests: ['tests/test_flips.py::test_flips']"
    once = validate(task, tcfg, runs_after=1)  # for callers that run the tests again later (SFT data)
    assert once.ok and once.fail_to_pass == ["tests/test_calc.py::test_add", "tests/test_flips.py::test_flips"]
    # no run after the gold patch (a caller that grades it itself): F2P is what fails before it
    trusted = validate(task, tcfg, runs_after=0)
    assert trusted.ok and trusted.fail_to_pass == once.fail_to_pass
    assert trusted.pass_to_pass == ["tests/test_calc.py::test_mul"]


def test_a_busy_loop_is_stopped_by_cpu_time_not_the_wall_timeout(tmp_path, tcfg):
    """A hang found by CPU time stops after the same work however loaded the machine is; the
    limit stays inside that run (the sandbox's shell keeps no ulimit)."""
    task = make_task(tmp_path)
    spin = "def test_spin():\n    while True:\n        pass\n"
    with create(Snapshot.from_dir(task.repo_dir, tcfg.state_dir), task.sandbox_config(tcfg)) as sb:
        sb.write("tests/test_spin.py", spin)
        run = run_tests(sb, task.test_command, 60.0, ["tests/test_spin.py"], cpu_s=1)
        assert run.timed_out and run.duration_s < 30, run
        assert any("more than 1 CPU-seconds" in p for p in run.problems)
        assert sb.exec("ulimit -t").output.strip() == "unlimited"
        sb.write("tests/test_spin.py", "def test_quick():\n    assert True\n")
        ok = run_tests(sb, task.test_command, 60.0, ["tests/test_spin.py"], cpu_s=1)
        assert not ok.timed_out and ok.statuses == {"tests/test_spin.py::test_quick": "PASSED"}


def test_a_sleeping_hang_is_stopped_at_a_few_times_the_cpu_limit(tmp_path, tcfg):
    """A test that waits forever uses no CPU: under a CPU limit the wall stops it at WALL_PER_CPU
    times that limit, not after the task's whole timeout."""
    gold = make_task(tmp_path).solution
    task = save_task(Task(id="calc-3", prompt="add is wrong", timeout_s=600.0), str(tmp_path / "suite"),
                     repo_src=str(tmp_path / "src"), solution=gold,
                     hidden={"tests/test_calc.py": TESTS, "tests/test_wait.py": "import time\n\n\n"
                             "def test_wait():\n    time.sleep(600)\n"})
    t0 = time.monotonic()
    assert validate(task, tcfg, cpu_s=1).reason == "tests time out before the gold patch"
    assert time.monotonic() - t0 < 30


def test_validate_rejects_bad_tasks(tmp_path, tcfg):
    no_fix = make_patch("calc.py", BUGGY, BUGGY + "\n# touched\n")
    assert validate(make_task(tmp_path, gold=no_fix), tcfg).reason == "no fail-to-pass test"
    breaks = make_patch("calc.py", BUGGY, FIXED.replace("a * b", "a ** b"))
    assert validate(make_task(tmp_path, gold=breaks), tcfg).reason.startswith("gold patch breaks passing tests")
    bad = make_patch("other.py", "x = 1\n", "x = 2\n")
    assert validate(make_task(tmp_path, gold=bad), tcfg).reason.startswith("gold patch does not apply")


def test_correctness_resolved_unresolved_and_test_tampering(tmp_path, tcfg):
    task = make_task(tmp_path)
    v = validate(task, tcfg)
    task.fail_to_pass, task.pass_to_pass = v.fail_to_pass, v.pass_to_pass
    base = Snapshot.from_dir(task.repo_dir, tcfg.state_dir)
    with create(base, tcfg) as sb:
        assert grade_correctness(sb, task)["resolved"] is False  # nothing done
        # cheating: the agent writes its own passing test file at the hidden path
        sb.write("tests/test_calc.py", "def test_add():\n    pass\n\n\ndef test_mul():\n    pass\n")
        g = grade_correctness(sb, task)
        assert g["resolved"] is False and g["f2p_passed"] == 0
        apply_patch_in(sb, task.solution)
        g = grade_correctness(sb, task)
        assert g["resolved"] is True and g["p2p_kept"] == 1
        assert sb.read_text("tests/test_calc.py").startswith("def test_add")  # grading used a fork
    assert is_test_path("pkg/tests/util.py") and is_test_path("test_x.py") and not is_test_path("pkg/x.py")


def test_saved_repo_drops_its_history_but_keeps_a_nested_repository(tmp_path):
    """repo/ has no future commits (the top-level .git goes); a repository inside it is the task's data
    (a Harbor image's /app/repo with its .git, which a task may ask about)."""
    src = tmp_path / "src"
    for rel in (".git/HEAD", "data/repo/.git/HEAD", "data/repo/a.txt", "pkg/__pycache__/m.pyc", "pkg/m.py"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("x\n")
    task = save_task(Task(id="t", prompt="p"), str(tmp_path / "suite"), repo_src=str(src))
    kept = sorted(os.path.relpath(os.path.join(d, f), task.repo_dir) for d, _, fs in os.walk(task.repo_dir) for f in fs)
    assert kept == ["data/repo/.git/HEAD", "data/repo/a.txt", "pkg/m.py"]
