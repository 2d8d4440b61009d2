"""The trainer's chunked target logprobs against log_softmax over the full logits: values and gradients."""
from __future__ import annotations

import pytest
import torch

from kiln.model.checkpoint import load_checkpoint
from kiln.rl import logp as logp_mod
from kiln.rl.logp import target_logprobs
from tests.threads import one_thread  # noqa: F401


def _plain(model, hidden, targets, temperature):
    logits = model.head(hidden).float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def _run(fn, model, hidden, targets, temperature, weights):
    """fn's logprobs and the gradients of sum(logp * weights) on hidden and the head weight."""
    model.zero_grad()
    h = hidden.clone().requires_grad_(True)
    lp = fn(model, h, targets, temperature)
    (lp * weights).sum().backward()
    head = model.lm_head.weight.grad
    return lp.detach(), h.grad, None if head is None else head.clone()


@pytest.mark.parametrize("frozen_head", [False, True])
def test_chunked_logprobs_and_gradients_equal_the_full_log_softmax(tiny_checkpoint, monkeypatch, frozen_head):
    model, _ = load_checkpoint(tiny_checkpoint, with_mtp=False)
    vocab = model.lm_head.weight.shape[0]
    monkeypatch.setattr(logp_mod, "CHUNK_BYTES", 4 * vocab * 7)  # chunks of 7 rows: 50 rows end on a ragged one
    if frozen_head:
        model.lm_head.weight.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, model.config.hidden_size, generator=g) * 3
    targets = torch.randint(0, vocab, (50,), generator=g)
    weights = torch.randn(50, generator=g)  # an upstream gradient that differs row by row
    for temperature in (0.7, 1.0):
        want = _run(_plain, model, hidden, targets, temperature, weights)
        got = _run(target_logprobs, model, hidden, targets, temperature, weights)
        assert (got[0] - want[0]).abs().max() < 1e-5 and want[0].max() < 0
        assert torch.allclose(got[1], want[1], rtol=1e-4, atol=1e-6)
        if frozen_head:
            assert got[2] is None and want[2] is None
        else:
            assert torch.allclose(got[2], want[2], rtol=1e-4, atol=1e-6) and got[2].abs().max() > 0
