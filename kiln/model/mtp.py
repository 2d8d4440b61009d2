"""Multi-token prediction (DeepSeek-V3 style) for speculative decoding, trained by self-distillation.

MTP layer k (k = 1..depth) at position i takes the previous depth's hidden state h^{k-1}_i (h^0 =
the main trunk's output) and the embedding of token t_{i+k}: RMSNorm each, concatenate, project
2d -> d, run one transformer block, and predict t_{i+k+1} through the main model's final-norm-free
shared head (its own RMSNorm, then the shared lm_head).

Self-distillation (the report's recipe): the target is the main head's full distribution at the
position that predicts the same token (i + k), detached; loss = KL(main || mtp). The trunk,
embedding and head are detached by default, so training MTP cannot change the main model.

The module also counts, in a buffer saved with its weights, how often each token was a training
input: the engine's drafter proposes only from the most frequent (`Engine(draft_vocab=K)`, as
FR-Spec does), so a draft reads K rows of the output head instead of the whole vocabulary's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.model.causal_lm import DEFAULT_REPLAY_RATIO, CausalLM
from kiln.model.config import ModelConfig
from kiln.model.families import model_class
from kiln.model.layers import RMSNorm, document_mask, init_weights, rope_tables

# Families whose decoder layer is the plain pre-norm block at the global RoPE base; Gemma 3's
# layers (sliding windows with their own base, offset norms) would need their own MTP design.
MTP_FAMILIES = ("qwen3_moe", "qwen3", "llama")
COUNTS = "token_counts"


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = model_class(cfg).make_layer(cfg, index, cfg.num_experts > 0)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, emb, rope, mask=None, cache=None, rows=None):
        """The layer's outputs [B, T, D], or with rows ([B, T] bool) at those rows only, [M, D]."""
        x = self.eh_proj(torch.cat((self.hnorm(h), self.enorm(emb)), dim=-1))
        if rows is not None:
            return self.block.forward_at(x, rope, mask, rows)[0]
        return self.block(x, rope, mask, cache, None, DEFAULT_REPLAY_RATIO)[0]


