"""The trainer's target logprobs, log softmax(head(h) / temperature)[target], without ever holding a
[targets, vocab] tensor: the head runs over chunks of rows, forward for each row's logsumexp and
backward again for its gradient.

Why: an RL step scores ~3,000 targets over an 8,192-token vocabulary, and each full-width tensor of
that (the logits, their division by the temperature, the log softmax, the zero-filled gradient of
the gather, its backward) is 116 MB, a pass over fresh memory that costs more than its arithmetic.
Chunks of CHUNK_BYTES stay in cache and reuse the allocator's blocks; the price is one more product
with the head weight in backward (measured in docs/architecture.md, RL, Trainer).
"""
from __future__ import annotations

import torch

CHUNK_BYTES = 8 << 20  # one chunk's logits: in cache, and under glibc's mmap threshold, so reused


def target_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """[N] logprob of each targets[i] under softmax(model.head(hidden[i]) / temperature), hidden [N, D]."""
    if model.config.final_logit_softcapping is not None:  # a capped head (Gemma): the plain way
        logits = model.head(hidden).float() / temperature
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    x = model.model.norm(hidden)
    return _TargetLogp.apply(x, model.lm_head.weight, targets, float(temperature))


def _chunk(vocab: int) -> int:
    """Rows a chunk: CHUNK_BYTES of fp32 logits."""
    return max(1, CHUNK_BYTES // (4 * vocab))


class _TargetLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, temperature):
        step = _chunk(len(weight))
        out, lse = x.new_empty(len(x), dtype=torch.float32), x.new_empty(len(x), dtype=torch.float32)
        for a in range(0, len(x), step):
            z = (x[a:a + step] @ weight.T).float().div_(temperature)
            lse[a:a + step] = torch.logsumexp(z, -1)
            out[a:a + step] = z.gather(-1, targets[a:a + step, None])[:, 0] - lse[a:a + step]
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, targets, lse = ctx.saved_tensors
        step = _chunk(len(weight))
        gx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        g = grad.float() / ctx.temperature  # d logp / d logit is (onehot - softmax) / temperature
        for a in range(0, len(x), step):
            xs, gs, ts = x[a:a + step], g[a:a + step], targets[a:a + step]
            p = (xs @ weight.T).float().div_(ctx.temperature).sub_(lse[a:a + step, None]).exp_()
            p.mul_(-gs[:, None]).scatter_add_(1, ts[:, None], gs[:, None])
            p = p.to(x.dtype)
            if gx is not None:
                torch.mm(p, weight, out=gx[a:a + step])
            if gw is not None:
                gw.addmm_(p.T, xs)
        return gx, gw, None, None
