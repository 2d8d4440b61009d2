"""The part of a Dockerfile the host provides without building anything (Harbor and Terminal-Bench
environments): the fast path. Any other Dockerfile gets a root of its own (env_build.py), which
reuses this module's reading of instructions (`instructions`, `expand`, `words`, `env_pairs`).

A kiln sandbox over the host root is the host's system (read-only), kiln's own Python environment and
a workspace. So an image is providable when it is a Python image whose only additions are files in
its working directory and pip packages kiln's environment already has:

    FROM <a python image>               one stage (python:3.x*, or any image named python*)
    WORKDIR <absolute path>             becomes the sandbox workspace (required)
    COPY / ADD <local files> <dest>     dest inside the final WORKDIR; the files become repo/
    RUN pip install <pkgs> | -r <file>  every package already installed here (versions not compared)
    RUN mkdir -p <dirs>                 inside the WORKDIR
    RUN apt-get install tmux asciinema  Terminal-Bench's own tools: a no-op (with apt-get update and
                                        rm -rf /var/lib/apt/lists/* around it)
    ENV <key>=<value>                   keys that do not change what programs compute (SAFE_ENV), or a
                                        path inside the WORKDIR (exported into the sandbox, see `env`)
    ARG <key>=<value>                   $key / ${key} expand in later instructions, as ENV keys do
    USER root; LABEL MAINTAINER CMD ENTRYPOINT EXPOSE STOPSIGNAL HEALTHCHECK: no effect here

Anything else is a problem naming the file, the line and the instruction kiln cannot provide;
`parse` collects every one of them before refusing the file.
"""
from __future__ import annotations

import functools
import glob
import importlib.metadata
import json
import os
import posixpath
import re
import shlex
import shutil
from dataclasses import dataclass, field

from .record import Problems, TaskError

SAFE_ENV = {"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING", "DEBIAN_FRONTEND", "LANG",
            "LC_ALL", "TZ", "TERM", "PIP_NO_CACHE_DIR", "PIP_DISABLE_PIP_VERSION_CHECK", "PIP_ROOT_USER_ACTION"}
IGNORED = {"LABEL", "MAINTAINER", "CMD", "ENTRYPOINT", "EXPOSE", "STOPSIGNAL", "HEALTHCHECK"}
# Terminal-Bench's harness drives the agent's container through tmux and records it with asciinema;
# kiln drives its sandbox itself, so installing them provides nothing the task needs.
TB_TOOLS = {"tmux", "asciinema"}
SUPPORTED = ("FROM a python image, WORKDIR, COPY/ADD of local files into the working directory, "
             "RUN pip install of packages installed in kiln's environment, RUN mkdir -p inside the working "
             f"directory, RUN apt-get install of {' and '.join(sorted(TB_TOOLS))} only, ENV of "
             f"{', '.join(sorted(SAFE_ENV))} or of paths inside the working directory, ARG, USER root, and "
             f"{', '.join(sorted(IGNORED))}")
NOTE = f"Without Docker kiln supports only: {SUPPORTED}."
_PIP_ARG_OPTS = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint",
                 "--trusted-host", "--python", "-p"}
_APT_ARG_OPTS = {"-o", "-t", "-c", "--option", "--target-release", "--config-file"}
_APT_HOUSEKEEPING = {"update", "clean", "autoclean", "autoremove"}
GLOB = re.compile(r"[*?\[]")
_SPEC = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([<>=!~;@ ].*)?$")
_VAR = re.compile(r"\$(?:\{(\w+)(?::?[-=]([^}]*))?\}|(\w+))")


@dataclass
class Step:
    line: int
    text: str  # the instruction as written, for error messages
    op: str  # COPY | PIP | MKDIR
    args: list[str] = field(default_factory=list)  # COPY: sources then the absolute dest; else paths/specs


@dataclass
class Image:
    path: str  # the Dockerfile, for error messages
    base: str = ""
    workdir: str = ""
    steps: list[Step] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # ENV paths inside the WORKDIR: exported into the sandbox


def instructions(text: str):
    """(first line number, instruction) with continuations joined and comments dropped."""
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # a comment inside a continued instruction
        start = start or n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        yield start, buf + line
        buf, start = "", 0
    if buf.strip():
        yield start, buf


def refuse(path: str, n: int, line: str, why: str) -> TaskError:
    """The problem with one line of a Dockerfile or a test script."""
    return TaskError(f"{path}:{n}: kiln cannot provide `{line[:120]}`: {why}")


