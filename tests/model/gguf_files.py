"""Tiny GGUF files written the way llama.cpp's converter writes them, for import tests.

`write_gguf` takes a kiln model (HF names and layout) and writes it through `gguf.GGUFWriter`:
llama q/k rows permuted, Gemma norms stored as 1 + w, tensors named by gguf's own tensor map, and
2-D tensors spread over several storage types (F16, BF16, Q8_0, Q5_0, Q4_1, Q4_0 and K-quants).
The writer cannot quantise to K-quants, so a K-quant tensor is written as random blocks with sane
scales: the file is then the truth, and both importers must read the same weights from it.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from kiln.model.config import ModelConfig
from kiln.model.gguf_import import FAMILIES

ARCH = {v: k for k, v in FAMILIES.items()}  # kiln's family -> llama.cpp's architecture
Q = gguf.GGMLQuantizationType
# the storage types 2-D tensors take in turn; rows a multiple of 256 wide take K-quants instead
CYCLE = (Q.F16, Q.Q8_0, Q.Q5_0, Q.Q4_1, Q.BF16, Q.Q4_0, Q.F32)
KQUANTS = (Q.Q4_K, Q.Q6_K)
# where each K-quant block keeps its fp16 scales, and the scale giving weights of ~0.1
_KQUANT_SCALES = {Q.Q4_K: ((0, 2e-4), (2, 1e-4)), Q.Q6_K: ((208, 3e-5),)}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf: each head's rows from (half, pair) to (pair, half) order
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_kquant(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    for offset, scale in _KQUANT_SCALES[qtype]:
        d = (rng.uniform(0.5, 1.5, size=(rows, cols // block)) * scale).astype(np.float16)
        raw[..., offset:offset + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_gguf(path: Path, model, tokenizer: dict, storage: str = "mixed", seed: int = 0) -> Path:
    """Write `model` (a kiln CausalLM) as a GGUF file. storage: "mixed" (the cycle of types,
    K-quants where they fit) or "f32" (lossless: the file holds the model's exact weights)."""
    cfg: ModelConfig = model.config
    arch = ARCH[cfg.model_type]
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if cfg.model_type == "qwen3_moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    _add_tokenizer(w, tokenizer)

    rng = np.random.default_rng(seed)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        del state["lm_head.weight"]
    turn = kturn = 0
    for key, t in state.items():
        if ".q_proj." in key and arch == "llama":
            t = _permute(t, cfg.num_attention_heads)
        if ".k_proj." in key and arch == "llama":
            t = _permute(t, cfg.num_key_value_heads)
        if "norm" in key and arch == "gemma3":
            t = t + 1.0
        parts = [(key, t)]
        if key.endswith("experts.gate_up_proj"):  # llama.cpp keeps gate and up apart
            base, inner = key.removesuffix(".gate_up_proj"), t.shape[1] // 2
            parts = [(f"{base}.gate_proj", t[:, :inner]), (f"{base}.up_proj", t[:, inner:])]
        for k, part in parts:
            name = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps"}.get(k.rsplit(".", 1)[-1])
            name = (f"blk.{k.split('.')[2]}.{name}" if name else names.get_name(k, try_suffixes=(".weight", ".bias")))
            name = name if name.endswith((".weight", ".bias")) else name + ".weight"
            part = np.ascontiguousarray(part, dtype=np.float32)
            if storage == "f32" or part.ndim == 1:
                w.add_tensor(name, part)
                continue
            cols = part.shape[-1]
            if cols % 256 == 0:
                qtype = KQUANTS[kturn % len(KQUANTS)]
                kturn += 1
                rows = int(np.prod(part.shape[:-1]))
                raw = _random_kquant(rows, cols, qtype, rng).reshape(*part.shape[:-1], -1)
            else:
                qtype = CYCLE[turn % len(CYCLE)]
                turn += 1
                raw = gguf.quants.quantize(part, qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tokenizer(w: gguf.GGUFWriter, tok: dict) -> None:
    w.add_tokenizer_model(tok["model"])
    w.add_tokenizer_pre(tok.get("pre", "default"))
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if "merges" in tok:
        w.add_token_merges(tok["merges"])
    if "scores" in tok:
        w.add_token_scores(tok["scores"])
    for key in ("bos", "eos", "unk", "pad"):
        if key in tok:
            getattr(w, {"unk": "add_unk_token_id", "pad": "add_pad_token_id"}.get(key, f"add_{key}_token_id"))(tok[key])
    w.add_add_bos_token(tok.get("add_bos", False))
    if tok.get("chat_template"):
        w.add_chat_template(tok["chat_template"])


def bpe_vocab(tokenizer_dir: Path, chat_template: str | None) -> dict:
    """A byte-level BPE vocabulary in GGUF's terms ("gpt2"), from a kiln tokenizer directory:
    tokens by id, merges, kiln's nine specials marked control."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [3 if i < 9 else 1 for i in range(len(tokens))]  # 3: control, 1: normal
    return {"model": "gpt2", "tokens": tokens, "merges": merges, "types": types, "eos": 2, "pad": 0,
            "chat_template": chat_template}


SP = "\u2581"  # SentencePiece's space


def sentencepiece_vocab(text: str) -> dict:
    """A Gemma-style SentencePiece vocabulary ("llama" tokenizer model): <pad> <eos> <bos> <unk> <mask>,
    256 byte-fallback tokens, every character of `text`, then every prefix of its words (so each
    piece splits into two pieces, as the merges derived from the token order need)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]  # Gemma's first five
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = text.replace(" ", SP)
    chars = sorted(set(pieces))
    words = sorted({SP + w for w in text.split()} | set(text.split()), key=lambda s: (len(s), s))
    prefixes = []
    for word in words:
        for n in range(2, len(word) + 1):
            if word[:n] not in prefixes:
                prefixes.append(word[:n])
    tokens = specials + byte_tokens + chars + sorted(prefixes, key=len)
    types = [3] * len(specials) + [6] * 256 + [1] * (len(chars) + len(prefixes))  # 6: byte
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(chars) + len(prefixes))]
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores,
            "bos": 2, "eos": 1, "unk": 3, "pad": 0, "add_bos": True}
