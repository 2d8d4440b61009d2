"""The dense families (Qwen3, Llama, Gemma 3 text) against their `transformers` classes, each on
tiny random configs: fp32 logits within 1e-5 both ways (kiln -> HF and HF -> kiln), the same
state-dict names, bit-identical save/load round trips, and the configs published checkpoints use.

Weights are scrambled (std 0.2, norms away from identity) so logits are O(1): at the default
0.02 init every logit is ~0 and a wrong layout would go unnoticed. Sequences are longer than the
sliding windows, so windowed layers see a different context from global ones.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kiln.config import project_path
from kiln.model import layers
from kiln.model.checkpoint import (
    CONFIG,
    CheckpointError,
    load_checkpoint,
    read_tensors,
    save_checkpoint,
)
from kiln.model.config import ARCHITECTURES, ModelConfig
from kiln.model.families import build_model
from kiln.model.layers import OffsetRMSNorm
from kiln.model.mtp import MTP
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module

SMALL = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "intermediate_size": 96}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
CONFIGS = {
    "qwen3": ModelConfig(model_type="qwen3", num_hidden_layers=2, rope_theta=5000.0, **SMALL),
    "qwen3-sliding-tied": ModelConfig(model_type="qwen3", num_hidden_layers=3, tie_word_embeddings=True,
                                      layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                                      sliding_window=6, **SMALL),
    # SmolLM2's shape in small: tied embeddings, 3:1 GQA, head_dim = hidden / heads
    "llama-llama3rope-tied": ModelConfig(model_type="llama", num_hidden_layers=2, tie_word_embeddings=True,
                                         rope_theta=100000.0, rope_scaling=LLAMA3_ROPE,
                                         **{**SMALL, "num_attention_heads": 6, "head_dim": 12, "hidden_size": 72}),
    "llama-bias-linear": ModelConfig(model_type="llama", num_hidden_layers=2, attention_bias=True, mlp_bias=True,
                                     rope_scaling={"rope_type": "linear", "factor": 2.0}, **SMALL),
    "gemma3-tied": ModelConfig(model_type="gemma3_text", hidden_act="gelu_pytorch_tanh", num_hidden_layers=3,
                               tie_word_embeddings=True, sliding_window=5, query_pre_attn_scalar=24,
                               layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                               rope_theta=1e6, rope_local_base_freq=1e4, **{**SMALL, "num_key_value_heads": 1}),
    "gemma3-softcap-untied": ModelConfig(model_type="gemma3_text", hidden_act="gelu_pytorch_tanh", num_hidden_layers=2,
                                         sliding_window=7, query_pre_attn_scalar=16, final_logit_softcapping=4.0,
                                         layer_types=["sliding_attention", "full_attention"], **SMALL),
}
FAMILIES = pytest.mark.parametrize("name", list(CONFIGS))
ATOL = 1e-5


def scramble(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights std 0.2; norms 1 + 0.2 noise (offset norms: 0.2 noise, the same scale)."""
    offset = {id(m.weight) for m in model.modules() if isinstance(m, OffsetRMSNorm) or "Gemma3RMSNorm" in type(m).__name__}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            norm = name.endswith("norm.weight") and id(p) not in offset
            p.copy_(1.0 + 0.2 * noise if norm else 0.2 * noise)
    return model.eval()


def tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


def hf_load(path):
    # eager attention: HF's own repeat_kv GQA and mask path, independent of kiln's SDPA calls
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@FAMILIES
def test_kiln_checkpoint_loads_in_transformers_with_the_same_logits(name, tmp_path):
    cfg = CONFIGS[name]
    kiln = scramble(build_model(cfg), seed=1)
    save_checkpoint(kiln, tmp_path)
    hf = hf_load(tmp_path)
    assert type(hf).__name__ == ARCHITECTURES[cfg.model_type]
    assert set(hf.state_dict()) == set(kiln.state_dict())  # the same names, lm_head included
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in read_tensors(tmp_path)  # written once
    ids = tokens(cfg.vocab_size)
    with torch.no_grad():
        ours, theirs = kiln(ids), hf(ids).logits
    assert ours.std() > 0.5, "logits too small for the comparison to mean anything"
    print(f"{name} kiln->HF: max |logit diff| {max_diff(ours, theirs):.2e}, logit std {ours.std():.2f}")
    assert max_diff(ours, theirs) <= ATOL


