"""The parts every model family shares: RMSNorms, RoPE, grouped-query attention (optionally with
q/k norms, biases, a custom scale and a sliding window), the gated MLP, packed-document masks and
the pre-norm decoder layer of the Qwen3 and Llama families.

Attention can read and write a key/value cache owned by the caller (the engine); the model only
needs `cache.update(layer, k, v) -> (k_all, v_all)`, `cache.mask` (bool, True = attend) and, for
sliding-window layers, `cache.window_mask(window)`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


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


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + weight), the weight starting at 0; all in fp32, then cast."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


# ---- RoPE ---------------------------------------------------------------------------------------

def inv_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """HF's inverse frequencies for rope_type default, linear or llama3 (`scaling` holds the
    rope_parameters beyond rope_theta; None = default)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    if kind != "default":
        raise ValueError(f"rope_type {kind!r} is not supported (default, linear or llama3)")
    return inv


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


# ---- attention ----------------------------------------------------------------------------------

class Attention(nn.Module):
    """Grouped-query attention. qk_norm: the norm class applied per head to q and k (Qwen3, Gemma
    3) or None (Llama); scale: the score scale (None = 1/sqrt(head_dim)); window: a sliding
    window (a query at p sees keys p - window < j <= p, as HF) or None for full attention."""

    def __init__(self, cfg, layer_idx: int, qk_norm: type[nn.Module] | None = RMSNorm,
                 scale: float | None = None, window: int | None = None):
        super().__init__()
        self.layer_idx, self.head_dim, self.scale, self.window = layer_idx, cfg.head_dim, scale, window
        q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = qk_norm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = qk_norm is not None

    def forward(self, x, rope, mask, cache):
        b, t, _ = x.shape
        shape = (b, t, -1, self.head_dim)
        q, k = self.q_proj(x).view(shape), self.k_proj(x).view(shape)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), rope), apply_rope(k.transpose(1, 2), rope)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
            mask = cache.mask if self.window is None else cache.window_mask(self.window)
        if isinstance(mask, Documents):
            o = mask.attend(q, k, v, self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                               is_causal=mask is None and t > 1, scale=self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def forward_at(self, x, rope, mask, rows):
        """forward's outputs at rows ([B, T] bool) only, [M, D] in row-major order, without a cache:
        keys and values at every position, queries at those rows alone (a training forward whose
        later layers and loss read only those rows)."""
        if self.window is not None:
            raise ValueError("forward_at takes full attention only, not a sliding window")
        b, t, _ = x.shape
        shape = (b, t, -1, self.head_dim)
        k = self.k_proj(x).view(shape)
        k = apply_rope((self.k_norm(k) if self.qk_norm else k).transpose(1, 2), rope)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin, rot = rope
        out = []
        for i in range(b):
            at = rows[i].nonzero().squeeze(1)
            if not len(at):
                continue
            q = self.q_proj(x[i, at]).view(1, len(at), -1, self.head_dim)
            q = apply_rope((self.q_norm(q) if self.qk_norm else q).transpose(1, 2), (cos[i:i + 1, :, at], sin[i:i + 1, :, at], rot))
            n = 0
            for qi, keys, sees in key_groups(mask, i, at, t):
                o = F.scaled_dot_product_attention(q[:, :, n:n + len(qi)], k[i:i + 1, :, keys], v[i:i + 1, :, keys],
                                                   attn_mask=sees[None, None], enable_gqa=True, scale=self.scale)
                out.append(o[0].transpose(0, 1).reshape(len(qi), -1))
                n += len(qi)
        return self.o_proj(torch.cat(out) if out else x.new_zeros(0, self.o_proj.in_features))


def key_groups(mask, b: int, rows: torch.Tensor, t: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Query rows `rows` (ascending) of batch row b in groups, in order, each with the keys it may
    attend to: (the group's rows, their keys, [rows, keys] bool: which each sees), under a
    cache-free forward's mask (None: causal; a [B, 1, T, T] bool mask; Documents without a window).
    Documents group by document, so a query never scores the keys of the row's other documents."""
    if isinstance(mask, torch.Tensor):
        return [(rows, torch.arange(t, device=rows.device), mask[b, 0, rows])]
    groups = [(rows, torch.arange(int(rows[-1]) + 1, device=rows.device))] if mask is None else mask.key_groups(b, rows)
    return [(q, k, k[None, :] <= q[:, None]) for q, k in groups]


def band(t: int, window: int | None, device=None) -> torch.Tensor:
    """[T, T] bool: causal, and within `window` positions when one is given."""
    i = torch.arange(t, device=device)
    m = i[None, :] <= i[:, None]
    return m if window is None else m & (i[None, :] > i[:, None] - window)


class Documents:
    """Packed rows as their documents' spans: attention runs causally inside each span, never
    across. The same result as a [B, 1, T, T] block-diagonal mask at a fraction of the cost: SDPA's
    causal path skips the masked half, and the blocks between documents are never computed (an SFT
    step of two 2,560-token rows spent 60% of its time in masked attention).

    shared: each row's first document is a prefix that every later document of the row continues
    (they attend to it as if it preceded each of them): several sequences with one prompt, the
    prompt computed once (the RL trainer's rollouts of a group)."""

    def __init__(self, doc_ids: torch.Tensor, window: int | None = None, shared: bool = False):
        """doc_ids [B, T]: contiguous runs of one id per document; padding (id -1) attends nowhere
        and gets a zero output (it is never a target). window: a sliding window inside each span."""
        self.window, self.shared = window, shared
        self.rows: list[list[tuple[int, int, bool]]] = []  # per row: (start, end, is a document)
        for d in doc_ids.tolist():
            spans, start = [], 0
            for i in range(1, len(d) + 1):
                if i == len(d) or d[i] != d[start]:
                    spans.append((start, i, d[start] >= 0))
                    start = i
            self.rows.append(spans)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """q [B, H, T, hd], k and v [B, KV, T, hd] -> [B, H, T, hd]."""
        out = []
        for spans, qb, kb, vb in zip(self.rows, q.split(1), k.split(1), v.split(1)):
            p = spans[0][1] if self.shared else 0  # the prefix's end: later spans continue [0, p)
            # The first continuation runs the prefix's queries too: their outputs are the prefix's own.
            reuse = bool(p) and len(spans) > 1 and spans[1][2]
            # One split a tensor, not a slice a span: a slice's backward zero-fills the whole row.
            sizes = [e - s for s, e, _ in spans]
            qs, ks, vs = (t.split(sizes, 2) for t in (qb, kb, vb))
            parts = []
            for i, (s, e, real) in enumerate(spans):
                if not real:
                    parts.append(q.new_zeros(1, q.shape[1], e - s, q.shape[3]))
                    continue
                if reuse and i == 0:
                    continue
                qkv = [t[i] if not (s and p) else torch.cat([t[0], t[i]], 2) for t in (qs, ks, vs)]
                o = self._span(*qkv, scale)
                parts.append(o if reuse and i == 1 else o.split([o.shape[2] - (e - s), e - s], 2)[1])  # its own queries
            out.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
        return out[0] if len(out) == 1 else torch.cat(out)

    def key_groups(self, b: int, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Query rows `rows` (ascending) of batch row b by document: (its rows, the keys it may see:
        its own document up to its last query row, after the shared prefix when shared)."""
        if self.window is not None:
            raise ValueError("key_groups does not take a sliding window")
        spans, out = self.rows[b], []
        prefix = torch.arange(spans[0][1] if self.shared else 0, device=rows.device)
        for s, e, _ in spans:
            q = rows[(rows >= s) & (rows < e)]
            if len(q):
                own = torch.arange(s, int(q[-1]) + 1, device=rows.device)
                out.append((q, torch.cat((prefix, own)) if s else own))
        return out

    def _span(self, q, k, v, scale):
        """Causal attention within q, k, v; a continuing span runs with its prefix's queries too (the
        first keeps their outputs as the prefix's, the others drop them): SDPA's causal path skips
        the masked half, which an explicit mask would not."""
        n = q.shape[2]
        if self.window is not None and n > self.window:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=band(n, self.window, q.device),
                                                  enable_gqa=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=n > 1, enable_gqa=True, scale=scale)


MIN_SHARED = 64  # a shorter common prompt is not worth a tree (shared Documents: RL's groups, SFT's steps)
SPANS_FROM = 512  # rows at least this long attend by document span; shorter ones by one mask (measured: at
# 16 x 256 the mask is 15% faster, at 4 x 1,024 the spans are 15% faster, at 2 x 2,560 35%)


def document_mask(doc_ids: torch.Tensor, window: int | None = None, shared: bool = False):
    """What keeps packed documents ([B, T] ids, contiguous; -1 = padding) from attending to each
    other: a [B, 1, T, T] bool mask for short rows, `Documents` spans for long ones. window: a
    sliding window as well; shared: see `Documents`."""
    t = doc_ids.shape[1]
    if t >= SPANS_FROM or shared:
        return Documents(doc_ids, window, shared)
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & band(t, window, doc_ids.device))[:, None]


def attention_mask(t: int, doc_ids: torch.Tensor | None, window: int | None, device, shared: bool = False):
    """A cache-free forward's mask for T positions: None (plain causal), a bool mask or spans."""
    if doc_ids is not None:
        return document_mask(doc_ids, window, shared)
    if window is None or t <= window:
        return None
    return band(t, window, device)


# ---- feed-forward and the decoder layer ---------------------------------------------------------

class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu_pytorch_tanh."""

    def __init__(self, hidden: int, inner: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block (Qwen3, Qwen3-MoE, Llama). An mlp with `routed = True` (the MoE
    block) returns (y, expert ids, aux loss, replaced) and takes the routes to replay."""

    def __init__(self, cfg, attn: Attention, mlp: nn.Module):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, mask, cache, replay, ratio):
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache)
        h = self.post_attention_layernorm(x)
        if getattr(self.mlp, "routed", False):
            y, idx, aux, replaced = self.mlp(h, replay, ratio)
            return x + y, idx, aux, replaced
        return x + self.mlp(h), None, None, 0

    def forward_at(self, x, rope, mask, rows, replay=None, ratio: float = 0.0):
        """forward at rows ([B, T] bool) only (Attention.forward_at): (x [M, D], expert ids [M, k]
        or None, aux loss or None, replaced), replay [B, T, k] read at those rows."""
        x = x[rows] + self.self_attn.forward_at(self.input_layernorm(x), rope, mask, rows)
        h = self.post_attention_layernorm(x)
        if getattr(self.mlp, "routed", False):
            y, idx, aux, replaced = self.mlp(h[None], None if replay is None else replay[rows][None], ratio)
            return x + y[0], idx[0], aux, replaced
        return x + self.mlp(h), None, None, 0


@dataclass
class TrunkOutput:
    hidden: torch.Tensor  # [B, T, D], before the final norm (what MTP consumes)
    routes: torch.Tensor | None  # [B, T, n_moe_layers, k] expert ids actually used; None without MoE layers
    aux_loss: torch.Tensor | None  # summed over MoE layers; only in training mode
    replaced: int  # implausible replayed experts swapped for live choices


def init_weights(module: nn.Module, std: float) -> None:
    """Normal(0, std) for every weight; norms at their identity (1, or 0 for an offset norm). Nothing
    on the meta device (a checkpoint's tensors replace it all, and normal_ there imports torch._dynamo)."""
    norms = {id(m.weight): 0.0 if isinstance(m, OffsetRMSNorm) else 1.0
             for m in module.modules() if isinstance(m, (RMSNorm, OffsetRMSNorm))}
    with torch.no_grad():
        for _, p in module.named_parameters():
            if p.is_meta:
                continue
            if id(p) in norms:
                p.fill_(norms[id(p)])
            elif p.ndim == 1:  # biases
                p.zero_()
            else:
                p.normal_(0.0, std)
