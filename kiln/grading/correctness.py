"""Correctness: the hidden tests, copied into a fork of the agent's final sandbox.

Test files the agent edited or deleted are reset to the task's version first (an agent must not
pass by rewriting the tests). Resolved means every fail-to-pass test passes and every
pass-to-pass test keeps passing (a skip keeps its standing).

A test-writing task (category `tests`, kiln/tasks/testwrite.py) is scored by the fraction of its
fail-to-pass tests that pass, its mutation score: each is a hidden mutant the agent's new tests
kill (and one that they pass on the code, without which none passes). `resolved` still needs all;
the score is 0 when a pass-to-pass test breaks.
"""
from __future__ import annotations

import fnmatch
import os

from kiln.tasks.record import Task
from kiln.tasks.testrun import run_tests
from kiln.tasks.validate import write_hidden_tests

TEST_PATTERNS = ("test_*.py", "*_test.py", "conftest.py")


def is_test_path(path: str) -> bool:
    parts = path.split("/")
    return any(p in ("tests", "test") for p in parts[:-1]) or any(fnmatch.fnmatch(parts[-1], p) for p in TEST_PATTERNS)


def reset_edited_tests(sandbox, task: Task, files: dict[str, str]) -> list[str]:
    """Restore the task's version of every test file the agent modified or deleted."""
    reset = []
    for path, status in files.items():
        base = os.path.join(task.repo_dir, path)
        if is_test_path(path) and status in ("M", "D") and os.path.isfile(base):
            with open(base, "rb") as f:
                sandbox.write(path, f.read())
            reset.append(path)
    return reset


def grade_correctness(sandbox, task: Task) -> dict:
    """Grade the sandbox's current state; the sandbox itself is left untouched (a fork is used)."""
    fork = sandbox.fork()
    try:
        reset = reset_edited_tests(fork, task, fork.diff().files)
        write_hidden_tests(fork, task)
        run = run_tests(fork, task.test_command, task.timeout_s)
    finally:
        fork.close()
    f2p = {i: run.statuses.get(i, "MISSING") for i in task.fail_to_pass}
    p2p = {i: run.statuses.get(i, "MISSING") for i in task.pass_to_pass}
    passed_f2p = sum(run.passed(i) for i in task.fail_to_pass)
    resolved = bool(task.fail_to_pass) and passed_f2p == len(f2p) and all(run.maintained(i) for i in p2p)
    score = 1.0 if resolved else 0.0
    if task.category == "tests" and f2p and all(run.maintained(i) for i in p2p):
        score = passed_f2p / len(f2p)
    return {"resolved": resolved, "score": score,
            "f2p_passed": passed_f2p, "f2p_total": len(f2p),
            "p2p_kept": sum(run.maintained(i) for i in p2p), "p2p_total": len(p2p),
            "timed_out": run.timed_out, "reset_tests": reset,
            "failing": sorted(i for i, s in {**f2p, **p2p}.items() if s not in ("PASSED", "XFAIL", "SKIPPED")
                              or (i in f2p and s == "SKIPPED"))[:20],
            "log_tail": run.log[-2000:]}
