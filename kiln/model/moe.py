"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`, transformers 5 layout: experts stored as 3-D tensors):
the math and parameter names of Hugging Face's model, so its state dict is HF's and a parity test
can hold the logits equal. Attention, RoPE and norms are the shared ones (layers.py).

Grouped-query attention with RMSNorm on q and k per head, RoPE, pre-norm residual blocks, and a
token-choice MoE: softmax router, top-k, renormalised top-k weights, SwiGLU experts.

Two things HF's model does not do, both for RL:
- **route capture**: `trunk` returns the expert ids each token was sent to in every MoE layer;
- **router replay**: given those ids back, every MoE layer uses them instead of its own top-k,
  while the gate weights are recomputed from the live router's probabilities (so the router still
  gets gradients). A replayed expert whose live probability is below `replay_ratio` x the live
  k-th best is implausible and is swapped for the live router's best unused choice; the number
  swapped is reported. Route id -1 means "not recorded": the live choice is used.
Both are MoE-only: the dense families have no routes, and asking them to replay one is an error.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.model.causal_lm import CausalLM
from kiln.model.config import ModelConfig
from kiln.model.layers import MLP, Attention, DecoderLayer


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None, ratio: float):
        """x: [N, D] -> (expert ids [N, k], gate weights [N, k], probs [N, E] fp32, n replaced)."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        replaced = 0
        if replay is None:
            idx, w = top_i, top_w
        else:
            idx, replaced = plausible_routes(replay, probs, top_w, top_i, ratio)
            w = probs.gather(1, idx)
        if self.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        return idx, w.to(logits.dtype), probs, replaced


def plausible_routes(replay, probs, top_w, top_i, ratio: float):
    """The replayed ids, with each implausible (or unrecorded, -1) one swapped for the live
    router's best choice not already used by that token. Returns (ids, number implausible)."""
    idx = replay.long()
    recorded = idx >= 0
    score = probs.gather(1, idx.clamp(min=0))
    ok = recorded & (score >= ratio * top_w[:, -1:])
    n_bad = int((recorded & ~ok).sum())
    if bool(ok.all()):
        return idx, n_bad
    idx = torch.where(ok.any(1, keepdim=True), idx, top_i)  # nothing usable: the live choice
    for r in ((~ok).any(1) & ok.any(1)).nonzero().flatten().tolist():  # rare: fix row by row
        keep = idx[r][ok[r]].tolist()
        fill = [e for e in top_i[r].tolist() if e not in keep]
        idx[r, ~ok[r]] = torch.tensor(fill[: int((~ok[r]).sum())], dtype=idx.dtype)
    return idx, n_bad


class Experts(nn.Module):
    """All experts as two 3-D tensors (HF 5 names): gate_up_proj [E, 2I, D], down_proj [E, D, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if idx.shape[0] <= 2:
            return self._per_token(x, idx, w)
        return self._grouped(x, idx, w)

    def _per_token(self, x, idx, w):
        """Few tokens (decoding): each chosen expert's weights used in place, no sort, no copy."""
        rows = []
        for n, experts in enumerate(idx.tolist()):
            xn = x[n]
            ys = [F.linear(F.silu(g) * u, self.down_proj[e]) for e in experts
                  for g, u in [F.linear(xn, self.gate_up_proj[e]).chunk(2)]]
            rows.append((torch.stack(ys) * w[n, :, None].to(x.dtype)).sum(0))
        return torch.stack(rows)

    def _grouped(self, x, idx, w):
        """Tokens sorted by expert, one matmul pair per expert that has tokens."""
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        tok = order // k
        # split, not slices: a slice's backward zero-fills all of xs once per expert (3% of an RL step)
        outs = []
        for e, xe in enumerate(x[tok].split(counts)):
            if len(xe):
                gate, up = F.linear(xe, self.gate_up_proj[e]).chunk(2, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
        ys = torch.cat(outs) * w.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tok, ys.to(x.dtype))


class MoeBlock(nn.Module):
    routed = True  # DecoderLayer passes it the routes to replay

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.gate = Router(cfg)
        self.experts = Experts(cfg)

    def forward(self, x, replay, ratio):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        idx, w, probs, replaced = self.gate(flat, None if replay is None else replay.reshape(b * t, -1), ratio)
        y = self.experts(flat, idx, w).view(b, t, d)
        aux = None
        if self.training:  # Switch-style balance: E * sum_e (fraction routed to e) * (mean prob of e)
            frac = torch.bincount(idx.reshape(-1), minlength=self.num_experts).float() / idx.numel()
            aux = self.num_experts * (frac * probs.mean(0)).sum()
        return y, idx.view(b, t, -1), aux, replaced


class MoeForCausalLM(CausalLM):
    """Qwen3-MoE: every layer MoE but `mlp_only_layers` (and those off `decoder_sparse_step`)."""

    @staticmethod
    def make_layer(cfg: ModelConfig, index: int, moe: bool) -> DecoderLayer:
        mlp = MoeBlock(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        return DecoderLayer(cfg, Attention(cfg, index), mlp)
