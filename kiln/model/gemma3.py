"""Gemma 3 text (HF `Gemma3ForCausalLM`): sliding-window and global layers (`layer_types`, each
kind with its own RoPE base), (1 + w) RMSNorms before and after both sub-blocks and on q and k,
embeddings scaled by sqrt(hidden_size), scores scaled by query_pre_attn_scalar^-1/2, GeGLU."""
from __future__ import annotations

import torch
from torch import nn

from kiln.model.causal_lm import CausalLM
from kiln.model.layers import MLP, Attention, OffsetRMSNorm


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, index: int):
        super().__init__()
        self.self_attn = Attention(cfg, index, qk_norm=OffsetRMSNorm, scale=cfg.query_pre_attn_scalar ** -0.5,
                                   window=cfg.window(index))
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(d, eps)
        self.post_attention_layernorm = OffsetRMSNorm(d, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(d, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(d, eps)

    def forward(self, x, rope, mask, cache, replay, ratio):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, mask, cache))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, None, None, 0


class Gemma3ForCausalLM(CausalLM):
    norm_class = OffsetRMSNorm
    local_rope = True

    @staticmethod
    def make_layer(cfg, index: int, moe: bool) -> Gemma3DecoderLayer:
        return Gemma3DecoderLayer(cfg, index)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # as HF: the scale is rounded to the weights' dtype first
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
