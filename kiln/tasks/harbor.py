"""Harbor / Terminal-Bench 2 task folders <-> kiln task records (and Terminal-Bench 1, import only).

Import: instruction.md -> prompt; environment/Dockerfile -> repo/ (the host root when it provides the
image, see dockerfile.py; else a Debian root built from the Dockerfile, env_build.py, whose final
WORKDIR is repo/); tests/ -> hidden files under .harbor/tests plus kiln's runner
(harbor_env.py: where /tests, /logs and the WORKDIR map); solution/solve.sh -> run once in a sandbox,
its change is the gold patch; validating with it derives fail-to-pass / pass-to-pass from the
pytest outcomes test.sh prints, plus the `harbor::reward` pseudo-test. Without validation the task
passes on the reward alone. task.toml, the Dockerfile and the solution files stay in provenance, so
export rebuilds the folder and import -> export -> import gives the same record.

Every problem visible without running anything (Dockerfile lines, test-script lines that need the
network, missing files) is refused together in one TaskError. What kiln cannot honour but can run
without (extra compose services, allow_internet) is a warning. Multi-step Harbor tasks (steps/) are
refused: kiln does not import them yet.

Export of a kiln-made task writes a Harbor folder of its own: python:3.11-slim + COPY of repo/,
tests/test.sh running the hidden tests with the task's test command (reward 1 when every
fail-to-pass test passes and every pass-to-pass test is kept), and solve.sh writing the gold change.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import tomllib
from dataclasses import dataclass

from . import dockerfile, env_base, env_build
from .harbor_env import (
    REWARD_ID,
    TEST_COMMAND,
    TESTS_DIR,
    VERIFY,
    grade_harbor,
    run_solution,
    sandbox_config,
    verify_script,
)
from .harbor_export import SCHEMA_VERSION, describe, export_harbor, prune
from .harbor_scripts import TB1_DEFAULT, check_script, offline_tests
from .patch import gold_stats
from .record import CATEGORIES, Problems, Task, TaskError, save_task

__all__ = ["REWARD_ID", "export_harbor", "grade_harbor", "import_folder", "import_harbor", "import_tb1",
           "sandbox_config"]
_DIFFICULTY = {"easy": 1, "medium": 2, "hard": 3}
_COMPOSE = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
_TB1_OWN = {"task.yaml", "solution.sh", "solution.yaml", "run-tests.sh", "tests", "Dockerfile", *_COMPOSE}
_TB1_TEST_SH = """#!/bin/bash
# Written by kiln for a Terminal-Bench 1 task: the reward is run-tests.sh's exit status.
mkdir -p /logs/verifier
export TEST_DIR=/tests
bash /tests/run-tests.sh
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def _warn_stderr(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class _Folder:
    """What an import reads from a task folder, in either format."""
    path: str
    source: str  # harbor | terminal-bench-1
    prompt: str
    config: dict  # task.toml (synthesised for Terminal-Bench 1)
    context: str  # the Docker build context
    context_own: set  # names in the context that are the task's own files, not the image's
    tests: dict
    solution: dict
    problems: Problems
    original_tests: dict | None = None  # test files as written, where kiln runs a rewritten one (export)


def _read_files(root: str) -> dict[str, bytes]:
    out = {}
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root).replace(os.sep, "/")] = f.read()
    return out


def _text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _task_id(folder: str) -> str:
    name = os.path.basename(os.path.abspath(folder))
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name).lstrip("._-") or "task"


def _has(folder: str, *names: str) -> bool:
    return any(os.path.exists(os.path.join(folder, n)) for n in names)


def import_folder(folder: str, out_dir: str, sandbox_cfg, validate: bool = True,
                  warn=_warn_stderr) -> tuple[Task, str, str]:
    """A Harbor or Terminal-Bench 1 folder -> (task, "validated" | "imported", why not validated).
    With `validate`, a task that has a solution is validated; one without is imported unvalidated."""
    tb1 = _has(folder, "task.yaml")
    solvable = _has(folder, "solution.sh", "solution.yaml") if tb1 else _has(folder, "solution/solve.sh")
    fn = import_tb1 if tb1 else import_harbor
    task = fn(folder, out_dir, sandbox_cfg, validate=validate and solvable, warn=warn)
    if validate and solvable:
        return task, "validated", ""
    return task, "imported", "not validated: " + ("no solution to run" if validate else "validation off")


