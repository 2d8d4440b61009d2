"""kiln's mixture-of-experts transformer: the math and parameter names of Hugging Face's
`Qwen3MoeForCausalLM` (transformers 5 layout: experts stored as 3-D tensors), so its state dict is
HF's and a parity test can hold the logits equal.

Grouped-query attention with RMSNorm on q and k per head, RoPE, pre-norm residual blocks, and a
token-choice MoE: softmax router, top-k, renormalised top-k weights, SwiGLU experts.

Two things HF's model does not do, both for RL:
- **route capture**: `trunk` returns the expert ids each token was sent to in every MoE layer;
- **router replay**: given those ids back, every MoE layer uses them instead of its own top-k,
  while the gate weights are recomputed from the live router's probabilities (so the router still
  gets gradients). A replayed expert whose live probability is below `replay_ratio` x the live
  k-th best is implausible and is swapped for the live router's best unused choice; the number
  swapped is reported. Route id -1 means "not recorded": the live choice is used.

Attention can read and write a key/value cache owned by the caller (the engine); the model only
needs `cache.update(layer, k, v) -> (k_all, v_all)` and `cache.mask` (bool, True = attend).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.model.config import ModelConfig

DEFAULT_REPLAY_RATIO = 0.5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; the same math as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # As HF: normalise in fp32, cast back, then scale (the order matters for bf16 parity).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, 1, T, hd] for `positions` [B, T], and the rotate-half matrix [hd, hd]."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype), _rotate_half_matrix(inv_freq.shape[0] * 2, dtype, inv_freq.device)


@functools.lru_cache(maxsize=16)
def _rotate_half_matrix(dim: int, dtype, device) -> torch.Tensor:
    """R with x @ R == cat(-x[half:], x[:half]): entries 0/+-1, so the product is exact, and one
    matmul replaces four ops per call (decoding is op-count bound on a CPU). Cached, and built
    outside inference mode so training can use the same tensor."""
    half = dim // 2
    with torch.inference_mode(False):
        r = torch.zeros(dim, dim, dtype=dtype, device=device)
        r[half:, :half] = -torch.eye(half, dtype=dtype, device=device)
        r[:half, half:] = torch.eye(half, dtype=dtype, device=device)
    return r


def apply_rope(x: torch.Tensor, rope) -> torch.Tensor:
    """x: [B, H, T, hd]; rope: (cos, sin, R) from rope_tables."""
    cos, sin, rot = rope
    return torch.addcmul(x * cos, x @ rot, sin)


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, cfg.head_dim
        q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, rope, mask, cache):
        b, t, _ = x.shape
        shape = (b, t, -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
            mask = cache.mask
        if isinstance(mask, Documents):
            o = mask.attend(q, k, v)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                               is_causal=mask is None and t > 1)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class Documents:
    """Packed rows as their documents' spans: attention runs causally inside each span, never
    across. The same result as a [B, 1, T, T] block-diagonal mask at a fraction of the cost: SDPA's
    causal path skips the masked half, and the blocks between documents are never computed (an SFT
    step of two 2,560-token rows spent 60% of its time in masked attention)."""

    def __init__(self, doc_ids: torch.Tensor):
        """doc_ids [B, T]: contiguous runs of one id per document; padding (id -1) attends nowhere
        and gets a zero output (it is never a target)."""
        self.rows: list[list[tuple[int, int, bool]]] = []  # per row: (start, end, is a document)
        for d in doc_ids.tolist():
            spans, start = [], 0
            for i in range(1, len(d) + 1):
                if i == len(d) or d[i] != d[start]:
                    spans.append((start, i, d[start] >= 0))
                    start = i
            self.rows.append(spans)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, hd], k and v [B, KV, T, hd] -> [B, H, T, hd]."""
        out = []
        for b, spans in enumerate(self.rows):
            parts = [F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e],
                                                    is_causal=e - s > 1, enable_gqa=True)
                     if real else q.new_zeros(1, q.shape[1], e - s, q.shape[3]) for s, e, real in spans]
            out.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
        return out[0] if len(out) == 1 else torch.cat(out)


SPANS_FROM = 512  # rows at least this long attend by document span; shorter ones by one mask (measured: at
# 16 x 256 the mask is 15% faster, at 4 x 1,024 the spans are 15% faster, at 2 x 2,560 35%)


def document_mask(doc_ids: torch.Tensor):
    """What keeps packed documents ([B, T] ids, contiguous; -1 = padding) from attending to each
    other: a [B, 1, T, T] bool mask for short rows, `Documents` spans for long ones."""
    t = doc_ids.shape[1]
    if t >= SPANS_FROM:
        return Documents(doc_ids)
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


class MLP(nn.Module):
    """SwiGLU; the dense layers of the model (mlp_only_layers)."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        xs = x[tok]
        outs, start = [], 0
        for e, c in enumerate(counts):
            if c:
                gate, up = F.linear(xs[start:start + c], self.gate_up_proj[e]).chunk(2, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
                start += c
        ys = torch.cat(outs) * w.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tok, ys.to(x.dtype))


class MoeBlock(nn.Module):
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


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, moe: bool):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MoeBlock(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, mask, cache, replay, ratio):
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoeBlock):
            y, idx, aux, replaced = self.mlp(h, replay, ratio)
            return x + y, idx, aux, replaced
        return x + self.mlp(h), None, None, 0


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.config = cfg
        self._inv_freq: torch.Tensor | None = None  # not a buffer: must stay fp32 under .to(bf16)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            self._inv_freq = inv_frequencies(self.config).to(device)
        return self._inv_freq


@dataclass
class TrunkOutput:
    hidden: torch.Tensor  # [B, T, D], before the final norm (what MTP consumes)
    routes: torch.Tensor | None  # [B, T, n_moe_layers, k] expert ids actually used
    aux_loss: torch.Tensor | None  # summed over MoE layers; only in training mode
    replaced: int  # implausible replayed experts swapped for live choices


class MoeForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        init_weights(self, cfg.initializer_range)

    def trunk(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
              routes: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
              replay_ratio: float = DEFAULT_REPLAY_RATIO) -> TrunkOutput:
        """input_ids [B, T]; positions [B, T] (default 0..T-1; required with a cache); routes
        [B, T, n_moe_layers, k] to replay; doc_ids [B, T] keep packed documents from attending
        to each other (pass positions that restart per document)."""
        b, t = input_ids.shape
        if positions is None:
            if cache is not None:
                raise ValueError("positions are required when decoding with a cache")
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        x = self.model.embed_tokens(input_ids)
        rope = rope_tables(self.model.inv_freq(x.device), positions, x.dtype)
        mask = None if doc_ids is None else document_mask(doc_ids)
        used, aux, replaced, m = [], None, 0, 0
        for layer in self.model.layers:
            replay = None
            if routes is not None and isinstance(layer.mlp, MoeBlock):
                replay = routes[:, :, m]
            x, idx, a, r = layer(x, rope, mask, cache, replay, replay_ratio)
            if idx is not None:
                used.append(idx)
                m += 1
                replaced += r
                aux = a if aux is None else (aux if a is None else aux + a)
        return TrunkOutput(x, torch.stack(used, dim=2) if used else None, aux, replaced)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden))

    def forward(self, input_ids: torch.Tensor, **kw) -> torch.Tensor:
        return self.head(self.trunk(input_ids, **kw).hidden)

    def set_rope_theta(self, theta: float) -> None:
        """Long-context extension: a larger RoPE base, as continued pretraining's second phase."""
        self.config.rope_theta = theta
        self.model._inv_freq = None


def init_weights(module: nn.Module, std: float) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
