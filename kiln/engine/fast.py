"""The engine's forward over the main model: the model's own math with fewer, larger ops.

Decoding a tiny model on a CPU is bound by the number of tensor ops, not by arithmetic, so per
layer this fuses q/k/v into one projection, normalises q and k heads in one call, rotates them
together, and reuses the model's MoE block or MLP unchanged. Fused weights are rebuilt by
`refresh()` after every weight update. Used for fp32 models (bf16 keeps HF's cast order via
`model.trunk`) whose layers are the shared pre-norm block with full attention (Qwen3-MoE, Qwen3,
Llama; `supports`). Parity with `model.trunk` is a test (tests/engine).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.model.causal_lm import DEFAULT_REPLAY_RATIO
from kiln.model.layers import DecoderLayer, apply_rope, rope_tables


def supports(model) -> bool:
    return all(type(la) is DecoderLayer and la.self_attn.window is None and la.self_attn.scale is None
               for la in model.model.layers)


class FastTrunk:
    def __init__(self, model):
        self.model, self.cfg = model, model.config
        self.layers: list[tuple] = []
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the fused weights from the model's current parameters."""
        cfg = self.cfg
        heads = torch.ones(cfg.num_attention_heads + cfg.num_key_value_heads, 1)
        self.layers = []
        for layer in self.model.model.layers:
            a = layer.self_attn
            wqkv = torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)).detach()
            bqkv = torch.cat((a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)).detach() if cfg.attention_bias else None
            qk_scale = torch.cat((heads[:cfg.num_attention_heads].to(a.q_norm.weight) * a.q_norm.weight,
                                  heads[cfg.num_attention_heads:].to(a.k_norm.weight) * a.k_norm.weight)).detach() \
                if a.qk_norm else None
            self.layers.append((layer, wqkv, bqkv, qk_scale))

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache):
        """-> (hidden [B, T, D] before the final norm, routes [B, T, n_moe, k] or None)."""
        cfg, m = self.cfg, self.model.model
        nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        b, t = ids.shape
        x = m.embed_tokens(ids)
        rope = rope_tables(m.inv_freq(x.device), positions, x.dtype)
        routes = []
        for i, (layer, wqkv, bqkv, qk_scale) in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],), layer.input_layernorm.weight, eps)
            qkv = F.linear(h, wqkv, bqkv).view(b, t, nh + 2 * nkv, hd)
            qk = qkv[:, :, : nh + nkv]
            qk = (qk if qk_scale is None else F.rms_norm(qk, (hd,), None, eps) * qk_scale).transpose(1, 2)
            q, k = apply_rope(qk, rope).split((nh, nkv), dim=1)
            k, v = cache.update(i, k, qkv[:, :, nh + nkv:].transpose(1, 2))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.mask, enable_gqa=True,
                                               is_causal=cache.mask is None and t > 1)
            x = x + layer.self_attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            h = F.rms_norm(x, (x.shape[-1],), layer.post_attention_layernorm.weight, eps)
            if getattr(layer.mlp, "routed", False):
                y, idx, _, _ = layer.mlp(h, None, DEFAULT_REPLAY_RATIO)
                routes.append(idx)
                x = x + y
            else:
                x = x + layer.mlp(h)
        return x, (torch.stack(routes, dim=2) if routes else None)
