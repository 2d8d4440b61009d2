"""Run a task's tests in a sandbox and read per-test outcomes from pytest's output.

The command's output goes to a file inside the sandbox and is read back whole, so a long test
log is never cut before it is parsed. Both pytest's verbose lines (`id STATUS`) and its -rA
summary (`STATUS id`) are understood; the summary wins (it reports teardown errors).
"""
from __future__ import annotations

import math
import re
import shlex
import signal
from dataclasses import dataclass, field

PASSED, FAILED, ERROR, SKIPPED, XFAIL, XPASS = "PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"
_STATUS = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_VERBOSE = re.compile(rf"^(?P<id>[^\s].*?::.+?) (?P<st>{_STATUS})(?: +\[ *\d+%\])?\s*$")
_SUMMARY = re.compile(rf"^(?P<st>{_STATUS}) (?P<id>[^\s\[]\S*(?:::.*?)?)(?: - .*)?\s*$")
LOG = "/tmp/kiln-test-output.log"
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)


@dataclass
class TestRun:
    statuses: dict[str, str] = field(default_factory=dict)  # test id -> status
    exit_code: int = 0
    timed_out: bool = False
    duration_s: float = 0.0
    log: str = ""
    problems: list[str] = field(default_factory=list)  # why tests could not run as written (run_problems)

    def passed(self, test_id: str) -> bool:
        return self.statuses.get(test_id) in (PASSED, XFAIL)

    def maintained(self, test_id: str) -> bool:
        """For pass-to-pass tests a skip keeps the test's standing (SWE-bench's rule)."""
        return self.statuses.get(test_id) in (PASSED, XFAIL, SKIPPED)


def parse_pytest(log: str) -> dict[str, str]:
    out: dict[str, str] = {}
    summary: dict[str, str] = {}
    for line in log.splitlines():
        m = _VERBOSE.match(line)
        if m:
            out[m["id"]] = m["st"]
            continue
        m = _SUMMARY.match(line)
        if m and "::" in m["id"] or (m and m["st"] == ERROR):
            summary[m["id"]] = m["st"]
    out.update(summary)
    return out


_E_LINE = re.compile(r"^E +(\S.*?)\s*$")
_CONFTEST = re.compile(r"^ImportError while loading conftest '(?P<path>.+)'\.\s*$")
_COLLECTING = re.compile(r"^_+ ERROR collecting (?P<path>\S+) _+\s*$")
_SECTION = re.compile(r"^(?:_{3,}|={3,}) ")
_SETUP = re.compile(r"^_+ ERROR at setup of (?P<name>.+?) _+\s*$")
_WHERE = re.compile(r"^(?P<loc>\S+:\d+): (?P<exc>[\w.]+)\s*$")


def run_problems(log: str, exit_code: int = 0, limit: int = 8) -> list[str]:
    """Why the tests could not run as the task wrote them, one line each: a conftest that does not
    import, a test module that does not import (pytest's `ERROR collecting` sections), or pytest
    itself dying before any test ran (exit 3 or 4, or a traceback: a plugin or hook signature the
    installed pytest rejects). These are what an environment without the repository's own
    dependencies looks like, so a validation that finds no fail-to-pass test names them."""
    lines = log.splitlines()
    out: list[str] = []

    def errors(start: int) -> str:
        found = []
        for line in lines[start:start + 200]:
            if _SECTION.match(line):
                break
            m = _E_LINE.match(line)
            if m:
                found.append(m[1])
        return " ".join(list(dict.fromkeys(found))[-3:]) or "(no error line)"
    setups: dict[tuple[str, str], int] = {}  # (where, error) -> tests whose setup failed there
    for i, line in enumerate(lines):
        m = _CONFTEST.match(line)
        if m:
            out.append(f"conftest {m['path']} does not import: {errors(i + 1)}")
            continue
        m = _COLLECTING.match(line)
        if m:
            out.append(f"collecting {m['path']}: {errors(i + 1)}")
            continue
        if _SETUP.match(line):
            where = ""
            for x in lines[i + 1:i + 200]:
                if _SECTION.match(x):
                    break
                w = _WHERE.match(x)
                where = w["loc"] if w else where
            key = (where, errors(i + 1))
            setups[key] = setups.get(key, 0) + 1
    statuses = parse_pytest(log)
    every = bool(statuses) and all(st == ERROR for st in statuses.values())
    for (where, err), n in sorted(setups.items(), key=lambda kv: -kv[1]):
        if "conftest" in where or every:  # a fixture of the repository's own test set-up, not one test's
            out.append(f"the setup of {n} test{'s' if n > 1 else ''} fails at {where or '?'}: {err}")
    if not out and (exit_code in (3, 4) or "Traceback (most recent call last)" in log) and \
            not any(_VERBOSE.match(x) for x in lines):
        tail = [x.strip() for x in lines if x.strip() and not x[0].isspace()  # not the traceback's code
                and not x.startswith("Traceback (")][-4:]
        out.append(f"pytest stopped before running any test (exit {exit_code}): " + " | ".join(tail))
    seen = list(dict.fromkeys(out))
    return seen[:limit] + ([f"... and {len(seen) - limit} more"] if len(seen) > limit else [])


def leading_env(command: str) -> dict[str, str]:
    """The `NAME=value` assignments a shell command starts with."""
    try:
        words = shlex.split(command)
    except ValueError:
        return {}
    env = {}
    for w in words:
        m = _ASSIGN.match(w)
        if not m:
            break
        env[m[1]] = m[2]
    return env


SIGXCPU_EXIT = 128 + signal.SIGXCPU  # the shell's exit code for a process killed by its CPU-time limit
# A run under a CPU limit still going after this many times that limit in wall time is asleep (a
# deadlocked thread, a wait that never ends), not working: the same hang, stopped without waiting
# out the task's whole timeout (a threaded more-itertools mutant held a worker 300 s).
WALL_PER_CPU = 3


def hang_wall(timeout_s: float, cpu_s: float | None) -> float:
    """The wall timeout of a run with per-process CPU limit `cpu_s` (none: `timeout_s` itself)."""
    return min(timeout_s, WALL_PER_CPU * cpu_s) if cpu_s else timeout_s


def run_tests(sandbox, command: str, timeout_s: float, ids: list[str] | None = None,
              cpu_s: float | None = None) -> TestRun:
    """Run `command` (plus `ids` as arguments, when given) in the workspace root. `cpu_s` limits
    each process of the run to that many CPU-seconds (RLIMIT_CPU): a busy loop is then stopped
    after the same work on an idle machine and a loaded one, where the wall timeout would stop it
    after a load-dependent amount; a run that hits it counts as timed out."""
    args = " ".join(shlex.quote(i) for i in ids or [])
    limit = f"ulimit -S -t {math.ceil(cpu_s)}; " if cpu_s else ""  # inside the subshell: not the shell's state
    r = sandbox.exec(f"( {limit}{command} -v {args} ) > {LOG} 2>&1", timeout_s=timeout_s, idle_timeout_s=timeout_s,
                     cwd=sandbox.cfg.workdir)
    try:
        log = sandbox.read_text(LOG)
    except OSError:
        log = r.output
    over_cpu = bool(cpu_s) and r.exit_code == SIGXCPU_EXIT
    problems = run_problems(log, r.exit_code) + ([f"a test process used more than {math.ceil(cpu_s)} CPU-seconds "
                                                  "(a busy loop?) and was stopped"] if over_cpu else [])
    return TestRun(parse_pytest(log), r.exit_code, r.timed_out or over_cpu, r.duration_s, log[-20_000:], problems)