def parse(text: str, path: str = "Dockerfile", problems: Problems | None = None) -> Image:
    """The image a Dockerfile describes. Every problem goes to `problems`; without one, they are
    raised here as one TaskError."""
    mine = problems is None
    problems = Problems(path) if mine else problems
    img, variables, other_env = Image(path), {}, []

    def report(e: TaskError) -> None:
        problems.add(str(e), NOTE)
    for n, line in instructions(text):
        fail = functools.partial(refuse, path, n, line)
        try:
            _instruction(img, n, line, variables, other_env, fail, report)
        except TaskError as e:
            report(e)
    if not img.base:
        problems.add(f"{path}: no FROM instruction")
    if not img.workdir or img.workdir == "/":
        problems.add(f"{path}: no WORKDIR (other than /): kiln maps the task's working directory onto its "
                     "workspace and must know which directory that is")
    for fail, key, value in other_env:  # known only now: whether the value is inside the final WORKDIR
        if img.workdir not in ("", "/") and (value + "/").startswith(img.workdir + "/"):
            img.env[key] = value
        else:
            report(fail(f"ENV {key} would not reach the agent's shell: kiln passes on only ENV values that are "
                        "paths inside the working directory"))
    if mine:
        problems.raise_any()
    return img


def _instruction(img: Image, n: int, line: str, variables: dict, other_env: list, fail, report) -> None:
    op, _, rest = line.partition(" ")
    op, rest = op.upper(), rest.strip()
    if op == "ARG":
        name, eq, default = rest.partition("=")
        if eq:
            variables[name.strip()] = expand(default.strip().strip("\"'"), variables, fail)
        return
    if op in ("WORKDIR", "COPY", "ADD", "RUN", "FROM", "ENV"):
        rest = expand(rest, variables, fail)
    if op == "FROM":
        image = next(a for a in rest.split() if not a.startswith("--"))
        if img.base:
            raise fail("multi-stage builds need Docker")
        img.base = image
        name = image.rsplit("/", 1)[-1].split(":")[0].split("@")[0]
        if not name.startswith("python"):
            raise fail(f"the base image {image!r} is not a Python image (kiln's sandbox has only the host "
                       "system and kiln's Python)")
    elif op == "WORKDIR":
        img.workdir = posixpath.normpath(posixpath.join(img.workdir or "/", rest.strip("\"'")))
    elif op in ("COPY", "ADD"):
        img.steps.append(_copy_step(img, n, op, line, rest, fail))
    elif op == "RUN":
        for e in _run(img, n, line, rest, fail):
            report(e)
    elif op == "ENV":
        pairs = env_pairs(rest)
        variables.update(pairs)
        other_env += [(fail, k, v) for k, v in pairs.items() if k not in SAFE_ENV]
    elif op == "USER":
        if rest.split(":")[0] not in ("root", "0"):
            raise fail("kiln runs commands as the sandbox's root user only")
    elif op not in IGNORED:
        raise fail(f"{op} is not supported")


def expand(rest: str, variables: dict, fail) -> str:
    """$NAME and ${NAME} (${NAME:-default}) of earlier ARG and ENV lines, as Docker expands them."""
    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in variables:
            return variables[name]
        if m.group(2) is not None:
            return m.group(2)
        raise fail(f"the build variable ${name} has no value here (no ARG or ENV line gives it one)")
    out = _VAR.sub(value, rest)
    if "$" in out:
        raise fail("shell expansions ($(...), $((...))) need a Docker build")
    return out


def _copy_step(img: Image, n: int, op: str, line: str, rest: str, fail) -> Step:
    args = words(rest)
    flags = [a for a in args if a.startswith("--")]
    args = [a for a in args if not a.startswith("--")]
    if any(f.startswith("--from") for f in flags):
        raise fail("copying from another image or stage needs Docker")
    if len(args) < 2:
        raise fail("expected sources and a destination")
    for src in args[:-1]:
        remote = re.match(r"^[a-z]+://|^git@", src) or re.search(r"\.(tar|tgz|tbz2|txz)(\.\w+)?$", src)
        if op == "ADD" and remote:
            raise fail("ADD of URLs and archives needs Docker")
        if posixpath.isabs(src) or ".." in src.split("/"):
            raise fail("the source must be inside the build context")
    dest = args[-1]
    abs_dest = posixpath.join(img.workdir or "/", dest)
    if dest.endswith("/") or dest in (".", "./") or len(args) > 2 or any(GLOB.search(s) for s in args[:-1]):
        abs_dest = posixpath.normpath(abs_dest) + "/"
    return Step(n, line, "COPY", [*args[:-1], abs_dest])