def import_harbor(folder: str, out_dir: str, sandbox_cfg=None, validate: bool = False, warn=_warn_stderr) -> Task:
    """A Harbor task folder -> a kiln task folder under `out_dir`. With `sandbox_cfg` the oracle
    runs to give the gold patch; `validate` then derives the test lists (and rejects a task whose
    oracle does not pass or whose do-nothing run does not fail). Every problem kiln can see without
    running anything is raised together, in one TaskError; `warn` hears what kiln cannot honour."""
    if not _has(folder, "instruction.md", "task.toml", "environment", "tests", "steps"):
        raise TaskError(f"{folder}: no instruction.md (is this a Harbor task folder?)")
    problems = Problems(folder)
    toml_path = os.path.join(folder, "task.toml")
    config = {}
    try:
        config = tomllib.loads(_text(toml_path)) if os.path.exists(toml_path) else {}
    except tomllib.TOMLDecodeError as e:
        problems.add(f"{toml_path}: invalid TOML: {e}")
    steps = [s.get("name", "?") for s in config.get("steps", []) if isinstance(s, dict)]
    if steps or os.path.isdir(os.path.join(folder, "steps")):
        names = steps or sorted(os.listdir(os.path.join(folder, "steps")))
        raise TaskError(f"{folder}: a multi-step Harbor task (steps: {', '.join(names)}); kiln does not import "
                        "multi-step tasks yet, only single-step ones (instruction.md, tests/ and solution/ at the "
                        "top of the folder)")
    for need in ("instruction.md", "tests/test.sh"):
        if not os.path.isfile(os.path.join(folder, need)):
            problems.add(f"{folder}: no {need}")
    env_dir = os.path.join(folder, "environment")
    if not os.path.isfile(os.path.join(env_dir, "Dockerfile")):
        image = config.get("environment", {}).get("docker_image")
        if _has(env_dir, *_COMPOSE):
            problems.add(f"{env_dir}: a compose file but no Dockerfile: kiln cannot provide compose environments "
                         "without Docker (it provides only what a Dockerfile describes)")
        elif image:
            problems.add(f"{toml_path}: a prebuilt image ({image}) and no environment/Dockerfile: kiln cannot "
                         "provide prebuilt images without Docker")
        else:
            problems.add(f"{folder}: no environment/Dockerfile (kiln provides the environment it describes)")
    prompt = _text(os.path.join(folder, "instruction.md")) if _has(folder, "instruction.md") else ""
    tests = _read_files(os.path.join(folder, "tests"))
    original = {}
    if "test.sh" in tests:
        path, text = os.path.join(folder, "tests", "test.sh"), tests["test.sh"].decode("utf-8", "replace")
        offline = offline_tests(text, path, problems)
        check_script(offline, path, problems)
        if offline.rstrip("\n") != text.rstrip("\n"):  # the boilerplate fetched tools: run what kiln has
            tests["test.sh"], original["test.sh"] = offline.encode(), text
    f = _Folder(folder, "harbor", prompt, config, env_dir, {"Dockerfile"}, tests,
                _read_files(os.path.join(folder, "solution")), problems, original)
    return _build(f, out_dir, sandbox_cfg, validate, warn)


