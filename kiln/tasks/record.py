"""The task record: one folder per task.

    <id>/task.toml        id, prompt, category, test command, fail-to-pass / pass-to-pass ids,
                          difficulty, provenance, gold-diff statistics
    <id>/repo/            the repository snapshot the agent starts from (no future history)
    <id>/tests/           hidden test files, at the paths they take inside the repository
    <id>/solution.patch   optional gold change (git-style unified diff)

Invalid records raise TaskError naming the file and the field.
"""
from __future__ import annotations

import os
import re
import shutil
import tomllib
from dataclasses import asdict, dataclass, field

from kiln.tomlw import toml_key, toml_value

CATEGORIES = ("bugfix", "feature", "refactor", "tests", "docs", "question")
DEFAULT_TEST_COMMAND = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -q -p no:cacheprovider"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class TaskError(ValueError):
    """A task record that cannot be used; the message names the file and the field."""


class Problems:
    """Every problem found in a task before it is refused: one TaskError lists them all, so fixing
    a task takes one round, not one per problem. `notes` (advice) are printed once, at the end."""

    def __init__(self, where: str):
        self.where, self.items, self.notes = where, [], []

    def add(self, problem: str, note: str = "") -> None:
        self.items.append(problem)
        if note and note not in self.notes:
            self.notes.append(note)

    def check(self, fn, *args, **kwargs):
        """fn(*args, **kwargs), or None after recording the TaskError it raised."""
        try:
            return fn(*args, **kwargs)
        except TaskError as e:
            self.add(str(e))
            return None

    def raise_any(self) -> None:
        if not self.items:
            return
        if len(self.items) == 1:
            msg = self.items[0]
        else:
            msg = f"{self.where}: {len(self.items)} problems:\n" + "\n".join(f"  - {p}" for p in self.items)
        raise TaskError("\n".join([msg, *self.notes]))


