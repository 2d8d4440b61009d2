"""`python -m pytest` without starting Python: a sandbox's pid 1 forks into a process that already
has pytest imported and runs it there.

An agent's rollout runs the tests about twice (its own run, then grading), and a fresh interpreter
spends much of a small task's run starting up and importing pytest. The zygote imports pytest once
(`preload`); every sandbox's pid 1 is a fork of the zygote, so it has pytest in memory, and for a
command that `plan` accepts it forks and runs pytest in that child instead of starting bash and
Python. `plan` accepts only what such a child runs exactly as a fresh interpreter would:
- the command is `[NAME=value ...] python|python3 -m pytest ARGS`, alone or in `run_tests`'s
  `( [ulimit -S -t N; ]...) > FILE 2>&1`, with no other shell syntax (no `$`, globs, pipes,
  lists, backslashes or comments): quoting only;
- `python` on the command's PATH is the zygote's own interpreter (the same venv, so the same
  pytest and plugins);
- the environment's Python start-up variables are ones the child applies (PYTHONPATH,
  PYTHONDONTWRITEBYTECODE, PYTHONUNBUFFERED, PYTHONNOUSERSITE) plus PYTHONHASHSEED 0 or unset (the
  zygote runs with seed 0, one of the seeds a fresh interpreter may draw), and the locale is UTF-8.
Anything else runs in bash as before.
"""
from __future__ import annotations

import gc
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import NamedTuple

# The zygote's hash seed (service.py starts it with this): a forked child cannot change it.
HASH_SEED = "0"
_APPLIED = {"PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PYTHONNOUSERSITE", "PYTHONHASHSEED"}
_WORD = r"""(?:[\w./:=,+@%^-]|'[^']*'|"[^"$`\\!]*")+"""
_WORDS = re.compile(rf"{_WORD}(?:[ \t]+{_WORD})*")
_WRAPPED = re.compile(r"\( (?:ulimit -S -t (\d+); )?(.*?)[ \t]*\) > ([\w./-]+) 2>&1")
_ASSIGN = re.compile(r"[A-Za-z_]\w*=")
# Run with -S: the interpreter's path before site (the stdlib), then after site.main() (+ site-packages).
_PROBE = "import json, site, sys; stdlib = sys.path[1:]; site.main(); print(json.dumps([stdlib, sys.path[1:]]))"
# What every run imports beyond pytest and its default plugins (the debugging plugin's pdb,
# faulthandler, argcomplete): imported once in the zygote, as a fresh interpreter imports them before
# any test runs. (Not tomllib: a run imports it only to read a pyproject.toml.)
RUN_IMPORTS = ("pdb", "faulthandler", "_pytest._argcomplete")


class Plan(NamedTuple):
    args: list[str]  # pytest's arguments
    assign: dict[str, str]  # the command's leading NAME=value words
    exe: str  # the interpreter as found on PATH (bash exports it as `_`)
    cpu_s: int | None  # the subshell's `ulimit -S -t`
    log: str | None  # the subshell's `> FILE 2>&1`