def import_tb1(folder: str, out_dir: str, sandbox_cfg=None, validate: bool = False, warn=_warn_stderr) -> Task:
    """A Terminal-Bench 1 folder (task.yaml, Dockerfile, solution.sh, run-tests.sh, tests/) -> a kiln
    task, through the same path as Harbor (its task.toml synthesised; the reward is run-tests.sh's
    exit status, as pytest's exit status says whether every test passed)."""
    try:
        import yaml
    except ImportError:
        raise TaskError("importing Terminal-Bench 1 tasks needs PyYAML (pip install pyyaml)") from None
    path = os.path.join(folder, "task.yaml")
    if not os.path.isfile(path):
        raise TaskError(f"{folder}: no task.yaml (is this a Terminal-Bench 1 task folder?)")
    problems = Problems(folder)
    meta = yaml.safe_load(_text(path)) or {}
    prompt = meta.get("instruction") or next((d.get("description") for d in meta.get("descriptions") or []), "")
    if not os.path.isfile(os.path.join(folder, "Dockerfile")):
        problems.add(f"{folder}: a compose file but no Dockerfile: kiln cannot provide compose-only environments "
                     "without Docker" if _has(folder, *_COMPOSE) else
                     f"{folder}: no Dockerfile (a Terminal-Bench 1 task has one beside task.yaml)")
    tests = _read_files(os.path.join(folder, "tests"))
    run_tests = os.path.join(folder, "run-tests.sh")
    script = _text(run_tests) if os.path.isfile(run_tests) else f"#!/bin/bash\n{TB1_DEFAULT}\n"
    script = offline_tests(script, run_tests, problems)
    check_script(script, run_tests, problems)
    tests["run-tests.sh"] = script.encode()
    tests["test.sh"] = _TB1_TEST_SH.encode()
    solution = {}
    if os.path.isfile(os.path.join(folder, "solution.sh")):
        solution["solve.sh"] = _bytes(os.path.join(folder, "solution.sh"))
    elif os.path.isfile(os.path.join(folder, "solution.yaml")):  # tmux keystrokes; run as commands
        steps = yaml.safe_load(_text(os.path.join(folder, "solution.yaml"))) or []
        commands = [str(s["command"]) for s in steps if isinstance(s, dict) and "command" in s]
        solution["solve.sh"] = ("#!/bin/bash\n" + "\n".join(commands) + "\n").encode()
    keep = {k: meta[k] for k in ("difficulty", "category") if meta.get(k) is not None}
    author = {"name": meta.get("author_name"), "email": meta.get("author_email")}
    config = prune({"schema_version": SCHEMA_VERSION,  # as Harbor's own Terminal-Bench adapter writes it
                    "task": {"name": f"terminal-bench/{_task_id(folder)}", "description": describe(prompt or ""),
                             "authors": [author] if author["name"] else [], "keywords": meta.get("tags") or []},
                    "metadata": keep,
                    "verifier": {"timeout_sec": float(meta.get("max_test_timeout_sec", 180.0))},
                    "agent": {"timeout_sec": float(meta.get("max_agent_timeout_sec", 360.0))}})
    f = _Folder(folder, "terminal-bench-1", prompt, config, folder, _TB1_OWN, tests, solution, problems)
    return _build(f, out_dir, sandbox_cfg, validate, warn)


def _warnings(f: _Folder, warn) -> None:
    """What a task asks for that kiln's sandbox cannot give, said once at import."""
    main = "client" if f.source == "terminal-bench-1" else "main"
    for path in (os.path.join(f.context, n) for n in _COMPOSE if _has(f.context, n)):
        services = _compose_services(path)
        others = [s for s in services or [] if s != main]
        if services is None or others:
            what = f"the compose services {', '.join(others)} are" if others else "any other compose services are"
            warn(f"{path}: kiln runs only the task's own container; {what} not started, so tests that talk to "
                 "them will fail")
    env = f.config.get("environment", {})
    if env.get("allow_internet") or env.get("network_mode") in ("public", "allowlist"):
        how = f"network_mode = {env['network_mode']!r}" if env.get("network_mode") else "allow_internet = true"
        warn(f"{f.path}: the task allows internet access ({how}), but kiln's sandbox has no "
             "network: anything that needs it will fail")


def _compose_services(path: str) -> list[str] | None:
    """The services a compose file names, or None when it cannot be read (no PyYAML, bad YAML)."""
    try:
        import yaml
    except ImportError:
        return None
    try:
        data = yaml.safe_load(_text(path))
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return None
    services = data.get("services") if isinstance(data, dict) else None
    return sorted(str(s) for s in services) if isinstance(services, dict) else None


def _environment(f: _Folder, docker_path: str, docker_text: str):
    """(host image, None) when the host provides the Dockerfile's environment (fast: no build), else
    (None, recipe) to build a root of its own (env_build.py); problems go to f.problems."""
    host = Problems(docker_path)
    img = dockerfile.parse(docker_text, docker_path, host)
    if not host.items:
        return img, None
    recipe = env_build.parse(docker_text, docker_path, f.problems)
    if recipe is not None:
        env_build.check_sources(recipe, f.context, f.problems)
    return None, recipe  # refused by the caller if any problem was found


