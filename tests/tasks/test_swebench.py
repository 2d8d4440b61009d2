"""SWE-bench rows: import from a real git clone, round trip through export, grading in real sandboxes."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from kiln.grading.correctness import grade_correctness
from kiln.sandbox import Snapshot, create
from kiln.tasks.record import TaskError, load_task
from kiln.tasks.swebench import (
    export_swebench,
    import_swebench,
    prediction_row,
    write_rows,
)
from kiln.tasks.validate import apply_patch_in

from .roundtrip import read, record

BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FIXED = BUGGY.replace("a - b", "a + b")
OLD_TESTS = "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
NEW_TESTS = "from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n" \
            "def test_mul():\n    assert mul(2, 3) == 6\n"


def git(repo, *args) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture(scope="module")
def row_file(tmp_path_factory):
    """A clone at repos/acme__calc with two commits (base, then the fix with its test), and a row."""
    root = tmp_path_factory.mktemp("sw")
    repo = root / "repos" / "acme__calc"
    (repo / "tests").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "calc.py").write_text(BUGGY)
    (repo / "tests" / "test_calc.py").write_text(OLD_TESTS)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "calc.py").write_text(FIXED)
    (repo / "tests" / "test_calc.py").write_text(NEW_TESTS)
    (repo / "tests" / "test_new.py").write_text("def test_new():\n    assert True\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "fix add")
    row = {"instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": base,
           "patch": git(repo, "diff", base, "HEAD", "--", "calc.py"),
           "test_patch": git(repo, "diff", base, "HEAD", "--", "tests"),
           "problem_statement": "add(2, 3) returns -1 instead of 5.", "hints_text": "",
           "created_at": "2024-01-02T03:04:05Z",
           "version": "0.1", "environment_setup_commit": base,
           "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]),
           "PASS_TO_PASS": json.dumps(["tests/test_calc.py::test_mul", "tests/test_new.py::test_new"]),
           "difficulty": "<15 min fix", "extra_none": None}
    write_rows([row], str(root / "rows.jsonl"))
    return root, row


def test_import_round_trip_and_grading(row_file, tmp_path, tcfg):
    root, row = row_file
    [task] = import_swebench(str(root / "rows.jsonl"), str(root / "repos"), str(tmp_path / "a"), tcfg, validate=True)
    assert task.id == "acme__calc-1" and task.category == "bugfix" and task.prompt == row["problem_statement"]
    assert task.fail_to_pass == ["tests/test_calc.py::test_add"]
    assert task.pass_to_pass == ["tests/test_calc.py::test_mul", "tests/test_new.py::test_new"]
    # the snapshot is the base commit, with no history; hidden tests are the test files after test_patch
    assert read(os.path.join(task.repo_dir, "calc.py")) == BUGGY
    assert not os.path.exists(os.path.join(task.repo_dir, ".git"))
    assert not os.path.exists(os.path.join(task.repo_dir, "tests", "test_new.py"))
    assert task.hidden_tests() == {"tests/test_calc.py": NEW_TESTS.encode(),
                                   "tests/test_new.py": b"def test_new():\n    assert True\n"}
    assert task.solution == row["patch"] and task.gold["files"] == ["calc.py"]
    assert task.test_command.endswith("tests/test_calc.py tests/test_new.py")
    assert load_task(task.path) == task

    out = export_swebench(task)
    assert list(out)[:12] == list(row)[:12]
    assert {k: out[k] for k in row if k != "test_patch"} == {k: row[k] for k in row if k != "test_patch"}
    write_rows([out], str(tmp_path / "again.jsonl"))
    [back] = import_swebench(str(tmp_path / "again.jsonl"), str(root / "repos"), str(tmp_path / "b"))
    assert record(back) == record(task)

    with create(Snapshot.from_dir(task.repo_dir, tcfg.state_dir), tcfg) as sb:
        g = grade_correctness(sb, task)
        assert g["resolved"] is False and g["f2p_passed"] == 0 and g["p2p_kept"] == 2
        apply_patch_in(sb, task.solution)
        assert grade_correctness(sb, task)["resolved"] is True
    assert prediction_row(task.id, "kiln-tiny", "diff") == {
        "instance_id": "acme__calc-1", "model_name_or_path": "kiln-tiny", "model_patch": "diff"}


def test_bad_rows(row_file, tmp_path, tcfg):
    root, row = row_file
    wrong = dict(row, instance_id="acme__calc-2", FAIL_TO_PASS=json.dumps(["tests/test_calc.py::test_mul"]))
    missing = dict(row, instance_id="other-1", repo="acme/nowhere")
    write_rows([wrong, missing], str(tmp_path / "bad.jsonl"))
    errors: list = []
    assert import_swebench(str(tmp_path / "bad.jsonl"), str(root / "repos"), str(tmp_path / "o"), tcfg,
                           validate=True, errors=errors) == []
    assert "does not give the row's outcomes" in errors[0][1] and "no local clone of 'acme/nowhere'" in errors[1][1]
    assert not os.path.exists(tmp_path / "o" / "acme__calc-2")  # a task that fails validation is removed
    with pytest.raises(TaskError, match="bad.jsonl:1"):
        import_swebench(str(tmp_path / "bad.jsonl"), str(root / "repos"), str(tmp_path / "o"), tcfg, validate=True)


# -- sympy-style bare test names, the real cause of a failed validation, a row's own environment ----------
SYM_OLD = "def double(x):\n    return x + x\n\n\ndef half(x):\n    return x * 2\n"
SYM_TESTS_OLD = "from symcalc.core import double\n\n\ndef test_double():\n    assert double(3) == 6\n"
SYM_TESTS_NEW = SYM_TESTS_OLD + "\n\ndef test_issue_24062():\n    assert half(8) == 4\n\n\n" \
    "class TestHalf:\n    def test_half_of_two(self):\n        assert half(2) == 1\n"
SYM_TESTS_NEW = SYM_TESTS_NEW.replace("import double", "import double, half")
# A conftest written for the pytest the repository pinned: a py.path hook argument, which pytest 8 warned
# about and pytest 9 (kiln's) refuses at start-up; Debian bookworm's pytest 7.2.1 runs it.
OLD_CONFTEST = "def pytest_ignore_collect(path, config):\n    return None\n"


def make_row(root, name: str, files: dict, fixed: dict, f2p: list, p2p: list, version: str = "1.12") -> dict:
    """A clone at repos/acme__<name> (base commit, then the fix with its tests) and its row."""
    repo = root / "repos" / f"acme__{name}"
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    for rel, text in fixed.items():
        (repo / rel).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "fix")
    tests = [rel for rel in fixed if "/tests/" in rel]
    src = [rel for rel in fixed if rel not in tests]
    return {"instance_id": f"acme__{name}-1", "repo": f"acme/{name}", "base_commit": base,
            "patch": git(repo, "diff", base, "HEAD", "--", *src), "test_patch": git(repo, "diff", base, "HEAD", "--", *tests),
            "problem_statement": "half(8) gives 16.", "hints_text": "", "created_at": "2024-05-06T07:08:09Z",
            "version": version, "environment_setup_commit": base,
            "FAIL_TO_PASS": json.dumps(f2p), "PASS_TO_PASS": json.dumps(p2p)}


SYM_FILES = {"symcalc/__init__.py": "", "symcalc/core.py": SYM_OLD, "symcalc/tests/__init__.py": "",
             "symcalc/tests/test_core.py": SYM_TESTS_OLD}
SYM_FIXED = {"symcalc/core.py": SYM_OLD.replace("x * 2", "x // 2"), "symcalc/tests/test_core.py": SYM_TESTS_NEW}


def test_bare_test_names_map_to_node_ids(tmp_path, tcfg):
    """sympy's rows name tests bare (`test_issue_24062`): kiln collects the test files of test_patch for
    their node ids; the row validates (those tests fail on the old code, pass after the gold patch) and
    exports with its own spelling."""
    row = make_row(tmp_path, "symcalc", SYM_FILES, SYM_FIXED, ["test_issue_24062", "test_half_of_two"],
                   ["test_double"])
    write_rows([row], str(tmp_path / "rows.jsonl"))
    [task] = import_swebench(str(tmp_path / "rows.jsonl"), str(tmp_path / "repos"), str(tmp_path / "a"), tcfg,
                             validate=True)
    path = "symcalc/tests/test_core.py"
    assert task.fail_to_pass == [f"{path}::test_issue_24062", f"{path}::TestHalf::test_half_of_two"]
    assert task.pass_to_pass == [f"{path}::test_double"]
    out = export_swebench(task)
    assert (out["FAIL_TO_PASS"], out["PASS_TO_PASS"]) == (row["FAIL_TO_PASS"], row["PASS_TO_PASS"])
    write_rows([out], str(tmp_path / "again.jsonl"))
    [back] = import_swebench(str(tmp_path / "again.jsonl"), str(tmp_path / "repos"), str(tmp_path / "b"))
    assert record(back) == record(task)

    errors: list = []
    write_rows([dict(row, FAIL_TO_PASS=json.dumps(["test_issue_99999"]))], str(tmp_path / "bad.jsonl"))
    assert import_swebench(str(tmp_path / "bad.jsonl"), str(tmp_path / "repos"), str(tmp_path / "c"),
                           errors=errors) == []
    assert "test name(s) ['test_issue_99999'] name no test function in the test files of test_patch " \
           f"({path})" in errors[0][1], errors


@pytest.fixture(scope="module")
def oldpin(tmp_path_factory):
    """A repository whose conftest needs an older pytest than kiln's (see OLD_CONFTEST), its row, and an
    install spec for it: Python 3.11, so Debian bookworm (python3-pytest 7.2.1); no pip, so nothing to fetch."""
    root = tmp_path_factory.mktemp("oldpin")
    files = {**SYM_FILES, "conftest.py": OLD_CONFTEST}
    row = make_row(root, "oldpin", files, SYM_FIXED, ["test_issue_24062"], ["test_double"], version="0.1")
    write_rows([row], str(root / "rows.jsonl"))
    return root, {"acme/oldpin": {"0.1": {"python": "3.11"}}}


def test_validation_shows_what_kept_the_tests_from_running(oldpin, tmp_path, tcfg):
    """In kiln's own environment the conftest above stops pytest 9 before any test runs, and a conftest
    that imports a package kiln lacks does not import: the refusal shows each, not just 'no fail-to-pass test'."""
    root, _ = oldpin
    errors: list = []
    assert import_swebench(str(root / "rows.jsonl"), str(root / "repos"), str(tmp_path / "a"), tcfg,
                           validate=True, errors=errors) == []
    msg = errors[0][1]
    assert "does not validate: no fail-to-pass test; the tests could not run as written" in msg, msg
    assert "before the gold patch, pytest stopped before running any test" in msg
    assert "PluginValidationError" in msg and "pytest_ignore_collect(path, config)" in msg

    files = {**SYM_FILES, "conftest.py": "import nosuchdep  # the repository's own dependency\n"}
    row = make_row(tmp_path, "needsdep", files, SYM_FIXED, ["test_issue_24062"], ["test_double"])
    write_rows([row], str(tmp_path / "rows.jsonl"))
    assert import_swebench(str(tmp_path / "rows.jsonl"), str(tmp_path / "repos"), str(tmp_path / "b"), tcfg,
                           validate=True, errors=errors) == []
    assert "conftest /workspace/conftest.py does not import: ModuleNotFoundError: No module named 'nosuchdep'" \
        in errors[1][1], errors[1][1]

    # Flask 2.0's conftest: an autouse fixture using what pytest 9 removed fails the setup of every test.
    files = {**SYM_FILES, "conftest.py": "import pytest\nfrom _pytest import monkeypatch\n\n\n"
             "@pytest.fixture(autouse=True)\ndef _environ():\n    return monkeypatch.notset\n"}
    row = make_row(tmp_path, "setuperr", files, SYM_FIXED, ["test_issue_24062"], ["test_double"])
    write_rows([row], str(tmp_path / "rows.jsonl"))
    assert import_swebench(str(tmp_path / "rows.jsonl"), str(tmp_path / "repos"), str(tmp_path / "c"), tcfg,
                           validate=True, errors=errors) == []
    assert "before the gold patch, the setup of 3 tests fails at conftest.py:7: AttributeError: module " \
           "'_pytest.monkeypatch' has no attribute 'notset'" in errors[2][1], errors[2][1]


def test_row_validates_and_the_oracle_solves_it_in_its_own_environment(oldpin, tmp_path, tcfg):
    """The same row with its install spec: its environment is built (here only the Debian base, which the
    install step bootstraps: no download), the tests run against bookworm's pytest 7.2.1 at /testbed, the
    row validates, the oracle scores 1.0 and noop 0.0 there."""
    from kiln.bench.run import run_rollout
    from kiln.config import Config, HarnessConfig
    from kiln.tasks import env_base, swebench_env
    root, specs = oldpin
    spec = swebench_env.spec_for("acme/oldpin", "0.1", specs)
    if not env_base.have_layer(env_base.cache_dir(tcfg.env_cache), env_base.base_id(spec.suite)):
        why = f"no Debian {spec.suite} base in {env_base.cache_dir(tcfg.env_cache)} (the install step builds it)"
        pytest.fail(why) if os.environ.get("CI") else pytest.skip(why)
    [task] = import_swebench(str(root / "rows.jsonl"), str(root / "repos"), str(tmp_path / "a"), tcfg,
                             validate=True, envs=True, specs=specs, log=lambda m: None)
    env = task.provenance["environment"]
    assert env["suite"] == "bookworm" and env["workdir"] == "/testbed" and env["spec"]["python"] == "3.11"
    assert task.fail_to_pass == ["symcalc/tests/test_core.py::test_issue_24062"]
    assert not task.test_command.startswith("PYTEST_DISABLE_PLUGIN_AUTOLOAD")  # the repository's own plugins
    assert load_task(task.path) == task
    cfg = task.sandbox_config(tcfg)
    assert cfg.workdir == "/testbed" and cfg.rootfs
    config = Config(sandbox=tcfg, harness=HarnessConfig(tools=["read_file", "edit_file", "run_shell"]))
    snap = Snapshot.from_dir(task.repo_dir, tcfg.state_dir)
    try:
        with create(snap, cfg) as sb:
            r = sb.exec("pwd; python -c 'import sys, pytest; print(sys.version_info[:2], pytest.__version__)'")
            assert r.output.split() == ["/testbed", "(3,", "11)", "7.2.1"], r.output
        os.makedirs(tmp_path / "bench" / "trajectories")
        rows = {p: run_rollout(task, 0, p, config, snap, str(tmp_path / "bench")) for p in ("oracle", "noop")}
    finally:
        snap.drop()
    assert rows["oracle"]["correctness"]["score"] == 1.0 and rows["noop"]["correctness"]["score"] == 0.0, rows
    assert export_swebench(task)["version"] == "0.1"
