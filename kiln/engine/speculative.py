"""Speculative decoding with the MTP module as the drafter.

A step feeds every running sequence its last token plus D drafted tokens (one main forward of D+1
positions), accepts the longest valid prefix of the drafts and adds one token from the main model
(a correction, or a bonus when all D were accepted). Greedy: a draft is accepted iff it is the
main model's argmax, so the output equals plain greedy decoding. Sampling: the standard rule
(accept d with probability min(1, p(d)/q(d)), else draw from norm(max(0, p - q))), so the output is
distributed exactly as plain sampling from p.

Then the MTP layers run over the positions just accepted, which extends their own KV cache and
proposes the next D drafts: layer k at position i reads h^{k-1}_i and the embedding of token i+k.
At the last D-1 positions, layers k >= 2 can only read draft tokens; the next draft re-runs those
positions once the tokens are known, so every entry the cache keeps is exact. Each request counts
the leading positions that are (`drafted`): prefix reuse keeps and restores only those. Rows past a
sequence's accepted length are computed but never attended to later (KVCache).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kiln.engine import runs
from kiln.engine.native import NATIVE_PREFILL
from kiln.engine.sampling import (
    argmax,
    draw,
    policy_logprobs,
    sample_row,
    sampling_probs,
    uniform,
    untruncated,
)
from kiln.model.layers import rope_tables


@dataclass
class SpecStats:
    depth: int
    steps: int = 0
    proposed: list[int] = field(default_factory=list)  # per draft position: times it was checked
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.proposed, self.accepted = [0] * self.depth, [0] * self.depth

    @property
    def acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def mean_accepted(self) -> float:
        """Drafted tokens accepted per verification step (each step also yields one more)."""
        return sum(self.accepted) / self.steps if self.steps else 0.0


def spec_step(engine) -> None:
    rs = engine.running
    if runs.speculative(engine, rs):  # several steps in one native call
        return
    depth = engine.mtp.depth
    starts = [r.length for r in rs]
    hidden = engine.forward(0, [[r.tokens[-1]] + r.drafts for r in rs], starts, rs)
    logits = engine.head(hidden).float().cpu()  # sampling and acceptance run on the CPU
    n_valid = []
    for b, r in enumerate(rs):
        new, a = verify(r, logits[b], depth, engine.sampler)
        stats = engine.spec_stats
        stats.steps += 1
        for j in range(min(a + 1, depth)):
            stats.proposed[j] += 1
        for j in range(a):
            stats.accepted[j] += 1
        r.length += a + 1
        n_valid.append(a + 1)
        engine.emit(r, new, fed=a + 1)
    if any(r.finish_reason is None for r in rs):
        draft(engine, 0, rs, hidden, starts, n_valid)


def verify(r, logits: torch.Tensor, depth: int, sampler=None) -> tuple[list[tuple[int, float]], int]:
    """Accept a prefix of r.drafts against the main logits [D+1, V]; return the new tokens with
    their logprobs and the number of drafts accepted. With a NativeSampler, untruncated rows whose
    drafts are lookup's (a point mass) or greedy take it, by the same rule."""
    p_, new = r.params, []
    if sampler is not None and untruncated(p_) and (p_.greedy or all(q is None for q in r.draft_probs[:depth])):
        return _verify_native(r, logits, depth, sampler)
    if p_.greedy:  # the longest prefix of drafts equal to the argmax, then the argmax after it
        best = argmax(logits)
        a = next((j for j in range(depth) if best[j] != r.drafts[j]), depth)
        toks = r.drafts[:a] + [best[a]]
        # Row by row, as plain decoding scores its one row: one op over all rows ran ~3x slower
        # in the engine, its two torch threads contending with native.c's helper thread.
        return [(t, float(policy_logprobs(logits[j], 0)[t])) for j, t in enumerate(toks)], a
    lp = policy_logprobs(logits, p_.temperature)
    for j in range(depth):
        d = r.drafts[j]
        p, q = sampling_probs(logits[j], p_), r.draft_probs[j]  # q None: a point mass at d (lookup.py)
        if not float(torch.rand((), generator=r.gen)) * (1.0 if q is None else float(q[d])) < float(p[d]):
            resid = p.index_fill(0, torch.tensor([d]), 0.0) if q is None else (p - q).clamp(min=0)
            y = draw(resid, r.gen) if resid.sum() > 0 else sample_row(logits[j], p_, r.gen)
            return new + [(y, float(lp[j, y]))], j
        new.append((d, float(lp[j, d])))
    y = sample_row(logits[depth], p_, r.gen)
    return new + [(y, float(lp[depth, y]))], depth


def _verify_native(r, logits: torch.Tensor, depth: int, sampler) -> tuple[list[tuple[int, float]], int]:
    """`verify` with one native call a row: greedy, the drafts up to the first that is not the
    argmax, then the argmax; sampled, each draft d accepted with probability p(d), else a token
    drawn from p without d, and after the last accepted draft one drawn from p."""
    t, new = r.params.temperature, []
    if r.params.greedy:
        for j in range(depth + 1):
            new.append(sampler.sample(logits[j], 0.0))
            if j == depth or new[-1][0] != r.drafts[j]:
                return new, j
    for j in range(depth):
        d = r.drafts[j]
        lp = sampler.logprob(logits[j], t, d)
        if uniform(r.gen) < math.exp(lp):
            new.append((d, lp))
            continue
        y = sampler.sample(logits[j], t, uniform(r.gen), skip=d)
        if y[0] < 0:  # d held all of p's mass
            y = sampler.sample(logits[j], t, uniform(r.gen))
        return new + [y], j
    return new + [sampler.sample(logits[depth], t, uniform(r.gen))], depth