def _build(f: _Folder, out_dir: str, cfg, validate: bool, warn) -> Task:
    problems, config = f.problems, f.config
    docker_path = os.path.join(f.context, "Dockerfile")
    docker_text = _text(docker_path) if os.path.isfile(docker_path) else ""
    img, recipe = _environment(f, docker_path, docker_text) if os.path.isfile(docker_path) else (None, None)
    if not f.prompt.strip() and (f.source != "harbor" or _has(f.path, "instruction.md")):  # else: reported missing
        problems.add(f"{f.path}: empty instruction")
    if validate and (cfg is None or "solve.sh" not in f.solution):
        problems.add(f"{f.path}: validating needs a sandbox config and solution/solve.sh")
    meta, verifier = config.get("metadata", {}), config.get("verifier", {})
    category = str(meta.get("category", ""))
    category = category if category in CATEGORIES else "bugfix" if ("debug" in category or "fix" in category) \
        else "feature"
    with tempfile.TemporaryDirectory(prefix="kiln-harbor-") as tmp:
        tree = os.path.join(tmp, "tree")
        copies = dockerfile.provide(img, f.context, tree, problems) if img and img.workdir not in ("", "/") else []
        problems.raise_any()
        _warnings(f, warn)
        built = None
        if recipe is not None:
            cache = env_base.cache_dir(cfg.env_cache if cfg is not None else "")
            built = env_build.build(recipe, f.context, cache, log=_progress)
            env_build.export_workdir(built, cache, tree)
            copies = env_build.workdir_copies(recipe, f.context)
        other = {}
        for rel, data in _read_files(f.context).items():
            top = rel.split("/")[0]
            covered = any(src in (".", "") or rel == src or rel.startswith(src + "/") for src, _, _ in copies)
            if top not in f.context_own and not covered:
                try:
                    other[rel] = data.decode("utf-8")
                except UnicodeDecodeError:
                    pass  # binary files the image never copies cannot matter to kiln
        harbor = {"task_toml": config, "dockerfile": docker_text, "workdir": built.workdir if built else img.workdir,
                  "image_env": built.env if built else img.env, "copies": copies, "environment_files": other,
                  "solution_files": _texts(f.solution, f.path)}
        if built:
            harbor["environment"] = built.to_dict()
        if f.original_tests:
            harbor["original_tests"] = f.original_tests
        task = Task(id=_task_id(f.path), prompt=f.prompt, category=category, test_command=TEST_COMMAND,
                    fail_to_pass=[REWARD_ID], difficulty=_DIFFICULTY.get(str(meta.get("difficulty", "")).lower(), 1),
                    timeout_s=float(verifier.get("timeout_sec", 300.0)),
                    provenance={"source": f.source, "harbor": harbor})
        hidden = {f"{TESTS_DIR}/{rel}": data for rel, data in f.tests.items()}
        hidden[VERIFY] = verify_script(harbor["workdir"], verifier.get("env", {}), list(f.tests))
        gold = None
        if cfg is not None and "solve.sh" in f.solution:
            agent_s = float(config.get("agent", {}).get("timeout_sec", 600))
            gold = run_solution(tree, f.solution, task, cfg, agent_s, config.get("solution", {}).get("env", {}))
            task.gold = gold_stats(gold)
        task = save_task(task, out_dir, repo_src=tree, hidden=hidden, solution=gold)
    if validate:
        _derive_tests(task, cfg)
    return task


def _texts(files: dict[str, bytes], folder: str) -> dict[str, str]:
    try:
        return {rel: data.decode("utf-8") for rel, data in files.items()}
    except UnicodeDecodeError:
        raise TaskError(f"{folder}: a solution file is not text; kiln keeps solution files in task.toml") from None


def _derive_tests(task: Task, cfg) -> None:
    from .validate import validate
    v = validate(task, cfg)
    if not v.ok:
        shutil.rmtree(task.path, ignore_errors=True)
        raise TaskError(f"{task.id}: does not validate (the oracle must pass and doing nothing must fail): "
                        f"{v.reason}")
    task.fail_to_pass, task.pass_to_pass = v.fail_to_pass, v.pass_to_pass
    with open(os.path.join(task.path, "task.toml"), "w", encoding="utf-8") as f:
        f.write(task.to_toml())
