"""Thin ctypes wrappers over the Linux calls the sandbox needs (namespaces, mounts, prctl).

Python 3.11 has no os.unshare or os.mount; these stay dependency-free so the helper
processes that use them start in milliseconds.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_PIVOT_ROOT_NR = {"x86_64": 155, "aarch64": 41}  # no glibc wrapper for pivot_root
_OPENAT2_NR = 437  # same number on every architecture


def _check(ret: int, what: str) -> int:
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    ret = _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(ret, f"mount {fstype or 'bind'} {source} -> {target}")


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    nr = _PIVOT_ROOT_NR.get(os.uname().machine)
    if nr is None:
        raise OSError(errno.ENOSYS, f"pivot_root syscall number unknown on {os.uname().machine}")
    _check(_libc.syscall(ctypes.c_long(nr), new_root.encode(), put_old.encode()), "pivot_root")


def prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), 0, 0, 0), "prctl")


def map_ids(pid: int | str, inside: int, outside_uid: int, outside_gid: int, inside_gid: int | None = None) -> None:
    """Map one uid/gid into a fresh user namespace (the only mapping an unprivileged owner may write)."""
    base = f"/proc/{pid}"
    with open(f"{base}/setgroups", "w") as f:
        f.write("deny")
    with open(f"{base}/uid_map", "w") as f:
        f.write(f"{inside} {outside_uid} 1")
    with open(f"{base}/gid_map", "w") as f:
        f.write(f"{inside if inside_gid is None else inside_gid} {outside_gid} 1")


def loopback_up() -> None:
    """Bring up `lo` in the current network namespace (ioctl: no `ip` binary needed)."""
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))


RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, resolve: int, mode: int = 0o644) -> int:
    """openat2(2): resolve `path` under `dir_fd` with kernel-enforced rules (no escape by symlink)."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, resolve)
    fd = _libc.syscall(ctypes.c_long(_OPENAT2_NR), ctypes.c_int(dir_fd), path.encode(),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    return _check(fd, f"open {path}")
