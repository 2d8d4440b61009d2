"""The weight store: a lossless delta chain, anchors, checksums, consumers and gc, in a folder and in
S3 (moto's real server on loopback, reached over HTTP by boto3)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from kiln.rl.store import (
    CorruptWeights,
    LocalBackend,
    StoreError,
    WeightStore,
    WeightSubscriber,
    open_backend,
)


@pytest.fixture(params=["local", "s3"])
def url(request, tmp_path, monkeypatch):
    if request.param == "local":
        return str(tmp_path / "weights")
    endpoint = request.getfixturevalue("s3_endpoint")
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    return f"s3://kiln/{tmp_path.name}"  # a fresh prefix per test


def _trainer(n: int, seed: int = 0):
    """Yields (state, expected copy) n times; like a trainer it updates the same tensors in place."""
    g = torch.Generator().manual_seed(seed)
    s = {"w": torch.randn(64, 48, generator=g), "b": torch.randn(300, generator=g).bfloat16(),
         "h": torch.randn(7, 5, generator=g).half(), "step": torch.tensor(0), "ids": torch.arange(12).reshape(3, 4),
         "mask": torch.rand(5, 6, generator=g) < 0.5, "frozen": torch.randn(16, 16, generator=g).bfloat16(),
         "empty": torch.zeros(0, 3)}
    for _ in range(n):
        yield s, {k: v.clone() for k, v in s.items()}
        s["w"].mul_(1 + 1e-3 * torch.randn(s["w"].shape, generator=g))  # every element changes a little
        hit = torch.rand(s["b"].shape, generator=g) < 0.05
        s["b"].copy_(torch.where(hit, s["b"] * 1.5, s["b"]))
        s["h"].add_(0.01)
        s["step"].add_(1)
        s["mask"].logical_not_()


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, x in a.items():
        assert x.dtype == b[k].dtype and x.shape == b[k].shape, k
        assert x.contiguous().view(-1).view(torch.uint8).equal(b[k].contiguous().view(-1).view(torch.uint8)), k


def test_backend_basics(url):
    b = open_backend(url)
    b.put("a/x.json", b"1")
    b.put("a/y.json", b"22")
    b.put("b/z", b"")
    assert b.get("a/y.json") == b"22" and b.get("b/z") == b""
    assert b.list("a/") == ["a/x.json", "a/y.json"] and b.list("c/") == []
    assert b.exists("a/x.json") and not b.exists("a/nope")
    b.delete("a/x.json")
    b.delete("a/x.json")  # deleting what is gone is fine
    assert b.list("a/") == ["a/y.json"]
    with pytest.raises(FileNotFoundError):
        b.get("a/x.json")


def test_the_delta_chain_rebuilds_every_version_bit_for_bit(url):
    store = WeightStore(url, anchor_every=5)
    sub, lagging = WeightSubscriber(store, "w0"), WeightSubscriber(store, "w1")
    expected = []
    for v, (state, want) in enumerate(_trainer(13)):
        assert store.publish(v, state)["kind"] == ("anchor" if v % 5 == 0 else "delta")
        expected.append(want)
        got = sub.poll()  # one delta at a time
        assert got[0] == v and sub.poll() is None
        _same(got[1], want)
        if v % 3 == 2:  # several deltas at once, across anchors
            got = lagging.poll()
            assert got[0] == v
            _same(got[1], want)
    assert store.versions() == list(range(13)) and store.latest() == 12
    assert [store.manifest(v)["base"] for v in (4, 5, 6)] == [3, None, 5]
    for v, want in enumerate(expected):
        _same(store.load(v), want)  # from scratch: the nearest anchor and its deltas
    held = {k: t.clone() for k, t in expected[7].items()}
    _same(store.load(12, have=(7, held)), expected[12])
    _same(held, expected[7])  # the caller's tensors are not touched
    with pytest.raises(StoreError, match="not newer"):
        store.publish(12, expected[12])


def test_publishing_live_tensors_that_change_in_place_afterwards(tmp_path):
    w = torch.zeros(8, 8)
    store = WeightStore(str(tmp_path), anchor_every=10)
    store.publish(0, {"w": w})
    w.add_(1.0)  # what an optimizer step does to the parameters the store was given
    store.publish(1, {"w": w})
    _same(store.load(0), {"w": torch.zeros(8, 8)})
    _same(store.load(1), {"w": torch.ones(8, 8)})


def test_a_sparse_bf16_update_ships_a_small_delta(tmp_path):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(256, 1024, generator=g).bfloat16()
    b = a.clone()
    idx = torch.randperm(a.numel(), generator=g)[: a.numel() // 50]  # 2% of the weights change
    b.view(-1)[idx] += 0.01
    store = WeightStore(str(tmp_path), anchor_every=10)
    assert store.publish(0, {"a": a})["kind"] == "anchor"
    stats = store.publish(1, {"a": b})
    assert stats["kind"] == "delta" and stats["full_bytes"] == a.numel() * 2
    assert stats["delta_fraction"] == stats["bytes_written"] / stats["full_bytes"] < 0.2
    _same(store.load(1), {"a": b})


def test_changed_names_shapes_or_dtypes_force_an_anchor(tmp_path):
    store = WeightStore(str(tmp_path), anchor_every=100)
    x = torch.randn(4, 4)
    store.publish(0, {"x": x})
    assert store.publish(1, {"x": x.reshape(2, 8)})["kind"] == "anchor"
    assert store.publish(2, {"x": x.reshape(2, 8).bfloat16()})["kind"] == "anchor"
    assert store.publish(3, {"x": x.reshape(2, 8).bfloat16(), "y": x})["kind"] == "anchor"
    assert store.publish(4, {"x": x.reshape(2, 8).bfloat16(), "y": x + 1})["kind"] == "delta"
    assert WeightStore(str(tmp_path), anchor_every=100).publish(5, {"y": x})["kind"] == "anchor"  # a restart
    _same(store.load(4), {"x": x.reshape(2, 8).bfloat16(), "y": x + 1})


def test_a_corrupt_delta_is_never_loaded_and_a_version_exists_only_with_its_manifest(url):
    store = WeightStore(url, anchor_every=100)
    sub = WeightSubscriber(store, "w0")
    states = [want for _, want in _trainer(5)]
    for v in range(3):
        store.publish(v, states[v])
        assert sub.poll()[0] == v
    store.publish(3, states[3])
    man = store.manifest(3)
    good = store.backend.get(man["blob"])
    bad = bytearray(good)
    bad[man["tensors"]["w"]["offset"] + man["tensors"]["w"]["length"] // 2] ^= 0x01
    store.backend.put(man["blob"], bytes(bad))
    with pytest.raises(CorruptWeights, match="version 3.*'w'"):
        sub.poll()
    assert sub.have[0] == 2  # it keeps what it had
    _same(sub.have[1], states[2])
    with pytest.raises(CorruptWeights, match="version 3"):
        store.load(3)  # from the anchor too
    store.backend.put(man["blob"], good)

    # A publish that died before its manifest, or left a truncated one, is not a version.
    store.backend.put("blobs/000000000004.bin", b"partial")
    assert store.latest() == 3
    full = json.dumps({"version": 4, "kind": "anchor"}).encode()
    store.backend.put("manifests/000000000004.json", full[: len(full) // 2])
    assert store.latest() == 3 and store.versions() == [0, 1, 2, 3]
    with pytest.raises(StoreError, match="version 4 is not in the weight store"):
        store.load(4)
    store.publish(4, states[4])  # the retry replaces both
    _same(store.load(4), states[4])
    got = sub.poll()  # from 2: the deltas 3 and 4
    assert got[0] == 4
    _same(got[1], states[4])


def _as_zlib(store: WeightStore, version: int) -> None:
    """Rewrite a stored version as kiln wrote it before zstd: zlib, and no codec in the manifest."""
    import hashlib
    import zlib

    import zstandard

    man = store.manifest(version)
    blob, parts, offset = store.backend.get(man["blob"]), [], 0
    for t in man["tensors"].values():
        data = zlib.compress(zstandard.ZstdDecompressor().decompress(blob[t["offset"]:t["offset"] + t["length"]]), 1)
        t.update(offset=offset, length=len(data), data_sha256=hashlib.sha256(data).hexdigest())
        parts.append(data)
        offset += len(data)
    del man["codec"]
    store.backend.put(man["blob"], b"".join(parts))
    store.backend.put(f"manifests/{version:012d}.json", json.dumps(man).encode())


def test_a_store_written_with_zlib_still_loads_and_an_unknown_codec_is_named(tmp_path):
    states = [want for _, want in _trainer(3)]
    store = WeightStore(str(tmp_path), anchor_every=100)
    for v in range(2):
        store.publish(v, states[v])
        _as_zlib(store, v)  # an anchor and a delta from before zstd
    assert store.publish(2, states[2])["kind"] == "delta"  # a zstd delta on top of them
    for v in range(3):
        _same(store.load(v), states[v])
    man = store.manifest(2)
    store.backend.put("manifests/000000000002.json", json.dumps({**man, "codec": "brotli"}).encode())
    with pytest.raises(StoreError, match="version 2 is compressed with 'brotli'.*update kiln"):
        store.load(2)


def test_gc_keeps_what_consumers_need(url):
    states = [want for _, want in _trainer(9)]
    store = WeightStore(url, anchor_every=4)  # anchors at 0, 4, 8
    for v in range(2):
        store.publish(v, states[v])
    old = WeightSubscriber(store, "old")
    old.poll()  # holds version 1: the chain from anchor 0 must stay
    for v in range(2, 6):
        store.publish(v, states[v])
    assert store.gc(keep_last=1) == [] and store.versions() == list(range(6))
    assert old.poll()[0] == 5
    assert store.gc(keep_last=1) == [0, 1, 2, 3]  # it is on 5: anchor 4 onwards
    assert store.versions() == [4, 5] and store.backend.list("blobs/") == [f"blobs/{v:012d}.bin" for v in (4, 5)]
    for v in range(6, 9):
        store.publish(v, states[v])
    got = old.poll()  # the deltas after what it holds are all still there
    assert got[0] == 8
    _same(got[1], states[8])
    _same(store.load(6), states[6])
    store.forget("old")
    assert store.gc(keep_last=1) == [4, 5, 6, 7] and store.versions() == [8]
    _same(store.load(8), states[8])
    with pytest.raises(StoreError, match="version 5 is not in the weight store"):
        store.load(5)
    with pytest.raises(StoreError, match="keep at least 1"):
        store.gc(keep_last=0)


def test_urls_and_missing_boto3(tmp_path, monkeypatch):
    assert isinstance(open_backend(f"file://{tmp_path}/a"), LocalBackend)
    assert isinstance(open_backend(str(tmp_path / "b")), LocalBackend)
    with pytest.raises(StoreError, match="unsupported scheme 'gs'"):
        open_backend("gs://bucket/x")
    with pytest.raises(StoreError, match="needs a bucket"):
        open_backend("s3:///x")
    monkeypatch.setitem(sys.modules, "boto3", None)  # what `import boto3` does when it is not installed
    with pytest.raises(StoreError, match="pip install boto3"):
        WeightStore("s3://bucket/x")
    with pytest.raises(StoreError, match="letters, digits"):
        WeightStore(str(tmp_path)).mark_consumed("../x", 0)
