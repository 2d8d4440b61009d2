"""kiln's MoE model against Hugging Face's `Qwen3MoeForCausalLM`, and kiln's checkpoint format.

Parity is checked with scrambled weights (std 0.2, norms around 1) so the logits are O(1) and the
routers pick different experts per token: with the default 0.02 init every logit is ~0 and every
router is near uniform, and a wrong expert layout or routing rule would go unnoticed.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from kiln.model.checkpoint import (
    CONFIG,
    INDEX,
    MTP_WEIGHTS,
    WEIGHTS,
    CheckpointError,
    load_checkpoint,
    read_tensors,
    save_checkpoint,
)
from kiln.model.config import ModelConfig
from kiln.model.moe import MoeForCausalLM
from kiln.model.mtp import MTP
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module

# One dense layer, GQA 4:2, raw (unnormalised) top-k weights, tied embeddings.
DENSE_FIRST = ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
                          moe_intermediate_size=32, intermediate_size=96, mlp_only_layers=[0],
                          norm_topk_prob=False, tie_word_embeddings=True, rope_theta=5000.0)
# All MoE, GQA 4:1, normalised top-3 weights, separate head.
ALL_MOE = ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=48, norm_topk_prob=True, tie_word_embeddings=False)
CONFIGS = pytest.mark.parametrize("cfg", [DENSE_FIRST, ALL_MOE], ids=["dense-first-tied", "all-moe-untied"])
ATOL = 1e-4


def scramble(module: torch.nn.Module, seed: int, std: float = 0.2) -> torch.nn.Module:
    """Weights large enough that logits are O(1) and routing depends on the token."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else std * noise)
    return module.eval()


def tokens(vocab: int, shape=(2, 24), seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def hf_load(path: Path) -> Qwen3MoeForCausalLM:
    # eager attention: HF's own repeat_kv GQA path, independent of kiln's SDPA call
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def assert_routing_is_nontrivial(model: MoeForCausalLM, ids: torch.Tensor) -> None:
    routes = model.trunk(ids).routes
    for layer in range(routes.shape[2]):
        assert routes[:, :, layer].unique().numel() >= model.config.num_experts - 1, "routing is degenerate"


@CONFIGS
def test_kiln_checkpoint_loads_in_transformers_with_same_logits(cfg, tmp_path):
    torch.manual_seed(0)
    kiln = scramble(MoeForCausalLM(cfg), seed=1)
    save_checkpoint(kiln, tmp_path)
    hf = hf_load(tmp_path)
    assert hf.config.mlp_only_layers == cfg.mlp_only_layers
    assert hf.config.norm_topk_prob == cfg.norm_topk_prob
    assert hf.config.tie_word_embeddings == cfg.tie_word_embeddings
    assert hf.config.num_key_value_heads == cfg.num_key_value_heads

    ids = tokens(cfg.vocab_size)
    with torch.no_grad():
        ours, theirs = kiln(ids), hf(ids).logits
        assert_routing_is_nontrivial(kiln, ids)
    assert ours.std() > 0.5, "logits too small for the comparison to mean anything"
    diff = (ours - theirs).abs().max().item()
    print(f"kiln->HF {cfg.num_experts} experts: max |logit diff| = {diff:.2e}, logit std {ours.std():.2f}")
    assert diff <= ATOL


@CONFIGS
def test_transformers_checkpoint_loads_in_kiln_with_same_logits(cfg, tmp_path):
    torch.manual_seed(0)
    hf = scramble(Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg.to_hf(), attn_implementation="eager")), seed=2)
    hf.save_pretrained(tmp_path)
    kiln, mtp = load_checkpoint(tmp_path)
    assert mtp is None
    assert kiln.config == cfg
    if cfg.tie_word_embeddings:
        assert kiln.lm_head.weight is kiln.model.embed_tokens.weight

    ids = tokens(cfg.vocab_size, seed=3)
    with torch.no_grad():
        ours, theirs = kiln(ids), hf(ids).logits
        assert_routing_is_nontrivial(kiln, ids)
    assert ours.std() > 0.5
    diff = (ours - theirs).abs().max().item()
    print(f"HF->kiln {cfg.num_experts} experts: max |logit diff| = {diff:.2e}")
    assert diff <= ATOL


