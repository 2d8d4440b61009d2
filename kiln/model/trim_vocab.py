"""Vocabulary trimming (`kiln model trim-vocab`): a checkpoint whose vocabulary holds only the tokens
a corpus uses, so the embedding and the output head (on Gemma 3 270M, 168M of its 268M
parameters, and most of a decoding step's work) shrink to what the work needs.

What is kept: every token the corpus encodes to, the tokens a rendered chat turn uses, every
added (special) token, the ids config.json names (bos, eos, pad), and the base alphabet (the 256
byte tokens of a byte-level or byte-fallback vocabulary, else every one-character token), so any
text still encodes. Then the BPE merges are closed over: a kept token's parts are kept too, and
only merges whose result is kept remain. Encoding text whose original tokens are all kept then
applies exactly the same merges in the same order, so it gives the same tokens under new ids;
other text falls back to smaller pieces. New ids keep the old order (kiln's special tokens stay at
0-8). The embedding and head rows of kept tokens are copied; everything else is unchanged.
`vocab_trim.json` in the new checkpoint lists each new id's old id.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from kiln.model.checkpoint import (
    CONFIG,
    MTP_WEIGHTS,
    WEIGHTS,
    CheckpointError,
    read_tensors,
)
from kiln.model.mtp import COUNTS
from kiln.model.tokenizer import KilnTokenizer, iter_corpus, load_tokenizer

TRIM_FILE = "vocab_trim.json"
_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")
_CHAT_SAMPLE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]


class TrimError(ValueError):
    pass


@dataclass
class TrimResult:
    kept: int
    before: int
    corpus_tokens: int  # distinct tokens the corpus itself used
    corpus_bytes: int


def used_ids(tok: KilnTokenizer, files: list[Path], max_bytes: int | None) -> tuple[set[int], int]:
    """The ids the corpus encodes to (read in chunks of up to 1 MiB), and the bytes read."""
    ids, read = set(), 0
    for text in iter_corpus(files, max_bytes):
        ids.update(tok.encode(text))
        read += len(text.encode("utf-8"))
    return ids, read


def _chat_ids(tok: KilnTokenizer) -> set[int]:
    try:  # a template may refuse this sample (say, one without a system role): then nothing to add
        return set(tok.encode(tok.apply_chat_template(_CHAT_SAMPLE, add_generation_prompt=True)))
    except Exception:  # noqa: BLE001 - a jinja TemplateError or whatever a foreign template raises
        return set()


def _merge_pairs(model: dict) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def trim_tokenizer(data: dict, keep: set[int]) -> tuple[dict, list[int]]:
    """tokenizer.json (as a dict) restricted to `keep` plus what keeps encoding exact; returns the
    new dict and the old id of each new id."""
    model = data["model"]
    if model.get("type") != "BPE":
        raise TrimError(f"trim-vocab handles BPE tokenizers; this one is {model.get('type')!r}")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise TrimError("trim-vocab does not handle BPE with subword prefixes or suffixes")
    vocab: dict[str, int] = model["vocab"]
    token = {i: t for t, i in vocab.items()}
    keep = set(keep) | {a["id"] for a in data.get("added_tokens", [])}
    if model.get("byte_fallback"):
        keep |= {vocab[t] for t in (f"<0x{b:02X}>" for b in range(256)) if t in vocab}
    else:
        keep |= {i for t, i in vocab.items() if len(t) == 1}
    pairs = _merge_pairs(model)
    made_by: dict[str, list[tuple[str, str]]] = {}
    for a, b in pairs:
        made_by.setdefault(a + b, []).append((a, b))
    todo = [token[i] for i in keep if i in token]
    kept_tokens = set(todo)
    while todo:
        for a, b in made_by.get(todo.pop(), ()):
            for part in (a, b):
                if part not in kept_tokens:
                    kept_tokens.add(part)
                    todo.append(part)
    keep |= {vocab[t] for t in kept_tokens}
    old_ids = sorted(keep)
    new_id = {old: new for new, old in enumerate(old_ids)}
    model["vocab"] = {t: new_id[i] for t, i in vocab.items() if i in new_id}
    model["merges"] = [[a, b] for a, b in pairs if a + b in kept_tokens]
    data["added_tokens"] = [dict(a, id=new_id[a["id"]]) for a in data.get("added_tokens", [])]
    _remap_processor(data.get("post_processor"), new_id)
    return data, old_ids


def _remap_processor(node, new_id: dict[int, int]) -> None:
    """Special-token ids inside a post-processor (TemplateProcessing's `ids`, Bert/Roberta's pairs)."""
    if isinstance(node, dict):
        if isinstance(node.get("ids"), list) and "tokens" in node:
            node["ids"] = [new_id[i] for i in node["ids"]]
        for key in ("sep", "cls"):
            if isinstance(node.get(key), list) and len(node[key]) == 2:
                node[key][1] = new_id[node[key][1]]
        for value in node.values():
            _remap_processor(value, new_id)
    elif isinstance(node, list):
        for value in node:
            _remap_processor(value, new_id)


def trim_checkpoint(ckpt: str | Path, files: list[Path], out: str | Path, max_bytes: int | None = None) -> TrimResult:
    """Write `ckpt` with the vocabulary `files` use to `out` (a different folder)."""
    ckpt, out = Path(ckpt), Path(out)
    if not (ckpt / CONFIG).is_file():
        raise CheckpointError(f"{ckpt}: no {CONFIG}; give a checkpoint folder (from `kiln pretrain` or "
                              "`kiln model import-gguf`)")
    if out.resolve() == ckpt.resolve():
        raise TrimError("--out must be a new folder, not the checkpoint itself")
    tok = load_tokenizer(ckpt)
    config = json.loads((ckpt / CONFIG).read_text())
    corpus, nbytes = used_ids(tok, files, max_bytes)
    if not corpus:
        raise TrimError(f"the corpus has no readable text ({len(files)} files, all empty, binary or unreadable)")
    named = {i for k in ("bos_token_id", "eos_token_id", "pad_token_id")
             for i in ([config.get(k)] if not isinstance(config.get(k), list) else config[k]) if i is not None}
    named |= {i for i in (tok.eos_id, tok.pad_id, tok.endoftext_id) if i is not None}
    data, old_ids = trim_tokenizer(json.loads(tok.backend.to_str()), corpus | _chat_ids(tok) | named)
    remap = {old: new for new, old in enumerate(old_ids)}

    state = read_tensors(ckpt)
    index = torch.tensor(old_ids)
    for name in _VOCAB_ROWS:
        if name in state:
            if state[name].shape[0] != config["vocab_size"]:
                raise CheckpointError(f"{ckpt}: {name} has {state[name].shape[0]} rows, config.json's vocab_size "
                                      f"is {config['vocab_size']}")
            state[name] = state[name].index_select(0, index).contiguous()
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = config.get(k)
        if v is not None:
            config[k] = [remap[i] for i in v] if isinstance(v, list) else remap[v]
    before, config["vocab_size"] = config["vocab_size"], len(old_ids)

    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    if (ckpt / MTP_WEIGHTS).exists():  # MTP shares the embedding and head: only its token counts are per token
        with safe_open(str(ckpt / MTP_WEIGHTS), "pt") as fh:
            meta, mstate = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
        if COUNTS in mstate:
            mstate[COUNTS] = mstate[COUNTS].index_select(0, index).contiguous()
        save_file(mstate, str(out / MTP_WEIGHTS), metadata=meta)
    trimmed = KilnTokenizer(Tokenizer.from_str(json.dumps(data)), tok.chat_template, tok.model_max_length,
                            tok.special_tokens, tok.extra_config)
    trimmed.save(out)
    (out / TRIM_FILE).write_text(json.dumps({"source": str(ckpt), "vocab_size_before": before,
                                             "old_ids": old_ids}) + "\n")
    return TrimResult(len(old_ids), before, len(corpus), nbytes)
