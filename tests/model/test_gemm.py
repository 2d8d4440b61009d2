"""kiln/model/gemm.py: routed() sends fp32 products to oneDNN only where they stay fp32, they come out
as MKL's do, and torch's setting is back to its own outside it."""
import pytest
import torch
import torch.nn.functional as F

from kiln.model import gemm

needs_onednn = pytest.mark.skipif(not gemm.onednn_keeps_fp32(),
                                  reason="oneDNN would not keep fp32 products on this CPU (or torch lacks it)")


def _products():
    """A linear layer's forward and backward and a causal GQA attention's, at trainer-like sizes."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(700, 256, generator=g, requires_grad=True)
    w = torch.randn(512, 256, generator=g, requires_grad=True)
    q = torch.randn(1, 4, 600, 64, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 600, 64, generator=g, requires_grad=True) for _ in range(2))
    y = F.linear(x, w)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (y.square().mean() + o.square().mean()).backward()
    return [t.detach() for t in (y, o, x.grad, w.grad, q.grad, k.grad, v.grad)]


@needs_onednn
def test_onednn_products_keep_fp32_and_agree_with_mkl():
    with gemm.routed("onednn"):
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"  # what routes fp32 to oneDNN
        assert gemm.probe_error() <= gemm.FP32_ERROR
        onednn = _products()
    assert torch.backends.mkldnn.matmul.fp32_precision != "bf16"  # restored
    with gemm.routed("mkl"):
        mkl = _products()
    for a, b in zip(onednn, mkl):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max())), float((a - b).abs().max())


def test_the_probe_tells_bf16_rounding_from_fp32():
    """What onednn_keeps_fp32 relies on: a product of bf16-rounded inputs fails the probe's bound."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 256, generator=g), torch.randn(256, 256, generator=g)
    ref = a.double() @ b.double()
    rounded = a.bfloat16().float() @ b.bfloat16().float()
    assert float((rounded - ref).abs().max() / ref.abs().max()) > 100 * gemm.FP32_ERROR
    assert gemm.probe_error() <= gemm.FP32_ERROR  # outside routed(): torch's own products


def test_the_environment_chooses(monkeypatch):
    monkeypatch.setenv("KILN_FP32_GEMM", "mkl")
    assert gemm.backend() == "mkl"
    monkeypatch.setenv("KILN_FP32_GEMM", "onednn")
    assert gemm.backend() == ("onednn" if gemm.onednn_keeps_fp32() else "mkl")
    monkeypatch.setenv("KILN_FP32_GEMM", "openblas")
    with pytest.raises(ValueError, match="KILN_FP32_GEMM must be one of"):
        gemm.backend()
