"""Debian base root filesystems for built task environments: made once by `mmdebstrap --mode=unshare`
(no root, no daemon) from the Debian mirror, kept in the environment cache and shared by every task.

    <cache>/layers/<suite>-<hash>/tree    a base, stored as a sandbox layer (kiln/sandbox/snapshot.py)
    <cache>/layers/<key>/tree             the layers built on top of it (env_build.py)

A base is minbase plus Python and pytest (PACKAGES) and fakeroot, with three files of kiln's own
(KILN_FILES). Its id hashes everything that went into it, so a change makes a new base.

fakeroot: a build step's sandbox maps one user id (root), so a package script that gives a file to
another owner or group fails there (openssh-client, which `apt-get install git` brings, runs `chgrp
_ssh ssh-agent`: "Invalid argument"). env_build runs a root RUN under fakeroot (FAKEROOTDONTTRYCHOWN),
which takes such changes without making them: the files stay root's, as the one id there is.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time

from kiln.sandbox.snapshot import default_env_cache, mark_owner

from .record import TaskError

DEFAULT_SUITE = "trixie"  # what ubuntu:24.04, today's python:3.1x and Terminal-Bench's images map to
VARIANT = "minbase"
# Python and pytest: kiln's verifier runs `python`, and the tests it maps Terminal-Bench's boilerplate to
# (and most Python tasks' tests) run `python -m pytest`.
PACKAGES = ("python3", "python-is-python3", "python3-pytest", "fakeroot")
KILN_FILES = {
    # The sandbox maps one user id, so apt cannot drop privileges to its _apt user.
    "etc/apt/apt.conf.d/00kiln-sandbox": ('APT::Sandbox::User "root";\n', 0o644),
    # No service starts during a build (what Docker's Debian images do too).
    "usr/sbin/policy-rc.d": ("#!/bin/sh\nexit 101\n", 0o755),
    # mmdebstrap copies the host's resolver in; a build step binds it there only while it runs.
    "etc/resolv.conf": ("", 0o644),
}
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "armhf", "i686": "i386", "ppc64le": "ppc64el",
         "s390x": "s390x", "riscv64": "riscv64"}


def host_arch() -> str:
    """This machine's Debian architecture name."""
    machine = os.uname().machine
    return _ARCH.get(machine, machine)


def cache_dir(configured: str = "") -> str:
    path = default_env_cache(configured)
    if any(c in path for c in ":,"):  # the layers' paths go into overlayfs mount options
        raise TaskError(f"the environment cache path {path!r} has ':' or ',', which overlayfs cannot take; "
                        "set KILN_ENV_CACHE (or sandbox.env_cache) to another folder")
    return path


def layer_tree(cache: str, layer: str) -> str:
    return os.path.join(cache, "layers", layer, "tree")


def have_layer(cache: str, layer: str) -> bool:
    return os.path.isdir(layer_tree(cache, layer))


def base_id(suite: str) -> str:
    recipe = json.dumps([suite, VARIANT, PACKAGES, KILN_FILES, host_arch()], sort_keys=True)
    return f"{suite}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


@contextlib.contextmanager
def layer_lock(cache: str, layer: str):
    """One builder per layer at a time (another process, or CI beside a developer)."""
    os.makedirs(os.path.join(cache, "layers"), exist_ok=True)
    with open(os.path.join(cache, "layers", f".{layer}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure_base(cache: str, suite: str, log=print) -> str:
    """The base layer for `suite`, built first when this cache has none (needs the network)."""
    layer = base_id(suite)
    if have_layer(cache, layer):
        return layer
    with layer_lock(cache, layer):
        if not have_layer(cache, layer):
            _bootstrap(cache, suite, layer, log)
    return layer


def _bootstrap(cache: str, suite: str, layer: str, log) -> None:
    if not shutil.which("mmdebstrap"):
        raise TaskError("building a task environment needs mmdebstrap, which is not installed: "
                        "`apt-get install mmdebstrap uidmap` (Debian/Ubuntu), then retry")
    dest = os.path.join(cache, "layers", layer)
    shutil.rmtree(dest, ignore_errors=True)  # a build that died half-way
    os.makedirs(dest + "/tree.part")
    mark_owner(dest)  # `kiln sandbox gc` removes it if this process dies half-way
    log(f"env: bootstrapping Debian {suite} ({VARIANT} + {', '.join(PACKAGES)}) into {dest} (downloads ~60 MB)")
    start = time.monotonic()
    cmd = ["mmdebstrap", "--mode=unshare", f"--variant={VARIANT}", f"--include={','.join(PACKAGES)}",
           f"--architectures={host_arch()}", "--format=tar", suite, "-"]
    with open(dest + "/mmdebstrap.log", "wb") as err:
        boot = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        # Owned by whoever builds (mapped to root inside a sandbox); device nodes come from the sandbox.
        tar = subprocess.run(["tar", "-x", "-C", dest + "/tree.part", "--no-same-owner", "--same-permissions",
                              "--exclude=./dev/*"], check=False, stdin=boot.stdout, stderr=subprocess.PIPE)
        boot.stdout.close()
        code = boot.wait()
    if code or tar.returncode:
        with open(dest + "/mmdebstrap.log", errors="replace") as f:
            tail = (f.read() + tar.stderr.decode(errors="replace"))[-1500:]
        shutil.rmtree(dest, ignore_errors=True)
        raise TaskError(f"bootstrapping Debian {suite} failed (mmdebstrap exit {code}, tar exit {tar.returncode}); "
                        f"is the Debian mirror reachable? Output tail:\n{tail}")
    for rel, (text, mode) in KILN_FILES.items():
        path = os.path.join(dest, "tree.part", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, mode)
    with open(dest + "/meta.json", "w") as f:
        json.dump({"source": f"debian:{suite}", "label": f"base {suite}", "parent": None, "created": time.time(),
                   "packages": list(PACKAGES), "variant": VARIANT, "arch": host_arch()}, f)
    os.rename(dest + "/tree.part", dest + "/tree")
    log(f"env: Debian {suite} base ready in {time.monotonic() - start:.0f} s")
