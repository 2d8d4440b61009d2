"""Build a task's environment from its Dockerfile without Docker: a Debian root, layer by layer.

    FROM     mapped to a Debian base (env_images.py; built once by env_base.py), plus the image's own
             packages as the first layer (python images: pip and venv)
    RUN      one layer: the command runs with /bin/sh in a build sandbox whose root is the layers so
             far, writable, with the host's network (the only sandbox that has any)
    COPY/ADD one layer: local files of the build context written into the root (--chmod honoured)
    WORKDIR, ENV, ARG, USER   state: the directory RUN starts in (created as Docker does), the
             variables it and the agent get, $VAR expansion, and the user commands run as (one uid
             is mapped: USER's uid and gid from the image's /etc/passwd, so `id` and file owners
             read as that user; it cannot become root)

Each layer's id hashes its instruction, the state it runs with, the content of what it copies and
its parent's id, so a layer is built once and shared by every task whose Dockerfile starts the same
way. `parse` finds every problem before anything runs (another architecture, an image kiln cannot
map, COPY --from, a second stage), and `build` refuses them in one message.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import posixpath
import re
import shlex
import shutil
import time
from dataclasses import dataclass, field

from . import dockerfile, env_base, env_images
from .record import Problems, TaskError

IGNORED = dockerfile.IGNORED | {"VOLUME", "ONBUILD"}
DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
PLATFORM = {k: v.format(arch=env_base.host_arch()) for k, v in (  # Docker's automatic platform ARGs
    ("TARGETPLATFORM", "linux/{arch}"), ("BUILDPLATFORM", "linux/{arch}"), ("TARGETOS", "linux"),
    ("BUILDOS", "linux"), ("TARGETARCH", "{arch}"), ("BUILDARCH", "{arch}"))}
_APT_INSTALL = ("apt-get update && apt-get install -y --no-install-recommends {} "
                "&& rm -rf /var/lib/apt/lists/*")


@dataclass
class Step:
    line: int  # 0 for the base image's own packages
    text: str  # the instruction as written
    op: str  # RUN | COPY
    args: list  # RUN: the argv (shell form: /bin/sh -c ...); COPY: sources then the absolute dest
    workdir: str
    env: dict
    user: str
    chmod: str = ""


@dataclass
class Recipe:
    """What a Dockerfile asks for, checked; `build` makes it."""
    path: str
    base: env_images.BaseImage
    steps: list[Step] = field(default_factory=list)
    workdir: str = "/"
    env: dict = field(default_factory=dict)
    user: str = "root"


@dataclass
class Environment:
    """A built environment: its layers in the cache (top first) and what the sandbox needs to run it."""
    image: str
    suite: str
    layers: list[str]
    workdir: str
    env: dict
    uid: int = 0
    gid: int = 0

    def trees(self, cache: str) -> list[str]:
        return [env_base.layer_tree(cache, layer) for layer in self.layers]

    def to_dict(self) -> dict:
        return {"image": self.image, "suite": self.suite, "layers": self.layers, "workdir": self.workdir,
                "env": self.env, "uid": self.uid, "gid": self.gid}


# -- reading the Dockerfile ---------------------------------------------------------------------------
def parse(text: str, path: str = "Dockerfile", problems: Problems | None = None) -> Recipe | None:
    """The recipe a Dockerfile describes (None without a FROM). Every problem goes to `problems`,
    whose caller refuses them (the recipe is then only good for finding more), or, when none is
    given, is raised here in one TaskError."""
    mine = problems is None
    problems = Problems(path) if mine else problems
    before = len(problems.items)
    state = {"recipe": None, "vars": {}, "workdir": "/", "env": {}, "user": "root", "stages": []}
    for n, line in dockerfile.instructions(text):
        fail = functools.partial(dockerfile.refuse, path, n, line)
        try:
            _instruction(state, path, n, line, fail)
        except TaskError as e:
            problems.add(str(e))
    recipe = state["recipe"]
    if recipe is None and not any("FROM" in p for p in problems.items[before:]):
        problems.add(f"{path}: no FROM instruction")
    if recipe is not None:
        recipe.workdir, recipe.env, recipe.user = state["workdir"], state["env"], state["user"]
        if recipe.workdir == "/":
            problems.add(f"{path}: no WORKDIR (other than /): kiln maps the task's working directory onto its "
                         "workspace and must know which directory that is")
    if mine:
        problems.raise_any()
    return recipe


def _instruction(state: dict, path: str, n: int, line: str, fail) -> None:
    op, _, rest = line.partition(" ")
    op, rest = op.upper(), rest.strip()
    recipe: Recipe | None = state["recipe"]
    # An ENV wins over an ARG of the same name, as in Docker.
    variables = {**DEFAULT_ENV, **PLATFORM, **(recipe.base.env if recipe else {}), **state["vars"], **state["env"]}
    if op == "ARG":
        name, _, default = rest.partition("=")
        state["vars"][name.strip()] = dockerfile.expand(default.strip().strip("\"'"), variables, fail)
        return
    if op == "FROM":
        _from(state, path, dockerfile.expand(rest, variables, fail), fail)
        return
    if recipe is None:
        raise fail("comes before FROM")
    if op in IGNORED:
        return
    rest = dockerfile.expand(rest, variables, fail) if op != "RUN" else rest  # RUN: the shell expands
    if op == "WORKDIR":
        state["workdir"] = posixpath.normpath(posixpath.join(state["workdir"], rest.strip("\"'")))
    elif op == "ENV":
        state["env"].update(dockerfile.env_pairs(rest))
    elif op == "USER":
        state["user"] = rest.strip()
    elif op == "RUN":
        recipe.steps.append(_run(state, n, line, rest, fail))
    elif op in ("COPY", "ADD"):
        recipe.steps.append(_copy(state, n, op, line, rest, fail))
    else:
        raise fail(f"{op} is not supported by kiln's environment builder")


def _from(state: dict, path: str, rest: str, fail) -> None:
    args = rest.split()
    flags = [a for a in args if a.startswith("--")]
    words = [a for a in args if not a.startswith("--")]
    if state["recipe"] is not None:
        raise fail("a second FROM (a multi-stage build): kiln builds single-stage Dockerfiles only")
    if not words:
        raise fail("no image named")
    if len(words) == 3 and words[1].lower() == "as":
        state["stages"].append(words[2])
    base = env_images.map_image(words[0])
    ok = isinstance(base, env_images.BaseImage)
    state["recipe"] = Recipe(path, base if ok else env_images.BaseImage(words[0], ""))  # later lines still checked
    why = [] if ok else [base]
    for f in flags:
        arch = f.split("=", 1)[1].split("/")[1] if f.startswith("--platform=") and "/" in f else ""
        if arch not in ("", env_base.host_arch()):
            why.append(f"another architecture ({arch}) than this machine's ({env_base.host_arch()})")
    if why:
        raise fail("; ".join(why))
    if base.packages:  # the image's own packages: the first layer on the Debian base
        cmd = _APT_INSTALL.format(" ".join(base.packages))
        state["recipe"].steps.append(Step(0, f"({base.image}: {cmd})", "RUN", ["/bin/sh", "-c", cmd], "/", {}, "root"))


def _state(state: dict, build_args: bool = False) -> dict:
    """The state a step runs with; RUN also sees the ARG values, as environment variables (as in Docker)."""
    env = {**state["vars"], **state["env"]} if build_args else dict(state["env"])
    return {"workdir": state["workdir"], "env": env, "user": state["user"]}


def _run(state: dict, n: int, line: str, rest: str, fail) -> Step:
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        if flag.startswith("--mount=") and "type=cache" not in flag:
            raise fail(f"RUN {flag} needs Docker (kiln builds without secrets or bind mounts)")
        rest = rest.strip()  # a cache mount only speeds up a build; --network is the build's anyway
    args = dockerfile.words(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
    return Step(n, line, "RUN", args, **_state(state, build_args=True))


def _copy(state: dict, n: int, op: str, line: str, rest: str, fail) -> Step:
    args = dockerfile.words(rest)
    flags = [a for a in args if a.startswith("--")]
    args = [a for a in args if not a.startswith("--")]
    chmod = ""
    for f in flags:
        if f.startswith("--from"):
            stage = f.split("=", 1)[-1]
            known = "an earlier stage" if stage in state["stages"] else "an unknown stage or another image"
            raise fail(f"COPY --from={stage} copies from {known}: kiln builds single-stage Dockerfiles only")
        if f.startswith("--chmod="):
            chmod = f.split("=", 1)[1]
            if not re.fullmatch(r"[0-7]{3,4}", chmod):
                raise fail(f"--chmod={chmod}: kiln takes an octal mode only")
    if len(args) < 2:
        raise fail("expected sources and a destination")
    for src in args[:-1]:
        if op == "ADD" and (re.match(r"^[a-z]+://|^git@", src) or re.search(r"\.(tar|tgz|tbz2|txz)(\.\w+)?$", src)):
            raise fail("ADD of URLs and archives needs Docker")
        if posixpath.isabs(src) or ".." in src.split("/"):
            raise fail("the source must be inside the build context")
    dest = posixpath.join(state["workdir"], args[-1])
    if args[-1].endswith("/") or args[-1] in (".", "./") or len(args) > 2 or \
            any(dockerfile.GLOB.search(s) for s in args[:-1]):
        dest = posixpath.normpath(dest) + "/"
    return Step(n, line, "COPY", [*args[:-1], dest], chmod=chmod, **_state(state))


# -- what a COPY writes ---------------------------------------------------------------------------------
def copy_plan(step: Step, context: str, fail) -> list[tuple[str, str, str]]:
    """(kind, context path, image path) for every entry a COPY writes: dir, file or link. A source
    directory's contents go into the destination, as in Docker."""
    dest, plan = step.args[-1], []
    for src in step.args[:-1]:
        pattern = os.path.join(context, src)
        matches = sorted(glob.glob(pattern)) if dockerfile.GLOB.search(src) else [pattern]
        matches = [m for m in matches if os.path.lexists(m)]
        if not matches:
            raise fail(f"{src!r} is not in the build context {context}")
        for m in matches:
            if not os.path.isdir(m) or os.path.islink(m):
                target = posixpath.join(dest, os.path.basename(m)) if dest.endswith("/") else dest
                plan.append(("link" if os.path.islink(m) else "file", m, target))
                continue
            plan.append(("dir", m, dest.rstrip("/") or "/"))
            for folder, dirs, files in os.walk(m):  # symlinked directories are listed, not followed
                dirs.sort()
                target = posixpath.normpath(posixpath.join(dest, os.path.relpath(folder, m)))
                for name in sorted(dirs + files):
                    p = os.path.join(folder, name)
                    kind = "link" if os.path.islink(p) else "dir" if os.path.isdir(p) else "file"
                    plan.append((kind, p, posixpath.join(target, name)))
    return plan


