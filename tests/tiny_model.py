"""A tiny real checkpoint (tokenizer + MoE + MTP) for engine, policy and server tests, and small
random checkpoints of the dense families.

Weights are random but scaled up so routing and sampling are not degenerate; nothing is trained,
so tests check mechanics (caches, logprobs, routes, swaps, protocols), not quality.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from kiln.model.checkpoint import save_checkpoint
from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.model.moe import MoeForCausalLM
from kiln.model.mtp import MTP
from kiln.model.tokenizer import list_corpus_files, train_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def tiny_config(vocab_size: int = 512, **kw) -> ModelConfig:
    return ModelConfig.from_depth(2, vocab_size=vocab_size, hidden_size=64, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, moe_intermediate_size=64,
                                  max_position_embeddings=2048, **kw)


def tiny_model(seed: int = 0, vocab_size: int = 512, scale: float = 4.0) -> tuple[MoeForCausalLM, MTP]:
    torch.manual_seed(seed)
    cfg = tiny_config(vocab_size)
    model, mtp = MoeForCausalLM(cfg).eval(), MTP(cfg, depth=2).eval()
    with torch.no_grad():
        for p in list(model.parameters()) + list(mtp.parameters()):
            if p.ndim > 1:
                p.mul_(scale)
    return model, mtp


def make_tiny_checkpoint(out: Path, seed: int = 0) -> Path:
    """tokenizer (vocab 512, trained on 1 MB of the stdlib) + model + MTP, in HF layout."""
    tok_dir = out / "tokenizer"
    tok = train_tokenizer(list_corpus_files([STDLIB / "json"]), tok_dir, vocab_size=512, max_bytes=1_000_000).tokenizer
    model, mtp = tiny_model(seed, vocab_size=tok.vocab_size)
    mtp.token_counts.copy_(torch.arange(tok.vocab_size) % 7)  # as if trained: counts for the drafter's vocabulary
    model.config.eos_token_id, model.config.pad_token_id = tok.eos_id, tok.pad_id
    return save_checkpoint(model, out / "ckpt", mtp=mtp, tokenizer_dir=tok_dir)


def dense_checkpoint(out: Path, model_type: str, vocab: int, tokenizer_dir: Path) -> Path:
    """A small random checkpoint of a dense family (qwen3, llama, gemma3_text), as `kiln pretrain
    --init` gets a real one, with the tokenizer files of tokenizer_dir."""
    extra = ({"hidden_act": "gelu_pytorch_tanh", "sliding_window": 16, "query_pre_attn_scalar": 16,
              "layer_types": ["sliding_attention", "full_attention"]} if model_type == "gemma3_text" else {})
    cfg = ModelConfig(model_type=model_type, vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      max_position_embeddings=512, tie_word_embeddings=True, **extra)
    torch.manual_seed(0)
    return save_checkpoint(build_model(cfg), out, tokenizer_dir=tokenizer_dir)