def draft(engine, start: int, reqs, hidden: torch.Tensor, start_positions: list[int], n_valid: list[int]) -> None:
    """Run the MTP layers over the main trunk's `hidden` [B, T, D] (row b at positions
    start_positions[b] + 0..T-1, its first n_valid[b] valid) and set each request's drafts."""
    mtp = engine.mtp
    # Layer k >= 2 wrote its entries at the last depth-1 positions from draft tokens; re-run those
    # positions (from the kept main hidden rows) now that their tokens are known.
    back = min([mtp.depth - 1] + start_positions)
    if back and all(r.mtp_tail is not None and r.mtp_tail.shape[0] >= back for r in reqs):
        hidden = torch.cat((torch.stack([r.mtp_tail[-back:] for r in reqs]), hidden), dim=1)
        start_positions = [s - back for s in start_positions]
        n_valid = [n + back for n in n_valid]
    t = hidden.shape[1]
    seqs = [r.prompt_ids + r.tokens for r in reqs]
    for r in reqs:
        r.drafts, r.draft_probs = [], []
    last = [n - 1 for n in n_valid]
    # native.c takes a run of up to NATIVE_PREFILL positions (a short prompt, a step) in one call a
    # layer; torch a longer one, as it takes the trunk's longer prefills.
    if engine.native is None or t > NATIVE_PREFILL:
        _torch_layers(engine, start, reqs, hidden, start_positions, seqs, last)
    else:
        _native_layers(engine, start, reqs, hidden, start_positions, seqs, last)
    for i, r in enumerate(reqs):
        r.mtp_tail = hidden[i, max(0, n_valid[i] - (mtp.depth - 1)):n_valid[i]] if mtp.depth > 1 else None
        if start_positions[i] <= r.drafted:  # this call rewrote every position from the last exact one
            r.drafted = len(seqs[i]) - mtp.depth  # where layer k read token p + k, known (not a draft)


def _native_layers(engine, start: int, reqs, h: torch.Tensor, starts: list[int], seqs, last: list[int] | None):
    """native.c's MTP layers over h [B, T <= NATIVE_PREFILL, D] at positions starts[b] + 0..T-1, every
    sequence in one call a layer; with `last` (each row's position in h to draft from), the drafts."""
    b, t, _ = h.shape
    # The last layer's outputs feed only the drafting positions' heads: elsewhere it only writes the cache.
    need = [[i == x for i in range(t)] for x in (last or [-1] * b)]
    depth = engine.mtp.depth
    for k, layer in enumerate(engine.mtp.layers, start=1):
        ids = [[_token_at(seq, r.drafts, s + i + k) for i in range(t)] for seq, r, s in zip(seqs, reqs, starts)]
        h = engine.native.mtp_layer(k - 1, h, ids, starts, engine.mtp_cache, start, need if k == depth else None)
        if last is not None:
            at = h[0, last[0]][None] if b == 1 else h[torch.arange(b), torch.tensor(last)]
            _propose(engine, reqs, engine.native.head(at, norm=layer.norm.weight, drafts=engine.draft_ids is not None))


def _torch_layers(engine, start: int, reqs, h: torch.Tensor, starts: list[int], seqs, last: list[int]):
    """The MTP layers through torch (no native step, or a run native.c does not take)."""
    mtp, model, dev = engine.mtp, engine.model, engine.device
    b, t, _ = h.shape
    pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(t, device=dev)
    engine.mtp_cache.begin(start, pos)
    rope = rope_tables(model.model.inv_freq(dev), pos, h.dtype)
    for k, layer in enumerate(mtp.layers, start=1):
        ids = torch.tensor([[_token_at(seq, r.drafts, s + i + k) for i in range(t)]
                            for seq, r, s in zip(seqs, reqs, starts)], device=dev)
        h = layer(h, mtp.embed(model, ids), rope, cache=engine.mtp_cache)
        at = h[torch.arange(b, device=dev), torch.tensor(last, device=dev)]
        _propose(engine, reqs, mtp.logits(model, k - 1, at, rows=engine.draft_ids).float().cpu())


def _propose(engine, reqs, logits: torch.Tensor) -> None:
    """Append each request's next draft from its row of the drafter's logits [B, V or draft vocab]."""
    rows = engine.draft_ids  # the drafter's vocabulary: logits column j is token rows[j] (None: j)
    best = argmax(logits) if rows is None else engine.draft_tokens(argmax(logits))
    for i, r in enumerate(reqs):
        if r.params.greedy:
            r.drafts.append(best[i])
            r.draft_probs.append(None)
        else:  # verification needs q over the whole vocabulary: 0 outside the drafter's
            q = sampling_probs(logits[i], r.params)
            if rows is not None:
                q = torch.zeros(engine.model.config.vocab_size).index_copy_(0, rows, q)
            r.drafts.append(draw(q, r.gen))
            r.draft_probs.append(q)


def _token_at(seq: list[int], drafts: list[int], i: int) -> int:
    """Token i of a sequence extended by its drafts so far; 0 for rows past what is known (their
    outputs are never used)."""
    if i < len(seq):
        return seq[i]
    i -= len(seq)
    return drafts[i] if i < len(drafts) else 0

