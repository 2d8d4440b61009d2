"""The Sandbox: an isolated, copy-on-write workspace with exec, files, diff, fork and snapshot."""
from __future__ import annotations

import itertools
import json
import os
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass

from . import ns
from .diff import Diff, compute_diff, excluded
from .fsutil import copy_tree
from .output import ExecResult, HeadTail
from .rootfs import bind_paths
from .service import SandboxError, get_service
from .snapshot import Snapshot, new_id

_DROP_STATE = {"SHLVL", "_", "PWD"}  # bash bookkeeping, not user state
_KILL_GRACE_S = 5.0  # after a kill, how long to wait for the job's pipes to close
_INLINE_MAX = 32 * 1024  # larger requests travel in a memfd


def _sandbox_config(config):
    if config is None:
        from kiln.config import SandboxConfig  # lazy: pydantic is not needed by the helpers
        config = SandboxConfig()
    return config


SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _base_env(cfg, build: bool = False) -> dict[str, str]:
    env = {k: os.environ[k] for k in cfg.env_allow if k in os.environ}
    # A built environment has its own programs and no kiln Python: its PATH is the image's (cfg.env).
    own = build or cfg.rootfs
    bins = [] if own else dict.fromkeys([os.path.join(sys.prefix, "bin"), os.path.join(sys.base_prefix, "bin")])
    env.update(PATH=":".join([*bins, SYSTEM_PATH]),
               HOME="/tmp", TMPDIR="/tmp", PYTHONDONTWRITEBYTECODE="1", LANG=env.get("LANG", "C.UTF-8"))
    env.update(cfg.env)
    return env


def create(snapshot: Snapshot, config=None, build: bool = False) -> "Sandbox":
    """A new sandbox whose workspace starts as `snapshot` (cost independent of its size).
    `build`: `snapshot` is instead a whole root filesystem, writable, with the host's network: one
    step of building an environment (kiln/tasks/env_build.py), never an agent's sandbox."""
    return Sandbox._start(snapshot, _sandbox_config(config), build=build)


@dataclass
class Job:
    """A background command; its output goes to `log` (a path inside the sandbox)."""
    sandbox: "Sandbox"
    id: int
    log: str
    _status_fd: int
    _code: int | None = None

    def poll(self) -> int | None:
        if self._code is None and self._status_fd >= 0 and select.select([self._status_fd], [], [], 0)[0]:
            fd, self._status_fd = self._status_fd, -1
            self._code = self.sandbox._read_status(fd)
        return self._code

    def wait(self, timeout_s: float | None = None) -> int | None:
        if self._status_fd >= 0:
            select.select([self._status_fd], [], [], timeout_s)
        return self.poll()

    def _abandon(self) -> None:
        if self._status_fd >= 0:
            os.close(self._status_fd)
            self._status_fd = -1

    def kill(self) -> int | None:
        if self.poll() is None:
            self.sandbox._send({"op": "kill", "job": self.id})
        return self.wait(_KILL_GRACE_S)

    def read_log(self) -> str:
        return self.sandbox.read_text(self.log)