def test_checkpoint_with_tokenizer_loads_with_auto_classes(tmp_path):
    from kiln.model.tokenizer import train_tokenizer

    corpus = tmp_path / "corpus.py"
    corpus.write_text("".join(f"def f{i}(x, y):\n    return x * {i} + y  # sum {i}\n" for i in range(300)))
    tok_dir = tmp_path / "tok"
    kiln_tok = train_tokenizer([corpus], tok_dir, vocab_size=512).tokenizer
    assert kiln_tok.vocab_size == 512

    cfg = ModelConfig.from_depth(1, vocab_size=kiln_tok.vocab_size, eos_token_id=kiln_tok.eos_id,
                                 pad_token_id=kiln_tok.pad_id)
    kiln = scramble(MoeForCausalLM(cfg), seed=4)
    ckpt = save_checkpoint(kiln, tmp_path / "ckpt", tokenizer_dir=tok_dir)

    tok = AutoTokenizer.from_pretrained(ckpt)
    text = "def g(a, b):\n    return a * 7 + b  # ünïcode ✓\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == kiln_tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.eos_token_id == kiln_tok.eos_id and tok.pad_token_id == kiln_tok.pad_id
    assert len(ids) < len(text.encode()), "BPE merged nothing"

    hf = hf_load(ckpt)
    x = torch.tensor([ids])
    with torch.no_grad():
        assert (hf(x).logits - kiln(x)).abs().max() <= ATOL


def test_round_trip_is_bit_identical_including_mtp(tmp_path):
    cfg = DENSE_FIRST
    kiln = scramble(MoeForCausalLM(cfg), seed=5)
    mtp = scramble(MTP(cfg, depth=2), seed=6)
    save_checkpoint(kiln, tmp_path, mtp=mtp)
    # on disk: one 2-D tensor per expert and projection (the published Qwen3-MoE layout)
    stored = read_tensors(tmp_path)
    assert "model.layers.1.mlp.experts.5.gate_proj.weight" in stored
    assert not any(k.endswith("gate_up_proj") for k in stored)
    assert "lm_head.weight" not in stored  # tied: written once
    with safe_open(str(tmp_path / MTP_WEIGHTS), "pt") as fh:
        assert fh.metadata()["depth"] == "2"

    kiln2, mtp2 = load_checkpoint(tmp_path)
    assert not kiln2.training and not mtp2.training
    for before, after in ((kiln, kiln2), (mtp, mtp2)):
        a, b = before.state_dict(), after.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert load_checkpoint(tmp_path, with_mtp=False)[1] is None


def test_bf16_save(tmp_path):
    cfg = ALL_MOE
    kiln = scramble(MoeForCausalLM(cfg), seed=7)
    save_checkpoint(kiln, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / CONFIG).read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in read_tensors(tmp_path).values())
    assert kiln.lm_head.weight.dtype == torch.float32  # saving does not cast the live model

    loaded, _ = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    for k, v in kiln.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16)), k
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hf.dtype == torch.bfloat16


def test_sharded_checkpoint_loads(tmp_path):
    cfg = ALL_MOE
    kiln = scramble(MoeForCausalLM(cfg), seed=8)
    save_checkpoint(kiln, tmp_path / "single")
    state = read_tensors(tmp_path / "single")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    out = tmp_path / "sharded"
    out.mkdir()
    (out / CONFIG).write_text((tmp_path / "single" / CONFIG).read_text())
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(out / fname), metadata={"format": "pt"})
    weight_map = {k: fname for fname, keys in shards.items() for k in keys}
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert not (out / WEIGHTS).exists()

    loaded, _ = load_checkpoint(out)
    for k, v in kiln.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    ids = tokens(cfg.vocab_size)
    with torch.no_grad():  # and transformers reads the same shards
        assert (hf_load(out)(ids).logits - kiln(ids)).abs().max() <= ATOL


def test_config_mismatch_is_a_clear_error(tmp_path):
    save_checkpoint(scramble(MoeForCausalLM(ALL_MOE), seed=9), tmp_path)
    good = json.loads((tmp_path / CONFIG).read_text())

    (tmp_path / CONFIG).write_text(json.dumps({**good, "num_hidden_layers": 1}))
    with pytest.raises(CheckpointError, match=r"do not match the config.*unexpected \['model\.layers\.1\."):
        load_checkpoint(tmp_path)

    (tmp_path / CONFIG).write_text(json.dumps({**good, "moe_intermediate_size": 40}))
    with pytest.raises(CheckpointError, match=r"experts\.(gate_up_proj|down_proj) has shape .* config wants"):
        load_checkpoint(tmp_path)


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"no config\.json; is this a checkpoint directory"):
        load_checkpoint(tmp_path)
    (tmp_path / CONFIG).write_text(json.dumps(ALL_MOE.to_hf()))
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_checkpoint(tmp_path)
