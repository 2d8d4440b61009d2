"""The client's connection to its zygote (one per process and state directory)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

from . import pytest_fork

_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_services: dict[str, "Service"] = {}
_lock = threading.Lock()


class SandboxError(RuntimeError):
    """A sandbox could not be created, used or torn down."""


class Service:
    def __init__(self, state_dir: str):
        self.state_dir = state_dir
        for sub in ("run", "layers"):
            os.makedirs(os.path.join(state_dir, sub), exist_ok=True)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # -S: skip site-packages for a fast start; the zygote needs only the stdlib and kiln.
        # The hash seed is fixed because pytest runs forked from this process (pytest_fork.py).
        env = {"PYTHONPATH": _PKG_PARENT, "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
               "PYTHONHASHSEED": pytest_fork.HASH_SEED}
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-m", "kiln.sandbox.zygote", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
        theirs.close()
        self.sock = mine
        self.lock = threading.Lock()
        self.pid = os.getpid()
        # Sent, not put in argv: every sandbox's pid 1 is a fork of the zygote and shows its cmdline.
        self.sock.sendall(json.dumps({"state_dir": state_dir}).encode())
        hello = self._recv(timeout=30)
        if not hello["ok"]:
            raise SandboxError(hello["error"] + " (sandboxes need Linux user namespaces: check "
                               "/proc/sys/user/max_user_namespaces and that overlayfs is available)")
        self.cgroups = hello["cgroups"]

    def _recv(self, timeout: float) -> dict:
        self.sock.settimeout(timeout)
        try:
            msg, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1)
        except socket.timeout:
            raise SandboxError(f"sandbox service did not answer within {timeout:.0f}s") from None
        if not msg:
            raise SandboxError("sandbox service exited unexpectedly (see stderr for its traceback)")
        reply = json.loads(msg)
        reply["fds"] = fds
        return reply

    def request(self, op: str, timeout: float = 120, **kw) -> dict:
        with self.lock:
            try:
                self.sock.sendall(json.dumps({"op": op, **kw}).encode())
            except OSError as e:
                raise SandboxError(f"sandbox service is gone ({e})") from None
            reply = self._recv(timeout)
        if not reply["ok"]:
            raise SandboxError(f"{op} failed: {reply['error']}")
        return reply


def get_service(state_dir: str) -> Service:
    with _lock:
        svc = _services.get(state_dir)
        if svc is None or svc.proc.poll() is not None:
            svc = _services[state_dir] = Service(state_dir)
        return svc


def stop_service(state_dir: str, timeout_s: float = 10.0) -> None:
    """Close every sandbox of this process under `state_dir` and stop its zygote."""
    with _lock:
        svc = _services.pop(state_dir, None)
    if svc is not None:
        svc.sock.close()  # EOF: the zygote tears everything down and exits
        svc.proc.wait(timeout_s)


def _after_fork_in_child() -> None:
    # A forked child must not talk to its parent's zygote; it starts its own when needed.
    global _lock
    _lock = threading.Lock()
    for svc in _services.values():
        svc.sock.close()
    _services.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
