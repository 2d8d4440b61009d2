"""native.c's sampler (NativeSampler) against sampling.py's torch rule: the same greedy token and
logprobs, and draws that invert the CDF of softmax(logits / T), with or without a rejected draft."""
from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from kiln.engine.native import NativeSampler, library

HAVE_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
pytestmark = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the engine samples through torch")


@pytest.fixture(scope="module")
def sampler():
    return NativeSampler(library())


@pytest.mark.parametrize("v", [8192, 37, 5])  # whole 16-float blocks, a tail, a tail alone
@pytest.mark.parametrize("t", [0.0, 0.7, 1.0])
def test_tokens_and_logprobs_match_torch(sampler, v, t):
    g = torch.Generator().manual_seed(v)
    for _ in range(20):
        row = torch.randn(v, generator=g) * 4
        lp_torch = torch.log_softmax(row / (t or 1.0), -1)
        tok, lp = sampler.sample(row, t, float(torch.rand((), generator=g)))
        if t == 0:
            assert tok == int(row.argmax())
        assert 0 <= tok < v and math.isclose(lp, float(lp_torch[tok]), abs_tol=2e-5)
        other = int(torch.randint(0, v, (), generator=g))
        assert math.isclose(sampler.logprob(row, t, other), float(lp_torch[other]), abs_tol=2e-5)


def test_greedy_takes_the_first_of_equal_maxima_and_a_nan_above_all(sampler):
    row = torch.zeros(40)
    row[[7, 30]] = 3.0
    assert sampler.sample(row, 0.0)[0] == 7 == int(row.argmax())
    row[33] = float("nan")
    assert sampler.sample(row, 0.0)[0] == 33 == int(row.argmax())
    tok, lp = sampler.sample(torch.full((20,), float("-inf")), 0.7, 0.5)  # nothing to draw from: no crash
    assert 0 <= tok < 20 and math.isnan(lp)


@pytest.mark.parametrize("skip", [-1, 3, 17])
def test_draws_invert_the_cdf(sampler, skip):
    """Uniforms on an even grid of n points land on each token n * p(token) times, to within one:
    the draw is the CDF's inverse, exactly as sampling.draw makes it (a rejected draft's mass left out)."""
    row = torch.tensor([0.0, 2.0, -1.0, 1.5, float("-inf"), 0.5, 3.0, -0.5] * 3)  # 24: a block and a tail
    t, n = 0.8, 4000
    p = torch.softmax(row.double() / t, -1)
    if skip >= 0:
        p[skip] = 0
        p /= p.sum()
    counts = torch.zeros(len(row))
    for i in range(n):
        tok, lp = sampler.sample(row, t, (i + 0.5) / n, skip)
        counts[tok] += 1
        assert math.isclose(lp, float(torch.log_softmax(row / t, -1)[tok]), abs_tol=2e-5)
    assert ((counts - n * p).abs() <= 1.0 + 1e-6).all(), (counts, n * p)
    assert counts[4] == 0 and (skip < 0 or counts[skip] == 0)


def test_a_draft_that_held_all_the_mass_leaves_nothing_to_draw(sampler):
    row = torch.full((20,), float("-inf"))
    row[9] = 1.0
    assert sampler.sample(row, 0.7, 0.3, skip=9)[0] == -1
    assert sampler.sample(row, 0.7, 0.3)[0] == 9


def test_rows_must_be_contiguous_fp32(sampler):
    with pytest.raises(ValueError, match="one contiguous fp32 CPU row"):
        sampler.sample(torch.randn(8, 4)[:, 0], 0.0)
    with pytest.raises(ValueError, match="one contiguous fp32 CPU row"):
        sampler.sample(torch.randn(16, dtype=torch.float64), 0.0)
