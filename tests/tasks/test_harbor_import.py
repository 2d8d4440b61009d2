"""Real-data import problems of Harbor / Terminal-Bench folders, each reproduced by a small fixture:
Terminal-Bench 1's run-tests.sh boilerplate, tmux/asciinema apt installs, multi-step and missing
environments, one error listing every problem, the WORKDIR as the workspace everywhere (validation,
bench), `${VAR:-/app}` defaults and the WORKDIR variable, and task.toml's env tables and warnings."""
from __future__ import annotations

import os

import pytest

from kiln.bench.run import run_rollout
from kiln.config import Config, HarnessConfig
from kiln.sandbox import Snapshot, create
from kiln.tasks import dockerfile
from kiln.tasks.harbor import REWARD_ID, import_harbor, import_tb1
from kiln.tasks.record import TaskError

from .test_harbor import (
    BUGGY,
    DOCKERFILE,
    SOLVE,
    TASK_TOML,
    TEST_SH,
    harbor_folder,
    write,
)

# Terminal-Bench 1's usual run-tests.sh: fetches curl, uv and pytest from the network.
TB1_RUN_TESTS = """#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh
source $HOME/.local/bin/env
uv venv .tbench-testing
source .tbench-testing/bin/activate
uv pip install pytest==8.4.1
uv run pytest $TEST_DIR/test_outputs.py -rA
"""
# "/" + "app" is never rewritten to the workspace: it passes only if the workspace is /app itself.
TB1_TESTS = """import os
import sys

sys.path.insert(0, "/app")
from calc import add  # noqa: E402


def test_add():
    assert add(2, 3) == 5


def test_workspace_is_the_workdir():
    assert os.getcwd() == "/" + "app" and os.path.isfile("/" + "app/calc.py")
"""
TB_TOOLS = ("RUN apt-get update && apt-get install -y --no-install-recommends tmux asciinema && "
            "rm -rf /var/lib/apt/lists/*")


def tb1_folder(root, run_tests=TB1_RUN_TESTS) -> str:
    return write(root, {
        "task.yaml": "instruction: |-\n  Fix add() in /app/calc.py.\ndifficulty: easy\nmax_test_timeout_sec: 60.0\n",
        "Dockerfile": f"FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620\n{TB_TOOLS}\nWORKDIR /app\n"
                      "COPY calc.py /app/\n",
        "docker-compose.yaml": "services:\n  client:\n    build: .\n",
        "calc.py": BUGGY, "solution.sh": SOLVE, "run-tests.sh": run_tests, "tests/test_outputs.py": TB1_TESTS})


def test_tb1_boilerplate_runs_kilns_pytest_at_the_workdir(tmp_path, tcfg):
    task = import_tb1(tb1_folder(tmp_path / "tb1-add"), str(tmp_path / "k"), tcfg, validate=True)
    script = task.hidden_tests()[".harbor/tests/run-tests.sh"].decode()
    run = [line for line in script.splitlines() if line and not line.startswith("#")]
    assert run == ["python -m pytest $TEST_DIR/test_outputs.py -rA"]  # the rest is commented out
    assert len(script.splitlines()) == len(TB1_RUN_TESTS.splitlines())  # problems would name the right lines
    # validated in a sandbox whose workspace is /app: the workdir test passes before and after the gold patch
    assert task.fail_to_pass == [".harbor/tests/test_outputs.py::test_add", REWARD_ID]
    assert task.pass_to_pass == [".harbor/tests/test_outputs.py::test_workspace_is_the_workdir"]

    # bench: the rollout's sandbox has the repository at /app, and grading there resolves
    config = Config(sandbox=tcfg.model_copy(update={"timeout_s": 30, "idle_timeout_s": 20}),
                    harness=HarnessConfig(tools=["read_file", "edit_file", "run_shell"]))
    snap = Snapshot.from_dir(task.repo_dir, tcfg.state_dir)
    try:
        with create(snap, task.sandbox_config(tcfg)) as sb:
            r = sb.exec("pwd; ls /app")
            assert r.output.split() == ["/app", "calc.py"], r.output
        os.makedirs(tmp_path / "bench" / "trajectories")
        row = run_rollout(task, 0, "oracle", config, snap, str(tmp_path / "bench"))
        assert row["correctness"]["resolved"], row
    finally:
        snap.drop()


