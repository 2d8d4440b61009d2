"""The weight store: versioned weights as a lossless delta chain in a folder or an S3 bucket.

The trainer publishes a version after every step; rollout workers poll, rebuild it and swap it in
(RECIPE "Infrastructure": only the diff from the previous version travels). Per tensor, a delta is
the XOR of the raw bits with the previous version's (zero wherever a weight did not change),
byte-shuffled (byte 0 of every element, then byte 1, ...: the sign/exponent bytes of a small update
are mostly zero and line up into long runs) and compressed with zstd (a manifest names its codec;
stores written with zlib before it still load). A version is a full anchor when it is the
first or crosses a multiple of `anchor_every`, so a reader never replays more than `anchor_every - 1`
deltas. A version is one data blob (one PUT and one GET on S3, one fsync locally) and a JSON
manifest written last, the commit point: a version without a readable manifest does not exist. The
manifest holds the sha256 of every tensor's stored bytes and of every rebuilt tensor, so a corrupted
or truncated delta raises `CorruptWeights` and is never returned. Consumers mark the version they
hold; `gc` keeps what any of them, or a fresh reader of the last versions, still needs.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
import zlib
from typing import Protocol

import numpy as np
import torch
import zstandard

# zstd level 1: a 9.2M-parameter fp32 delta (every element updated) shrinks to 0.414 of its size in
# 0.11 s on one core, where zlib level 1 (the codec before) took 0.64 s for 0.447, and a bf16 delta
# to 0.100 in 0.04 s against 0.17 s for 0.118 (docs/architecture.md, RL, Weight store).
LEVEL = 1
CODEC = "zstd"
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class StoreError(RuntimeError):
    """The store cannot do what was asked (missing version, bad URL, non-increasing version ...)."""


class CorruptWeights(StoreError):
    """Stored bytes or a rebuilt tensor do not match the manifest's checksum."""


class Backend(Protocol):
    """Keys are '/'-separated paths; `get` raises FileNotFoundError for a missing key."""

    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...


class LocalBackend:
    """A folder; every write is atomic (temp file in the same folder, fsync, rename)."""

    def __init__(self, root_dir: str):
        self.root = os.path.abspath(root_dir)
        os.makedirs(self.root, exist_ok=True)

    def put(self, key: str, data: bytes) -> None:
        path = os.path.join(self.root, key)
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        dfd = os.open(folder, os.O_RDONLY)  # the rename itself survives a crash only once its folder is synced
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def get(self, key: str) -> bytes:
        with open(os.path.join(self.root, key), "rb") as f:
            return f.read()

    def exists(self, key: str) -> bool:
        return os.path.isfile(os.path.join(self.root, key))

    def list(self, prefix: str) -> list[str]:
        keys = []
        for folder, _, files in os.walk(os.path.join(self.root, os.path.dirname(prefix))):
            rel = os.path.relpath(folder, self.root).replace(os.sep, "/")
            keys += [n if rel == "." else f"{rel}/{n}" for n in files if not n.startswith(".tmp-")]
        return sorted(k for k in keys if k.startswith(prefix))

    def delete(self, key: str) -> None:
        try:
            os.unlink(os.path.join(self.root, key))
        except FileNotFoundError:
            pass


class S3Backend:
    """Any S3-compatible store. Without `endpoint_url`, boto3 reads AWS_ENDPOINT_URL (or uses AWS)."""

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None):
        try:
            import boto3
            from botocore.exceptions import ClientError
        except ImportError:
            raise StoreError("an s3:// weight store needs boto3: pip install boto3 (or 'kiln[s3]')") from None
        self.s3, self.bucket, self.prefix = boto3.client("s3", endpoint_url=endpoint_url), bucket, prefix.strip("/")
        self._client_error = ClientError

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)  # S3 objects appear whole

    def get(self, key: str) -> bytes:
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            raise FileNotFoundError(f"s3://{self.bucket}/{self._key(key)}") from None

    def exists(self, key: str) -> bool:
        try:
            self.s3.head_object(Bucket=self.bucket, Key=self._key(key))
        except self._client_error as e:
            if e.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def list(self, prefix: str) -> list[str]:
        cut = len(self._key(""))
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
        return sorted(o["Key"][cut:] for page in pages for o in page.get("Contents", []))

    def delete(self, key: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=self._key(key))


def open_backend(url: str) -> Backend:
    """A folder path or file://PATH -> LocalBackend; s3://bucket/prefix -> S3Backend."""
    scheme = re.match(r"([a-zA-Z][a-zA-Z0-9+.-]*)://", url)
    if scheme is None or scheme[1] == "file":
        return LocalBackend(url.removeprefix("file://"))
    if scheme[1] == "s3":
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise StoreError(f"weight store {url!r}: an s3:// URL needs a bucket (s3://bucket/prefix)")
        return S3Backend(bucket, prefix)
    raise StoreError(f"weight store {url!r}: unsupported scheme {scheme[1]!r}; use a folder, file://PATH or "
                     "s3://bucket/prefix")


