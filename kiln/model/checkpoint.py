"""Checkpoints in Hugging Face layout: config.json + model.safetensors (+ tokenizer files), and
the MTP module beside them in mtp.safetensors (HF ignores files it does not know). Every family
(families.py) reads and writes the same way; config.json's model_type says which one loads.

Experts are written one tensor per expert and projection (`mlp.experts.3.gate_proj.weight`), the
layout of published Qwen3-MoE checkpoints that every transformers version reads; in memory they
are fused 3-D tensors. Loading accepts both layouts and sharded checkpoints
(`model.safetensors.index.json`), so a real Qwen3-MoE directory loads on a GPU.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kiln.model.causal_lm import CausalLM
from kiln.model.config import ModelConfig
from kiln.model.families import build_model

WEIGHTS, INDEX, MTP_WEIGHTS, CONFIG = "model.safetensors", "model.safetensors.index.json", "mtp.safetensors", "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    pass


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused [E, 2I, D] / [E, D, I] expert tensors -> one 2-D tensor per expert and projection."""
    out = {}
    for name, t in state.items():
        if name.endswith(".experts.gate_up_proj"):
            base, inner = name[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = t[e, :inner].contiguous()
                out[f"{base}.{e}.up_proj.weight"] = t[e, inner:].contiguous()
        elif name.endswith(".experts.down_proj"):
            base = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of split_experts; tensors already fused pass through."""
    out, parts = {}, {}
    for name, t in state.items():
        m = _EXPERT.match(name)
        if m:
            parts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        else:
            out[name] = t
    for base, projs in parts.items():
        n = len(projs["down_proj"])
        gate = [projs["gate_proj"][e] for e in range(n)]
        up = [projs["up_proj"][e] for e in range(n)]
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat((g, u)) for g, u in zip(gate, up)])
        out[f"{base}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out


def save_checkpoint(model: CausalLM, out_dir: str | Path, mtp: torch.nn.Module | None = None,
                    tokenizer_dir: str | Path | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write the model (and MTP module, tokenizer files) to `out_dir` in HF layout. Files are
    written under temporary names and renamed, so a crash never leaves a half checkpoint."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to(dtype) if dtype else v.detach()).cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    cfg = model.config.to_hf()
    cfg["dtype"] = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
    _atomic(out / CONFIG, lambda p: p.write_text(json.dumps(cfg, indent=2) + "\n"))
    _atomic(out / WEIGHTS, lambda p: save_file(split_experts(state), str(p), metadata={"format": "pt"}))
    if mtp is not None:
        mstate = {k: (v.detach().to(dtype) if dtype and v.is_floating_point() else v.detach()).cpu().contiguous()
                  for k, v in mtp.state_dict().items()}  # the token counts stay integers
        meta = {"format": "pt", "depth": str(len(mtp.layers))}
        _atomic(out / MTP_WEIGHTS, lambda p: save_file(split_experts(mstate), str(p), metadata=meta))
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
    return out


def copy_tokenizer(src_dir: str | Path, out_dir: str | Path) -> None:
    """Copy the tokenizer files that exist in src_dir into out_dir (created if missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        src = Path(src_dir) / name
        if src.exists() and src.resolve() != (out / name).resolve():
            shutil.copyfile(src, out / name)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)


def read_config(ckpt_dir: str | Path) -> ModelConfig:
    path = Path(ckpt_dir) / CONFIG
    if not path.exists():
        raise CheckpointError(f"{ckpt_dir}: no {CONFIG}; is this a checkpoint directory? "
                              f"(expected {CONFIG} and {WEIGHTS}, as `kiln pretrain` writes)")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except ValueError as e:  # a family or setting kiln does not run: name the file
        raise CheckpointError(f"{path}: {e}") from None


def read_tensors(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the model, one file or shards, expert layout as stored."""
    d = Path(ckpt_dir)
    if (d / WEIGHTS).exists():
        files = [d / WEIGHTS]
    elif (d / INDEX).exists():
        files = sorted({d / f for f in json.loads((d / INDEX).read_text())["weight_map"].values()})
    else:
        raise CheckpointError(f"{d}: no {WEIGHTS} or {INDEX}")
    state = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():  # noqa: SIM118 (safe_open is not iterable)
                state[k] = fh.get_tensor(k)
    return state


def load_checkpoint(ckpt_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    with_mtp: bool = True):
    """(model, mtp or None) from a checkpoint directory, in eval mode; the family (model class) is
    config.json's model_type (or architectures)."""
    from kiln.model.mtp import COUNTS, MTP

    cfg = read_config(ckpt_dir)
    with torch.device("meta"):
        model = build_model(cfg)
    state = fuse_experts(read_tensors(ckpt_dir))
    if cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    _load_into(model, state, ckpt_dir)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(device=device, dtype=dtype).eval()
    mtp = None
    path = Path(ckpt_dir) / MTP_WEIGHTS
    if with_mtp and path.exists():
        with safe_open(str(path), "pt") as fh:
            depth = int(fh.metadata()["depth"])
            mstate = fuse_experts({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118
        mstate.setdefault(COUNTS, torch.zeros(cfg.vocab_size, dtype=torch.int64))  # written before the counts
        with torch.device("meta"):
            mtp = MTP(cfg, depth)
        _load_into(mtp, mstate, path)
        mtp.to(device=device, dtype=dtype).eval()
    return model, mtp


def _load_into(module: torch.nn.Module, state: dict[str, torch.Tensor], where) -> None:
    expected = set(module.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise CheckpointError(f"{where}: tensors do not match the config "
                              f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    for name, t in state.items():
        if tuple(t.shape) != shapes[name]:
            raise CheckpointError(f"{where}: {name} has shape {tuple(t.shape)}, config wants {shapes[name]}")
    module.load_state_dict(state, assign=True, strict=True)


def read_weights(ckpt_dir: Path, model: torch.nn.Module, mtp: torch.nn.Module | None):
    """(state, mtp_state or None) for `model`/`mtp` from a checkpoint directory, checked name by
    name and shape by shape. Without mtp.safetensors the served MTP module keeps its weights (it
    only drafts: stale drafts are rejected more often, never change what is sampled)."""
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
    state = fuse_experts(read_tensors(ckpt_dir))
    _check_fits(state, model, ckpt_dir)
    mtp_state = None
    if mtp is not None and (ckpt_dir / MTP_WEIGHTS).exists():
        from kiln.model.mtp import COUNTS

        mtp_state = fuse_experts(load_file(str(ckpt_dir / MTP_WEIGHTS)))
        mtp_state.setdefault(COUNTS, mtp.state_dict()[COUNTS])  # written before the counts: keep the served ones
        _check_fits(mtp_state, mtp, ckpt_dir / MTP_WEIGHTS)
    return state, mtp_state


def _check_fits(state: dict[str, torch.Tensor], module: torch.nn.Module, where: Path) -> None:
    own = module.state_dict()
    tied = getattr(getattr(module, "config", None), "tie_word_embeddings", False)
    missing = set(own) - set(state) - ({"lm_head.weight"} if tied else set())
    unexpected = set(state) - set(own)
    if missing or unexpected:
        raise CheckpointError(f"{where}: tensors do not match the served model "
                              f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
    for name, t in state.items():
        if t.shape != own[name].shape:
            raise CheckpointError(f"{where}: {name} has shape {tuple(t.shape)}, the served model's is "
                                  f"{tuple(own[name].shape)}")