def check_sources(recipe: Recipe, context: str, problems: Problems) -> None:
    """A problem for each COPY source missing from the build context (before anything is built)."""
    for step in recipe.steps:
        if step.op == "COPY":
            problems.check(copy_plan, step, context, functools.partial(dockerfile.refuse, recipe.path, step.line,
                                                                       step.text))


def workdir_copies(recipe: Recipe, context: str) -> list[list[str]]:
    """[context path, path in the WORKDIR, dir | file] for every COPY source that lands in the final
    WORKDIR: what dockerfile.reverse needs to rebuild the context from the task's repo/ (export)."""
    out = []
    for step in recipe.steps:
        if step.op != "COPY":
            continue
        dest = step.args[-1]
        for src in step.args[:-1]:
            pattern = os.path.join(context, src)
            for m in sorted(glob.glob(pattern)) if dockerfile.GLOB.search(src) else [pattern]:
                kind = "dir" if os.path.isdir(m) else "file"
                target = posixpath.join(dest, os.path.basename(m)) if dest.endswith("/") and kind == "file" else dest
                rel = posixpath.relpath(posixpath.normpath(target), recipe.workdir)
                if rel != ".." and not rel.startswith("../"):
                    out.append([os.path.relpath(m, context).replace(os.sep, "/"), "" if rel == "." else rel, kind])
    return out


