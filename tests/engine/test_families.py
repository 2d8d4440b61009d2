"""Every model family in the engine: greedy decoding equals transformers' greedy `generate` on a
tiny random checkpoint of each (through native.c where it covers the family, through torch where
it does not, and batched with the cache's sliding-window masks), and `kiln serve` answers with a
dense family's checkpoint."""
from __future__ import annotations

import dataclasses
import logging

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.engine import Engine, SamplingParams
from kiln.model.checkpoint import copy_tokenizer, load_checkpoint, save_checkpoint
from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.model.layers import OffsetRMSNorm
from kiln.model.mtp import MTP
from kiln.serve import serve
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module

SMALL = {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 128, "num_hidden_layers": 2, "max_position_embeddings": 256}
CONFIGS = {
    "qwen3": ModelConfig(model_type="qwen3", **SMALL),
    "llama": ModelConfig(model_type="llama", tie_word_embeddings=True, rope_theta=1e5, **SMALL),
    "gemma3": ModelConfig(model_type="gemma3_text", hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
                          sliding_window=6, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
                          **SMALL),
}
NATIVE = {"qwen3": True, "llama": True, "gemma3": False}  # which families native.c computes
PROMPTS = [[5, 17, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48], [300, 2, 9, 11, 13, 21, 8, 7, 100, 101, 3]]
N = 12  # generated tokens: every prompt runs past the sliding window


def random_model(cfg: ModelConfig, seed: int = 0):
    """Weights large enough that greedy choices depend on the context (no ties, no constant reply)."""
    model = build_model(cfg)
    offset = {id(m.weight) for m in model.modules() if isinstance(m, OffsetRMSNorm)}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") and id(p) not in offset else 0.3 * noise)
        if cfg.model_type == "gemma3_text":  # undo the sqrt(hidden) embedding scale, or with a tied head the
            model.model.embed_tokens.weight /= cfg.hidden_size ** 0.5  # model repeats the last token forever
    return model.eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory):
    """(name, checkpoint dir, HF greedy continuations of PROMPTS)."""
    path = save_checkpoint(random_model(CONFIGS[request.param]), tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = []
    for p in PROMPTS:
        out = hf.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    assert len({tuple(w) for w in want}) == len(PROMPTS) and all(len(set(w)) > 2 for w in want), "degenerate model"
    return request.param, path, want


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_greedy_engine_output_equals_transformers_generate(family, native, caplog):
    name, path, want = family
    model, _ = load_checkpoint(path)
    with caplog.at_level(logging.WARNING, logger="kiln.engine.engine"):
        engine = Engine(model, native=native)
    assert (engine.native is not None) == (native and NATIVE[name])
    covered = [r.message for r in caplog.records if "does not cover" in r.message]
    line = f"kiln: the native decoding step does not cover {model.config.model_type} models; this engine decodes through torch"
    assert covered == ([line] if native and not NATIVE[name] else [])
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N))
    assert [c.token_ids for c in outs] == want
    assert all(c.routes is None for c in outs)  # a dense family routes nothing


def test_batched_decoding_with_slot_moves_equals_transformers(family):
    """Two slots for three prompts of different lengths: per-row masks (and sliding-window masks)
    over a shared cache, and a finished sequence's slot taken over by the last one."""
    _, path, want = family
    model, _ = load_checkpoint(path)
    lengths = [N, 4, N]
    outs = Engine(model, max_batch=2, native=False).generate(
        PROMPTS, [SamplingParams(temperature=0, max_tokens=n) for n in lengths])
    assert [c.token_ids for c in outs] == [w[:n] for w, n in zip(want, lengths)]


def test_serve_answers_with_a_dense_family(tiny_checkpoint, tmp_path):
    cfg = dataclasses.replace(CONFIGS["llama"], eos_token_id=2, pad_token_id=0)
    ckpt = save_checkpoint(random_model(cfg), tmp_path / "llama")
    copy_tokenizer(tiny_checkpoint, ckpt)  # the tiny checkpoint's 512-token tokenizer
    with serve(ckpt, port=0, request_timeout=60) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Fix a.py."}],
                                           temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert len(r.choices[0].model_extra["kiln"]["token_ids"]) == 8


def test_prefix_reuse_keeps_a_dense_familys_tokens(family):
    """RL workers keep finished sequences for prefix reuse; a dense family keeps no routes there."""
    _, path, want = family
    model, _ = load_checkpoint(path)
    engine = Engine(model, prefix_slots=4)
    params = SamplingParams(temperature=0, max_tokens=N)
    first = engine.generate(PROMPTS, params)
    again = engine.generate(PROMPTS, params)  # each prompt now restores its kept prefix
    assert [c.token_ids for c in first] == [c.token_ids for c in again] == want
    assert all(c.routes is None for c in again)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_speculative_decoding_with_mtp_keeps_greedy_tokens(family, native):
    """MTP drafts for the dense Qwen3/Llama block: greedy output stays the plain greedy output."""
    name, path, want = family
    if name == "gemma3":
        pytest.skip("MTP is not built for Gemma 3 (model/mtp.py)")
    model, _ = load_checkpoint(path)
    torch.manual_seed(1)
    engine = Engine(model, mtp=MTP(model.config, depth=2).eval(), native=native)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N))
    assert [c.token_ids for c in outs] == want
    assert engine.spec_stats.steps > 0
