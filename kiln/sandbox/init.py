"""pid 1 of a sandbox: runs the client's commands, each in a pid namespace of its own.

Protocol (client -> init, one SOCK_SEQPACKET message each, JSON + passed fds):
  {"op": "exec", "job": N, "command": str, "cwd": str, "env": {...}, "log": path|null}
      fds: [status_w, out_w, state_w] (foreground) or [status_w] (background, output to `log`)
  {"op": "kill", "job": N}
  {"memfd": true}: the request is too big for a datagram; it is the content of the last fd.
When a job ends, init writes {"code": int} to its status pipe and closes it. Init never
writes to the control socket, so a client thread waiting on one job never blocks another.

Process tree per job: init -> intermediate (its death is the kill switch) -> reaper (pid 1 of
the job's own pid namespace) -> bash. Killing the intermediate makes the kernel kill the
reaper (parent-death signal) and with it the whole namespace, so a timeout takes down every
grandchild, daemonised or not.
"""
from __future__ import annotations

import json
import os
import resource
import select
import selectors
import signal
import socket

from . import ns, pytest_fork

# Runs the user's command (read from fd 4, a memfd: argv is capped at 128 KiB per string) in
# this shell and, on any exit, reports the shell state (cwd + exported variables,
# NUL-separated) on fd 3 so the client can carry `cd` and `export` forward.
WRAPPER = r"""__kiln_save() { local __n; { printf '%s\0' "$PWD"; for __n in $(compgen -e); do printf '%s=%s\0' "$__n" "${!__n}"; done; } >&3 2>/dev/null; }
trap __kiln_save EXIT
. /dev/fd/4
"""
BASH = "/bin/bash"
MB = 1024 * 1024


def serve(ctl: socket.socket, spec: dict) -> None:
    """Serve until the client's end of `ctl` closes; returning ends the sandbox."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(ctl, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    jobs: dict[int, tuple[int, int]] = {}  # pid -> (job id, status fd)
    by_job: dict[int, int] = {}  # job id -> pid
    while True:
        for key, _ in sel.select():
            if key.fileobj is ctl:
                msg, fds, _, _ = socket.recv_fds(ctl, 1 << 16, 5)
                if not msg:
                    return
                req = json.loads(msg)
                if req.get("memfd"):  # a request too big for one datagram
                    with os.fdopen(fds.pop(), "rb") as f:
                        f.seek(0)  # the offset is shared with the writer's descriptor
                        req = json.loads(f.read())
                if req["op"] == "exec":
                    pid = _spawn(req, fds, spec)
                    jobs[pid] = (req["job"], fds[0])
                    by_job[req["job"]] = pid
                    for fd in fds[1:]:
                        os.close(fd)
                elif req["op"] == "kill" and req["job"] in by_job:
                    _kill(by_job[req["job"]])
            else:
                while os.read(wake_r, 512) == 512:
                    pass
        _reap(jobs, by_job)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(jobs: dict, by_job: dict) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in jobs:
            job, status_fd = jobs.pop(pid)
            by_job.pop(job, None)
            code = os.waitstatus_to_exitcode(status)
            try:
                os.write(status_fd, json.dumps({"code": code if code >= 0 else 128 - code}).encode())
            except OSError:
                pass  # the client stopped waiting
            os.close(status_fd)


def _spawn(req: dict, fds: list[int], spec: dict) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:  # intermediate: owns the job's pid namespace; SIGKILL here kills the whole job
        os.close(fds[0])
        ns.unshare(ns.CLONE_NEWPID)
        alive_r, alive_w = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(alive_w)
            _command(req, fds[1:], alive_r, spec)
        for fd in (*fds[1:], alive_r):
            os.close(fd)
        _, status = os.waitpid(child, 0)
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    finally:
        os._exit(127)


def _command(req: dict, fds: list[int], alive_r: int, spec: dict) -> None:
    try:
        ns.prctl(ns.PR_SET_PDEATHSIG, signal.SIGKILL)
        if select.select([alive_r], [], [], 0)[0]:  # parent died before prctl took effect
            os._exit(137)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        if req["log"]:  # background job: output to a log file, no shell state
            os.makedirs(os.path.dirname(req["log"]), exist_ok=True)
            out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            state = os.open("/dev/null", os.O_WRONLY)
        else:
            out, state = fds
        os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.dup2(state, 3)
        script = os.memfd_create("command")
        os.write(script, req["command"].encode("utf-8", errors="surrogateescape"))
        os.lseek(script, 0, os.SEEK_SET)
        os.dup2(script, 4)
        os.closerange(5, 65536)
        _set_limits(spec)
        try:
            os.chdir(req["cwd"])
        except OSError:
            os.chdir(spec["workdir"])
        os.umask(0o022)
        with open("/proc/self/oom_score_adj", "w") as f:  # the zygote lowered it for pid 1 only
            f.write("0")
        # The shell must not be pid 1 (the kernel drops default-action signals sent to pid 1,
        # so `kill $$` would do nothing): this process stays as the namespace's reaper.
        base = spec.get("pytest_fork")
        fast = pytest_fork.plan(req["command"], req["env"], base) if base and not req["log"] else None
        shell = os.fork()
        if shell == 0:
            if fast:
                pytest_fork.run(fast, req["env"], base)
            os.execve(BASH, ["bash", "--noprofile", "--norc", "-c", WRAPPER], req["env"])
        for fd in range(5):
            os.close(fd)
        while True:
            pid, status = os.wait()
            if pid == shell:
                code = os.waitstatus_to_exitcode(status)
                os._exit(code if code >= 0 else 128 - code)
    finally:
        os._exit(127)


def _set_limits(spec: dict) -> None:
    lim = [(resource.RLIMIT_CORE, 0)]
    if spec["file_size_mb"]:  # 0: no limit (see SandboxConfig.file_size_mb)
        lim.append((resource.RLIMIT_FSIZE, spec["file_size_mb"] * MB))
    if not spec["cgroups"]:  # per-process stand-ins for the cgroup's tree-wide limits
        lim += [(resource.RLIMIT_AS, spec["memory_mb"] * MB), (resource.RLIMIT_NPROC, spec["max_procs"])]
    for which, value in lim:
        resource.setrlimit(which, (value, value))
