"""The held-out "internal codebase" loss, as the report measures it, and its fit against log tokens.

The held-out project's files, concatenated in alphabetical order (the corpus's heldout.txt), are
tokenised and scored with a rolling window: every token is scored exactly once, with up to
`window` tokens of context, `stride` new tokens per window. The NLL is summed (nats), and also
given per token and in bits per UTF-8 byte, which does not depend on the tokenizer.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F


def heldout_eval(model, tokenizer_or_ids, text: str, window: int, stride: int,
                 endoftext_id: int = 0, batch_tokens: int = 8192) -> dict:
    """Score `text` (or its ids, when a list/tensor of ids is passed instead of a tokenizer).

    The text is one document: an <|endoftext|> in front gives its first token a context, as
    documents in training follow one, so every token of the text is scored and bits per byte
    covers all of it. Windows are batched (about `batch_tokens` tokens a forward) under
    inference mode; the model's train/eval mode is restored afterwards.
    """
    if not 1 <= stride <= window:
        raise ValueError(f"need 1 <= stride <= window (got stride {stride}, window {window})")
    if hasattr(tokenizer_or_ids, "encode"):
        ids = tokenizer_or_ids.encode(text)
    else:
        ids = [int(i) for i in tokenizer_or_ids]
    n_bytes = len(text.encode("utf-8"))
    if not ids or not n_bytes:
        raise ValueError("the held-out text is empty: nothing to score")
    device = next(model.parameters()).device
    seq = torch.tensor([endoftext_id, *ids], device=device)
    n = len(ids)  # input position p (0..n-1) predicts seq[p + 1]
    # (lo, first, end): inputs seq[lo:end], scoring the predictions made at positions first..end-1.
    spans = [(max(0, min(first + stride, n) - window), first, min(first + stride, n)) for first in range(0, n, stride)]
    per_batch = max(1, batch_tokens // window)
    nll = 0.0
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for b in range(0, len(spans), per_batch):
                nll += _score(model, seq, spans[b:b + per_batch])
    finally:
        model.train(was_training)
    return {"nll_sum": nll, "tokens": n, "bytes": n_bytes, "nll_per_token": nll / n,
            "bits_per_byte": nll / math.log(2) / n_bytes}


def _score(model, seq: torch.Tensor, spans: list[tuple[int, int, int]]) -> float:
    """Summed NLL of the scored positions of a batch of windows (right-padded: causal attention
    never lets a real position see the padding after it)."""
    width = max(end - lo for lo, _, end in spans)
    x = torch.zeros(len(spans), width, dtype=torch.long, device=seq.device)
    y = torch.zeros_like(x)
    scored = torch.zeros_like(x, dtype=torch.bool)
    for r, (lo, first, end) in enumerate(spans):
        x[r, :end - lo] = seq[lo:end]
        y[r, :end - lo] = seq[lo + 1:end + 1]
        scored[r, first - lo:end - lo] = True
    hidden = model.trunk(x).hidden[scored]  # only scored positions go through the (large) head
    logits = model.head(hidden).float()
    return float(F.cross_entropy(logits, y[scored], reduction="sum"))


def fit_log_linear(tokens_seen: Sequence[float], losses: Sequence[float]) -> tuple[float, float, float]:
    """Least squares of loss = slope x ln(tokens) + intercept: (slope, intercept, R²)."""
    if len(tokens_seen) != len(losses):
        raise ValueError(f"{len(tokens_seen)} token counts but {len(losses)} losses")
    pts = [(math.log(t), float(v)) for t, v in zip(tokens_seen, losses) if t > 0]
    if len({x for x, _ in pts}) < 2:
        raise ValueError("a fit needs losses at two or more distinct token counts (> 0)")
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in pts)
    ss_tot = sum((y - my) ** 2 for _, y in pts)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return slope, intercept, r2


def log_spaced_steps(first: int, last: int, n: int) -> list[int]:
    """About n distinct steps from `first` to `last` inclusive, evenly spaced in log(step)."""
    if n <= 0 or last < 1:
        return []
    first = min(max(1, first), last)
    if n == 1 or first == last:
        return [last]
    ratio = (last / first) ** (1 / (n - 1))
    return sorted({round(first * ratio ** i) for i in range(n)} | {last})


def plot_heldout(evals: list[dict], fit: tuple[float, float, float] | None, path: str | Path) -> Path:
    """heldout_loss.png: loss (nats/token) and bits/byte against tokens seen, log x, with the fit."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    tokens = [r["tokens_seen"] for r in evals]
    fig, (ax_loss, ax_bpb) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(tokens, [r["nll_per_token"] for r in evals], "o", label="held-out loss")
    if fit is not None:
        slope, intercept, r2 = fit
        xs = [min(tokens), max(tokens)]
        ax_loss.plot(xs, [slope * math.log(x) + intercept for x in xs], "--",
                     label=f"fit: {slope:.3f} ln(tokens) + {intercept:.2f}, R² {r2:.3f}")
    ax_bpb.plot(tokens, [r["bits_per_byte"] for r in evals], "o-", color="tab:orange")
    for ax, label in ((ax_loss, "loss (nats / token)"), (ax_bpb, "bits / byte")):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # labels on every minor tick overlap
        ax.set_xlabel("training tokens seen")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_loss.legend(fontsize=8)
    fig.suptitle("held-out codebase")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
