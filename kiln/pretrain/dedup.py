"""Exact and near-duplicate detection for the corpus: content hashes, MinHash signatures, LSH bands.

Duplicates waste tokens and, worse, let a model memorise instead of generalise (vendored copies
of a package, the same file in two installed versions). Everything here is deterministic: word
ids and shingle hashes come from blake2b and fixed arithmetic, never from Python's salted
`hash()`, so one corpus always dedups the same way on every machine.
"""
from __future__ import annotations

import hashlib
import re

import numpy as np

NUM_PERM = 128  # MinHash permutations: the Jaccard estimate's standard error is about 0.03
SHINGLE = 5  # words per shingle: one changed line changes only a few shingles of a long file
_WORD = re.compile(r"\w+")
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier that folds word ids into a shingle hash


def normalise(text: str) -> str:
    """The text with line endings unified, trailing spaces and leading/trailing blank lines gone:
    two files that differ only in these are the same document."""
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def content_hash(text: str) -> bytes:
    """Hash of the normalised text: equal for exact duplicates."""
    return hashlib.blake2b(normalise(text).encode("utf-8"), digest_size=16).digest()


def lsh_bands(threshold: float, num_perm: int = NUM_PERM) -> tuple[int, int]:
    """(bands, rows) with bands * rows = num_perm: the most rows per band (fewest false candidates)
    that still makes a pair at `threshold` a candidate with probability >= 0.99."""
    best = (num_perm, 1)
    for rows in range(1, num_perm + 1):
        if num_perm % rows == 0 and 1 - (1 - threshold ** rows) ** (num_perm // rows) >= 0.99:
            best = (num_perm // rows, rows)
    return best


class NearDupIndex:
    """MinHash over word 5-gram shingles with LSH banding.

    `add(text)` returns False when a document already added has an estimated Jaccard similarity
    >= `threshold` with `text` (a near-duplicate, not added), else adds it and returns True.
    Candidates come from LSH buckets; each is checked against the threshold on its signature,
    so banding only decides which pairs are compared.
    """

    def __init__(self, threshold: float, seed: int = 0, num_perm: int = NUM_PERM):
        self.threshold = threshold
        self.bands, self.rows = lsh_bands(threshold, num_perm)
        rng = np.random.default_rng(seed)
        # h(x) = a*x + b mod 2^64 with odd a is a bijection of the 64-bit hashes: one "permutation".
        self._a = rng.integers(1, 2**63, num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._b = rng.integers(0, 2**63, num_perm, dtype=np.uint64)
        self._words: dict[str, int] = {}
        self._buckets: list[dict[bytes, list[int]]] = [{} for _ in range(self.bands)]
        self._signatures: list[np.ndarray] = []

    def signature(self, text: str) -> np.ndarray:
        """The MinHash signature [num_perm] of the text's word shingles."""
        words = _WORD.findall(text)
        for w in set(words).difference(self._words):
            self._words[w] = int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little")
        ids = np.array([self._words[w] for w in words], dtype=np.uint64)
        if len(ids) < SHINGLE:  # too short for one shingle: the whole word list is the only shingle
            ids = np.concatenate([ids, np.zeros(SHINGLE - len(ids), dtype=np.uint64)])
        n = len(ids) - SHINGLE + 1
        shingles = ids[:n].copy()
        with np.errstate(over="ignore"):  # wrap-around arithmetic mod 2^64 is the point
            for k in range(1, SHINGLE):
                shingles = shingles * _MIX + ids[k:k + n]
            sig = np.full(len(self._a), np.iinfo(np.uint64).max, dtype=np.uint64)
            for start in range(0, n, 1024):  # chunks keep the [num_perm, chunk] table in cache
                chunk = shingles[start:start + 1024]
                sig = np.minimum(sig, (self._a[:, None] * chunk[None, :] + self._b[:, None]).min(axis=1))
        return sig

    def add(self, text: str) -> bool:
        sig = self.signature(text)
        keys = [sig[i * self.rows:(i + 1) * self.rows].tobytes() for i in range(self.bands)]
        candidates = {i for bucket, key in zip(self._buckets, keys) for i in bucket.get(key, ())}
        for c in sorted(candidates):
            if np.mean(self._signatures[c] == sig) >= self.threshold:
                return False
        index = len(self._signatures)
        self._signatures.append(sig)
        for bucket, key in zip(self._buckets, keys):
            bucket.setdefault(key, []).append(index)
        return True