class Sandbox:
    _jobs = itertools.count(1)

    def __init__(self, snapshot: Snapshot, cfg, sid: str, reply: dict, build: bool = False):
        self.base, self.cfg, self.sid, self.build = snapshot, cfg, sid, build
        self.init_pid = reply["init"]
        self.cgroups = reply["cgroups"]
        self._upper = f"/proc/{get_service(snapshot.state_dir).proc.pid}/root{reply['upper']}"
        self._ctl = socket.socket(fileno=reply["fds"][0])
        self._root = os.open(f"/proc/{self.init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._send_lock = threading.Lock()
        self.cwd = cfg.workdir
        self.env = _base_env(cfg, build)
        self.jobs: list[Job] = []  # background jobs, so close() can release their pipes
        self.closed = False

    @classmethod
    def _start(cls, snapshot: Snapshot, cfg, copy_from: str | None = None, build: bool = False) -> "Sandbox":
        svc = get_service(snapshot.state_dir)
        spec = {k: getattr(cfg, k) for k in ("workdir", "memory_mb", "max_procs", "file_size_mb", "disk_mb", "tmp_mb",
                                             "rootfs", "uid", "gid", "cpus")}
        # A built root brings its own system and Python; a build step's root must hold only its own changes.
        host = not cfg.rootfs
        spec["binds"] = [] if build else bind_paths(list(cfg.ro_binds), [sys.prefix, sys.base_prefix] if host else [], host)
        spec["build"] = build
        spec["fork_pytest"] = cfg.fork_pytest and host and not build
        sid = new_id()
        reply = svc.request("create", sid=sid, spec=spec, layers=list(snapshot.layers), copy_from=copy_from)
        return cls(snapshot, cfg, sid, reply, build)

    # -- commands ---------------------------------------------------------------------------
    def _send(self, msg: dict, fds: list[int] = ()) -> None:
        if self.closed:
            raise SandboxError(f"sandbox {self.sid} is closed")
        data, fds, memfd = json.dumps(msg).encode(), list(fds), None
        if len(data) > _INLINE_MAX:  # a datagram is capped by the socket buffer; big requests go by memfd
            memfd = os.memfd_create("kiln-request", os.MFD_CLOEXEC)
            os.write(memfd, data)
            data, fds = b'{"memfd": true}', fds + [memfd]
        try:
            with self._send_lock:
                socket.send_fds(self._ctl, [data], fds)
        except OSError as e:
            raise SandboxError(f"sandbox {self.sid} is gone ({e})") from None
        finally:
            if memfd is not None:
                os.close(memfd)

    def _read_status(self, fd: int) -> int:
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        if not data:
            raise SandboxError(f"sandbox {self.sid} died while running a command")
        return json.loads(data)["code"]

    def _resolve(self, path: str | None) -> str:
        """Absolute path inside the sandbox; relative paths are relative to the workspace root."""
        if not path:
            return self.cwd
        return os.path.normpath(os.path.join(self.cfg.workdir, path))

    def exec(self, command: str, timeout_s: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, idle_timeout_s: float | None = None) -> ExecResult:
        """Run `command` with bash. `cd` and `export` persist to the next call; `cwd` and `env`
        apply to this call only. Never raises for the command's own failures: see ExecResult."""
        timeout_s = self.cfg.timeout_s if timeout_s is None else timeout_s
        idle_s = self.cfg.idle_timeout_s if idle_timeout_s is None else idle_timeout_s
        job = next(self._jobs)
        pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(3)]  # status, output, shell state
        (status_r, _), (out_r, _), (state_r, _) = pipes
        start = time.monotonic()
        try:
            self._send({"op": "exec", "job": job, "command": command, "cwd": self._resolve(cwd),
                        "env": {**self.env, **(env or {})}, "log": None}, [w for _, w in pipes])
        finally:
            for _, w in pipes:
                os.close(w)
        buf, state, status = HeadTail(self.cfg.output_bytes), bytearray(), bytearray()
        kind = self._pump(job, {out_r: buf.feed, state_r: state.extend, status_r: status.extend},
                          start + timeout_s, idle_s, out_r)
        if not status:
            raise SandboxError(f"sandbox {self.sid} died while running a command")
        if state and kind is None:
            self._update_state(bytes(state), env or {}, keep_cwd=cwd is not None)
        code = json.loads(status)["code"]
        return ExecResult(code, buf.text(), kind is not None, time.monotonic() - start, kind, buf.total, buf.elided)

    def _pump(self, job: int, sinks: dict, deadline: float, idle_s: float, out_fd: int) -> str | None:
        """Read every pipe of a job until all close (the job ended); kill it on the wall or idle
        timeout. Returns the timeout kind or None. The status pipe is read here too, so a command
        that closes its output early still cannot outlive its timeout."""
        open_fds, kind, last = set(sinks), None, time.monotonic()
        try:
            while open_fds:
                now = time.monotonic()
                wait = min(deadline - now, last + idle_s - now) if kind is None else deadline - now
                if wait <= 0:
                    if kind is not None:
                        raise SandboxError(f"sandbox {self.sid}: job {job} did not stop after kill")
                    kind = "wall" if now >= deadline else "idle"
                    self._send({"op": "kill", "job": job})
                    deadline = now + _KILL_GRACE_S
                    continue
                for fd in select.select(list(open_fds), [], [], wait)[0]:
                    data = os.read(fd, 1 << 16)
                    if not data:
                        open_fds.discard(fd)
                        continue
                    sinks[fd](data)
                    if fd == out_fd:
                        last = time.monotonic()
        finally:
            for fd in sinks:
                os.close(fd)
        return kind

    def _update_state(self, raw: bytes, call_env: dict[str, str], keep_cwd: bool) -> None:
        fields = raw.decode("utf-8", errors="surrogateescape").split("\0")
        new_env = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
        for k, v in call_env.items():  # per-call variables do not persist unless changed
            if new_env.get(k) == v:
                if k in self.env:
                    new_env[k] = self.env[k]
                else:
                    new_env.pop(k)
        if not keep_cwd:  # an explicit cwd, like env, is for that call only
            self.cwd = fields[0] or self.cwd
        self.env = {k: v for k, v in new_env.items() if k not in _DROP_STATE}

    def spawn(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None) -> Job:
        """Start `command` in the background; it runs until it exits, is killed, or the sandbox closes."""
        job = next(self._jobs)
        log = f"/tmp/kiln-jobs/{job}.log"
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        try:
            self._send({"op": "exec", "job": job, "command": command, "cwd": self._resolve(cwd),
                        "env": {**self.env, **(env or {})}, "log": log}, [status_w])
        finally:
            os.close(status_w)
        self.jobs.append(Job(self, job, log, status_r))
        return self.jobs[-1]

    # -- files ------------------------------------------------------------------------------
    def _open(self, path: str, flags: int, mode: int = 0o644) -> int:
        # RESOLVE_IN_ROOT: symlinks written by the sandbox resolve inside it, never on the host.
        return ns.openat2(self._root, self._resolve(path).lstrip("/") or ".", flags, ns.RESOLVE_IN_ROOT, mode)

    def read_bytes(self, path: str) -> bytes:
        with os.fdopen(self._open(path, os.O_RDONLY), "rb") as f:
            return f.read()

    def read_text(self, path: str) -> str:
        return self.read_bytes(path).decode("utf-8", errors="replace")

    def exists(self, path: str) -> bool:
        try:
            os.close(self._open(path, os.O_PATH))
            return True
        except FileNotFoundError:
            return False

    def makedirs(self, path: str) -> None:
        full = self._resolve(path)
        try:
            os.close(self._open(full, os.O_PATH | os.O_DIRECTORY))
            return
        except FileNotFoundError:
            pass
        parent, name = os.path.split(full)
        self.makedirs(parent)
        fd = self._open(parent, os.O_PATH | os.O_DIRECTORY)
        try:
            os.mkdir(name, 0o755, dir_fd=fd)
        except FileExistsError:
            pass
        finally:
            os.close(fd)

    def write(self, path: str, data: str | bytes, mode: int | None = None) -> None:
        full = self._resolve(path)
        self.makedirs(os.path.dirname(full))
        fd = self._open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644 if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if mode is not None:
                os.fchmod(f.fileno(), mode)

    def list_files(self, path: str = ".", exclude: list[str] | None = None) -> list[str]:
        """Files under `path` (recursive, relative to it), skipping `diff_exclude` patterns."""
        exclude = self.cfg.diff_exclude if exclude is None else exclude
        out: list[str] = []

        def walk(fd: int, prefix: list[str]) -> None:
            with os.scandir(fd) as it:
                for e in it:
                    parts = prefix + [e.name]
                    if excluded(parts, exclude):
                        continue
                    if e.is_dir(follow_symlinks=False):
                        sub = os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                        try:
                            walk(sub, parts)
                        finally:
                            os.close(sub)
                    else:
                        out.append("/".join(parts))

        top = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            walk(top, [])
        finally:
            os.close(top)
        return sorted(out)

    def copy_out(self, path: str, dest: str) -> int:
        """Copy the directory `path` (inside) to `dest` on the host, which must not exist yet: files,
        directories and symlinks as links, never followed, so nothing the sandbox planted reaches
        past it. Returns the number of entries."""
        fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return copy_tree(fd, dest)
        finally:
            os.close(fd)

    # -- state ------------------------------------------------------------------------------
    def diff(self) -> Diff:
        """Unified diff of the workspace against the snapshot it was created from."""
        return compute_diff(self._upper, self.base.tree_paths, list(self.cfg.diff_exclude))

    def fork(self) -> "Sandbox":
        """An independent sandbox with this one's current workspace and shell state."""
        self._check_open()
        child = Sandbox._start(self.base, self.cfg, copy_from=self.sid, build=self.build)
        child.cwd, child.env = self.cwd, dict(self.env)
        return child

    def snapshot(self, label: str = "") -> Snapshot:
        """Freeze the workspace as a new read-only base for `create` (cost ~ the changes)."""
        self._check_open()
        layer = new_id()
        get_service(self.base.state_dir).request("snapshot", sid=self.sid, layer=layer)
        return self.base.child(layer, label)

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError(f"sandbox {self.sid} is closed")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for job in self.jobs:
            job._abandon()
        self._ctl.close()
        os.close(self._root)
        try:
            get_service(self.base.state_dir).request("close", sid=self.sid)
        except SandboxError as e:
            if "gone" not in str(e) and "exited" not in str(e):
                raise

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Sandbox({self.sid}, layers={len(self.base.layers)}, closed={self.closed})"
