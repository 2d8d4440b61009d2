"""The model's shape: one dataclass whose fields are Hugging Face Qwen3-MoE's config keys.

`from_depth` is the single size dial (nanochat style): depth sets the layer count and everything
else follows from it. `to_hf`/`from_hf` read and write `config.json` so `transformers` loads a kiln
checkpoint as `Qwen3MoeForCausalLM`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

HF_ARCH = "Qwen3MoeForCausalLM"
HF_MODEL_TYPE = "qwen3_moe"


@dataclass
class ModelConfig:
    vocab_size: int = 8192
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 256
    intermediate_size: int = 512  # dense MLP width, used only by layers that are not MoE
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_depth(cls, depth: int, vocab_size: int = 8192, **overrides) -> ModelConfig:
        """depth -> layers = depth, width = 64 * depth, heads of 64, half as many KV heads (GQA;
        for an odd head count the largest divisor below half), 8 experts with top-2 routing,
        expert width = model width."""
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (got {depth})")
        width = 64 * depth
        heads = max(1, width // 64)
        kv_heads = max(n for n in range(1, max(1, heads // 2) + 1) if heads % n == 0)
        cfg = {"vocab_size": vocab_size, "hidden_size": width, "num_hidden_layers": depth,
                   "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 64,
                   "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": width,
                   "intermediate_size": 2 * width}
        cfg.update(overrides)
        return cls(**cfg)

    @classmethod
    def from_section(cls, m) -> ModelConfig:
        """From the config tree's [model] section (kiln.config.ModelSection)."""
        return cls.from_depth(m.depth, vocab_size=m.vocab_size, num_experts=m.experts,
                              num_experts_per_tok=m.top_k, max_position_embeddings=m.context,
                              tie_word_embeddings=m.tie_embeddings)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if not 0 < self.num_experts_per_tok <= max(self.num_experts, 1):
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts})")

    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def to_hf(self) -> dict:
        """config.json as transformers writes it for Qwen3-MoE (v4 and v5 key names both present)."""
        d = dataclasses.asdict(self)
        d.update(architectures=[HF_ARCH], model_type=HF_MODEL_TYPE, hidden_act="silu",
                 attention_bias=False, attention_dropout=0.0, use_sliding_window=False,
                 sliding_window=None, output_router_logits=False, use_cache=True,
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})
        return d

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        if d.get("model_type") not in (HF_MODEL_TYPE, None):
            raise ValueError(f"config.json has model_type {d.get('model_type')!r}; kiln loads "
                             f"{HF_MODEL_TYPE!r} checkpoints (Qwen3-MoE architecture)")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (kiln's experts use silu)")
        d = dict(d)
        d.setdefault("num_experts", d.get("num_local_experts"))
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not supported (only 'default')")
        d["rope_theta"] = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        if d.get("head_dim") is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items()
                      if k in names and (v is not None or k.endswith("token_id"))})
