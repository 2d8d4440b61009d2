"""Reading the corpus: token shards as one array, training windows chosen by (seed, step), and the
per-document ids and positions that keep packed documents apart.

Windows are drawn afresh for every step from a generator seeded by (seed, step) alone, so the data a
step sees depends on nothing that happened before it: a resumed run sees exactly the batches the
uninterrupted run would have.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch


class CorpusError(ValueError):
    """A corpus folder that cannot be read; the message says what to do."""


class TokenShards:
    """The shards of a `kiln corpus build` folder, memory-mapped and read as one concatenated array."""

    def __init__(self, corpus_dir: str | Path):
        self.dir = Path(corpus_dir)
        meta_path = self.dir / "meta.json"
        if not meta_path.is_file():
            raise CorpusError(f"no meta.json in {str(self.dir)!r}: the corpus was never built there or its build "
                              "did not finish; run `kiln corpus build` first")
        self.meta = json.loads(meta_path.read_text())
        self.endoftext_id = self.meta["endoftext_id"]
        self._shards = []
        for name in self.meta["shards"]:
            path = self.dir / name
            if not path.is_file():
                raise CorpusError(f"shard {name} listed in {meta_path} is missing; run `kiln corpus build` again")
            self._shards.append(np.memmap(path, dtype=self.meta["dtype"], mode="r"))
        self._starts = np.cumsum([0] + [len(s) for s in self._shards])
        if self._starts[-1] != self.meta["train_tokens"]:
            raise CorpusError(f"the shards in {str(self.dir)!r} hold {self._starts[-1]} tokens but meta.json says "
                              f"{self.meta['train_tokens']}; run `kiln corpus build` again")

    def __len__(self) -> int:
        return int(self._starts[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length), across shard boundaries."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"window [{start}, {start + length}) is outside the corpus's {len(self)} tokens")
        parts, pos, end = [], start, start + length
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        while pos < end:
            lo = pos - self._starts[i]
            hi = min(end, self._starts[i + 1]) - self._starts[i]
            parts.append(self._shards[i][lo:hi])
            pos += hi - lo
            i += 1
        return np.concatenate(parts) if len(parts) != 1 else np.array(parts[0])

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] token windows (inputs and their next-token targets), at
        positions that depend only on (seed, step)."""
        span = seq_len + 1
        if len(self) < span:
            raise CorpusError(f"the corpus in {str(self.dir)!r} has {len(self)} tokens, fewer than one window of "
                              f"{span}; build a bigger corpus (corpus.max_mb) or use a shorter sequence")
        g = torch.Generator().manual_seed(_step_seed(seed, step))
        starts = torch.randint(0, len(self) - span + 1, (batch_size,), generator=g).tolist()
        return torch.from_numpy(np.stack([self.window(s, span) for s in starts]).astype(np.int64))


def _step_seed(seed: int, step: int) -> int:
    # A hash, not seed + step: runs with seeds 0 and 1 must not replay each other's steps shifted by one.
    return int.from_bytes(hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest(), "little") >> 1


def doc_ids(tokens: torch.Tensor, endoftext_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(document ids, positions), each shaped like `tokens` [B, T]: a new document starts after every
    <|endoftext|> (which belongs to the document it ends), and positions restart at 0 in each one.
    Passed to the model's trunk, they keep packed documents from attending to each other.
    `endoftext_id` is kiln's fixed id for <|endoftext|> (also `TokenShards.endoftext_id`)."""
    is_end = (tokens == endoftext_id).long()
    docs = torch.cumsum(is_end, dim=-1) - is_end
    idx = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(is_end, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = is_end[..., :-1].bool()
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=-1).values
    return docs, idx - first