def words(rest: str) -> list[str]:
    if rest.startswith("["):
        try:
            return [str(a) for a in json.loads(rest)]
        except json.JSONDecodeError:
            pass
    return shlex.split(rest)


def run_commands(rest: str) -> list[list[str]]:
    if rest.startswith("["):
        argv = words(rest)
        if argv[:2] in (["/bin/sh", "-c"], ["sh", "-c"], ["bash", "-c"], ["/bin/bash", "-c"]):
            rest = " ".join(argv[2:])
        else:
            return [argv]
    cmds, cur = [], []
    lex = shlex.shlex(rest, posix=True, punctuation_chars="&;|")
    lex.whitespace_split = True
    for tok in lex:
        if tok in ("&&", ";"):
            cmds.append(cur)
            cur = []
        else:
            cur.append(tok)
    return [c for c in cmds + [cur] if c]


def apt_command(cmd: list[str]) -> tuple[str, list[str]] | None:
    """(subcommand, packages) of an apt-get / apt command, or ("rm", []) for removing apt's lists;
    None for any other command. Leading VAR=value assignments and sudo are skipped."""
    words = list(cmd)
    while words and (words[0] == "sudo" or re.fullmatch(r"\w+=\S*", words[0])):
        words.pop(0)
    if words[:2] == ["rm", "-rf"] and words[2:] and all(w.startswith("/var/lib/apt/lists") for w in words[2:]):
        return "rm", []
    if not words or words[0] not in ("apt-get", "apt"):
        return None
    args, it = [], iter(words[1:])
    for w in it:
        if w in _APT_ARG_OPTS:
            next(it, None)
        elif not w.startswith("-"):
            args.append(w)
    return (args[0], args[1:]) if args else ("", [])


def _run(img: Image, n: int, line: str, rest: str, fail) -> list[TaskError]:
    """The steps of one RUN line, appended to `img`; returns a problem per command kiln cannot run.
    apt commands are no-ops when the line installs only TB_TOOLS; otherwise one problem for them."""
    try:
        cmds = run_commands(rest)
    except ValueError as e:  # shlex: an unclosed quote
        return [fail(f"cannot read the command: {e}")]
    apt = [(c, apt_command(c)) for c in cmds]
    extra = sorted({p.split("=")[0] for _, a in apt if a and a[0] == "install" for p in a[1]} - TB_TOOLS)
    errors = [fail(f"`{' '.join(c)}` can only run in a Docker build (it changes the system's packages)")
              for c, a in apt if a and a[0] not in _APT_HOUSEKEEPING | {"install", "rm"}]
    if extra:
        first = next(" ".join(c) for c, a in apt if a)
        errors.insert(0, fail(f"`{first}` can only run in a Docker build: this RUN installs system packages "
                              f"kiln's sandbox does not have ({', '.join(extra)}); an apt install of only "
                              f"{' and '.join(sorted(TB_TOOLS))} (Terminal-Bench's own tools) is skipped"))
    for cmd, a in apt:
        if a is None:
            try:
                img.steps.append(_run_step(n, line, cmd, img, fail))
            except TaskError as e:
                errors.append(e)
    return errors


def _run_step(n: int, line: str, cmd: list[str], img: Image, fail) -> Step:
    shown = " ".join(cmd)
    rest = cmd
    if rest[:1] == ["uv"] and rest[1:2] == ["pip"]:
        rest = rest[1:]
    elif len(rest) > 2 and re.fullmatch(r"python[\d.]*", rest[0]) and rest[1:3] == ["-m", "pip"]:
        rest = rest[2:]
    known = rest and (rest[0] == "mkdir" or (re.fullmatch(r"pip[\d.]*", rest[0]) and rest[1:2] == ["install"]))
    if not known:
        raise fail(f"`{shown}` can only run in a Docker build (only pip installs, mkdir and apt installs of "
                   f"{' and '.join(sorted(TB_TOOLS))} run here)")
    if any(t in ("|", "||", ">", ">>", "<", "&") for t in cmd):
        raise fail(f"`{shown}` uses pipes or redirections")
    if rest[0] != "mkdir":
        specs, reqs, it = [], [], iter(rest[2:])
        for a in it:
            if a in ("-r", "--requirement"):
                reqs.append(next(it, ""))
            elif a.startswith("--requirement="):
                reqs.append(a.split("=", 1)[1])
            elif a in _PIP_ARG_OPTS:
                next(it, None)
            elif a in ("-e", "--editable") or (not a.startswith("-") and (a.startswith((".", "/")) or "://" in a)):
                raise fail(f"`{shown}` installs a local path or URL into the environment, which kiln shares")
            elif not a.startswith("-"):
                specs.append(a)
        for spec in specs:
            check_package(spec, fail)
        return Step(n, line, "PIP", [posixpath.join(img.workdir or "/", r) for r in reqs])
    dirs = [posixpath.normpath(posixpath.join(img.workdir or "/", a)) for a in rest[1:] if not a.startswith("-")]
    return Step(n, line, "MKDIR", dirs)