@dataclass
class Task:
    id: str
    prompt: str
    category: str = "bugfix"
    test_command: str = DEFAULT_TEST_COMMAND  # prints pytest -rA style outcomes
    fail_to_pass: list[str] = field(default_factory=list)
    pass_to_pass: list[str] = field(default_factory=list)
    difficulty: int = 1
    timeout_s: float = 300.0  # per test run
    provenance: dict = field(default_factory=dict)  # generator, seed, source, commit, mutation...
    gold: dict = field(default_factory=dict)  # lines_added, lines_removed, files
    path: str = ""  # the task's folder (not stored in task.toml)

    @property
    def repo_dir(self) -> str:
        return os.path.join(self.path, "repo")

    @property
    def tests_dir(self) -> str:
        return os.path.join(self.path, "tests")

    @property
    def solution(self) -> str | None:
        p = os.path.join(self.path, "solution.patch")
        return open(p, encoding="utf-8").read() if os.path.exists(p) else None

    def sandbox_config(self, cfg):
        """The sandbox config this task runs in: `cfg` plus what the task's own environment sets (an
        imported Harbor task's WORKDIR as the workspace, its env; a SWE-bench task's built environment,
        its workspace at /testbed). Every sandbox made for a task
        (validation, bench, RL) is created with it; grading forks those, so it follows.

        The test command's leading assignments (`PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest`)
        are the task's environment too, so the agent's own `python -m pytest` runs as the grader's
        does: without the plugins of kiln's interpreter (hypothesis alone costs 2 s a run)."""
        from .harbor_env import environment_config, sandbox_config
        from .testrun import leading_env
        cfg = sandbox_config(self, cfg)
        if self.provenance.get("environment"):  # a SWE-bench task's own environment (swebench_env.py)
            cfg = environment_config(self, self.provenance["environment"], cfg)
        env = {k: v for k, v in leading_env(self.test_command).items() if k not in cfg.env}
        return cfg.model_copy(update={"env": {**cfg.env, **env}}) if env else cfg

    def hidden_tests(self) -> dict[str, bytes]:
        """Repository-relative path -> content of every hidden test file."""
        out = {}
        for root, _, files in os.walk(self.tests_dir):
            for name in files:
                full = os.path.join(root, name)
                with open(full, "rb") as f:
                    out[os.path.relpath(full, self.tests_dir)] = f.read()
        return out

    def validate(self) -> "Task":
        where = os.path.join(self.path, "task.toml") if self.path else f"task {self.id!r}"
        problems = []
        if not isinstance(self.id, str) or not _ID.match(self.id):
            problems.append(f"id: {self.id!r} must be letters, digits, '.', '_' or '-'")
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            problems.append("prompt: must be a non-empty string")
        if self.category not in CATEGORIES:
            problems.append(f"category: {self.category!r} is not one of {', '.join(CATEGORIES)}")
        if not isinstance(self.test_command, str) or not self.test_command.strip():
            problems.append("test_command: must be a non-empty string")
        for name in ("fail_to_pass", "pass_to_pass"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                problems.append(f"{name}: must be a list of test ids (strings)")
        if not isinstance(self.difficulty, int) or self.difficulty < 1:
            problems.append(f"difficulty: {self.difficulty!r} must be an integer >= 1")
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            problems.append(f"timeout_s: {self.timeout_s!r} must be a positive number")
        if self.path and not os.path.isdir(self.repo_dir):
            problems.append(f"repo/: missing (the repository snapshot belongs in {self.repo_dir})")
        if problems:
            raise TaskError(f"{where}: " + "; ".join(problems))
        return self

    def to_toml(self) -> str:
        data = {k: v for k, v in asdict(self).items() if k != "path"}
        return "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in data.items())


def load_task(path: str) -> Task:
    toml_path = os.path.join(path, "task.toml")
    try:
        with open(toml_path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise TaskError(f"{path}: no task.toml (is this a task folder?)") from None
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"{toml_path}: invalid TOML: {e}") from None
    known = set(Task.__dataclass_fields__) - {"path"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise TaskError(f"{toml_path}: unknown field(s) {unknown}; allowed: {sorted(known)}")
    missing = [k for k in ("id", "prompt") if k not in data]
    if missing:
        raise TaskError(f"{toml_path}: missing required field(s) {missing}")
    return Task(**data, path=os.path.abspath(path)).validate()


def load_suite(path: str) -> list[Task]:
    """Every task folder under `path` (a suite, or a folder of suites such as a built suite's
    train/ and eval/), sorted by id."""
    if os.path.exists(os.path.join(path, "task.toml")):
        return [load_task(path)]
    if not os.path.isdir(path):
        raise TaskError(f"{path}: {'not a folder' if os.path.exists(path) else 'no such folder'}")
    dirs = sorted(d for d in os.listdir(path) if os.path.exists(os.path.join(path, d, "task.toml")))
    if not dirs:  # a suite of splits (kiln tasks build-suite: DIR/train, DIR/eval): one level down
        dirs = sorted(os.path.join(s, d) for s in os.listdir(path) if os.path.isdir(os.path.join(path, s))
                      for d in os.listdir(os.path.join(path, s)) if os.path.exists(os.path.join(path, s, d, "task.toml")))
    if not dirs:
        raise TaskError(f"{path}: no task folders (each needs a task.toml)")
    tasks = [load_task(os.path.join(path, d)) for d in dirs]
    return sorted(tasks, key=lambda t: t.id)


def _ignore_for(root: str):
    """What a task's repo/ leaves out: caches, and the repository's own history (its top-level .git: no
    future commits). A git repository further down is the task's data (a Harbor image's /app/repo)."""
    caches = shutil.ignore_patterns("__pycache__", ".pytest_cache")

    def ignore(folder: str, names: list[str]) -> set[str]:
        out = set(caches(folder, names))
        if os.path.samefile(folder, root):
            out |= {".git"} & set(names)
        return out
    return ignore


def save_task(task: Task, out_dir: str, repo_src: str | None = None, hidden: dict[str, bytes | str] | None = None,
              solution: str | None = None) -> Task:
    """Write a task folder atomically (built beside, renamed into place)."""
    task.validate()
    final = os.path.join(out_dir, task.id)
    tmp = final + ".part"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if repo_src is not None:
        shutil.copytree(repo_src, os.path.join(tmp, "repo"), symlinks=True, ignore=_ignore_for(repo_src))
    for rel, data in (hidden or {}).items():
        dst = os.path.join(tmp, "tests", rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
    if solution is not None:
        with open(os.path.join(tmp, "solution.patch"), "w", encoding="utf-8") as f:
            f.write(solution)
    with open(os.path.join(tmp, "task.toml"), "w", encoding="utf-8") as f:
        f.write(task.to_toml())
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    task.path = os.path.abspath(final)
    return task
