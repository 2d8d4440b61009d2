"""`kiln sandbox gc`: remove what sandboxes of dead processes left on the host.

Mounts never leak (they live in the zygote's private mount namespace and die with it), and
processes die with their zygote (parent-death signal). What can remain after a SIGKILL is an
empty run directory, cgroup directories, and half-written layers; this removes those whose
owner process is gone.
"""
from __future__ import annotations

import os
import shutil

from . import cgroups
from .snapshot import default_env_cache, default_state_dir


def zygote_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"kiln.sandbox.zygote" in f.read()
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def gc(cfg) -> int:
    """Remove leftovers of dead owners under the configured state dir and the environment cache
    (half-built layers of a build that died); returns how many."""
    sb = getattr(cfg, "sandbox", cfg)
    return sum(_gc_dir(d) for d in dict.fromkeys([default_state_dir(getattr(sb, "state_dir", "")),
                                                  default_env_cache(getattr(sb, "env_cache", ""))]))


def _gc_dir(state: str) -> int:
    removed = 0
    run = os.path.join(state, "run")
    for name in os.listdir(run) if os.path.isdir(run) else []:
        if name.isdigit() and not zygote_alive(int(name)):
            shutil.rmtree(os.path.join(run, name), ignore_errors=True)
            removed += 1
    for path in cgroups.list_owned():
        owner = os.path.basename(path).split("-", 1)[0]
        if owner.isdigit() and not zygote_alive(int(owner)):
            removed += cgroups.remove([path])
    layers = os.path.join(state, "layers")
    for name in os.listdir(layers) if os.path.isdir(layers) else []:
        path = os.path.join(layers, name)
        if not os.path.isdir(path) or os.path.isdir(os.path.join(path, "tree")):
            continue  # a lock file, or a finished layer
        try:
            owner = int(open(os.path.join(path, "owner")).read())
        except (OSError, ValueError):
            owner = 0
        if not pid_alive(owner):  # an import or snapshot that never finished
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed
