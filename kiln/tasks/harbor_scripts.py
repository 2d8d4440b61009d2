"""Test scripts of Harbor / Terminal-Bench tasks against kiln's sandbox, which has no network but
already has pytest (kiln's, or the Debian base's in a built root): `check_script` finds the lines that
need the network; `offline_tests` rewrites the usual boilerplate into `python -m pytest ...` with the
same arguments: Terminal-Bench 1's run-tests.sh (install curl, uv and pytest, make a venv, `uv run
pytest ...`) and Harbor's test.sh as `harbor tasks init` writes it (install curl and uv, then `uvx -p 3.13
-w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf /logs/verifier/ctrf.json /tests/... -rA`,
also inside `if ...; then`): the CTRF report is Harbor's log, not its reward, so it is left out.
"""
from __future__ import annotations

import functools
import re
import shlex

from .dockerfile import apt_command, check_package, refuse
from .record import Problems

# Commands that need the network or a package manager; kiln's verifier has neither.
_OFFLINE = re.compile(r"(?:^|[;&|(]\s*|\bsudo\s+)(apt-get|apt|apk|yum|dnf|curl|wget|uvx?)\b")
_ADVICE = "(pytest and kiln's packages are already there: call `python -m pytest` directly)"
TB1_DEFAULT = 'python -m pytest "$TEST_DIR/test_outputs.py" -rA'  # what Terminal-Bench 1 runs without one

# The boilerplate's steps that only fetch tools kiln's sandbox already has.
_FETCH_TOOLS = [re.compile(p) for p in (
    r"^curl\s.*\bastral\.sh/uv/\S*install\.sh\s*\|\s*(ba)?sh$",  # the uv installer
    r"^(source|\.)\s+(\$HOME|\$\{HOME\}|~)/\.local/bin/env$",  # uv's PATH set-up
    r"^uv\s+(venv|init)(\s.*)?$",  # a venv for the test dependencies
    r"^(source|\.)\s+\S+/bin/activate$",
    r"^(source|bash|\.)\s+\S*setup-uv-pytest\.sh$")]  # TB1's shared helper doing all of the above
_INSTALL = re.compile(r"^(?:uv\s+pip\s+install|uv\s+add|(?:python3?\s+-m\s+)?pip3?\s+install)\s+(.*)$")
_RUNNER = re.compile(r"^(?:uv\s+run\s+(?:python3?\s+-m\s+)?pytest|python3?\s+-m\s+pytest|pytest)(\s.*)?$")
_TB1_RUN_HELPER = re.compile(r"^(bash|source|\.)?\s*\S*run-uv-pytest\.sh$")
# uvx [-p PY | --python PY | -w PKG | --with PKG]... pytest ARGS: Harbor's template runner.
_UVX = re.compile(r"^uvx\s+(?P<opts>(?:(?:-p|--python|-w|--with)\s+\S+\s+)*)pytest(?P<args>\s.*)?$")
_CTRF = re.compile(r"\s--ctrf(?:=|\s+)\S+")
_CTRF_PLUGIN = "pytest-json-ctrf"  # writes Harbor's CTRF log; kiln's verifier reads the reward
_KEYWORD = re.compile(r"^(?P<kw>(?:if|then|elif|else|do|!)\s+)(?P<rest>.*)$")
_CURL_ONLY = {"curl", "ca-certificates"}


def check_script(text: str, where: str, problems: Problems) -> None:
    """A problem for each line of a test script kiln's sandbox cannot run (it has no network)."""
    for n, line in enumerate(text.splitlines(), 1):
        m = _OFFLINE.search(line.split("#")[0].strip())
        if m:
            why = f"{m.group(1)} needs the network or a package manager, and kiln's sandbox has neither {_ADVICE}"
            problems.add(str(refuse(where, n, line.strip(), why)))


def _logical_lines(text: str):
    """(first line number, physical line count, text) with backslash continuations joined."""
    buf, start, count = "", 0, 0
    for n, raw in enumerate(text.splitlines(), 1):
        start, count = start or n, count + 1
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        yield start, count, buf + raw
        buf, start, count = "", 0, 0
    if count:
        yield start, count, buf


def offline_tests(text: str, where: str, problems: Problems) -> str:
    """A test script with its tool-fetching boilerplate dropped and its pytest run as `python -m
    pytest` (same arguments). Line numbers stay as written, so later problems name the right line.
    Installing a package kiln's environment lacks is a problem; anything else is left for
    `check_script` to judge."""
    out = []
    for n, count, line in _logical_lines(text):
        body = line.split(" #")[0].strip()
        # Split `a && b; c` (keeping the separators) only when no quotes could hide one.
        parts = re.split(r"(\s*(?:&&|;)\s*)", body) if not re.search(r"[\"'`]", body) else [body]
        cmds, seps = parts[0::2], parts[1::2]
        fail = functools.partial(refuse, where, n, body)
        new = [problems.check(_keyword_command, c, fail) or "" for c in cmds]
        if body and new != cmds:
            kept = [(sep, c) for sep, c in zip(["", *seps], new) if c]
            line = "".join(sep + c for sep, c in kept).lstrip("&; ") or \
                f"# (kiln skipped `{body[:80]}`: it fetches tools the sandbox already has)"
        out += [line] + [""] * (count - 1)
    return "\n".join(out) + "\n"


offline_tb1_tests = offline_tests  # the name it had when only Terminal-Bench 1's scripts were rewritten


def _keyword_command(cmd: str, fail) -> str:
    """A command that may start with a shell keyword (`if uvx ...`, `then ...`): the keyword stays."""
    m = _KEYWORD.match(cmd)
    if m:
        rest = _offline_command(m["rest"], fail)
        return m["kw"] + rest if rest else ("" if m["kw"].strip() not in ("if", "elif", "!") else m["kw"] + "true")
    return _offline_command(cmd, fail)


def _offline_command(cmd: str, fail) -> str:
    """One command of a test script -> what kiln runs instead ("" to drop it)."""
    if not cmd or any(p.match(cmd) for p in _FETCH_TOOLS):
        return ""
    m = _UVX.match(cmd)
    if m:
        opts = m["opts"].split()
        for flag, pkg in zip(opts[0::2], opts[1::2]):
            if flag in ("-w", "--with") and not pkg.startswith(_CTRF_PLUGIN):
                check_package(pkg, fail)
        return "python -m pytest" + _CTRF.sub("", m["args"] or "")
    if _TB1_RUN_HELPER.match(cmd):
        return TB1_DEFAULT
    m = _RUNNER.match(cmd)
    if m:
        return "python -m pytest" + _CTRF.sub("", m.group(1) or "")
    try:
        words = shlex.split(cmd)
    except ValueError:
        return cmd
    apt = apt_command(words)
    if apt and (apt[0] in ("update", "clean", "rm") or (apt[0] == "install" and set(apt[1]) <= _CURL_ONLY)):
        return ""  # curl is fetched only to fetch uv
    m = _INSTALL.match(cmd)
    if m:
        words = shlex.split(m.group(1))
        specs = [w for w in words if not w.startswith("-")]
        if any(w in ("-r", "--requirement", "-e", "--editable") for w in words) or \
                any(s.startswith((".", "/")) or "://" in s for s in specs):
            raise fail("installing from a file, a local path or a URL cannot be checked against kiln's "
                       "environment: name the packages instead")
        for spec in specs:
            if spec.split("=")[0].split("<")[0].split(">")[0] not in ("uv", _CTRF_PLUGIN):  # the boilerplate's own
                check_package(spec, fail)
        return ""
    return cmd
