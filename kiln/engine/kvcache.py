"""A preallocated key/value cache for a fixed number of sequence slots.

Running sequences always occupy slots 0..n-1 (the engine moves the last one into a freed slot),
so a forward over any contiguous run of slots reads the cache as a view, never a gathered copy.
Each slot has its own length; a query at position p attends to keys at positions <= p of its own
slot, so entries written past a sequence's accepted length (rejected speculative drafts) are
simply overwritten later.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, slots: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (n_layers, slots, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots, self.max_len = slots, max_len
        self.mask: torch.Tensor | None = None
        self._start = self._count = 0
        self._pos: torch.Tensor | None = None
        self._ctx = 0
        self._windows: dict[int, torch.Tensor | None] = {}

    def begin(self, start: int, positions: torch.Tensor) -> None:
        """Prepare one forward over slots start..start+B-1 whose tokens sit at `positions` [B, T]
        (consecutive within a row)."""
        b = positions.shape[0]
        if start + b > self.slots:
            raise ValueError(f"slots {start}..{start + b - 1} exceed the cache's {self.slots}")
        self._ctx = int(positions.max()) + 1
        if self._ctx > self.max_len:
            raise ValueError(f"position {self._ctx - 1} is past the cache length {self.max_len}")
        self._start, self._count, self._pos = start, b, positions
        self._windows = {}
        if b == 1 and (positions.shape[1] == 1 or int(positions[0, 0]) == 0):
            self.mask = None  # one sequence: all of its context (T = 1) or plain causal (from 0)
        else:
            keys = torch.arange(self._ctx, device=positions.device)
            self.mask = (keys <= positions[:, :, None])[:, None]  # [B, 1, T, ctx]

    def window_mask(self, window: int) -> torch.Tensor | None:
        """`mask` for a sliding-window layer: a query at p also sees no key at or before p - window."""
        if window not in self._windows:
            if self._ctx <= window:  # no query reaches back that far
                self._windows[window] = self.mask
            else:
                keys = torch.arange(self._ctx, device=self._pos.device)
                p = self._pos[:, :, None]
                self._windows[window] = ((keys <= p) & (keys > p - window))[:, None]
        return self._windows[window]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k/v [B, H, T, hd] at the prepared positions; return the slots' keys and values (in
        k's dtype: a bf16 cache stores them rounded and hands them back widened)."""
        s, e = self._start, self._start + self._count
        kc, vc = self.k[layer, s:e], self.v[layer, s:e]
        dtype, k, v = k.dtype, k.to(kc.dtype), v.to(kc.dtype)
        if self._count == 1:  # one sequence (prefill): its positions are one run, a slice write
            p0 = int(self._pos[0, 0])
            kc[:, :, p0:p0 + k.shape[2]] = k
            vc[:, :, p0:p0 + k.shape[2]] = v
        else:
            rows = torch.arange(self._count, device=k.device)[:, None]
            kc[rows, :, self._pos] = k.transpose(1, 2)
            vc[rows, :, self._pos] = v.transpose(1, 2)
        kc, vc = kc[:, :, : self._ctx], vc[:, :, : self._ctx]
        return (kc, vc) if kc.dtype == dtype else (kc.to(dtype), vc.to(dtype))

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot src's first `length` positions into slot dst (compaction after a finish)."""
        self.move_from(self, src, dst, length)

    def move_from(self, other: KVCache, src: int, dst: int, length: int) -> None:
        """Copy `other`'s slot src's first `length` positions into this cache's slot dst."""
        self.k[:, dst, :, :length] = other.k[:, src, :, :length]
        self.v[:, dst, :, :length] = other.v[:, src, :, :length]
