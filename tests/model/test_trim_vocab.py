"""`kiln model trim-vocab`: a trimmed checkpoint gives the same logits, on the kept ids, for text
made of kept tokens; its tokenizer encodes that text to the same tokens under new ids and still
round-trips any text; kiln's own vocabulary and a SentencePiece one imported from GGUF."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kiln.cli import app
from kiln.model.checkpoint import load_checkpoint
from kiln.model.gguf_import import import_gguf
from kiln.model.tokenizer import list_corpus_files, load_tokenizer
from kiln.model.trim_vocab import TRIM_FILE, trim_checkpoint
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.tiny_model import make_tiny_checkpoint

CORPUS = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
OTHER = "ünïcode 🙂 and words the corpus never had: zebra, quokka\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def corpus_dir(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.py").write_text(CORPUS)
    return tmp_path / "corpus"


def check_trimmed(src, out, text: str) -> None:
    old_tok, new_tok = load_tokenizer(src), load_tokenizer(out)
    old_ids = json.loads((out / TRIM_FILE).read_text())["old_ids"]
    new_of = {old: new for new, old in enumerate(old_ids)}
    ids = old_tok.encode(text)
    assert set(ids) <= set(new_of)  # the text is made of kept tokens
    assert new_tok.encode(text) == [new_of[i] for i in ids]
    assert new_tok.decode(new_tok.encode(OTHER)) == OTHER  # anything else still encodes
    (old, _), (new, _) = load_checkpoint(src), load_checkpoint(out)
    assert new.config.vocab_size == len(old_ids) < old.config.vocab_size
    with torch.no_grad():
        want = old(torch.tensor([ids]))[..., old_ids]
        got = new(torch.tensor([new_tok.encode(text)]))
    assert want.abs().max() > 0.1 and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert new_tok.eos_id == new_of[old_tok.eos_id]


def test_trim_kilns_vocabulary(tiny, tmp_path):
    result = trim_checkpoint(tiny, list_corpus_files([corpus_dir(tmp_path)]), tmp_path / "out")
    assert result.before == 512 and result.kept < result.before and result.corpus_tokens > 5
    check_trimmed(tiny, tmp_path / "out", CORPUS)
    tok = load_tokenizer(tmp_path / "out")
    assert tok.special_tokens is None and tok.im_end_id == 2  # kiln's specials keep their fixed ids
    (_, src_mtp), (_, out_mtp) = load_checkpoint(tiny), load_checkpoint(tmp_path / "out")
    old_ids = json.loads((tmp_path / "out" / TRIM_FILE).read_text())["old_ids"]
    assert torch.equal(out_mtp.token_counts, src_mtp.token_counts[old_ids])  # the drafter's counts follow the ids


def test_trim_an_imported_sentencepiece_vocabulary(tmp_path):
    """Gemma's kind: byte fallback instead of a byte alphabet, merges derived from the token order."""
    from tests.model.gguf_files import sentencepiece_vocab, write_gguf
    from tests.model.test_gguf_import import make_model

    vocab = sentencepiece_vocab(CORPUS + "x = 1\nclass Point: pass\n")
    path = write_gguf(tmp_path / "g.gguf", make_model("gemma3", len(vocab["tokens"])), vocab)
    import_gguf(path, tmp_path / "gemma")
    result = trim_checkpoint(tmp_path / "gemma", list_corpus_files([corpus_dir(tmp_path)]), tmp_path / "out")
    assert result.kept < result.before
    check_trimmed(tmp_path / "gemma", tmp_path / "out", CORPUS)


def test_the_command_and_its_mistakes(tiny, tmp_path):
    runner = CliRunner()
    corpus = corpus_dir(tmp_path)
    result = runner.invoke(app, ["model", "trim-vocab", str(tiny), "--corpus", str(corpus), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert f"{tiny} -> {tmp_path / 'o'}: kept " in result.stdout and "of 512 tokens" in result.stdout

    def error_of(*args) -> str:
        r = runner.invoke(app, ["model", "trim-vocab", *map(str, args)])
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        return r.stderr.strip()

    assert error_of(tiny, "--corpus", tmp_path / "nope", "--out", tmp_path / "o2") == (
        f"error: corpus path {str(tmp_path / 'nope')!r} does not exist")
    assert error_of(corpus, "--corpus", corpus, "--out", tmp_path / "o2").startswith(
        f"error: {corpus}: no config.json; give a checkpoint folder")
    assert error_of(tiny, "--corpus", corpus, "--out", tiny) == (
        "error: --out must be a new folder, not the checkpoint itself")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.txt").write_bytes(b"\0\1\2")
    assert error_of(tiny, "--corpus", tmp_path / "bin", "--out", tmp_path / "o3").startswith(
        "error: the corpus has no readable text")
