"""`python -m pytest` forked from the zygote's imported pytest (kiln/sandbox/pytest_fork.py): which
commands take that path, and that a test sees what a fresh interpreter run by bash gives it."""
from __future__ import annotations

import json
import sys

import pytest

from kiln.sandbox import Snapshot, create
from kiln.sandbox.pytest_fork import RUN_IMPORTS, plan
from kiln.tasks.testrun import SIGXCPU_EXIT, run_tests

COMMAND = "PYTHONHASHSEED=0 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -q -p no:cacheprovider"
ENV = {"PATH": f"{sys.prefix}/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
BASE = {"exe": sys.executable, "stdlib": []}

# What a test can observe of the interpreter that runs it. `sys.flags.no_site` is the one known
# difference (the zygote runs `python -S`; site's builtins are added back), so it shows which path ran;
# `frozen`: the objects a forked run inherits are out of the GC's reach (gc.freeze in the zygote).
# `run_imports`: the modules the zygote imports ahead of a run, which a fresh run has imported too.
PROBE = f"RUN_IMPORTS = {RUN_IMPORTS!r}\n" + '''import builtins, gc, json, os, signal, site, sys

def test_probe():
    seen = {"env": dict(os.environ), "path": sys.path, "cwd": os.getcwd(), "argv0": os.path.basename(sys.argv[0]),
            "main": getattr(sys.modules["__main__"], "__file__", None), "hash": hash("kiln"),
            "sigpipe": str(signal.getsignal(signal.SIGPIPE)), "sigint": str(signal.getsignal(signal.SIGINT)),
            "builtins": [hasattr(builtins, n) for n in ("exit", "quit", "help", "license")],
            "bytecode": sys.dont_write_bytecode, "encoding": sys.stdout.encoding, "kiln": "kiln" in sys.modules,
            "meta_path": [getattr(f, "__name__", type(f).__name__) for f in sys.meta_path],
            "site": [site.ENABLE_USER_SITE, site.USER_SITE], "forked": sys.flags.no_site,
            "frozen": gc.get_freeze_count() > 0, "run_imports": [m in sys.modules for m in RUN_IMPORTS]}
    with open("/tmp/probe.json", "w") as f:
        json.dump(seen, f)
'''


@pytest.mark.parametrize("command", [
    "python -m pytest", "python3 -m pytest -q tests/test_a.py::test_b", COMMAND, COMMAND + " -v 'tests/a b.py'",
    f"( ulimit -S -t 5; {COMMAND} -v  ) > /tmp/kiln-test-output.log 2>&1", f"( {COMMAND} -v ) > /tmp/x.log 2>&1",
    'python -m pytest -k "add and not slow"'])
def test_plan_accepts_plain_pytest_runs(command):
    p = plan(command, ENV, BASE)
    assert p is not None and p.exe.endswith(("/python", "/python3"))
    if "ulimit" in command:
        assert (p.cpu_s, p.log, p.args) == (5, "/tmp/kiln-test-output.log", ["-rA", "-q", "-p", "no:cacheprovider", "-v"])
    if command.startswith("PYTHONHASHSEED"):
        assert p.assign == {"PYTHONHASHSEED": "0", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if "-k" in command:
        assert p.args == ["-k", "add and not slow"]


@pytest.mark.parametrize("command,env", [
    ("python -m pytest | tail -5", ENV), ("python -m pytest; echo done", ENV), ("python -m pytest && ls", ENV),
    ("python -m pytest $ARGS", ENV), ("python -m pytest tests/*.py", ENV), ("python -m pytest \\\n -q", ENV),
    ('python -m pytest -k "$(id)"', ENV), ("python -m pytest # note", ENV), ("python -m pytest > out.txt", ENV),
    ("pytest -q", ENV), ("python -X dev -m pytest", ENV), ("python -m unittest", ENV), ("'X=1' python -m pytest", ENV),
    ("PATH=/bin python -m pytest", ENV), ("PYTHONHASHSEED=1 python -m pytest", ENV),
    ("PYTHONWARNINGS=error python -m pytest", ENV), ("python -m pytest", {**ENV, "PYTHONOPTIMIZE": "1"}),
    ("python -m pytest", {**ENV, "LANG": "C"}), ("python -m pytest", {**ENV, "LC_ALL": "en_US.ISO-8859-1"}),
    ("python -m pytest", {**ENV, "PATH": "/usr/bin:/bin"}),  # another interpreter
])
def test_plan_leaves_everything_else_to_bash(command, env):
    assert plan(command, env, BASE) is None


@pytest.fixture(scope="module")
def probe_base(tmp_path_factory, state_dir):
    root = tmp_path_factory.mktemp("probe")
    (root / "tests").mkdir()
    (root / "tests" / "test_probe.py").write_text(PROBE)
    return Snapshot.from_dir(root, state_dir)


def _observe(sb, command: str, wrapped: bool) -> dict:
    code = run_tests(sb, command, 60).exit_code if wrapped else sb.exec(command).exit_code
    return {**json.loads(sb.read_text("/tmp/probe.json")), "code": code}


@pytest.mark.parametrize("wrapped", [False, True], ids=["agent", "run_tests"])
def test_a_forked_run_sees_what_bash_and_python_give(probe_base, cfg, wrapped):
    if cfg.rootfs:
        pytest.skip("a built root has its own Python: never forked (test_built_roots_never_fork)")
    seen = {}
    for fork in (False, True):
        with create(probe_base, cfg.model_copy(update={"fork_pytest": fork})) as sb:
            seen[fork] = _observe(sb, COMMAND, wrapped)
    assert (seen[False].pop("forked"), seen[True].pop("forked")) == (0, 1)
    assert (seen[False].pop("frozen"), seen[True].pop("frozen")) == (False, True)
    assert all(seen[False]["run_imports"])  # else RUN_IMPORTS names one a fresh run does not import
    assert seen[True] == seen[False]
    assert seen[True]["code"] == 0 and seen[True]["env"]["PYTHONHASHSEED"] == "0"


def test_other_commands_and_built_roots_run_in_bash(probe_base, cfg):
    with create(probe_base, cfg) as sb:
        if cfg.rootfs:
            r = sb.exec(COMMAND)
            assert r.exit_code != 0 or not json.loads(sb.read_text("/tmp/probe.json"))["forked"]
            return
        assert _observe(sb, COMMAND, False)["forked"] == 1
        assert _observe(sb, COMMAND + " 2>&1 | tail -3", False)["forked"] == 0
        assert _observe(sb, "PYTHONWARNINGS=default " + COMMAND, False)["forked"] == 0


@pytest.mark.parametrize("fork", [False, True])
def test_outcomes_exit_codes_and_cpu_limit_match(tmp_path, state_dir, cfg, fork):
    if cfg.rootfs:
        pytest.skip("host root only: the built root's Debian has no pytest")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import sys\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2\n\n"
        "def test_out():\n    print('é' * 3); sys.stderr.write('to stderr\\n')\n\n"
        "def test_spin():\n    while True:\n        pass\n")
    with create(Snapshot.from_dir(tmp_path, state_dir), cfg.model_copy(update={"fork_pytest": fork})) as sb:
        run = run_tests(sb, COMMAND, 30, ["tests/test_x.py::test_ok", "tests/test_x.py::test_bad",
                                          "tests/test_x.py::test_out"])
        assert run.statuses == {"tests/test_x.py::test_ok": "PASSED", "tests/test_x.py::test_bad": "FAILED",
                                "tests/test_x.py::test_out": "PASSED"}
        assert run.exit_code == 1 and "assert 1 == 2" in run.log
        assert sb.exec(COMMAND + " -k nothing_matches").exit_code == 5
        assert sb.exec(COMMAND + " --no-such-option").exit_code == 4
        spin = run_tests(sb, COMMAND, 30, ["tests/test_x.py::test_spin"], cpu_s=1)
        assert spin.exit_code == SIGXCPU_EXIT and spin.timed_out
        out = sb.exec(COMMAND + " -s tests/test_x.py::test_out")
        assert "ééé" in out.output and "1 passed" in out.output
        assert sb.exec("echo still a shell").output == "still a shell\n"
