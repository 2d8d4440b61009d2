"""What a pretraining run keeps on disk, written so that a crash at any moment loses nothing.

- `<run>/state/`: the latest resumable state: an HF-layout checkpoint (model, MTP once attached,
  tokenizer) plus `trainer_state.pt` (optimizer moments, step, tokens seen, RNG states).
- `<run>/checkpoint/`: the final model, the folder `kiln serve` and the local policy load.
- `<run>/metrics.jsonl`: one row per step and per evaluation.

Folders are written beside their final name and swapped in with renames; if a crash falls between
the two renames, the previous state is still found under `<name>.old`.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.model.checkpoint import save_checkpoint

STATE, TRAINER_STATE, METRICS = "state", "trainer_state.pt", "metrics.jsonl"


def write_dir_atomically(final: Path, write: Callable[[Path], None]) -> Path:
    """Call write(tmp_dir), then make tmp_dir `final`, replacing any previous folder there."""
    tmp, old = final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)  # a write cut short earlier
    tmp.mkdir(parents=True)
    write(tmp)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def save_state(run_dir: Path, model, mtp, tokenizer_dir: Path | None, trainer: dict) -> Path:
    """The resumable state: the weights as a loadable checkpoint, and everything else torch.save can hold."""
    def write(d: Path) -> None:
        save_checkpoint(model, d, mtp=mtp, tokenizer_dir=tokenizer_dir)
        torch.save(trainer, d / TRAINER_STATE)
    return write_dir_atomically(Path(run_dir) / STATE, write)


def find_state(run_dir: Path) -> Path | None:
    """The folder of the latest complete state, or None for a fresh run."""
    for name in (STATE, STATE + ".old"):  # .old only survives a crash between the two renames
        d = Path(run_dir) / name
        if (d / TRAINER_STATE).is_file():
            return d
    return None


def read_trainer_state(state_dir: Path) -> dict:
    return torch.load(state_dir / TRAINER_STATE, map_location="cpu", weights_only=True)


class MetricsLog:
    """Append-only JSONL, flushed per row so a crash keeps every finished step."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # the last line of a run killed mid-write
        return rows

    def truncate(self, step: int) -> None:
        """Keep the rows up to `step`: a resumed run logs the steps after its state again."""
        kept = [r for r in self.rows() if r["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def append(self, row: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
