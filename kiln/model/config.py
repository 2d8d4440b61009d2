"""The model's shape: one dataclass whose fields are Hugging Face config keys, for every family
kiln runs (`model_type`: Qwen3-MoE, Qwen3 dense, Llama, Gemma 3 text). Fields a family does not
use keep their defaults (a dense family has num_experts = 0).

`from_depth` is the single size dial (nanochat style) of kiln's own Qwen3-MoE: depth sets the layer
count and everything else follows from it. `to_hf`/`from_hf` read and write `config.json` so
`transformers` loads a kiln checkpoint as the family's HF class.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

HF_ARCH = "Qwen3MoeForCausalLM"
HF_MODEL_TYPE = "qwen3_moe"
# model_type -> the HF class that loads it
ARCHITECTURES = {"qwen3_moe": HF_ARCH, "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}
_COMMON = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
           "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias")
# the config.json keys each family writes (besides rope and the fixed ones in to_hf)
_KEYS = {"qwen3_moe": _COMMON + ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                                 "mlp_only_layers", "norm_topk_prob", "router_aux_loss_coef", "rope_theta"),
         "qwen3": _COMMON + ("rope_theta", "sliding_window", "layer_types"),
         "llama": _COMMON + ("mlp_bias", "rope_theta"),
         "gemma3_text": _COMMON + ("query_pre_attn_scalar", "sliding_window", "layer_types", "final_logit_softcapping")}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    model_type: str = HF_MODEL_TYPE  # the family
    hidden_act: str = "silu"  # Gemma's hidden_activation
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict | None = None  # rope parameters beyond rope_theta (rope_type linear or llama3)
    sliding_window: int | None = None  # window of the layers layer_types calls "sliding_attention"
    layer_types: list[str] | None = None  # None: every layer full attention
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power, not head_dim's
    rope_local_base_freq: float = 10000.0  # Gemma: the sliding layers' RoPE base
    final_logit_softcapping: float | None = None  # Gemma: logits = cap * tanh(logits / cap)

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
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type {self.model_type!r} is not a family kiln runs ({', '.join(ARCHITECTURES)})")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        if self.model_type == HF_MODEL_TYPE and self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (kiln's experts use silu)")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.layer_types and "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.model_type != HF_MODEL_TYPE:
            self.num_experts = 0  # the MoE's default of 8 means nothing to a dense family
        elif not 0 < self.num_experts_per_tok <= max(self.num_experts, 1):
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts})")

    def window(self, i: int) -> int | None:
        """Layer i's sliding window, or None for full attention."""
        return self.sliding_window if self.layer_types and self.layer_types[i] == "sliding_attention" else None

    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def to_hf(self) -> dict:
        """config.json as transformers writes it for the family (Qwen3-MoE: v4 and v5 key names)."""
        d = {k: getattr(self, k) for k in _KEYS[self.model_type]}
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        d.update(architectures=[ARCHITECTURES[self.model_type]], model_type=self.model_type,
                 attention_dropout=0.0, use_cache=True)
        if "layer_types" in d:  # written out: absent, transformers would assume its own pattern
            d["layer_types"] = self.layer_types or ["full_attention"] * self.num_hidden_layers
        if self.model_type == "gemma3_text":
            d.update(hidden_activation=self.hidden_act, attn_logit_softcapping=None, use_bidirectional_attention=False,
                     rope_parameters={"full_attention": rope, "sliding_attention":
                                      {"rope_type": "default", "rope_theta": self.rope_local_base_freq}})
            return d
        d.update(hidden_act=self.hidden_act, rope_parameters=rope)
        if self.model_type == "qwen3_moe":
            d.update(use_sliding_window=False, sliding_window=None, output_router_logits=False)
        elif self.model_type == "qwen3":
            d.update(use_sliding_window=self.sliding_window is not None,
                     max_window_layers=(self.layer_types or []).count("full_attention"))
        return d

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        """From a config.json of any family kiln runs; a clear ValueError for what it cannot."""
        kind = d.get("model_type") or {v: k for k, v in ARCHITECTURES.items()}.get((d.get("architectures") or [None])[0])
        if kind is None:
            kind = HF_MODEL_TYPE  # kiln's own early checkpoints wrote neither
        if kind not in ARCHITECTURES:
            raise ValueError(f"config.json has model_type {kind!r}; kiln loads {', '.join(ARCHITECTURES)} "
                             f"checkpoints ({', '.join(ARCHITECTURES.values())})")
        d = dict(d, model_type=kind)
        if kind == "gemma3_text":
            d["hidden_act"] = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
            if d.get("attn_logit_softcapping") is not None or d.get("use_bidirectional_attention"):
                raise ValueError("attention logit soft-capping and bidirectional attention are not supported "
                                 "(Gemma 2 and embedding variants)")
            rope = d.get("rope_parameters") or {}
            full = rope.get("full_attention") or {**(d.get("rope_scaling") or {}), "rope_theta": d.get("rope_theta", 1e6)}
            d["rope_local_base_freq"] = (rope.get("sliding_attention") or {}).get(
                "rope_theta", d.get("rope_local_base_freq", 10000.0))
            d.setdefault("query_pre_attn_scalar", 256)
            d.setdefault("head_dim", 256)
            if d.get("layer_types") is None:  # the BC form: every sliding_window_pattern-th layer is global
                every = d.get("sliding_window_pattern", 6)
                d["layer_types"] = ["sliding_attention" if (i + 1) % every else "full_attention"
                                    for i in range(d["num_hidden_layers"])]
            d.setdefault("tie_word_embeddings", True)
        else:
            if kind == "qwen3" and d.get("use_sliding_window") and d.get("layer_types") is None:
                d["layer_types"] = ["sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
                                    for i in range(d["num_hidden_layers"])]
            if kind != "qwen3" or not d.get("use_sliding_window"):
                d["sliding_window"], d["layer_types"] = None, None
            full = d.get("rope_parameters") or {**(d.get("rope_scaling") or {}), "rope_theta": d.get("rope_theta", 10000.0)}
        if kind == HF_MODEL_TYPE:
            d.setdefault("num_experts", d.get("num_local_experts"))
        full = dict(full)
        kind_rope = full.pop("rope_type", full.pop("type", "default"))
        d["rope_theta"] = full.pop("rope_theta", d.get("rope_theta", 10000.0))
        if full.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
        if kind_rope not in ("default", "linear", "llama3"):
            raise ValueError(f"rope_type {kind_rope!r} is not supported (default, linear or llama3)")
        d["rope_scaling"] = None if kind_rope == "default" else {"rope_type": kind_rope, **full}
        if d.get("head_dim") is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if d.get("num_key_value_heads") is None:
            d["num_key_value_heads"] = d["num_attention_heads"]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})
