"""Llama family (HF `LlamaForCausalLM`; SmolLM2 is one): attention without q/k norms, optional
biases, RoPE with default, linear or Llama 3 scaling, and a gated MLP in every layer."""
from __future__ import annotations

from kiln.model.causal_lm import CausalLM
from kiln.model.layers import MLP, Attention, DecoderLayer


class LlamaForCausalLM(CausalLM):
    @staticmethod
    def make_layer(cfg, index: int, moe: bool) -> DecoderLayer:
        mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=cfg.mlp_bias)
        return DecoderLayer(cfg, Attention(cfg, index, qk_norm=None), mlp)
