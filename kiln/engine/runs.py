"""Decoding runs: several of the engine's steps in one native.c call.

Between two steps the engine's Python (the next call's arguments, sampling's bookkeeping, emit)
runs cold, right after a native call has streamed the weights through the caches: at batch 1 it
was about a third of a plain token's time. Where every running row allows it, a step hands native.c
up to DECODE_RUN steps at once, which chain the same calls in the same order (kiln_trunk, kiln_head,
kiln_sample, kiln_mtp_layer), so tokens, logprobs, routes and drafts are the bits as many steps give:

- `plain` (Engine._decode): rows without top-k or top-p (native.c's sampler).
- `speculative` (spec_step): greedy rows without stop strings, with the MTP drafter.
- `lookup` (lookup_step): rows without top-k, top-p or stop strings (an RL worker's), with prompt
  lookup's drafts (the latest earlier occurrence of a row's last N tokens, searched in C).

A sampled row's generator hands a run the uniforms it could need; those the run did not use are
put back, so the row draws what as many Python steps would.

A run ends after the step in which a row finishes by a stop id (speculative, lookup: any way emit ends it),
or in which a request or new weights arrived (`NativeTrunk.yield_run`, which submit and
update_weights set): what arrives still waits one step.
"""
from __future__ import annotations

import ctypes

import torch

from kiln.engine.native import DECODE_RUN, MAX_TOKENS, NATIVE_MAX_BATCH, _bf16
from kiln.engine.sampling import untruncated


