"""Group advantages and the policy-gradient loss (Dr. GRPO by default), as pure functions.

advantage = reward - group mean (divided by the group's std only when asked); every generated
token of a trajectory, in every self-summary segment, carries the trajectory's advantage. Token
terms -A * ratio are aggregated by name:
  "constant"   sum over all tokens / a fixed constant (Dr. GRPO: no length normalisation)
  "token_mean" sum / number of tokens in the batch
  "seq_mean"   mean over sequences of each sequence's token mean (GRPO as first published)
ratio = exp(logp - logp.detach()) (value 1, gradient of logp) unless sampler logprobs are given
for truncated importance sampling, which multiplies by min(exp(logp_trainer - logp_sampler), cap),
detached.
"""
from __future__ import annotations

import torch

AGGREGATIONS = ("constant", "token_mean", "seq_mean")


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, scale_std: bool = False,
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards [N], groups [N] (ids): reward minus its group's mean (over its group's std if scale_std)."""
    out = torch.empty_like(rewards, dtype=torch.float32)
    for g in torch.unique(groups):
        at = groups == g
        r = rewards[at].float()
        a = r - r.mean()
        if scale_std:
            a = a / (r.std(unbiased=False) + eps)
        out[at] = a
    return out


def uniform_groups(correctness: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """[N] bool: the rollout's group solved all or none of its rollouts alike (no correctness contrast)."""
    out = torch.zeros(len(groups), dtype=torch.bool)
    for g in torch.unique(groups):
        at = groups == g
        out[at] = bool((correctness[at] == correctness[at][0]).all())
    return out


def policy_loss(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, aggregation: str = "constant",
                constant: float = 1.0, sampler_logp: torch.Tensor | None = None,
                tis_cap: float | None = None) -> torch.Tensor:
    """logp, mask [B, T] (the trainer's logprobs of the sampled tokens; mask 1 on generated tokens),
    advantages [B] (one per row) or [B, T] (per token). Returns the scalar loss whose gradient is the
    policy gradient."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {aggregation!r}")
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - logp.detach())
    if sampler_logp is not None:
        w = torch.exp(logp.detach() - sampler_logp)
        ratio = ratio * (w if tis_cap is None else w.clamp(max=tis_cap))
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    terms = -adv.to(logp.dtype) * ratio * mask
    if aggregation == "constant":
        return terms.sum() / constant
    if aggregation == "token_mean":
        return terms.sum() / mask.sum().clamp(min=1)
    return (terms.sum(1) / mask.sum(1).clamp(min=1)).mean()
