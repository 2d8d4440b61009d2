"""Build a sandbox's root filesystem and switch into it (runs as pid 1 of the sandbox).

Three kinds of root, by the spec:
- host (default): an empty tmpfs holding read-only binds of the host's system directories and the
  Python installation;
- a built environment (`rootfs`: layer trees, top first): those layers as one read-only overlay,
  the task's own Debian root, with nothing of the host but `ro_binds`;
- a build step (`build`): the workspace overlay itself is the root, writable (its /tmp included, as in
  a Docker build), with the host's DNS
  resolver and CA bundle (the network is the host's, see zygote.py); what a command changes is the
  next layer.
Then a writable workspace (the overlay) at `workdir`, a private /tmp and a minimal /dev. Nothing
else of the host exists inside: home directories, /tmp, other sandboxes and kiln's own state are
simply absent. A final user namespace locks every mount, so root inside cannot remount a read-only
bind writable; it maps the sandbox's user (`uid`, `gid`: root unless an environment says USER).
"""
from __future__ import annotations

import os

from . import ns

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
MASKED = ("/etc/shadow", "/etc/gshadow", "/etc/ssh")  # host secrets readable by (mapped) root
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# A build step reaches the network as the host does: with its DNS resolver and its CA bundle (a
# TLS-inspecting proxy's CA is trusted by pip, curl and apt as on the host).
BUILD_HOST_FILES = ("/etc/resolv.conf", "/etc/ssl/certs/ca-certificates.crt")

# statvfs flags -> mount flags. A bind remount in a user namespace must keep these
# (they are locked), or the kernel refuses it.
_LOCKED = {os.ST_NOSUID: ns.MS_NOSUID, os.ST_NODEV: ns.MS_NODEV, os.ST_NOEXEC: 0x8,
           os.ST_NOATIME: 0x400, os.ST_NODIRATIME: 0x800, os.ST_RELATIME: 0x200000}


def bind_paths(extra: list[str], python_prefixes: list[str], system: bool = True) -> list[str]:
    """Host paths to expose read-only, minus ones already inside another bind. `system`: the host's
    system directories too (not in a built root, which has its own)."""
    paths = [p for p in (*(SYSTEM_DIRS if system else ()), *python_prefixes, *extra) if os.path.lexists(p)]
    # A symlink is recreated inside, not bound: every link it goes through and its target must be there
    # too, or a venv reached through one (`.venv -> elsewhere`) dangles and `python` on PATH silently
    # becomes another interpreter.
    paths += [q for p in paths if os.path.exists(p) for q in _link_chain(p)]
    keep: list[str] = []
    for p in sorted({os.path.normpath(p) for p in paths}):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in keep if not os.path.islink(k)):
            keep.append(p)
    return keep


def _link_chain(path: str) -> list[str]:
    """The paths a symlink at `path` leads through to its target ([] for no symlink). Called only on
    paths that exist, so the chain ends (a loop of links does not exist)."""
    out = []
    while os.path.islink(path):
        path = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
        out.append(path)
    return out


def _bind_ro(src: str, dst: str) -> None:
    ns.mount(src, dst, None, ns.MS_BIND)
    flags = ns.MS_REMOUNT | ns.MS_BIND | ns.MS_RDONLY
    st = os.statvfs(dst).f_flag
    flags |= sum(m for s, m in _LOCKED.items() if st & s)
    ns.mount("none", dst, None, flags)


def _mkpoint(root: str, path: str, is_dir: bool) -> str:
    dst = root + path
    real, top = os.path.realpath(dst), os.path.realpath(root)
    if real != top and not real.startswith(top + "/"):  # a built root's symlink pointing out of it
        raise OSError(f"{path} is a symlink leaving the sandbox's root filesystem")
    if is_dir:
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    return dst


