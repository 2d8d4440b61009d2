"""kiln/model/gemm.py: fp32 products go to oneDNN only where they stay fp32, and come out as MKL's do."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kiln.model import gemm


@pytest.fixture
def restore():
    before = gemm.current()
    yield
    gemm.route(before)


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


def test_onednn_products_keep_fp32_and_agree_with_mkl(restore):
    if gemm.route("onednn") != "onednn":
        pytest.skip("oneDNN would not keep fp32 products on this CPU (or torch lacks it): kiln uses MKL")
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"  # what routes fp32 to oneDNN
    assert gemm.probe_error() <= gemm.FP32_ERROR
    onednn = _products()
    assert gemm.route("mkl") == "mkl" == gemm.current()
    for a, b in zip(onednn, _products()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max())), float((a - b).abs().max())


def test_route_falls_back_to_mkl_when_the_probe_is_not_fp32(restore, monkeypatch):
    monkeypatch.setattr(gemm, "FP32_ERROR", 0.0)  # no product is that exact: as if oneDNN rounded to bf16
    assert gemm.route("onednn") == "mkl" == gemm.current()
    assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"


def test_route_rejects_an_unknown_backend(restore):
    with pytest.raises(ValueError, match="KILN_FP32_GEMM must be one of"):
        gemm.route("openblas")


@pytest.mark.parametrize("env", ["mkl", ""])
def test_the_environment_chooses_for_every_kiln_process(env, restore):
    """A process that imports kiln's model layers is routed at import; KILN_FP32_GEMM=mkl opts out."""
    code = "import kiln.model.layers; from kiln.model import gemm; print(gemm.current())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KILN_FP32_GEMM": env},
                         capture_output=True, text=True, check=True).stdout.split()[-1]
    assert out == (env or gemm.route("onednn"))