HARBOR_TEST_SH = """#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh
source $HOME/.local/bin/env
uvx \\
  -p 3.13 \\
  -w pytest==8.4.1 \\
  -w pytest-json-ctrf==0.3.5 \\
  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def test_harbor_template_boilerplate_runs_pytest_offline():
    """Harbor's test.sh as `harbor tasks init` writes it (and its `if uvx ...; then` form) runs the same
    tests with `python -m pytest`; the CTRF plugin and option go, other packages are still checked."""
    from kiln.tasks.harbor_scripts import check_script, offline_tests
    from kiln.tasks.record import Problems
    problems = Problems("t")
    out = offline_tests(HARBOR_TEST_SH, "test.sh", problems)
    run = [ln for ln in out.splitlines() if ln and not ln.startswith("#")]
    assert run == ["python -m pytest /tests/test_outputs.py -rA", HARBOR_TEST_SH.splitlines()[-1]], out
    assert len(out.splitlines()) == len(HARBOR_TEST_SH.splitlines()) and not problems.items
    check_script(out, "test.sh", problems)
    assert not problems.items
    inline = "if uvx --with pytest==8.4.1 --with pytest-json-ctrf==0.3.5 pytest --ctrf /logs/verifier/ctrf.json " \
             "/tests/test_outputs.py -rA; then\n  echo 1 > /logs/verifier/reward.txt\nfi\n"
    assert offline_tests(inline, "t", problems).splitlines()[0] == "if python -m pytest /tests/test_outputs.py -rA; then"
    offline_tests(inline.replace("--with pytest==8.4.1", "--with pandas==2.0.3"), "test.sh", problems)
    assert len(problems.items) == 1 and "the package 'pandas' is not installed" in problems.items[0]


def test_tb1_real_needs_are_still_refused(tmp_path):
    needs = TB1_RUN_TESTS.replace("apt-get install -y curl", "apt-get install -y curl jq").replace(
        "pytest==8.4.1", "pytest==8.4.1 pandas==2.0.3")
    with pytest.raises(TaskError) as e:
        import_tb1(tb1_folder(tmp_path / "needs", needs), str(tmp_path / "k"))
    msg = str(e.value)
    assert "2 problems" in msg
    assert "run-tests.sh:8: kiln cannot provide `uv pip install pytest==8.4.1 pandas==2.0.3`: the package " \
           "'pandas' is not installed in kiln's environment" in msg
    assert "run-tests.sh:3: kiln cannot provide `apt-get install -y curl jq`: apt-get needs the network" in msg


def test_tb_tools_apt_install_is_a_no_op():
    img = dockerfile.parse(DOCKERFILE.replace("WORKDIR /app", TB_TOOLS + "\nRUN apt-get update\nWORKDIR /app"))
    assert [s.op for s in img.steps] == ["PIP", "COPY", "COPY", "MKDIR"]
    with pytest.raises(TaskError, match=r"`apt-get update` can only run in a Docker build: this RUN installs system "
                                        r"packages kiln's sandbox does not have \(vim\)"):
        dockerfile.parse(DOCKERFILE.replace("tmux asciinema", "") + TB_TOOLS.replace("tmux", "tmux vim") + "\n")


def test_every_static_problem_in_one_error(tmp_path):
    bad = DOCKERFILE.replace("FROM python:3.11-slim", "FROM ubuntu:24.04") + \
        "COPY missing.py /app/\nCOPY --from=deps /x /y\n"
    folder = harbor_folder(tmp_path / "many", bad)
    write(folder, {"tests/test.sh": "wget https://example.com/data.csv\n" + TEST_SH})
    os.remove(os.path.join(folder, "instruction.md"))
    with pytest.raises(TaskError) as e:
        import_harbor(folder, str(tmp_path / "o"))
    msg = str(e.value)
    assert msg.startswith(f"{folder}: 4 problems:\n")
    for part in (f"{folder}: no instruction.md", "test.sh:1: kiln cannot provide `wget https://example.com/data.csv`",
                 "Dockerfile:11: kiln cannot provide `COPY missing.py /app/`: 'missing.py' is not in the build context",
                 "Dockerfile:12: kiln cannot provide `COPY --from=deps /x /y`: COPY --from=deps copies from an "
                 "unknown stage"):
        assert part in msg, part


def test_multi_step_and_missing_environments_say_what_they_are(tmp_path):
    multi = write(tmp_path / "multi", {
        "task.toml": 'schema_version = "1.1"\n\n[[steps]]\nname = "scaffold"\n\n[[steps]]\nname = "extend"\n',
        "environment/Dockerfile": DOCKERFILE, "steps/scaffold/instruction.md": "Make it.\n",
        "steps/extend/instruction.md": "Extend it.\n", "steps/scaffold/tests/test.sh": TEST_SH})
    with pytest.raises(TaskError, match=r"multi: a multi-step Harbor task \(steps: scaffold, extend\); kiln does not "
                                        r"import multi-step tasks yet"):
        import_harbor(multi, str(tmp_path / "o"))
    folder = tb1_folder(tmp_path / "bare")
    os.remove(os.path.join(folder, "Dockerfile"))
    os.remove(os.path.join(folder, "docker-compose.yaml"))
    with pytest.raises(TaskError, match=r"bare: no Dockerfile \(a Terminal-Bench 1 task has one beside task.yaml\)$"):
        import_tb1(folder, str(tmp_path / "o"))
    write(folder, {"docker-compose.yaml": "services:\n  client:\n    image: ubuntu\n"})
    with pytest.raises(TaskError, match="a compose file but no Dockerfile: kiln cannot provide compose-only"):
        import_tb1(folder, str(tmp_path / "o"))
    folder = harbor_folder(tmp_path / "image")
    os.remove(os.path.join(folder, "environment", "Dockerfile"))
    write(folder, {"task.toml": TASK_TOML + 'docker_image = "ghcr.io/x/y:1"\n'})
    with pytest.raises(TaskError, match=r"a prebuilt image \(ghcr.io/x/y:1\) and no environment/Dockerfile"):
        import_harbor(folder, str(tmp_path / "o"))


# WORKDIR /usr/src/app is the sandbox's own /usr: the workspace stays /workspace and paths are rewritten.
USR_DOCKERFILE = "FROM python:3.11-slim\nENV APP_HOME=/usr/src/app\nWORKDIR $APP_HOME\nCOPY calc.py ./\n"
USR_SOLVE = """#!/bin/bash
set -e
cd "${APP_DIR:-/usr/src/app}"
test "$APP_HOME" = "$PWD"
sed -i "s/a - b/$FIX/" calc.py
"""
USR_TESTS = """import os
import sys