def _env_root(box: str, root: str, layers: list[str]) -> None:
    """The environment's layers as the root. Its small writable upper (on the sandbox's disk tmpfs)
    only takes mount points such as the WORKDIR: the root is remounted read-only before any command."""
    for d in ("rootfs", "rootfs/upper", "rootfs/work"):
        os.mkdir(f"{box}/{d}")
    ns.mount("overlay", root, "overlay", ns.MS_NOSUID | ns.MS_NODEV,
             f"userxattr,lowerdir={':'.join(layers)},upperdir={box}/rootfs/upper,workdir={box}/rootfs/work")


def build_and_enter(box: str, spec: dict) -> None:
    """Populate `box`/root (or, for a build step, use `box`/ws) and pivot into it. Must run as pid 1
    of a new pid namespace, in a mount namespace whose owner we are."""
    root, build = box + "/root", spec.get("build", False)
    if build:
        root = box + "/ws"
    elif spec.get("rootfs"):
        _env_root(box, root, spec["rootfs"])
    else:
        ns.mount("tmpfs", root, "tmpfs", ns.MS_NOSUID | ns.MS_NODEV, "size=1m,mode=0755")
    # The private /tmp and /dev first: a bind below them (a virtual environment under /tmp, say)
    # must land on top of them, not be hidden by them. A build step's /tmp is the image's, as in a
    # Docker build: a file COPY puts there is what the next RUN reads (and stays in the layer).
    if build:
        os.makedirs(root + "/tmp", exist_ok=True)
        os.chmod(root + "/tmp", 0o1777)
    else:
        tmp_opts = f"size={spec['tmp_mb']}m,mode=1777"
        ns.mount("tmpfs", _mkpoint(root, "/tmp", True), "tmpfs", ns.MS_NOSUID | ns.MS_NODEV, tmp_opts)
    dev = _mkpoint(root, "/dev", True)
    ns.mount("tmpfs", dev, "tmpfs", ns.MS_NOSUID, f"size={spec['tmp_mb']}m,mode=0755")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            ns.mount("/dev/" + name, _mkpoint(root, "/dev/" + name, False), None, ns.MS_BIND)
    os.mkdir(dev + "/shm", 0o1777)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    for src in spec["binds"]:
        if os.path.islink(src):
            _mkpoint(root, os.path.dirname(src), True)
            os.symlink(os.readlink(src), root + src)
        else:
            _bind_ro(src, _mkpoint(root, src, os.path.isdir(src)))
    if build:  # the build's network is the host's: so are its resolver and trusted CAs (not in the layer)
        for path in BUILD_HOST_FILES:
            if os.path.isfile(path) and os.path.isfile(root + path) and not os.path.islink(root + path):
                ns.mount(path, root + path, None, ns.MS_BIND | ns.MS_RDONLY)
    else:
        for path in MASKED:
            if os.path.islink(root + path):
                continue
            if os.path.isdir(root + path):
                ns.mount("tmpfs", root + path, "tmpfs", ns.MS_RDONLY, "size=4k")
            elif os.path.isfile(root + path):
                ns.mount("/dev/null", root + path, None, ns.MS_BIND)
        work = _mkpoint(root, spec["workdir"], True)
        ns.mount(box + "/ws", work, None, ns.MS_BIND)
    # The kernel allows a new proc mount in a user namespace only while a fully visible one
    # exists in the mount namespace: mount it before the host's /proc is detached.
    os.makedirs(root + "/proc", exist_ok=True)
    ns.mount("proc", root + "/proc", "proc", ns.MS_NOSUID | ns.MS_NODEV | 0x8)
    os.mkdir(root + "/.old")
    ns.pivot_root(root, root + "/.old")
    os.chdir("/")
    ns.umount("/.old")
    os.rmdir("/.old")
    if not build:
        ns.mount("none", "/", None, ns.MS_REMOUNT | ns.MS_BIND | ns.MS_RDONLY | ns.MS_NOSUID | ns.MS_NODEV)
    # A user namespace of our own, created after the mounts, locks them all (no remount rw).
    ns.unshare(ns.CLONE_NEWUSER | ns.CLONE_NEWNS)
    ns.map_ids("self", spec.get("uid", 0), 0, 0, spec.get("gid", 0))
