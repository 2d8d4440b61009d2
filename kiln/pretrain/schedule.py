"""Learning rate at a step of one phase: linear warmup, then cosine or WSD (warmup-stable-decay).

Pure functions of the step, so a resumed run recomputes exactly the rates it would have used.
Both shapes reach `min_ratio x peak` at the phase's last step (step = total - 1).
"""
from __future__ import annotations

import math


def lr_at(step: int, total: int, peak: float, warmup: int = 0, min_ratio: float = 0.1,
          kind: str = "cosine", decay_frac: float = 0.2) -> float:
    """The rate for 0-based `step` of a phase of `total` steps.

    warmup: the first `warmup` steps rise linearly to `peak` (step 0 gets peak / warmup, never 0,
    so no step is wasted). cosine: from the end of warmup a half cosine down to min_ratio x peak.
    wsd: `peak` until the last round(decay_frac x total) steps, which fall linearly to min_ratio x
    peak (the stable stretch is what lets a run be extended without restarting the decay).
    """
    if kind not in ("cosine", "wsd"):
        raise ValueError(f"schedule must be 'cosine' or 'wsd' (got {kind!r})")
    if not 0 <= step < total:
        raise ValueError(f"step {step} is outside the phase's {total} steps")
    if step < warmup:
        return peak * (step + 1) / warmup
    low = peak * min_ratio
    if kind == "cosine":
        span = total - 1 - warmup
        progress = (step - warmup) / span if span > 0 else 1.0
        return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * progress))
    n_decay = round(decay_frac * total)
    first = total - n_decay
    if n_decay == 0 or step < first:
        return peak
    return peak + (low - peak) * (step - first + 1) / n_decay