@FAMILIES
def test_transformers_checkpoint_loads_in_kiln_with_the_same_logits(name, tmp_path):
    cfg = CONFIGS[name]
    hf_cfg = AutoConfig.for_model(**cfg.to_hf())
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = scramble(AutoModelForCausalLM.from_config(hf_cfg), seed=2)
    hf.save_pretrained(tmp_path)
    kiln, mtp = load_checkpoint(tmp_path)
    assert mtp is None and type(kiln).__name__.endswith("ForCausalLM")
    assert kiln.config == cfg
    if cfg.tie_word_embeddings:
        assert kiln.lm_head.weight is kiln.model.embed_tokens.weight
    ids = tokens(cfg.vocab_size, seed=3)
    with torch.no_grad():
        ours, theirs = kiln(ids), hf(ids).logits
    assert ours.std() > 0.5
    print(f"{name} HF->kiln: max |logit diff| {max_diff(ours, theirs):.2e}")
    assert max_diff(ours, theirs) <= ATOL


@FAMILIES
def test_round_trip_is_bit_identical(name, tmp_path):
    cfg = CONFIGS[name]
    kiln = scramble(build_model(cfg), seed=4)
    save_checkpoint(kiln, tmp_path)
    assert json.loads((tmp_path / CONFIG).read_text())["architectures"] == [ARCHITECTURES[cfg.model_type]]
    again, _ = load_checkpoint(tmp_path)
    assert type(again) is type(kiln) and again.config == cfg
    a, b = kiln.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_loading_a_checkpoint_for_inference_does_not_import_torch_dynamo(tmp_path):
    """A worker, `kiln serve` or `kiln agent` loads weights without training: the meta-device build
    must not run an init whose meta kernel imports torch._dynamo (~0.9 s of every start-up)."""
    base, _ = load_checkpoint(project_path("bases/tiny"))  # the preset's MoE, tied embeddings
    save_checkpoint(base, tmp_path, mtp=MTP(base.config, 1))
    code = ("import sys; from kiln.model.checkpoint import load_checkpoint; "
            f"m, mtp = load_checkpoint({str(tmp_path)!r}); assert mtp is not None; "
            "print('torch._dynamo' in sys.modules, float(m.model.embed_tokens.weight.abs().sum()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "False"
    assert float(out[1]) == float(base.model.embed_tokens.weight.detach().abs().sum()) > 0


def test_sliding_window_changes_what_a_layer_sees():
    """The window is live in these tests: widening it changes the logits past the window."""
    cfg = CONFIGS["gemma3-tied"]
    narrow = scramble(build_model(cfg), seed=5)
    wide = build_model(dataclasses.replace(cfg, sliding_window=64))
    wide.load_state_dict(narrow.state_dict())
    ids = tokens(cfg.vocab_size)
    with torch.no_grad():
        a, b = narrow(ids), wide.eval()(ids)
    w = cfg.sliding_window
    assert torch.equal(a[:, :w], b[:, :w])  # within the window nothing differs
    assert max_diff(a[:, w:], b[:, w:]) > 1e-2


@pytest.fixture(params=["mask", "spans"])
def packing(request, monkeypatch):
    """Both ways of keeping packed documents apart (layers.document_mask picks by row length)."""
    monkeypatch.setattr(layers, "SPANS_FROM", 10**9 if request.param == "mask" else 1)
    return request.param


@pytest.mark.parametrize("name", ["gemma3-tied", "qwen3-sliding-tied"])
def test_packed_documents_with_sliding_windows_match_documents_run_alone(name, packing):
    cfg = CONFIGS[name]
    model = scramble(build_model(cfg), seed=6)
    a, b = tokens(cfg.vocab_size, seed=7)[0, :15], tokens(cfg.vocab_size, seed=8)[0, :9]
    packed = torch.cat((a, b))[None]
    docs = torch.tensor([[0] * 15 + [1] * 9])
    pos = torch.cat((torch.arange(15), torch.arange(9)))[None]
    with torch.no_grad():
        together = model(packed, positions=pos, doc_ids=docs)[0]
        alone = torch.cat((model(a[None])[0], model(b[None])[0]))
    assert max_diff(together, alone) < 1e-5


@pytest.mark.parametrize("name", [*CONFIGS, "qwen3-moe"])
def test_the_trunk_at_some_positions_equals_the_whole_trunk_there(name, packing):
    """trunk(at=) runs the last layer's queries and MLP only where a loss will read: the same
    hidden states there as the whole trunk, over packed documents (and routes replayed, MoE)."""
    cfg = ModelConfig.from_depth(2, vocab_size=256) if name == "qwen3-moe" else CONFIGS[name]
    model = scramble(build_model(cfg), seed=4)
    ids, docs = tokens(cfg.vocab_size, seed=5), torch.tensor([[0] * 15 + [1] * 9] * 2)
    pos = torch.cat((torch.arange(15), torch.arange(9))).expand(2, 24)
    at = torch.rand(2, 24, generator=torch.Generator().manual_seed(6)) < 0.3
    with torch.no_grad():
        whole = model.trunk(ids, positions=pos, doc_ids=docs)
        some = model.trunk(ids, positions=pos, doc_ids=docs, routes=whole.routes, at=at)
    assert some.hidden.shape == (int(at.sum()), cfg.hidden_size) and some.replaced == 0
    assert torch.allclose(some.hidden, whole.hidden[at], rtol=1e-5, atol=ATOL)


def test_router_replay_and_mtp_say_which_families_they_cover():
    llama = build_model(CONFIGS["llama-llama3rope-tied"])
    ids = tokens(256)
    assert llama.trunk(ids).routes is None  # nothing routed, nothing captured
    with pytest.raises(ValueError, match="router replay is for mixture-of-experts models only.*'llama'"):
        llama.trunk(ids, routes=torch.zeros(2, 24, 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="MTP layers are built for .* not 'gemma3_text'.*mtp_depth=0"):
        MTP(CONFIGS["gemma3-tied"], depth=1)
    mtp = MTP(CONFIGS["llama-llama3rope-tied"], depth=2)  # a dense block of the family's own
    out = mtp(llama, llama.trunk(ids).hidden, ids)
    assert [tuple(o.shape) for o in out] == [(2, 23, 256), (2, 22, 256)]


def test_published_config_forms_load():
    """Hub configs as released: SmolLM2 (Llama, v4 keys) and Gemma 3 (sliding_window_pattern,
    rope_local_base_freq) become the configs transformers 5 reads them as."""
    smol = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
            "intermediate_size": 1536, "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
            "rms_norm_eps": 1e-5, "rope_theta": 100000, "rope_scaling": None, "tie_word_embeddings": True,
            "vocab_size": 49152, "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    cfg = ModelConfig.from_hf(smol)
    assert (cfg.model_type, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.num_experts) == ("llama", 64, 1e5, None, 0)
    assert cfg.to_hf()["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e5}
    gemma = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
             "intermediate_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
             "num_hidden_layers": 12, "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1e6,
             "rope_local_base_freq": 1e4, "rope_scaling": None, "query_pre_attn_scalar": 256, "vocab_size": 1024,
             "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None, "attn_logit_softcapping": None}
    cfg = ModelConfig.from_hf(gemma)
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    assert (cfg.rope_theta, cfg.rope_local_base_freq, cfg.tie_word_embeddings) == (1e6, 1e4, True)
    hf = AutoConfig.for_model(**cfg.to_hf())  # what transformers makes of kiln's config.json
    assert hf.layer_types == cfg.layer_types and hf.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    with pytest.raises(ValueError, match="soft-capping"):
        ModelConfig.from_hf({**gemma, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_hf({**smol, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_a_family_kiln_does_not_run_is_a_clear_error(tmp_path):
    save_checkpoint(build_model(CONFIGS["qwen3"]), tmp_path)
    good = json.loads((tmp_path / CONFIG).read_text())
    (tmp_path / CONFIG).write_text(json.dumps({**good, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match=r"config\.json: config\.json has model_type 'gpt2'; kiln loads qwen3_moe, "
                                              r"qwen3, llama, gemma3_text checkpoints"):
        load_checkpoint(tmp_path)
    # architectures alone (no model_type) still names the family
    (tmp_path / CONFIG).write_text(json.dumps({k: v for k, v in good.items() if k != "model_type"}))
    assert type(load_checkpoint(tmp_path)[0]).__name__ == "Qwen3ForCausalLM"
