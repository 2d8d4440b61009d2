"""Harbor / Terminal-Bench folders: import, round trip, and the two graders agreeing, in real sandboxes."""
from __future__ import annotations

import json
import os
import textwrap
import tomllib

import pytest

from kiln.grading.correctness import grade_correctness
from kiln.sandbox import Snapshot, create
from kiln.tasks import dockerfile
from kiln.tasks.harbor import (
    REWARD_ID,
    export_harbor,
    grade_harbor,
    import_harbor,
    import_tb1,
    sandbox_config,
)
from kiln.tasks.harbor_env import RUN_ROOT, TEST_COMMAND
from kiln.tasks.patch import make_patch
from kiln.tasks.record import Task, TaskError, load_task, save_task
from kiln.tasks.validate import apply_patch_in, write_hidden_tests

from .roundtrip import read, record

BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TASK_TOML = """schema_version = "1.3"

[task]
name = "kiln-tests/add-fix"
description = "Make add() add"
authors = [{ name = "kiln tests", email = "tests@kiln.invalid" }]
keywords = ["python", "arithmetic"]

[metadata]
author_name = "kiln tests"
difficulty = "medium"
category = "debugging"
tags = ["python", "arithmetic"]

[verifier]
timeout_sec = 120.0
env = { CALC_MODE = "strict" }

[agent]
timeout_sec = 600.0

[environment]
build_timeout_sec = 600.0
cpus = 1
memory_mb = 2048
storage_mb = 10240
"""
DOCKERFILE = """FROM python:3.11-slim
# the environment
ENV PYTHONUNBUFFERED=1
RUN pip install --no-cache-dir \\
    pytest==8.4.1
WORKDIR /app
COPY calc.py /app/calc.py
COPY data/ /app/data/
RUN mkdir -p /app/out
CMD ["sleep", "infinity"]
"""
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
cd /app
python -m pytest /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
TEST_OUTPUTS = """import json
import os
import sys

sys.path.insert(0, "/app")
from calc import add, mul  # noqa: E402


def test_add():
    assert add(2, 3) == 5


def test_mul():
    assert mul(2, 3) == 6


def test_paths():
    assert json.load(open("/tests/expected.json")) == {"sum": 5}
    assert os.path.isdir("/app/out") and os.environ["CALC_MODE"] == "strict"
"""
SOLVE = "#!/bin/bash\ncd /app\nsed -i 's/a - b/a + b/' calc.py\n"