def check_package(spec: str, fail) -> None:
    m = _SPEC.match(spec.strip().strip("\"'"))
    if not m:
        raise fail(f"cannot read the package requirement {spec!r}")
    try:
        importlib.metadata.distribution(m.group(1))
    except importlib.metadata.PackageNotFoundError:
        raise fail(f"the package {m.group(1)!r} is not installed in kiln's environment (the sandbox shares it "
                   "read-only; install it there first)") from None


def env_pairs(rest: str) -> dict[str, str]:
    words = shlex.split(rest)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) for w in words if "=" in w)


# -- building the working directory ----------------------------------------------------------------
def provide(img: Image, context: str, tree: str, problems: Problems | None = None) -> list[list[str]]:
    """Run the image's steps into `tree` (the working directory). Returns the copies as
    [context path, tree path, "dir" | "file"], which `reverse` uses to rebuild a context. Every
    problem (a missing source, a path outside the WORKDIR) goes to `problems`, as in `parse`."""
    mine = problems is None
    problems = Problems(img.path) if mine else problems
    os.makedirs(tree, exist_ok=True)
    copies: list[list[str]] = []
    for step in img.steps:
        fail = functools.partial(refuse, img.path, step.line, step.text)
        if step.op == "COPY":
            for src in step.args[:-1]:
                copies += problems.check(_copy, img, context, tree, src, step.args[-1], fail) or []
        elif step.op == "MKDIR":
            for d in step.args:
                rel = problems.check(_inside, img, d, fail)
                if rel is not None:
                    os.makedirs(os.path.join(tree, rel), exist_ok=True)
        elif step.op == "PIP":
            for req in step.args:
                problems.check(_check_requirements, img, tree, req, fail)
    if mine:
        problems.raise_any()
    return copies


def _copy(img: Image, context: str, tree: str, src: str, dest: str, fail) -> list[list[str]]:
    matches = sorted(glob.glob(os.path.join(context, src))) if GLOB.search(src) else [os.path.join(context, src)]
    matches = [m for m in matches if os.path.lexists(m)]
    if not matches:
        raise fail(f"{src!r} is not in the build context {context}")
    copies = []
    for m in matches:
        rel = os.path.relpath(m, context).replace(os.sep, "/")
        target = posixpath.join(dest, posixpath.basename(rel)) if dest.endswith("/") and not os.path.isdir(m) \
            else dest
        tree_rel = _inside(img, target, fail)
        kind = "dir" if os.path.isdir(m) else "file"
        out = os.path.join(tree, tree_rel)
        if kind == "dir":
            shutil.copytree(m, out, symlinks=True, dirs_exist_ok=True)
        else:
            os.makedirs(os.path.dirname(out) or tree, exist_ok=True)
            shutil.copy2(m, out)
        copies.append([rel, tree_rel, kind])
    return copies


def _check_requirements(img: Image, tree: str, req: str, fail) -> None:
    path = os.path.join(tree, _inside(img, req, fail))
    if not os.path.isfile(path):
        raise fail(f"the requirements file {req} is not in the working directory at this point")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for ln in lines:
        ln = ln.split("#")[0].strip()
        if ln and not ln.startswith("-"):
            check_package(ln, fail)


def _inside(img: Image, path: str, fail) -> str:
    rel = posixpath.relpath(posixpath.normpath(path), img.workdir)
    if rel == ".." or rel.startswith("../"):
        raise fail(f"{path} is outside the working directory {img.workdir} (kiln provides only the workspace)")
    return "" if rel == "." else rel


def reverse(copies: list[list[str]], tree: str, context: str) -> None:
    """Write into `context` the files that `provide` copies to give `tree` (export)."""
    for src, tree_rel, kind in copies:
        have = os.path.join(tree, tree_rel)
        out = os.path.join(context, src)
        if kind == "dir" and os.path.isdir(have):
            shutil.copytree(have, out, symlinks=True, dirs_exist_ok=True)
        elif kind == "file" and os.path.lexists(have):
            os.makedirs(os.path.dirname(out) or context, exist_ok=True)
            shutil.copy2(have, out, follow_symlinks=False)