sys.path.insert(0, os.getcwd())
from calc import add  # noqa: E402


def test_add():
    assert add(2, 3) == 5


def test_env():
    assert os.environ["CALC_HOME"] == os.environ["APP_HOME"] == os.getcwd()
    assert os.environ.get("FIX") is None  # [solution.env] is the solution's alone
"""
USR_TOML = """version = "1.0"

[verifier]
timeout_sec = 120.0

[environment]
allow_internet = true
env = { CALC_HOME = "/usr/src/app" }

[solution]
env = { FIX = "a + b" }
"""


def test_workdir_variable_defaults_and_env_tables(tmp_path, tcfg):
    folder = write(tmp_path / "usr-app", {
        "instruction.md": "add() in /usr/src/app/calc.py subtracts.\n", "task.toml": USR_TOML,
        "environment/Dockerfile": USR_DOCKERFILE, "environment/calc.py": BUGGY,
        "environment/docker-compose.yaml": "services:\n  main:\n    build: .\n  db:\n    image: postgres\n",
        "tests/test.sh": TEST_SH.replace("/app", "/usr/src/app"), "tests/test_outputs.py": USR_TESTS,
        "solution/solve.sh": USR_SOLVE})
    warnings: list[str] = []
    task = import_harbor(folder, str(tmp_path / "k"), tcfg, validate=True, warn=warnings.append)
    assert "+    return a + b" in task.solution  # solve.sh found the workspace through the default and $APP_HOME
    assert task.fail_to_pass == [".harbor/tests/test_outputs.py::test_add", REWARD_ID]
    assert task.pass_to_pass == [".harbor/tests/test_outputs.py::test_env"]  # [environment.env] reached the tests
    assert len(warnings) == 2
    assert "the compose services db are not started" in warnings[0] and "allow_internet = true" in warnings[1]
