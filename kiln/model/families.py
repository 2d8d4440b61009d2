"""The model class of each family, by config.json's model_type (ModelConfig.model_type)."""
from __future__ import annotations

from kiln.model.causal_lm import CausalLM
from kiln.model.gemma3 import Gemma3ForCausalLM
from kiln.model.llama import LlamaForCausalLM
from kiln.model.moe import MoeForCausalLM
from kiln.model.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[CausalLM]] = {"qwen3_moe": MoeForCausalLM, "qwen3": Qwen3ForCausalLM,
                                     "llama": LlamaForCausalLM, "gemma3_text": Gemma3ForCausalLM}


def model_class(cfg) -> type[CausalLM]:
    return MODELS[cfg.model_type]


def build_model(cfg) -> CausalLM:
    return model_class(cfg)(cfg)