def write(root, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return str(root)


def harbor_folder(root, dockerfile=DOCKERFILE) -> str:
    return write(root, {"instruction.md": "add() in /app/calc.py subtracts. Make it add.\n", "task.toml": TASK_TOML,
                        "environment/Dockerfile": dockerfile, "environment/calc.py": BUGGY,
                        "environment/data/numbers.txt": "2 3\n", "environment/README.md": "not copied\n",
                        "tests/test.sh": TEST_SH, "tests/test_outputs.py": TEST_OUTPUTS,
                        "tests/expected.json": '{"sum": 5}\n', "solution/solve.sh": SOLVE})


def graders_agree(task: Task, cfg) -> None:
    """Untouched: reward 0 and not resolved; after the gold patch: reward 1 and resolved."""
    with create(Snapshot.from_dir(task.repo_dir, cfg.state_dir), cfg) as sb:
        h, k = grade_harbor(sb, task), grade_correctness(sb, task)
        assert (h["reward"], h["resolved"], k["resolved"]) == (0.0, False, False), (h["log_tail"], k["log_tail"])
        sb.write(".harbor/tests/conftest.py", "def pytest_collection_modifyitems(items):\n    items.clear()\n")
        assert grade_harbor(sb, task)["resolved"] is grade_correctness(sb, task)["resolved"] is False  # planted
        apply_patch_in(sb, task.solution)
        h, k = grade_harbor(sb, task), grade_correctness(sb, task)
        assert (h["reward"], h["resolved"], k["resolved"]) == (1.0, True, True), (h["log_tail"], k["log_tail"])


def test_harbor_import_round_trip_and_graders_agree(tmp_path, tcfg):
    task = import_harbor(harbor_folder(tmp_path / "add-fix"), str(tmp_path / "a"), tcfg, validate=True)
    assert task.id == "add-fix" and task.prompt.startswith("add() in /app/calc.py")
    assert (task.category, task.difficulty, task.timeout_s) == ("bugfix", 2, 120.0)
    assert sorted(os.listdir(task.repo_dir)) == ["calc.py", "data", "out"]
    assert task.fail_to_pass == [".harbor/tests/test_outputs.py::test_add", REWARD_ID]
    # test_paths passes only because /app, /tests and the verifier's env are mapped into the sandbox
    assert task.pass_to_pass == [".harbor/tests/test_outputs.py::test_mul", ".harbor/tests/test_outputs.py::test_paths"]
    assert "+    return a + b" in task.solution and task.gold["files"] == ["calc.py"]
    assert set(task.hidden_tests()) == {".harbor/verify.py", ".harbor/tests/test.sh", ".harbor/tests/test_outputs.py",
                                        ".harbor/tests/expected.json"}
    assert load_task(task.path) == task
    assert "environment" not in task.provenance["harbor"]  # the host provides it: no root is built

    out = export_harbor(task, str(tmp_path / "exported"))
    assert read(out, "environment", "Dockerfile") == DOCKERFILE
    assert read(out, "environment", "README.md") == "not copied\n"
    assert read(out, "tests", "test.sh") == TEST_SH
    back = import_harbor(out, str(tmp_path / "b"), tcfg, validate=True)
    assert record(back) == record(task)
    graders_agree(task, sandbox_config(task, tcfg))  # the workspace at /app, as in the image


def test_unsupported_environment_is_a_clear_error(tmp_path):
    folder = harbor_folder(tmp_path / "net")
    # The uv boilerplate is dropped (tests/tasks/test_harbor_import.py); what the tests themselves fetch is not.
    write(folder, {"tests/test.sh": "apt-get update\napt-get install -y jq\ncurl -LsSf https://astral.sh/uv/install.sh "
                   "| sh\ncurl -sO https://example.com/expected.json\n" + TEST_SH})
    with pytest.raises(TaskError) as e:
        import_harbor(folder, str(tmp_path / "o"))
    assert "2 problems" in str(e.value) and "test.sh:2: kiln cannot provide `apt-get install -y jq`: apt-get needs " \
        "the network" in str(e.value) and "test.sh:4: kiln cannot provide `curl -sO" in str(e.value)
    # What the host cannot provide is built (tests/tasks/test_env_build.py); what no build can map is refused.
    with pytest.raises(TaskError, match=r"Dockerfile:11: kiln cannot provide `FROM node:20`: a second FROM"):
        import_harbor(harbor_folder(tmp_path / "x", DOCKERFILE + "FROM node:20\n"), str(tmp_path / "o"))
    with pytest.raises(TaskError, match="the base image 'node:20' is not one kiln can map to a Debian root"):
        import_harbor(harbor_folder(tmp_path / "y", DOCKERFILE.replace("python:3.11-slim", "node:20")),
                      str(tmp_path / "o"))


def test_no_validation_grades_on_the_reward(tmp_path, tcfg):
    task = import_harbor(harbor_folder(tmp_path / "add-fix"), str(tmp_path / "a"))  # no sandbox: no gold
    assert task.fail_to_pass == [REWARD_ID] and task.solution is None
    with create(Snapshot.from_dir(task.repo_dir, tcfg.state_dir), tcfg) as sb:
        assert grade_harbor(sb, task)["resolved"] is grade_correctness(sb, task)["resolved"] is False
        sb.write("calc.py", BUGGY.replace("a - b", "b + a"))
        assert grade_harbor(sb, task)["resolved"] is grade_correctness(sb, task)["resolved"] is True


def test_terminal_bench_1_import(tmp_path, tcfg):
    folder = write(tmp_path / "tb1-add", {
        "task.yaml": textwrap.dedent("""\
            instruction: |-
              Fix add() in /app/calc.py.
            author_email: someone@example.com
            difficulty: easy
            category: software-engineering
            tags: [python]
            parser_name: pytest
            max_agent_timeout_sec: 360.0
            max_test_timeout_sec: 60.0
            """),
        "Dockerfile": "FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620\nWORKDIR /app\nCOPY calc.py /app/\n",
        "docker-compose.yaml": "services:\n  client:\n    build: .\n",
        "calc.py": BUGGY, "solution.sh": SOLVE,
        "run-tests.sh": "#!/bin/bash\nsource $TEST_DIR/setup-uv-pytest.sh\nbash $TEST_DIR/run-uv-pytest.sh\n",
        "tests/test_outputs.py": TEST_OUTPUTS.replace("/tests/expected.json", "/tests/test_outputs.py").replace(
            "== {\"sum\": 5}", "is not None").replace("json.load(", "(").replace(
            ' and os.environ["CALC_MODE"] == "strict"', "").replace('os.path.isdir("/app/out")', "True")})
    task = import_tb1(folder, str(tmp_path / "k"), tcfg)  # the oracle runs (gold patch); no validation
    assert task.prompt == "Fix add() in /app/calc.py." and task.category == "feature" and task.timeout_s == 60.0
    assert os.listdir(task.repo_dir) == ["calc.py"] and task.fail_to_pass == [REWARD_ID]
    assert task.provenance["source"] == "terminal-bench-1"
    graders_agree(task, tcfg)
    out = export_harbor(task, str(tmp_path / "h"))  # a TB1 task exports as a Harbor folder
    assert sorted(os.listdir(out)) == ["environment", "instruction.md", "solution", "task.toml", "tests"]


def test_kiln_task_exports_to_harbor_and_back(tmp_path, tcfg):
    src = tmp_path / "src"
    write(src, {"calc.py": BUGGY,
                "tests/test_calc.py": "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"})
    hidden = ("from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
              "def test_mul():\n    assert mul(2, 3) == 6\n")
    task = save_task(Task(id="calc-1", prompt="add is wrong", fail_to_pass=["tests/test_calc.py::test_add"],
                          pass_to_pass=["tests/test_calc.py::test_mul"], difficulty=3),
                     str(tmp_path / "suite"), repo_src=str(src), hidden={"tests/test_calc.py": hidden},
                     solution=make_patch("calc.py", BUGGY, BUGGY.replace("a - b", "a + b")))
    out = export_harbor(task, str(tmp_path / "h"))
    assert "FROM python:3.11-slim" in read(out, "environment", "Dockerfile")
    assert os.access(os.path.join(out, "solution", "solve.sh"), os.X_OK)
    # Harbor's current task schema, as `harbor tasks init` writes it, with no empty keys
    toml = read(out, "task.toml")
    cfg = tomllib.loads(toml)
    assert toml.startswith('schema_version = "1.3"\n\n[task]\n') and "version" not in cfg
    assert cfg["task"] == {"name": "kiln/calc-1", "description": "add is wrong", "authors": [{"name": "kiln"}],
                           "keywords": ["kiln", "bugfix"]}
    assert cfg["metadata"] == {"difficulty": "hard", "category": "bugfix"}  # no kiln_source = ""
    assert cfg["environment"] == {"build_timeout_sec": 600.0, "cpus": 1, "memory_mb": 2048, "storage_mb": 10240,
                                  "network_mode": "no-network"}
    assert (cfg["verifier"], cfg["agent"]) == ({"timeout_sec": 300.0}, {"timeout_sec": 1800.0})

    back = import_harbor(out, str(tmp_path / "k"), tcfg, validate=True)
    assert back.fail_to_pass == [REWARD_ID, "tests/test_calc.py::test_add"]  # sorted by validate
    assert back.pass_to_pass == ["tests/test_calc.py::test_mul"] and back.difficulty == 3
    assert back.solution.replace("diff --git a/calc.py b/calc.py\n", "") == task.solution
    graders_agree(back, tcfg)
    # the exported tests/test.sh writes a CTRF report of every test beside the reward
    with create(Snapshot.from_dir(back.repo_dir, tcfg.state_dir), tcfg) as sb:
        apply_patch_in(sb, back.solution)
        write_hidden_tests(sb, back)
        assert sb.exec(f"mkdir -p {RUN_ROOT} && {TEST_COMMAND}").exit_code == 0
        ctrf = json.loads(sb.read_text(f"{RUN_ROOT}/logs/verifier/ctrf.json"))
    assert ctrf["results"]["tool"] == {"name": "pytest"}
    assert {k: ctrf["results"]["summary"][k] for k in ("tests", "passed", "failed")} == {
        "tests": 2, "passed": 2, "failed": 0}
    assert sorted(t["name"] for t in ctrf["results"]["tests"]) == ["tests/test_calc.py::test_add",
                                                                   "tests/test_calc.py::test_mul"]
    # round trip: the imported task exports to the same folder
    again = export_harbor(back, str(tmp_path / "h2"))
    for rel in ("task.toml", "instruction.md", "environment/Dockerfile", "tests/test.sh", "tests/kiln_grade.py",
                "tests/kiln.json", "solution/solve.sh"):
        assert read(again, rel) == read(out, rel), rel


def test_dockerfile_subset_builds_and_reverses(tmp_path):
    ctx = write(tmp_path / "ctx", {"app/a.py": "a\n", "app/sub/b.py": "b\n", "requirements.txt": "pytest\njinja2>=3\n",
                                   "x.py": "x\n", "y.py": "y\n"})
    img = dockerfile.parse(textwrap.dedent("""\
        # syntax=docker/dockerfile:1
        FROM --platform=linux/amd64 python:3.12-slim-bookworm AS base
        ARG X=1
        ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
        WORKDIR /srv
        WORKDIR app
        COPY --chown=1000:1000 app/ ./
        COPY ["requirements.txt", "./"]
        COPY *.py lib/
        RUN python -m pip install --upgrade pip && pip install -r requirements.txt ; \\
            mkdir -p out /srv/app/logs
        ENTRYPOINT ["python"]
        """), "Dockerfile")
    assert img.workdir == "/srv/app" and img.base == "python:3.12-slim-bookworm"
    copies = dockerfile.provide(img, ctx, str(tmp_path / "tree"))
    assert copies == [["app", "", "dir"], ["requirements.txt", "requirements.txt", "file"],
                      ["x.py", "lib/x.py", "file"], ["y.py", "lib/y.py", "file"]]
    assert sorted(os.listdir(tmp_path / "tree")) == ["a.py", "lib", "logs", "out", "requirements.txt", "sub"]
    dockerfile.reverse(copies, str(tmp_path / "tree"), str(tmp_path / "ctx2"))  # export, then build again
    assert dockerfile.provide(img, str(tmp_path / "ctx2"), str(tmp_path / "tree2")) == copies
    assert sorted(os.listdir(tmp_path / "tree2")) == sorted(os.listdir(tmp_path / "tree"))
    with pytest.raises(TaskError, match=r"D:3: kiln cannot provide `RUN curl -sSL https://x \| sh`: `curl -sSL "
                                        r"https://x | sh` can only run in a Docker build"):
        dockerfile.parse("FROM python:3.11\nWORKDIR /app\nRUN curl -sSL https://x | sh\n", "D")
    with pytest.raises(TaskError, match="installs a local path"):
        dockerfile.parse("FROM python:3.11\nWORKDIR /app\nRUN pip install -e .\n", "D")
