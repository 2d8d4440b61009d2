"""Validate a task by execution: hidden tests fail before the gold change and pass after it,
twice (a flaky task is rejected; once, or not at all, when a later step runs them after the gold
change anyway, or when a generator's baseline already shows the tree after it), and the gold
change breaks nothing that passed."""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from kiln.sandbox import Snapshot, create

from .patch import PatchError, apply_patch
from .record import Task
from .testrun import TestRun, hang_wall, run_tests


@dataclass
class Validation:
    ok: bool
    reason: str = ""  # why a task was rejected: a short, countable phrase first
    fail_to_pass: list[str] = field(default_factory=list)
    pass_to_pass: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # why the tests could not run as written (see `cause`)


def cause(before: TestRun, after: list[TestRun] | None = None) -> list[str]:
    """What kept the tests from running as written, before and after the gold patch: conftest and
    test-module import errors, pytest dying at start (testrun.run_problems)."""
    out = [f"before the gold patch, {p}" for p in before.problems]
    if after:
        out += [f"after it, {p}" for p in after[0].problems if p not in before.problems]
    return out


def with_cause(reason: str, problems: list[str]) -> str:
    """`reason`, followed by the run problems that explain it (the real cause, shown whole)."""
    if not problems:
        return reason
    return (f"{reason}; the tests could not run as written, so the environment may lack the repository's own "
            "dependencies:\n" + "\n".join(f"    {p}" for p in problems))


def write_hidden_tests(sandbox, task: Task) -> None:
    for rel, data in task.hidden_tests().items():
        sandbox.write(rel, data)


def apply_patch_in(sandbox, patch: str) -> list[str]:
    def write(rel: str, text: str | None) -> None:
        if text is None:
            sandbox.exec(f"rm -f -- {shlex.quote(rel)}", cwd=sandbox.cfg.workdir)
        else:
            sandbox.write(rel, text)
    return apply_patch(patch, sandbox.read_text, write)


def validate(task: Task, sandbox_cfg, snapshot: Snapshot | None = None, runs_after: int = 2,
             cpu_s: float | None = None, base_run: TestRun | None = None, only: list[str] | None = None) -> Validation:
    """Run the hidden tests before and `runs_after` times after the gold patch (two or more: a
    test whose result changes is flaky); derive F2P and P2P. runs_after=0 is for a caller that
    grades the gold change itself (SFT data keeps only the oracle's solved rollouts): F2P is then
    what fails before, P2P what passes. Without a `snapshot` the task's repo is imported for this
    run and dropped afterwards. `cpu_s`: each test process's CPU-time limit (run_tests); a run
    asleep past a few times it is a hang too (testrun.hang_wall).

    `base_run`: a generator's baseline run of its base tree (two runs alike: flakiness is checked
    there), which these tests need not repeat. Alone it says the gold patch turns the task's tree
    back into the base (a mutant reverted, a deleted feature restored), so it stands for the run
    after the patch; a caller may also put it together from runs that covered that tree (a
    test-writing task's: the base plus its harness, which screening ran). With `only`, the task's
    tree is the base plus just those test files (a move's hidden test): only they run before the
    patch, the rest keep the baseline's outcomes."""
    gold = task.solution
    if not gold:
        return Validation(False, "no gold patch")
    base = snapshot or Snapshot.from_dir(task.repo_dir, sandbox_cfg.state_dir)
    try:
        return _run(task, gold, base, sandbox_cfg, runs_after, cpu_s, base_run, only)
    finally:
        if snapshot is None:  # imported here for this run only
            base.drop()


def _run(task: Task, gold: str, base: Snapshot, sandbox_cfg, runs_after: int, cpu_s: float | None,
         base_run: TestRun | None, only: list[str] | None) -> Validation:
    with create(base, task.sandbox_config(sandbox_cfg)) as sb:
        write_hidden_tests(sb, task)
        wall = hang_wall(task.timeout_s, cpu_s)
        before = run_tests(sb, task.test_command, wall, only, cpu_s=cpu_s)
        if before.timed_out:
            return Validation(False, "tests time out before the gold patch")
        if base_run is not None and only is None:
            return judge(before, [base_run])
        if base_run is not None:
            before = TestRun({**{i: st for i, st in base_run.statuses.items() if i.split("::")[0] not in only},
                              **before.statuses}, before.exit_code, False, before.duration_s, before.log, before.problems)
        if runs_after == 0:
            failing = sorted(i for i in before.statuses if not before.passed(i))
            passing = sorted(i for i in before.statuses if before.passed(i))
            return Validation(bool(failing), "" if failing else with_cause("no fail-to-pass test", cause(before)),
                              failing, passing, cause(before))
        try:
            apply_patch_in(sb, gold)
        except (PatchError, OSError) as e:
            return Validation(False, f"gold patch does not apply: {e}")
        after = [run_tests(sb, task.test_command, wall, cpu_s=cpu_s) for _ in range(runs_after)]
    return judge(before, after)


def judge(before: TestRun, after: list[TestRun]) -> Validation:
    problems = cause(before, after)
    if any(a.timed_out for a in after):
        return Validation(False, "tests time out after the gold patch", problems=problems)
    ids = set(before.statuses) | {i for a in after for i in a.statuses}
    flaky = sorted(i for i in ids if len({a.statuses.get(i) for a in after}) > 1)
    if flaky:
        return Validation(False, f"flaky tests: {flaky[:5]}", problems=problems)
    broken = sorted(i for i in ids if before.passed(i) and not after[0].passed(i))
    if broken:
        return Validation(False, with_cause(f"gold patch breaks passing tests: {broken[:5]}", problems),
                          problems=problems)
    f2p = sorted(i for i in ids if after[0].passed(i) and not before.passed(i))
    p2p = sorted(i for i in ids if before.passed(i) and after[0].passed(i))
    if not f2p:
        return Validation(False, with_cause("no fail-to-pass test", problems), problems=problems)
    return Validation(True, "", f2p, p2p, problems)
