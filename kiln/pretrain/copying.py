"""Copying from context: the probe that measures it and the practice rows that teach it.

Every useful tool call an agent makes copies something from its context (a symbol from the task,
a path from a listing, a line from a file), so a base that cannot copy cannot act.

- `copy_probe`: rows of [<|endoftext|>][span][the same span]; the mean loss (nats) on the second
  copy against the first. Spans are random full-vocabulary tokens (pure induction: nothing but the
  context predicts them; chance is ln(vocab - specials)) and real code from the held-out codebase
  (never trained on). The first token of each copy is not scored: nothing says a copy starts there.
- `copy_rows`: pretraining rows packed with [span][same span]<|endoftext|> documents, half random
  tokens and half corpus windows, loss on the second copy only (the first is unpredictable noise
  for random spans). Mixed into a phase's batches at `copy_frac` (Bi-Induct-style copy practice).
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

SPAN = 32  # the probe's span length, in tokens
PRACTICE_SPANS = (8, 64)  # practice span lengths, drawn uniformly


def _generator(*key) -> torch.Generator:
    seed = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 1
    return torch.Generator().manual_seed(seed)


def random_spans(n: int, span: int, vocab: int, first_id: int, g: torch.Generator) -> torch.Tensor:
    """[n, span] tokens drawn uniformly from ids first_id..vocab-1 (no special tokens)."""
    return torch.randint(first_id, vocab, (n, span), generator=g)


def code_spans(ids: list[int], n: int, span: int, g: torch.Generator) -> torch.Tensor:
    """[n, span] windows of a tokenised text at random offsets."""
    if len(ids) < span:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one span of {span}")
    t = torch.tensor(ids)
    starts = torch.randint(0, len(ids) - span + 1, (n,), generator=g)
    return torch.stack([t[s:s + span] for s in starts.tolist()])


@torch.inference_mode()
def copy_loss(model, spans: torch.Tensor, endoftext_id: int = 0) -> dict:
    """Mean NLL (nats) of each copy of `spans` [n, L] laid out as [eot][span][span]: positions
    2..L of each copy (the first token of a copy has no cue). Batched; train/eval mode restored."""
    n, length = spans.shape
    device = next(model.parameters()).device
    x = torch.cat([torch.full((n, 1), endoftext_id), spans, spans], dim=1).to(device)
    was_training = model.training
    model.eval()
    try:
        logits = model.head(model.trunk(x[:, :-1]).hidden).float()
    finally:
        model.train(was_training)
    nll = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")  # [n, 2L]: nll[:, p] predicts x[p+1]
    first, second = nll[:, 1:length], nll[:, length + 1:]
    return {"first": float(first.mean()), "second": float(second.mean()),
            "second_top1": float((logits[:, length + 1:].argmax(-1) == x[:, length + 2:]).float().mean())}


def copy_probe(model, heldout_ids: list[int] | None, vocab: int, n: int = 64, span: int = SPAN,
               first_id: int = 9, endoftext_id: int = 0, seed: int = 0) -> dict:
    """{"random": {...}, "code": {...} (when held-out ids are given), "chance": nats}: see copy_loss.
    The same seed gives the same spans, so probes of different checkpoints compare like for like."""
    out = {"span": span, "n": n, "chance": float(torch.log(torch.tensor(float(vocab - first_id)))),
           "random": copy_loss(model, random_spans(n, span, vocab, first_id, _generator("probe", seed)), endoftext_id)}
    if heldout_ids:
        out["code"] = copy_loss(model, code_spans(heldout_ids, n, span, _generator("probe-code", seed)), endoftext_id)
    return out


def copy_rows(corpus, step: int, n: int, seq_len: int, seed: int, vocab: int, first_id: int = 9,
              endoftext_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), each [n, seq_len + 1]: rows packed with [span][span]<|endoftext|> documents
    (random tokens or windows of `corpus`, a TokenShards, alternately); mask is 1 on the second
    copy's tokens after its first. A pure function of (seed, step), like the corpus batches."""
    g = _generator("copy-rows", seed, step)
    lo, hi = PRACTICE_SPANS
    ids = torch.full((n, seq_len + 1), endoftext_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r in range(n):
        at, k = 0, 0
        while True:
            length = int(torch.randint(lo, hi + 1, (1,), generator=g))
            if at + 2 * length + 1 > seq_len + 1:
                break
            if (r + k) % 2 == 0:
                span = random_spans(1, length, vocab, first_id, g)[0]
            else:
                start = int(torch.randint(0, len(corpus) - length, (1,), generator=g))
                span = torch.from_numpy(corpus.window(start, length).astype("int64"))
                span = torch.where(span == endoftext_id, torch.full_like(span, first_id), span)
            ids[r, at:at + length] = ids[r, at + length:at + 2 * length] = span
            mask[r, at + length + 1:at + 2 * length] = 1
            at, k = at + 2 * length + 1, k + 1  # the <|endoftext|> after each document is already there
    return ids, mask


def heldout_text() -> str:
    """The default held-out codebase (kiln's own source tree), as `kiln corpus build` writes it."""
    from kiln.config import CorpusConfig
    from kiln.pretrain.corpus import heldout_project, heldout_texts

    return "\n".join(t for _, t in heldout_texts(heldout_project(CorpusConfig())))


def probe_checkpoint(path, heldout: str | None = None, n: int = 64, span: int = SPAN, seed: int = 0) -> dict:
    """copy_probe of a checkpoint folder with its own tokenizer; code spans from `heldout` (default:
    kiln's own source tree, the default held-out codebase)."""
    from kiln.model.checkpoint import load_checkpoint
    from kiln.model.tokenizer import load_tokenizer

    model, _ = load_checkpoint(path, with_mtp=False)
    tok = load_tokenizer(path)
    ids = tok.encode(heldout if heldout is not None else heldout_text())
    return copy_probe(model, ids, tok.vocab_size, n=n, span=span, endoftext_id=tok.endoftext_id, seed=seed)