def _digest(step: Step, plan: list, parent: str) -> str:
    h = hashlib.sha256(json.dumps([parent, step.op, step.args, step.workdir, sorted(step.env.items()), step.user,
                                   step.chmod]).encode())
    for kind, src, target in plan:
        h.update(f"\0{kind}\0{target}\0{os.lstat(src).st_mode:o}\0".encode())
        if kind == "file":
            with open(src, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        elif kind == "link":
            h.update(os.readlink(src).encode())
    return h.hexdigest()[:24]


# -- building -------------------------------------------------------------------------------------------
def _build_cfg(cache: str, step_env: dict, uid: int, gid: int, timeout_s: float):
    from kiln.config import SandboxConfig
    return SandboxConfig(state_dir=cache, workdir="/", memory_mb=4096, max_procs=1024, disk_mb=16384,
                         tmp_mb=2048, timeout_s=timeout_s, idle_timeout_s=timeout_s, output_bytes=16384,
                         env={"HOME": "/root", **step_env}, uid=uid, gid=gid)


def _lookup_user(cache: str, layers: list[str], user: str, fail) -> tuple[int, int]:
    """USER's uid and gid: numbers as given, names from the image's /etc/passwd and /etc/group."""
    name, _, group = user.partition(":")
    if name in ("root", "0") and group in ("", "root", "0"):
        return 0, 0
    if name.isdigit() and (not group or group.isdigit()):
        return int(name), int(group or name)
    files = {}
    for rel in ("etc/passwd", "etc/group"):  # the topmost layer that has the file wins
        path = next((os.path.join(t, rel) for t in (env_base.layer_tree(cache, lid) for lid in layers)
                     if os.path.isfile(os.path.join(t, rel))), None)
        with open(path) as f:
            files[rel] = [ln.split(":") for ln in f.read().splitlines() if ln.count(":") >= 3]
    entry = next((p for p in files["etc/passwd"] if p[0] == name or p[2] == name), None)
    if entry is None:
        raise fail(f"USER {user}: no such user in the image's /etc/passwd")
    gid = int(entry[3])
    if group:
        g = next((p for p in files["etc/group"] if p[0] == group or p[2] == group), None)
        if g is None:
            raise fail(f"USER {user}: no such group in the image's /etc/group")
        gid = int(g[2])
    return int(entry[2]), gid


def layers(recipe: Recipe, context: str) -> list[tuple[str, Step | None, list]]:
    """(layer id, step, copy plan) bottom up, the base first (its step None): known before building."""
    out = [(env_base.base_id(recipe.base.suite), None, [])]
    for step in recipe.steps:
        fail = functools.partial(dockerfile.refuse, recipe.path, step.line, step.text)
        plan = copy_plan(step, context, fail) if step.op == "COPY" else []
        out.append((_digest(step, plan, out[-1][0]), step, plan))
    return out


def missing(recipe: Recipe, context: str, cache: str) -> list[str]:
    """The layers `build` would have to make (and so, for RUN steps, download for)."""
    return [key for key, _, _ in layers(recipe, context) if not env_base.have_layer(cache, key)]


def build(recipe: Recipe, context: str, cache: str, log=print, timeout_s: float = 1800.0) -> Environment:
    """Every layer of `recipe` that the cache lacks, built in order; the environment on top of them."""
    plan_all = layers(recipe, context)
    stack = [env_base.ensure_base(cache, recipe.base.suite, log)]
    for key, step, plan in plan_all[1:]:
        fail = functools.partial(dockerfile.refuse, recipe.path, step.line, step.text)
        if not env_base.have_layer(cache, key):
            with env_base.layer_lock(cache, key):
                if not env_base.have_layer(cache, key):
                    _build_layer(cache, stack, step, plan, key, fail, log, timeout_s, recipe.base.env)
        stack.insert(0, key)
    uid, gid = _lookup_user(cache, stack, recipe.user, functools.partial(
        dockerfile.refuse, recipe.path, 0, f"USER {recipe.user}"))
    return Environment(recipe.base.image, recipe.base.suite, stack, recipe.workdir,
                       {**DEFAULT_ENV, **recipe.base.env, **recipe.env}, uid, gid)


def _build_layer(cache: str, layers: list[str], step: Step, plan: list, key: str, fail, log, timeout_s: float,
                 base_env: dict) -> None:
    from kiln.sandbox import Snapshot, create
    uid, gid = _lookup_user(cache, layers, step.user, fail)
    cfg = _build_cfg(cache, {**DEFAULT_ENV, **base_env, **step.env}, uid, gid, timeout_s)
    start = time.monotonic()
    log(f"env: building `{step.text[:100]}`")
    with create(Snapshot(cache, tuple(layers)), cfg, build=True) as sb:
        if step.op == "RUN":
            wd = shlex.quote(step.workdir)
            # As root, under fakeroot: a chown to an id the sandbox does not map is taken, not made (env_base.py).
            fake = "env FAKEROOTDONTTRYCHOWN=1 fakeroot -- " if uid == 0 else ""
            r = sb.exec(f"mkdir -p {wd} && cd {wd} && exec {fake}{shlex.join(step.args)}", timeout_s=timeout_s,
                        idle_timeout_s=timeout_s)
            if r.exit_code or r.timed_out:
                how = "timed out" if r.timed_out else f"exit {r.exit_code}"
                raise fail(f"it failed while building the environment ({how}); output tail:\n{r.output[-1500:]}")
        else:
            _write_copy(sb, plan, step.chmod)
        new = sb.snapshot(step.text[:80]).layers[0]
    src, dest = os.path.join(cache, "layers", new), os.path.join(cache, "layers", key)
    shutil.rmtree(dest, ignore_errors=True)  # a half-written layer of a builder that died
    os.rename(src, dest)
    log(f"env: layer {key} built in {time.monotonic() - start:.1f} s")


def _write_copy(sb, plan: list, chmod: str) -> None:
    """Write a COPY's files through the sandbox's file API, so paths resolve inside the image (its
    /lib -> usr/lib links included), never on the host."""
    for kind, src, target in plan:
        if kind == "dir":
            sb.makedirs(target)
        elif kind == "file":
            with open(src, "rb") as f:
                mode = int(chmod, 8) if chmod else os.stat(src).st_mode & 0o7777
                sb.write(target, f.read(), mode=mode)
        else:
            sb.makedirs(posixpath.dirname(target))
            r = sb.exec(f"ln -sfn {shlex.quote(os.readlink(src))} {shlex.quote(target)}")
            if r.exit_code:
                raise TaskError(f"COPY of the link {src}: {r.output.strip()}")


def export_workdir(env: Environment, cache: str, dest: str) -> None:
    """The environment's WORKDIR as a folder on the host (the task's repo/: the agent's workspace)."""
    from kiln.sandbox import Snapshot, create
    cfg = _build_cfg(cache, {}, 0, 0, 60)
    with create(Snapshot(cache, tuple(env.layers)), cfg, build=True) as sb:
        if not sb.exists(env.workdir):
            os.makedirs(dest)
            return
        sb.copy_out(env.workdir, dest)