def plain(engine, rs) -> bool:
    """Up to DECODE_RUN plain steps of the running rows in one call, if they all allow it -> whether it
    ran. Short enough that no row reaches max_tokens or the cache's end before the last step."""
    native = engine.native
    if not engine.runs or native is None or len(rs) > NATIVE_MAX_BATCH or not all(untruncated(r.params) for r in rs):
        return False
    b = len(rs)
    n = min(DECODE_RUN, *(min(r.params.max_tokens - len(r.tokens), engine.max_len - r.length) for r in rs))
    states, u = _draws(rs, n)
    pos0, k, v = native.slots([r.length for r in rs], 1, engine.cache, 0, [n] * b)
    stops, off = _stops(rs)
    tokens, logprobs = torch.empty(n, b, dtype=torch.int64), torch.empty(n, b)
    routes = _routes(native, n, b)
    work = torch.empty(b * (native.dim + native.vocab) + native.vocab + native.vocab // 16)
    steps = native.lib.kiln_decode(
        native.ref, native.final_norm.data_ptr(), b, n, (ctypes.c_int64 * b)(*(r.tokens[-1] for r in rs)), pos0,
        (ctypes.c_float * b)(*(r.params.temperature for r in rs)), u.data_ptr(), stops, off, k, v, engine.cache.k.stride(1),
        engine.cache.k.stride(0), engine.cache.max_len, _bf16(engine.cache), native.vocab, routes[0, 0].numel(),
        tokens.data_ptr(), logprobs.data_ptr(), routes.data_ptr(), ctypes.byref(native.yield_run), work.data_ptr(),
        native.scratch(b, 1))
    toks, lps = tokens[:steps].t().tolist(), logprobs[:steps].t().tolist()
    routes = routes[:steps].to(torch.int16) if native.n_moe and engine.capture_routes else None
    _put_back(rs, states, [steps] * b)
    for i, r in enumerate(rs):
        _emit(engine, r, list(zip(toks[i], lps[i])), None if routes is None else routes[:, i])
    return True


def speculative(engine, rs) -> bool:
    """Up to DECODE_RUN speculative steps (spec_step, then draft) of greedy rows without stop strings
    in one call -> whether it ran."""
    native, mtp = engine.native, engine.mtp
    depth = mtp.depth
    if not engine.runs or native is None or len(rs) > NATIVE_MAX_BATCH or 2 * depth > MAX_TOKENS \
            or not all(r.params.greedy and not r.params.stop and len(r.drafts) == depth for r in rs):
        return False
    b, n, dim, t = len(rs), DECODE_RUN, native.dim, depth + 1
    spec = _spec(engine)
    i64, i32 = ctypes.c_int64, ctypes.c_int32
    last = (i64 * b)(*(r.tokens[-1] for r in rs))
    drafts = (i64 * (b * depth))(*(d for r in rs for d in r.drafts))
    length = (i32 * b)(*(r.length for r in rs))
    left = (i32 * b)(*(r.params.max_tokens - len(r.tokens) for r in rs))
    tail = torch.empty(b, max(depth - 1, 1), dim)
    for i, r in enumerate(rs):
        if r.mtp_tail is not None:
            tail[i, :r.mtp_tail.shape[0]] = r.mtp_tail
    tail_rows = (i32 * b)(*(0 if r.mtp_tail is None else r.mtp_tail.shape[0] for r in rs))
    drafted = (i32 * b)(*(r.drafted for r in rs))
    recent = (i64 * (b * depth))(*(x for r in rs for x in _recent(r, depth)))
    stops, off = _stops(rs)
    tokens, logprobs = torch.empty(n, b, t, dtype=torch.int64), torch.empty(n, b, t)
    accepted = torch.empty(n, b, dtype=torch.int32)
    routes = _routes(native, n, b * t)
    work = torch.empty(native.lib.kiln_spec_work_floats(ctypes.byref(spec), b, n))
    steps = native.lib.kiln_spec_decode(
        ctypes.byref(spec), b, n, last, drafts, length, left, tail.data_ptr(), tail_rows, drafted, recent, stops, off,
        tokens.data_ptr(), logprobs.data_ptr(), accepted.data_ptr(), routes.data_ptr(), ctypes.byref(native.yield_run),
        work.data_ptr(), native.scratch(b, 2 * depth))
    toks, lps, acc = tokens[:steps].tolist(), logprobs[:steps].tolist(), accepted[:steps].tolist()
    routes = routes[:steps].view(steps, b, t, *routes.shape[2:]) if native.n_moe and engine.capture_routes else None
    stats = engine.spec_stats
    for i, r in enumerate(rs):
        new = []
        for s in range(steps):
            a = acc[s][i]
            new += zip(toks[s][i][:a + 1], lps[s][i][:a + 1])
            stats.steps += 1
            for j in range(min(a + 1, depth)):
                stats.proposed[j] += 1
            for j in range(a):
                stats.accepted[j] += 1
        _emit(engine, r, new, _kept(routes, i, [a + 1 for a in (acc[s][i] for s in range(steps))]), length[i])
        r.drafts, r.draft_probs = list(drafts[i * depth:(i + 1) * depth]), [None] * depth
        r.mtp_tail = tail[i, :tail_rows[i]] if tail_rows[i] else None
        r.drafted = drafted[i]
    return True


def lookup(engine, rs, ngram: int) -> bool:
    """Up to DECODE_RUN prompt-lookup steps (lookup_step, drafts found by the last `ngram` tokens) of
    rows without top-k, top-p or stop strings in one call -> whether it ran."""
    native, depth = engine.native, engine.lookup
    if not engine.runs or native is None or len(rs) > NATIVE_MAX_BATCH or depth + 1 > MAX_TOKENS \
            or not all(untruncated(r.params) and not r.params.stop for r in rs):
        return False
    b, n, t = len(rs), DECODE_RUN, depth + 1
    i32 = ctypes.c_int32
    seqs = [r.prompt_ids + r.tokens for r in rs]
    cap = max(map(len, seqs)) + n * t
    hist = torch.zeros(b, cap, dtype=torch.int64)
    for i, seq in enumerate(seqs):
        hist[i, :len(seq)] = torch.tensor(seq)
    per_row = n * (depth + 2)  # the most a run can draw: a step draws at most its drafts and two more
    states, u = _draws(rs, per_row)
    known, used = (i32 * b)(*map(len, seqs)), (i32 * b)()
    length = (i32 * b)(*(r.length for r in rs))
    left = (i32 * b)(*(r.params.max_tokens - len(r.tokens) for r in rs))
    stops, off = _stops(rs)
    fed, kept = torch.empty(n, b, dtype=torch.int32), torch.empty(n, b, dtype=torch.int32)
    tokens, logprobs = torch.empty(n, b, t, dtype=torch.int64), torch.empty(n, b, t)
    routes = _routes(native, n, b * t)
    rs_ints = routes[0, 0].numel()
    work = torch.empty(native.lib.kiln_lookup_work_floats(native.ref, b, depth, native.vocab, rs_ints))
    cache = engine.cache
    steps = native.lib.kiln_lookup_decode(
        native.ref, native.final_norm.data_ptr(), b, n, depth, ngram, hist.data_ptr(), known, cap, length, left,
        (ctypes.c_float * b)(*(r.params.temperature for r in rs)), u.data_ptr(), per_row, used, stops, off,
        cache.k.data_ptr(), cache.v.data_ptr(), cache.k.stride(1), cache.k.stride(0), cache.max_len, _bf16(cache),
        native.vocab, rs_ints, fed.data_ptr(), kept.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(),
        routes.data_ptr(), ctypes.byref(native.yield_run), work.data_ptr(), native.scratch(b, t))
    fed, kept, toks, lps = fed[:steps].tolist(), kept[:steps].tolist(), tokens[:steps].tolist(), logprobs[:steps].tolist()
    routes = routes[:steps].view(steps, b, t, *routes.shape[2:]) if native.n_moe and engine.capture_routes else None
    stats = engine.spec_stats
    _put_back(rs, states, used)
    for i, r in enumerate(rs):
        new = []
        for s in range(steps):
            k, d = kept[s][i], fed[s][i] - 1
            new += zip(toks[s][i][:k], lps[s][i][:k])
            stats.steps += bool(d)
            for j in range(min(k, d)):
                stats.proposed[j] += 1
            for j in range(k - 1):
                stats.accepted[j] += 1
        _emit(engine, r, new, _kept(routes, i, [kept[s][i] for s in range(steps)]), length[i])
    return True


def _draws(rs, k: int) -> tuple[list, torch.Tensor]:
    """Each sampled row's next k uniforms, in the order uniform() would draw them (torch.rand(k)
    draws those k and leaves the generator where k uniform() calls do), 0 for greedy rows -> (the
    generators' states before, u [B, k])."""
    states = [None if r.params.greedy else r.gen.get_state() for r in rs]
    u = torch.zeros(len(rs), k)
    for i, (r, st) in enumerate(zip(rs, states)):
        if st is not None:
            u[i] = torch.rand(k, generator=r.gen)
    return states, u


def _put_back(rs, states: list, used: list[int]) -> None:
    """Leave each sampled row's generator as if it had drawn only the used[i] uniforms a run took."""
    for r, st, n in zip(rs, states, used):
        if st is not None:
            r.gen.set_state(st)
            torch.rand(n, generator=r.gen)


def _emit(engine, r, new: list, routes: torch.Tensor | None, length: int | None = None) -> None:
    """emit a run's new tokens as one step feeding as many positions would. length: the row's cache
    positions after the run (speculative, lookup: every verified position, whatever emit keeps);
    None (plain): one per token kept, fewer when a stop string ended the row early."""
    if routes is not None:
        r.pending_routes = routes
    before, fed = len(r.tokens), len(new)
    r.length = r.length + fed if length is None else length
    engine.emit(r, new, fed=fed)
    if length is None:
        r.length -= fed - (len(r.tokens) - before)


def _kept(routes: torch.Tensor | None, i: int, counts: list[int]) -> torch.Tensor | None:
    """Row i's routes [steps, b, t, ...] at the first counts[s] positions of each step, in order, as
    int16: one gather (12 µs for a 16-step run) where a slice a step and a cat took about twice that."""
    if routes is None:
        return None
    t = routes.shape[2]
    rows = routes[:, i].reshape(len(counts) * t, *routes.shape[3:])
    return rows[torch.tensor([s * t + j for s, c in enumerate(counts) for j in range(c)])].to(torch.int16)


def _stops(rs):
    """Each row's stop ids, flat, and where each row's begin (C int64s, int32s)."""
    flat = [t for r in rs for t in sorted(r.stop_ids)]
    off = [0]
    for r in rs:
        off.append(off[-1] + len(r.stop_ids))
    return (ctypes.c_int64 * max(len(flat), 1))(*flat), (ctypes.c_int32 * len(off))(*off)


def _routes(native, n: int, rows: int) -> torch.Tensor:
    return torch.empty(n, rows, max(native.n_moe, 1), native.top_k, dtype=torch.int32)


def _recent(r, depth: int) -> list[int]:
    """r's last `depth` known tokens (positions r.length - depth + 1 .. r.length), 0 before its start."""
    seq = (r.prompt_ids + r.tokens)[-depth:]
    return [0] * (depth - len(seq)) + seq


class _Spec(ctypes.Structure):
    """native.c's Spec: the drafter and both caches, as kiln_spec_decode reads them."""
    _fields_ = [("m", ctypes.c_void_p), ("mtp", ctypes.c_void_p), ("norm", ctypes.c_void_p),
                ("mtp_norms", ctypes.c_void_p), ("draft_head", ctypes.c_void_p), ("draft_ids", ctypes.c_void_p)] \
        + [(f, ctypes.c_int) for f in ("depth", "draft_vocab", "vocab", "max_len", "kv_bf16", "route_stride")] \
        + [(f, ctypes.c_void_p) for f in ("k_cache", "v_cache", "mk_cache", "mv_cache")] \
        + [(f, ctypes.c_int64) for f in ("slot_stride", "layer_stride", "mslot_stride", "mlayer_stride")]


def _spec(engine) -> _Spec:
    """The engine's _Spec, built again only when what it points to moved (new weights rebuild the
    native structs and the drafter's head rows): building it took 20-60 µs a run."""
    native, kept = engine.native, engine._spec_struct
    if kept is not None and kept.m == ctypes.addressof(native.struct) and kept.mtp == ctypes.addressof(
            native.mtp_struct) and kept.draft_head == (None if native.draft_head is None else native.draft_head.data_ptr()):
        return kept
    engine._spec_struct = _build_spec(engine)
    return engine._spec_struct


def _build_spec(engine) -> _Spec:
    native, mtp, cache, mcache = engine.native, engine.mtp, engine.cache, engine.mtp_cache
    norms = (ctypes.c_void_p * mtp.depth)(*(layer.norm.weight.data_ptr() for layer in mtp.layers))
    ids = None if engine.draft_ids is None else engine.draft_ids.to(torch.int64).contiguous()
    spec = _Spec(ctypes.addressof(native.struct), ctypes.addressof(native.mtp_struct), native.final_norm.data_ptr(),
                 ctypes.addressof(norms), None if ids is None else native.draft_head.data_ptr(),
                 None if ids is None else ids.data_ptr(), mtp.depth, native.vocab if ids is None else len(ids),
                 native.vocab, cache.max_len, _bf16(cache), max(native.n_moe, 1) * native.top_k,
                 cache.k.data_ptr(), cache.v.data_ptr(), mcache.k.data_ptr(), mcache.v.data_ptr(),
                 cache.k.stride(1), cache.k.stride(0), mcache.k.stride(1), mcache.k.stride(0))
    spec._keep = (norms, ids)  # what it points into lives as long as it does
    return spec