class MTP(nn.Module):
    def __init__(self, cfg: ModelConfig, depth: int = 1):
        super().__init__()
        if depth < 1:
            raise ValueError(f"MTP depth must be >= 1 (got {depth})")
        if cfg.model_type not in MTP_FAMILIES:
            raise ValueError(f"MTP layers are built for {', '.join(MTP_FAMILIES)} models, not {cfg.model_type!r}: "
                             "set model.mtp_depth=0")
        self.config = cfg
        self.layers = nn.ModuleList(MTPLayer(cfg, k) for k in range(depth))
        self.depth = depth  # a plain attribute: the engine reads it several times a decoding step
        init_weights(self, cfg.initializer_range)
        self.register_buffer(COUNTS, torch.zeros(cfg.vocab_size, dtype=torch.int64))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints written before the counts load with none (the drafter then uses the whole vocabulary).
        state_dict.setdefault(prefix + COUNTS, torch.zeros(self.config.vocab_size, dtype=torch.int64))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def draft_ids(self, k: int) -> torch.Tensor | None:
        """The k most frequent training tokens (ascending ids), or None for the whole vocabulary: k
        is 0 or covers it, or nothing was counted (a checkpoint from before the counts)."""
        counts = getattr(self, COUNTS)
        if k <= 0 or k >= len(counts) or not bool(counts.any()):
            return None
        return torch.argsort(-counts, stable=True)[:k].sort().values  # ties: the lower id

    def logits(self, model: CausalLM, k: int, h: torch.Tensor, detach: bool = True,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """Depth k's logits (0-based) over the vocabulary, or over the token ids `rows` only."""
        w = model.lm_head.weight.detach() if detach else model.lm_head.weight
        return F.linear(self.layers[k].norm(h), w if rows is None else w[rows])

    def embed(self, model: CausalLM, ids: torch.Tensor, detach: bool = True) -> torch.Tensor:
        w = model.model.embed_tokens.weight
        return F.embedding(ids, w.detach() if detach else w)

    def forward(self, model: CausalLM, hidden: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                detach_trunk: bool = True, keep: torch.Tensor | None = None, shared: bool = False) -> list[torch.Tensor]:
        """Training forward over whole sequences. hidden: the trunk's output [B, T, D].
        Returns per depth k (1-based) logits [B, T-k, V]; row i predicts token i+k+1. With keep
        ([B, T] bool: the positions whose main-head logits were computed, e.g. SFT's assistant
        targets), only rows i whose i+k is kept go through the head: [M_k, V], row-major order.
        shared: each row's first document is a prompt its later ones continue (layers.Documents)."""
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        h = hidden.detach() if detach_trunk else hidden
        if self.training:
            counts = getattr(self, COUNTS)
            counts += torch.bincount(input_ids.flatten().to(counts.device), minlength=len(counts))
        out = []
        for k, layer in enumerate(self.layers, start=1):
            n = t - k
            if n <= 0:
                break
            pos = positions[:, :n]
            rope = rope_tables(model.model.inv_freq(h.device), pos, h.dtype)
            mask = None if doc_ids is None else document_mask(doc_ids[:, :n], shared=shared)
            # The last layer's outputs feed only the kept rows' head: its queries and MLP run there
            # alone (the tiny preset's SFT step 1.13x faster, 12 alternating steps on real trajectories).
            rows = None if keep is None or k < self.depth else keep[:, k:k + n]
            h = layer(h[:, :n], self.embed(model, input_ids[:, k:], detach_trunk), rope, mask, rows=rows)
            at = h if keep is None or rows is not None else h[keep[:, k:k + n]]
            out.append(self.logits(model, k - 1, at, detach_trunk))
        return out


def mtp_loss(main_logits: torch.Tensor, mtp_logits: list[torch.Tensor], input_ids: torch.Tensor,
             doc_ids: torch.Tensor | None = None, mode: str = "distill",
             keep: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
    """Mean over depths of the per-position loss. mode "distill": KL(main head's detached
    distribution at i+k || MTP-k at i); "hard": cross-entropy on the true token t_{i+k+1}
    (the baseline the benchmark compares acceptance against). Positions whose inputs cross a
    packed-document boundary are left out. With keep (distill only), main_logits are [M, V] at
    the kept positions and mtp_logits as MTP.forward(keep=...) returns them. Returns (loss,
    per-depth values)."""
    if mode not in ("distill", "hard"):
        raise ValueError(f"mode must be 'distill' or 'hard' (got {mode!r})")
    if keep is not None:
        if mode != "distill":
            raise ValueError("keep= needs mode 'distill': hard labels are scored at every position")
        return _distill_kept(main_logits, mtp_logits, doc_ids, keep)
    t = input_ids.shape[1]
    losses = []
    for k, q in enumerate(mtp_logits, start=1):
        n = t - k if mode == "distill" else t - k - 1
        if n <= 0:
            break
        valid = torch.ones_like(input_ids[:, :n], dtype=torch.bool)
        if doc_ids is not None:  # inputs (and hard targets) must stay in position i's document
            last = k if mode == "distill" else k + 1
            valid = doc_ids[:, :n] == doc_ids[:, last:last + n]
        logq = torch.log_softmax(q[:, :n].float(), dim=-1)
        if mode == "distill":
            logp = torch.log_softmax(main_logits[:, k:k + n].detach().float(), dim=-1)
            per = (logp.exp() * (logp - logq)).sum(-1)
        else:
            per = -logq.gather(-1, input_ids[:, k + 1:k + 1 + n, None]).squeeze(-1)
        losses.append((per * valid).sum() / valid.sum().clamp(min=1))
    total = torch.stack(losses).mean()
    return total, [float(x.detach()) for x in losses]


def _distill_kept(main_logits: torch.Tensor, mtp_logits: list[torch.Tensor], doc_ids: torch.Tensor | None,
                  keep: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """mtp_loss's distillation where only the kept positions have logits (see mtp_loss)."""
    t = keep.shape[1]
    index = (keep.flatten().long().cumsum(0) - 1).view_as(keep)  # kept position -> row of main_logits
    losses = []
    for k, q in enumerate(mtp_logits, start=1):
        n = t - k
        if n <= 0:
            break
        at = keep[:, k:k + n]
        logp = torch.log_softmax(main_logits[index[:, k:k + n][at]].detach().float(), dim=-1)
        logq = torch.log_softmax(q.float(), dim=-1)
        per = (logp.exp() * (logp - logq)).sum(-1)
        valid = torch.ones_like(per, dtype=torch.bool) if doc_ids is None else (doc_ids[:, :n] == doc_ids[:, k:k + n])[at]
        losses.append((per * valid).sum() / valid.sum().clamp(min=1))
    total = torch.stack(losses).mean()
    return total, [float(x.detach()) for x in losses]
