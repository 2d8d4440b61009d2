"""Prompt-lookup speculative decoding: drafts copied from the sequence itself (vLLM's "ngram"
drafter, the idea behind speculative edits). An agent's turns copy a lot (file text into an edit's
old_str, names, paths, the tool-call JSON's shape), so the tokens that followed the latest earlier
occurrence of a sequence's last N tokens are often the next ones. Nothing is trained or run to
draft; the main model verifies the drafts in one forward, as with the MTP drafter.

Each row proposes up to `depth` drafts, fewer after a shorter match (`propose`; none when its last
N tokens never occurred before), and is fed its last token plus its own drafts, in one ragged
native call for all rows (through torch, rows are padded to the longest). Verification is
`speculative.verify` with q a point mass at each draft: greedy output equals plain greedy
decoding, samples are distributed exactly as plain sampling.
"""
from __future__ import annotations

import torch

from kiln.engine import runs
from kiln.engine.speculative import verify

# The n-gram a draft is looked up by. On the rollouts of benchmarks/rl_async.py (docs/architecture.md,
# "Where an RL rollout core's time goes") 2 gave the most tokens a step at every depth, 3 and 4 fewer.
N = 2


def propose(r, depth: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of r's last N tokens (its prompt and
    tokens so far, indexed incrementally on the request): 2^m of them and at most `depth`, m the
    tokens before the two occurrences that match as well. A longer match is a likelier copy: on RL
    rollouts 42% of drafts were accepted after a bare 2-gram match and 91% after 9 or more tokens
    (docs/architecture.md, "Draft length by match length")."""
    seq = r.prompt_ids + r.tokens
    # The n-gram ending before position i -> i, for every i but the end (the suffix itself); the
    # latest occurrence wins.
    for i in range(max(r.indexed, N), len(seq)):
        r.ngrams[tuple(seq[i - N:i])] = i
    r.indexed = len(seq)
    at = r.ngrams.get(tuple(seq[-N:]))
    if at is None:
        return []
    want, m, end = 1, 0, len(seq)
    while want < depth and at - N - 1 - m >= 0 and seq[at - N - 1 - m] == seq[end - N - 1 - m]:
        want, m = want * 2, m + 1
    return seq[at:at + min(want, depth)]


def lookup_step(engine) -> None:
    """One decoding step of every running sequence with prompt-lookup drafts (plain when no row has
    any): each row is fed its last token and its own drafts. Drafts stop short of the cache's end."""
    rs = engine.running
    if runs.lookup(engine, rs, N):  # several steps in one native call
        return
    drafts = [propose(r, min(engine.lookup, engine.max_len - r.length - 1)) for r in rs]
    if not any(drafts):  # one step, not a native run: a row may find a draft after its next token
        engine._decode_step(rs)
        return
    for r, d in zip(rs, drafts):
        r.drafts, r.draft_probs = d, [None] * len(d)  # a point mass at each draft (verify's rule for None)
    hidden = engine.forward_rows([[r.tokens[-1]] + r.drafts for r in rs], [r.length for r in rs], rs)
    logits = engine.head(torch.cat(hidden)).float().cpu().split([len(d) + 1 for d in drafts])
    stats = engine.spec_stats
    for r, d, lg in zip(rs, drafts, logits):
        new, a = verify(r, lg, len(d), engine.sampler)
        stats.steps += bool(d)
        for j in range(min(a + 1, len(d))):
            stats.proposed[j] += 1
        for j in range(a):
            stats.accepted[j] += 1
        r.length += a + 1
        engine.emit(r, new, fed=a + 1)