def preload() -> dict | None:
    """In the zygote: import pytest and its built-in plugins; return what `plan` and `run` need (the
    interpreter's sys.path as a fresh `python` in a sandbox sees it), or None if pytest is missing."""
    try:
        out = subprocess.run([sys.executable, "-S", "-c", _PROBE], capture_output=True, text=True, timeout=60,
                             check=True, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8"})
        stdlib, full = json.loads(out.stdout)
        sys.path.extend(p for p in full if p not in sys.path)  # for pytest's import here; .pth files not run
        import importlib.metadata  # noqa: F401  (entry-point plugin discovery)

        import _pytest.config
        import pytest  # noqa: F401
        for name in _pytest.config.default_plugins:
            __import__("_pytest." + name)
    except (OSError, ValueError, KeyError, ImportError, subprocess.SubprocessError):
        return None
    for name in RUN_IMPORTS:  # only a head start: a run imports whatever is missing itself
        try:
            __import__(name)
        except ImportError:
            pass
    # Everything imported so far lives as long as the children: a child's full collections would
    # traverse it, writing to each object's GC header and so copying the pages it shares with the
    # zygote. Frozen, they are skipped (Python's gc.freeze, for pre-fork servers).
    gc.freeze()
    return {"stdlib": stdlib, "exe": sys.executable}


def plan(command: str, env: dict[str, str], base: dict) -> Plan | None:
    """How to run `command` in a fork (env: the exec's environment), or None for bash."""
    command, cpu_s, log = command.strip(), None, None
    m = _WRAPPED.fullmatch(command)
    if m:
        cpu_s, command, log = (int(m[1]) if m[1] else None), m[2], m[3]
    if not _WORDS.fullmatch(command):
        return None
    raw = re.findall(_WORD, command)
    assign = {}
    while raw and _ASSIGN.match(raw[0]):  # a quoted name is no assignment to bash
        name, value = shlex.split(raw.pop(0))[0].split("=", 1)
        assign[name] = value
    words = [shlex.split(w)[0] for w in raw]
    if words[:3] not in (["python", "-m", "pytest"], ["python3", "-m", "pytest"]) or "PATH" in assign:
        return None
    full = {**env, **assign}
    exe = shutil.which(words[0], path=full.get("PATH", ""))
    exe = exe and os.path.abspath(exe)
    if not exe or os.path.dirname(exe) != os.path.dirname(base["exe"]) or not os.path.samefile(exe, base["exe"]):
        return None
    if any(k.startswith("PYTHON") and k not in _APPLIED for k in full) or full.get("PYTHONHASHSEED", HASH_SEED) != HASH_SEED:
        return None
    ctype = full.get("LC_ALL") or full.get("LC_CTYPE") or full.get("LANG") or ""
    if not re.search(r"utf-?8", ctype, re.I):
        return None
    return Plan(words[3:], assign, exe, cpu_s, log)


def run(p: Plan, env: dict[str, str], base: dict) -> None:
    """In the forked child (cwd set, fds 0-2 the job's): become `python -m pytest ARGS`; never returns."""
    import atexit
    import io
    import resource
    import runpy
    import signal
    import site
    code = 1
    try:
        # bash exports these; its subshell execs the command without counting a level
        level = int(env["SHLVL"]) if env.get("SHLVL", "").isdigit() else 0
        full = {**env, **p.assign, "PWD": os.getcwd(), "SHLVL": str(level + (p.log is None)), "_": p.exe}
        os.environ.clear()
        os.environ.update(full)
        if p.log:
            try:
                out = os.open(p.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            except OSError as e:  # as bash reports a redirection it cannot make
                os.write(2, f"bash: {p.log}: {e.strerror}\n".encode())
                return
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
        os.closerange(3, 65536)
        if p.cpu_s is not None:
            try:
                resource.setrlimit(resource.RLIMIT_CPU, (p.cpu_s, resource.getrlimit(resource.RLIMIT_CPU)[1]))
            except (ValueError, OSError) as e:  # bash's ulimit fails the same way and the command still runs
                os.write(2, f"bash: ulimit: cpu time: cannot modify limit: {e}\n".encode())
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # as CPython sets them at start-up
            signal.signal(sig, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # sys.path and .pth hooks as a fresh start makes them: PYTHONPATH, the stdlib, then site with
        # this environment (venv, user site, site-packages, .pth files), then `-m`'s cwd in front
        extra = full.get("PYTHONPATH")
        sys.path[:] = [*([os.path.abspath(e) for e in extra.split(":")] if extra else []), *base["stdlib"]]
        site.ENABLE_USER_SITE = False if full.get("PYTHONNOUSERSITE") else None
        site.USER_BASE = site.USER_SITE = None
        site.main()
        sys.path.insert(0, os.getcwd())
        sys.dont_write_bytecode = bool(full.get("PYTHONDONTWRITEBYTECODE"))
        unbuffered = bool(full.get("PYTHONUNBUFFERED"))
        sys.stdin = sys.__stdin__ = open(0, closefd=False, encoding="utf-8")
        sys.stdout = sys.__stdout__ = _stream(1, "strict", os.isatty(1), unbuffered, io)
        sys.stderr = sys.__stderr__ = _stream(2, "backslashreplace", True, unbuffered, io)
        for name in [n for n in sys.modules if n == "kiln" or n.startswith("kiln.")]:
            del sys.modules[name]  # the sandbox's own code may have a package of that name
        import importlib
        importlib.invalidate_caches()
        sys.argv = ["-m", *p.args]
        try:
            runpy.run_module("pytest", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except BaseException:
            import traceback
            traceback.print_exc()
        if "threading" in sys.modules:  # what interpreter shutdown does: join non-daemon threads, atexit
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
    finally:
        os._exit(code)


def _stream(fd: int, errors: str, line: bool, unbuffered: bool, io):
    raw = io.FileIO(fd, "w", closefd=False)
    buffered = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(buffered, encoding="utf-8", errors=errors, line_buffering=line, write_through=unbuffered)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
