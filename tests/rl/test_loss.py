"""Group advantages and the policy loss against hand-computed values, per aggregation mode."""
from __future__ import annotations

import pytest
import torch

from kiln.rl.loss import group_advantages, policy_loss, uniform_groups


def test_group_advantages_subtract_the_group_mean_and_optionally_scale():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    torch.testing.assert_close(group_advantages(r, g), torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]))
    s = (2 / 9) ** 0.5  # population std of (1, 0, 0)
    torch.testing.assert_close(group_advantages(r, g, scale_std=True),
                               torch.tensor([2 / 3 / s, -1 / 3 / s, -1 / 3 / s, 0.0, 0.0, 0.0]), atol=1e-5, rtol=1e-5)


def test_uniform_groups_are_those_without_a_solve_fail_contrast():
    c = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2])
    assert uniform_groups(c, g).tolist() == [False, False, True, True, True, True]


# Two sequences: 3 and 1 generated tokens; advantages +1 and -2.
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])


@pytest.mark.parametrize("aggregation,value,grads", [
    # -sum(A_b * n_b) / 8 = -(3 - 2) / 8; d/dlogp = -A_b / 8 on generated tokens
    ("constant", -1 / 8, [[-1 / 8] * 3 + [0.0], [0.0, 2 / 8, 0.0, 0.0]]),
    # / 4 tokens in the batch
    ("token_mean", -1 / 4, [[-1 / 4] * 3 + [0.0], [0.0, 2 / 4, 0.0, 0.0]]),
    # mean over sequences of the per-sequence token mean: (-1 + 2) / 2
    ("seq_mean", 1 / 2, [[-1 / 6] * 3 + [0.0], [0.0, 1.0, 0.0, 0.0]]),
])
def test_policy_loss_by_aggregation(aggregation, value, grads):
    logp = torch.log(torch.full((2, 4), 0.3)).requires_grad_()
    loss = policy_loss(logp, ADV, MASK, aggregation=aggregation, constant=8.0)
    loss.backward()
    assert loss.item() == pytest.approx(value)
    torch.testing.assert_close(logp.grad, torch.tensor(grads))


def test_truncated_importance_sampling_weights_each_token():
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.4, 0.1], [0.3, 0.6, 0.3, 0.3]])).requires_grad_()
    sampler = torch.log(torch.tensor([[0.25, 0.2, 0.1, 0.1], [0.3, 0.3, 0.3, 0.3]]))
    loss = policy_loss(logp, ADV, MASK, sampler_logp=sampler, tis_cap=3.0)
    # weights min(p_train / p_sampler, 3): 2, 1, 3 (capped from 4); 2 on the second sequence's token
    assert loss.item() == pytest.approx(-(1 * (2 + 1 + 3)) + 2 * 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -1.0, -3.0, 0.0], [0.0, 4.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="aggregation must be one of"):
        policy_loss(logp, ADV, MASK, aggregation="sum")
