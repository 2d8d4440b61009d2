"""Prefix reuse: the keys and values of finished sequences (and, the engine being without a drafter,
of prompts as soon as they are prefilled), kept so that a later prompt starting with the same
tokens prefills only the rest.

An agent's turns are token-in, token-out (policies/local.py): each turn's prompt is the previous
turn's prompt and completion ids plus the new messages, and the G rollouts of a group all start
from one prompt. Without reuse every turn prefills the whole conversation again.

Entries live in a KV cache of their own, least recently used evicted. A hit is copied into the
request's running slot (never shared), so running sequences keep slots 0..n-1 and an entry
outlives the request that reused it (the other rollouts of a group want it too).

With an MTP drafter the entry also keeps the drafter's cache. Its layer k's entry at position i
read token i + k, so for a new prompt that shares the first m tokens it holds only below m - D
(D layers), and only where the kept sequence had drafted with known tokens. A hit restores both
caches that far; the trunk recomputes the rest, whose hidden states the drafter's layers read.

Each entry remembers the oldest weights version among its keys and values. After new weights an
older entry serves no new prompt; with `carry_turns` it still serves the conversation it came from
(a prompt extending all of it), as a running sequence carries its cache on under the new version:
an RL rollout's next turn then prefills only its new messages, not its whole context again.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from kiln.engine.kvcache import KVCache


@dataclass
class _Entry:
    tokens: np.ndarray  # the tokens whose keys and values the slot holds, in order
    # Their routed experts, per position [L][k] as the completions carry them (so a reusing
    # request does not convert them again: ~5 ms at 2,500 positions), when the engine captures them.
    routes: list | None
    used: int  # last use, on the cache's clock
    drafted: int  # leading positions whose drafter entries are exact (0 without a drafter)
    version: int  # the oldest weights version among its keys and values


class PrefixCache:
    def __init__(self, slots: int, like: KVCache, min_tokens: int = 16, drafter: KVCache | None = None,
                 version: int = 0, carry_turns: bool = False):
        self.kv, self.drafter = _like(like, slots), (_like(drafter, slots) if drafter is not None else None)
        self.version, self.carry_turns = version, carry_turns  # the engine's weights version (it sets it)
        self.entries: list[_Entry | None] = [None] * slots
        self.min_tokens = min_tokens  # shorter prefixes are not worth a slot
        self._clock = itertools.count()
        self.hits = self.reused_tokens = 0

    def clear(self) -> None:
        """Forget every entry and the hit counts (a benchmark's arms start from empty caches)."""
        self.entries = [None] * len(self.entries)
        self.hits = self.reused_tokens = 0

    def park(self, cache: KVCache, slot: int, tokens: list[int], routes: list | None,
             drafter: KVCache | None = None, drafted: int = 0, version: int | None = None) -> None:
        """Keep the first len(tokens) positions of `cache`'s `slot`, which hold `tokens`; routes:
        per position from the first ([L][k] lists, at least len(tokens)), or None. drafter: the
        drafter's cache, whose first `drafted` positions in that slot are exact. version: the
        oldest weights version among them (default the current one)."""
        n = len(tokens)
        if n < self.min_tokens:
            return
        new = np.asarray(tokens, dtype=np.int64)
        # An entry that this one extends (the previous turn of the same conversation) is replaced;
        # otherwise a free slot, otherwise the least recently used.
        i = next((i for i, e in enumerate(self.entries) if e is not None and len(e.tokens) <= n
                  and _common(e.tokens, new, n) == len(e.tokens)), None)
        if i is None:
            free = [j for j, e in enumerate(self.entries) if e is None]
            i = free[0] if free else min(range(len(self.entries)), key=lambda j: self.entries[j].used)
        self.kv.move_from(cache, slot, i, n)
        drafted = min(drafted, n) if self.drafter is not None else 0
        if drafted:
            self.drafter.move_from(drafter, slot, i, drafted)
        self.entries[i] = _Entry(new, routes[:n] if routes else None, next(self._clock), drafted,
                                 self.version if version is None else version)

    def restore(self, prompt: list[int], cache: KVCache, slot: int,
                drafter: KVCache | None = None) -> tuple[int, list, int]:
        """Copy the longest kept prefix of `prompt` into `cache`'s `slot` (and the drafter's into
        `drafter`'s, when the cache keeps one), leaving at least the prompt's last token to feed
        (its logits start the completion). Returns how many positions were restored (0: none),
        their routes (n [L][k] lists, or [] when none are kept) and the version of the keys and
        values the slot now starts with (the entry's, or the current one when none was restored)."""
        want = np.asarray(prompt, dtype=np.int64)
        best, n = None, 0
        for i, e in enumerate(self.entries):
            if e is not None:
                m = _common(e.tokens, want, len(prompt) - 1)
                if e.version != self.version and not (self.carry_turns and m == len(e.tokens)):
                    continue  # older weights' keys and values: for their own conversation at most
                if self.drafter is not None:
                    m = min(m - self.drafter.k.shape[0], e.drafted)
                if m > n:
                    best, n = i, m
        if best is None or n < self.min_tokens:
            return 0, [], self.version
        cache.move_from(self.kv, best, slot, n)
        if self.drafter is not None:
            drafter.move_from(self.drafter, best, slot, n)
        e = self.entries[best]
        e.used = next(self._clock)
        self.hits += 1
        self.reused_tokens += n
        return n, (e.routes[:n] if e.routes is not None else []), e.version


def _like(cache: KVCache, slots: int) -> KVCache:
    """An empty cache of `cache`'s layers, heads, length and dtype with `slots` slots."""
    n_layers, _, heads, max_len, head_dim = cache.k.shape
    return KVCache(n_layers, slots, max_len, heads, head_dim, cache.k.dtype, cache.k.device)


def _common(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit`."""
    m = min(len(a), len(b), limit)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m
