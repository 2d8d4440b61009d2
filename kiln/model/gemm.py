"""Which library computes torch's fp32 matrix products on the CPU in kiln's large forwards (training
steps, long prefills): oneDNN where it keeps fp32, else MKL (torch's default).

Why: torch hands fp32 GEMMs (linear layers, their backward, and the blocks of its CPU flash
attention) to MKL, whose sgemm takes an AVX2 path on AMD CPUs. On a Zen 5 EPYC core MKL ran the
RL trainer's products at 93-107 GFLOP/s and oneDNN the same products at 140-213, which made a
trainer step 1.45x faster (docs/architecture.md, RL, Trainer). torch sends fp32 products to oneDNN
only under `torch.backends.mkldnn.matmul.fp32_precision = "bf16"`, a setting that *permits*
oneDNN to round the inputs to bf16 where it has such a kernel (AMX CPUs). kiln wants fp32, so it
uses oneDNN only after a probe product came out fp32-accurate in this process.

Only inside `routed()`, around the training steps and the engine's prefills too long for its native
step: oneDNN builds a kernel for each new product shape (~0.5 ms), which large products repay,
while decoding's many small ones of changing sizes (the attention over a growing cache) do not
(HF generate at batch 8 ran 5-20% slower under it). KILN_FP32_GEMM=mkl in the environment keeps
MKL everywhere.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

BACKENDS = ("onednn", "mkl")
FP32_ERROR = 1e-5  # the probe's largest error over its largest value: fp32 gives ~1e-6, bf16 inputs ~1e-2


def backend() -> str:
    """Where routed() sends fp32 products: $KILN_FP32_GEMM if set, else oneDNN where it keeps fp32."""
    chosen = os.environ.get("KILN_FP32_GEMM") or "onednn"
    if chosen not in BACKENDS:
        raise ValueError(f"KILN_FP32_GEMM must be one of {BACKENDS}, not {chosen!r}")
    return "onednn" if chosen == "onednn" and onednn_keeps_fp32() else "mkl"


@contextlib.contextmanager
def routed(use: str | None = None):
    """Inside (or a function decorated with it): fp32 products go to `use` (default: `backend()`);
    torch's setting is restored after."""
    use = use or backend()
    mkldnn = torch.backends.mkldnn.matmul
    before = mkldnn.fp32_precision
    mkldnn.fp32_precision = "bf16" if use == "onednn" else "ieee"
    try:
        yield
    finally:
        mkldnn.fp32_precision = before


@functools.cache
def onednn_keeps_fp32() -> bool:
    """Whether torch has oneDNN and its products routed so come out fp32-accurate on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    with routed("onednn"):
        return probe_error() <= FP32_ERROR


def probe_error() -> float:
    """Largest error of a trainer-sized fp32 product against fp64, over its largest value."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 256, generator=g), torch.randn(256, 256, generator=g)
    ref = a.double() @ b.double()
    return float((a @ b - ref).abs().max() / ref.abs().max())
