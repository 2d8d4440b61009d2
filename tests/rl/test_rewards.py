"""The length penalty C(x) and the k1 KL term, against their analytic properties."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from kiln.rl.rewards import LengthPenalty, concave_penalty, k1


@pytest.mark.parametrize("k,q", [(0.01, 0.5), (0.1, 2.0), (1.0, 0.9)])
def test_penalty_is_zero_at_zero_increasing_and_concave(k, q):
    xs = [0.0, 1.0, 10.0, 100.0, 1000.0, 10000.0]
    c = [concave_penalty(x, k, q) for x in xs]
    assert c[0] == 0.0
    assert all(b > a for a, b in itertools.pairwise(c))  # increasing
    grid = [i * 50.0 for i in range(200)]
    v = [concave_penalty(x, k, q) for x in grid]
    assert all(v[i - 1] + v[i + 1] - 2 * v[i] < 1e-12 for i in range(1, len(v) - 1))  # concave


def test_q_to_one_is_the_log_limit():
    for x in (0.5, 3.0, 400.0):
        want = math.log1p(0.02 * x) / 0.02
        assert concave_penalty(x, 0.02, 1.0) == pytest.approx(want, rel=1e-12)
        assert concave_penalty(x, 0.02, 1.0 + 1e-6) == pytest.approx(want, rel=1e-4)
        assert concave_penalty(x, 0.02, 1.0 - 1e-6) == pytest.approx(want, rel=1e-4)
    with pytest.raises(ValueError, match="k > 0"):
        concave_penalty(1.0, 0.0, 0.5)


def test_length_penalty_weighs_the_effort_counts():
    pen = LengthPenalty(lam=0.5, k=0.01, q=0.5, weights={"tool_output_tokens": 0.1, "turns": 20.0})
    effort = {"tool_output_tokens": 1000, "turns": 5, "thinking_tokens": 999}
    assert pen.x(effort) == pytest.approx(200.0)
    assert pen(effort) == pytest.approx(0.5 * ((1 + 2.0) ** 0.5 - 1) / (0.01 * 0.5))
    with pytest.raises(ValueError, match="unknown effort kinds"):
        LengthPenalty(1.0, 0.1, 0.5, {"tokens": 1.0})


def _tabular(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(7, generator=g, requires_grad=True)
    logp_ref = torch.log_softmax(torch.randn(7, generator=g), -1)
    return theta, logp_ref


def test_k1_in_the_reward_gives_the_gradient_of_the_reverse_kl():
    theta, logp_ref = _tabular()
    logp = torch.log_softmax(theta, -1)
    kl = (logp.exp() * (logp - logp_ref)).sum()  # KL(pi || pi_ref), analytic
    (want,) = torch.autograd.grad(kl, theta)
    # REINFORCE with reward -k1 over the exact sampling distribution: E_pi[grad log pi(a) * (-k1(a))]
    logp = torch.log_softmax(theta, -1)
    surrogate = (logp.exp().detach() * logp * -k1(logp, logp_ref)).sum()
    (got,) = torch.autograd.grad(surrogate, theta)
    torch.testing.assert_close(got, -want)  # ascending the reward descends the KL
    assert want.abs().max() > 1e-2  # a gradient worth checking


def test_k1_differentiated_as_a_loss_has_zero_expected_gradient():
    theta, logp_ref = _tabular(1)
    logp = torch.log_softmax(theta, -1)
    expected_loss = (logp.exp().detach() * (logp - logp_ref)).sum()  # E_pi[k1], k1 not detached
    (grad,) = torch.autograd.grad(expected_loss, theta)
    torch.testing.assert_close(grad, torch.zeros_like(grad), atol=1e-6, rtol=0)
    assert not k1(logp, logp_ref).requires_grad
