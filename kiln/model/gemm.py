"""Which library computes torch's fp32 matrix products on the CPU: oneDNN where it keeps fp32, else MKL.

Why: torch hands fp32 GEMMs (linear layers, their backward, and the blocks of its CPU flash
attention) to MKL, whose sgemm takes an AVX2 path on AMD CPUs. On a Zen 5 EPYC core MKL ran the
RL trainer's products at 93-107 GFLOP/s and oneDNN the same products at 165-244, which made a
trainer step 1.45x faster (docs/architecture.md, RL, Trainer). torch sends fp32 products to oneDNN
only under `torch.backends.mkldnn.matmul.fp32_precision = "bf16"`, a setting that *permits*
oneDNN to round the inputs to bf16 where it has such a kernel (AMX). kiln wants fp32, so `route`
turns it on and keeps it only if a probe product comes out fp32-accurate on this CPU.

KILN_FP32_GEMM=mkl in the environment keeps torch's default (MKL) in every kiln process.
"""
from __future__ import annotations

import os

import torch

BACKENDS = ("onednn", "mkl")
FP32_ERROR = 1e-5  # the probe's largest error over its largest value: fp32 gives ~1e-7, bf16 inputs ~1e-2


def route(backend: str | None = None) -> str:
    """Send fp32 products to `backend` (default: $KILN_FP32_GEMM, else "onednn"); returns the one in
    use, "mkl" when oneDNN would not compute in fp32 here (or torch was built without it)."""
    backend = backend or os.environ.get("KILN_FP32_GEMM") or "onednn"
    if backend not in BACKENDS:
        raise ValueError(f"KILN_FP32_GEMM must be one of {BACKENDS}, not {backend!r}")
    mkldnn = torch.backends.mkldnn
    if backend == "onednn" and mkldnn.is_available():
        mkldnn.matmul.fp32_precision = "bf16"
        if probe_error() <= FP32_ERROR:
            return "onednn"
    mkldnn.matmul.fp32_precision = "ieee"
    return "mkl"


def current() -> str:
    """The backend fp32 products go to now."""
    return "onednn" if torch.backends.mkldnn.matmul.fp32_precision == "bf16" else "mkl"


def probe_error() -> float:
    """Largest error of a trainer-sized fp32 product against fp64, over its largest value."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 256, generator=g), torch.randn(256, 256, generator=g)
    ref = a.double() @ b.double()
    return float((a @ b - ref).abs().max() / ref.abs().max())