def _bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes as unsigned ints of its element size (a view where possible)."""
    t = t.detach().cpu().contiguous().view(-1)
    return t.view(torch.uint8).numpy().view(_UINT[t.element_size()])


def _shuffle(a: np.ndarray) -> bytes:
    return a.view(np.uint8).reshape(-1, a.itemsize).T.tobytes()


def _unshuffle(data: bytes, dtype: type) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    return np.frombuffer(data, np.uint8).reshape(size, -1).T.copy().view(dtype).reshape(-1)


def _decompressor(man: dict):
    """The codec a manifest names; one without a name was written with zlib (before zstd)."""
    codec = man.get("codec", "zlib")
    if codec == "zlib":
        return zlib.decompress
    if codec == "zstd":
        return zstandard.ZstdDecompressor().decompress
    raise StoreError(f"version {man['version']} is compressed with {codec!r}, which this kiln cannot read: "
                     "update kiln, or publish the weights again")


def _sha(data: bytes | np.ndarray) -> str:
    return hashlib.sha256(data).hexdigest()


def _version_of(key: str) -> int:
    return int(key.rsplit("/", 1)[-1].split(".")[0])


def _meta(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


class WeightStore:
    """Versions under one URL: `manifests/<version>.json` (the commit point), `blobs/<version>.bin`
    (every tensor's compressed bytes back to back) and `consumers/<id>.json`; `level` is zstd's."""

    def __init__(self, url: str, anchor_every: int = 10, level: int = LEVEL):
        if anchor_every < 1:
            raise StoreError(f"anchor_every must be >= 1 (got {anchor_every})")
        self.url, self.anchor_every, self.level, self.backend = url, anchor_every, level, open_backend(url)
        self._prev: tuple[int, dict[str, dict], dict[str, np.ndarray]] | None = None  # last publish: meta, bits

    def _manifest(self, version: int) -> dict | None:
        try:
            man = json.loads(self.backend.get(f"manifests/{version:012d}.json"))
        except (FileNotFoundError, ValueError):  # missing, or truncated by a crash: not a version
            return None
        return man if isinstance(man, dict) and man.get("version") == version else None

    def manifest(self, version: int) -> dict:
        man = self._manifest(version)
        if man is None:
            raise StoreError(f"version {version} is not in the weight store {self.url} (versions: "
                             f"{self.versions()}); it was never published or gc() removed it")
        return man

    def _names(self) -> list[int]:
        return sorted(_version_of(k) for k in self.backend.list("manifests/"))

    def versions(self) -> list[int]:
        return [v for v in self._names() if self._manifest(v) is not None]

    def latest(self) -> int | None:
        return next((v for v in reversed(self._names()) if self._manifest(v) is not None), None)

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> dict:
        """Store `state` as `version` (newer than every stored one). Returns {kind: "anchor" | "delta",
        bytes_written, full_bytes (the raw size of every tensor), delta_fraction (their ratio)}."""
        latest = self.latest()
        if latest is not None and version <= latest:
            raise StoreError(f"cannot publish version {version}: it is not newer than the store's latest ({latest})")
        meta = {k: _meta(t) for k, t in state.items()}
        bits = {k: _bits(t).copy() for k, t in state.items()}  # a copy: the trainer updates its tensors in place
        # An anchor when crossing a multiple of anchor_every, when this publisher did not publish the
        # latest version (it restarted: an anchor is cheaper than rebuilding the latest to diff against),
        # and when names, dtypes or shapes changed (a delta cannot express that).
        anchor = (latest is None or version // self.anchor_every > latest // self.anchor_every
                  or self._prev is None or self._prev[0] != latest or self._prev[1] != meta)
        parts, tensors, offset, zc = [], {}, 0, zstandard.ZstdCompressor(level=self.level)
        for k, a in bits.items():
            data = zc.compress(_shuffle(a if anchor else a ^ self._prev[2][k]))
            tensors[k] = {**meta[k], "sha256": _sha(a), "offset": offset, "length": len(data), "data_sha256": _sha(data)}
            parts.append(data)
            offset += len(data)
        blob = f"blobs/{version:012d}.bin"
        self.backend.put(blob, b"".join(parts))
        man = {"version": version, "kind": "anchor" if anchor else "delta", "base": None if anchor else latest,
               "codec": CODEC, "blob": blob, "tensors": tensors}
        self.backend.put(f"manifests/{version:012d}.json", json.dumps(man).encode())  # last: the commit point
        self._prev = (version, meta, bits)
        full = sum(a.nbytes for a in bits.values())
        return {"kind": man["kind"], "bytes_written": offset, "full_bytes": full, "delta_fraction": offset / max(full, 1)}

    def size(self, version: int) -> dict:
        """publish()'s figures for a stored version, from its manifest (bytes_written, full_bytes, delta_fraction)."""
        tensors = self.manifest(version)["tensors"].values()
        written = sum(t["length"] for t in tensors)
        full = sum(math.prod(t["shape"]) * torch.empty(0, dtype=getattr(torch, t["dtype"])).element_size()
                   for t in tensors)
        return {"bytes_written": written, "full_bytes": full, "delta_fraction": written / max(full, 1)}

    def load(self, version: int, have: tuple[int, dict[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
        """Rebuild `version`, verified, from `have` (a version the caller holds, older than `version`:
        only the deltas after it are read) or from the nearest anchor at or below `version`."""
        chain = [self.manifest(version)]  # newest first, back to an anchor or to the version held
        while chain[-1]["kind"] == "delta" and not (have is not None and chain[-1]["base"] == have[0]):
            chain.append(self.manifest(chain[-1]["base"]))
        bits = None if chain[-1]["kind"] == "anchor" else {k: _bits(t) for k, t in have[1].items()}
        for man in reversed(chain):
            blob = memoryview(self.backend.get(man["blob"]))  # slices without copying
            decompress = _decompressor(man)
            new = {}
            for k, t in man["tensors"].items():
                data = blob[t["offset"]:t["offset"] + t["length"]]
                if _sha(data) != t["data_sha256"]:
                    raise CorruptWeights(f"version {man['version']}: the stored bytes of tensor {k!r} do not match "
                                         "their checksum; republish it or load another version")
                a = _unshuffle(decompress(data), _UINT[getattr(torch, t["dtype"]).itemsize])
                if man["kind"] == "delta" and (k not in bits or bits[k].shape != a.shape):
                    raise CorruptWeights(f"version {man['version']}: tensor {k!r} does not fit version {man['base']} "
                                         "it is a delta against; load without `have`")
                new[k] = a if man["kind"] == "anchor" else a ^ bits[k]
            bits = new
        tensors = chain[0]["tensors"]
        for k, t in tensors.items():  # the end result, whatever it was rebuilt from
            if _sha(bits[k]) != t["sha256"]:
                hint = f" (from the held version {have[0]}: was it modified?)" if chain[-1]["kind"] == "delta" else ""
                raise CorruptWeights(f"version {version}: tensor {k!r} rebuilds to the wrong bits{hint}")
        return {k: torch.from_numpy(bits[k].view(np.uint8)).view(getattr(torch, t["dtype"])).reshape(t["shape"])
                for k, t in tensors.items()}

    # ---- consumers ---------------------------------------------------------------------------
    def _consumer_key(self, consumer_id: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", consumer_id):
            raise StoreError(f"consumer id {consumer_id!r}: use letters, digits, '.', '_' and '-' only")
        return f"consumers/{consumer_id}.json"

    def mark_consumed(self, consumer_id: str, version: int) -> None:
        self.backend.put(self._consumer_key(consumer_id), json.dumps({"version": version}).encode())

    def forget(self, consumer_id: str) -> None:
        """Drop a consumer's marker (it left), so `gc` no longer keeps its version."""
        self.backend.delete(self._consumer_key(consumer_id))

    def gc(self, keep_last: int = 2) -> list[int]:
        """Delete the versions nobody needs; returns them. Kept: the last `keep_last` versions and
        every version from the anchor at or below the oldest one a consumer holds (its deltas follow)."""
        if keep_last < 1:
            raise StoreError(f"gc(keep_last={keep_last}) would delete the latest version: keep at least 1")
        vs = self.versions()
        held = [json.loads(self.backend.get(k))["version"] for k in self.backend.list("consumers/")]
        oldest = min(held + vs[-keep_last:], default=None)
        floor = next((v for v in reversed(vs) if v <= oldest and self.manifest(v)["kind"] == "anchor"), None)
        if floor is None:
            return []
        gone = [v for v in vs if v < floor]
        # Manifests first (the version stops existing), then every blob below the floor, including
        # those of publishes that crashed before writing their manifest.
        for key in self.backend.list("manifests/") + self.backend.list("blobs/"):
            if _version_of(key) < floor:
                self.backend.delete(key)
        return gone


class WeightSubscriber:
    """A reader that holds one version and rebuilds newer ones from the deltas after it."""

    def __init__(self, store: WeightStore, consumer_id: str):
        self.store, self.consumer_id = store, consumer_id
        self.have: tuple[int, dict[str, torch.Tensor]] | None = None

    def poll(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest version if it is newer than the one held (a copy the caller may modify), else None.
        Raises CorruptWeights (still holding the previous version) when it fails its checksums."""
        latest = self.store.latest()
        if latest is None or (self.have is not None and latest <= self.have[0]):
            return None
        state = self.store.load(latest, self.have)
        self.have = (latest, state)
        self.store.mark_consumed(self.consumer_id, latest)
        return latest, {k: v.clone() for k, v in state.items()}
