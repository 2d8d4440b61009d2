"""Qwen3 dense (HF `Qwen3ForCausalLM`): Qwen3-MoE's attention (RMSNorm on q and k per head) with a
SwiGLU MLP in every layer; optional sliding-window layers (`use_sliding_window`)."""
from __future__ import annotations

from kiln.model.causal_lm import CausalLM
from kiln.model.layers import MLP, Attention, DecoderLayer


class Qwen3ForCausalLM(CausalLM):
    @staticmethod
    def make_layer(cfg, index: int, moe: bool) -> DecoderLayer:
        attn = Attention(cfg, index, window=cfg.window(index))
        return DecoderLayer(cfg, attn, MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act))
