"""Read-only snapshots: a stack of layers on disk that sandboxes are created from.

A layer is `<state>/layers/<id>/tree` plus `meta.json`. Importing a repository copies it
once into a base layer; `Sandbox.snapshot()` adds a layer holding only the sandbox's changes,
so a snapshot costs what changed, and any number of sandboxes share the layers below.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass

MAX_LAYERS = 200  # overlayfs stacks at most 500 lowers; the mount option holds one page


def default_state_dir(configured: str = "") -> str:
    return configured or os.environ.get("KILN_STATE_DIR") or "/tmp/kiln-sandbox"


def default_env_cache(configured: str = "") -> str:
    """Where built task environments live (kiln/tasks/env_base.py): a state dir of their own, kept
    across runs, so its layers are built once per machine."""
    return os.path.abspath(os.path.expanduser(
        configured or os.environ.get("KILN_ENV_CACHE") or "~/.cache/kiln/envs"))


def new_id() -> str:
    return secrets.token_hex(5)


@dataclass(frozen=True)
class Snapshot:
    state_dir: str
    layers: tuple[str, ...]  # layer ids, top first

    @classmethod
    def from_dir(cls, path: str | os.PathLike, state_dir: str = "", label: str = "") -> "Snapshot":
        """Import a directory as a new read-only base (copied, so later edits to `path` don't leak in)."""
        src = os.fspath(path)
        if not os.path.isdir(src):
            raise FileNotFoundError(f"cannot snapshot {src!r}: not a directory")
        state = default_state_dir(state_dir)
        layer = new_id()
        dest = os.path.join(state, "layers", layer)
        os.makedirs(dest)
        mark_owner(dest)
        shutil.copytree(src, os.path.join(dest, "tree.part"), symlinks=True)
        os.rename(os.path.join(dest, "tree.part"), os.path.join(dest, "tree"))
        _write_meta(dest, {"source": os.path.abspath(src), "label": label, "parent": None})
        return cls(state, (layer,))

    @classmethod
    def load(cls, state_dir: str, layers: list[str]) -> "Snapshot":
        snap = cls(default_state_dir(state_dir), tuple(layers))
        missing = [lid for lid in layers if not os.path.isdir(snap.layer_path(lid))]
        if missing:
            raise FileNotFoundError(f"snapshot layers not found under {snap.state_dir}/layers: {missing}")
        return snap

    def layer_path(self, layer: str) -> str:
        return os.path.join(self.state_dir, "layers", layer, "tree")

    @property
    def tree_paths(self) -> list[str]:
        return [self.layer_path(lid) for lid in self.layers]

    def child(self, layer: str, label: str = "") -> "Snapshot":
        if len(self.layers) + 1 > MAX_LAYERS:
            raise ValueError(f"snapshot would have {len(self.layers) + 1} layers (max {MAX_LAYERS}); "
                             "import a flattened copy with Snapshot.from_dir instead")
        _write_meta(os.path.join(self.state_dir, "layers", layer),
                    {"source": None, "label": label, "parent": self.layers[0]})
        return Snapshot(self.state_dir, (layer, *self.layers))

    def drop(self, keep: "Snapshot | None" = None) -> None:
        """Delete this snapshot's layers that `keep` does not use (none kept by default). For
        layers imported or frozen for temporary use; their sandboxes must be closed first."""
        for layer in set(self.layers) - set(keep.layers if keep else ()):
            shutil.rmtree(os.path.join(self.state_dir, "layers", layer), ignore_errors=True)

    def to_json(self) -> dict:
        return {"state_dir": self.state_dir, "layers": list(self.layers)}


def mark_owner(layer_dir: str) -> None:
    """Record who is writing a layer, so `kiln sandbox gc` can remove it if they die mid-way."""
    with open(os.path.join(layer_dir, "owner"), "w") as f:
        f.write(str(os.getpid()))


def _write_meta(layer_dir: str, meta: dict) -> None:
    with open(os.path.join(layer_dir, "meta.json"), "w") as f:
        json.dump({**meta, "created": time.time()}, f)
