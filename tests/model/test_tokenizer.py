"""The tokenizer: exact round trip, fixed special ids, parity with transformers, corpus reading, CLI."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.exceptions import TemplateError
from typer.testing import CliRunner

from kiln.cli import app
from kiln.model.tokenizer import (
    SPECIAL_TOKENS,
    CorpusStats,
    KilnTokenizer,
    iter_corpus,
    list_corpus_files,
    load_tokenizer,
    train_tokenizer,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
VOCAB = 1024


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A small tokenizer trained on 3 MB of the stdlib (about a second)."""
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(list_corpus_files([STDLIB]), out, vocab_size=VOCAB, max_bytes=3_000_000)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir) -> KilnTokenizer:
    return load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tok_dir))


# --- round trip and special tokens ---------------------------------------------------------------

NASTY = [
    "", " ", "  leading and trailing  ", "\t\tindented\n", "a\r\nb\r\n\r\n", "\r", "\x00\x01\x07\x1b[31mred\x7f",
    "é vs e\u0301 (no normalisation)", "🎉👩‍👩‍👧 emoji", "\u200b\ufeff\u00a0", "\U0010ffff\U0001f600", "ﬁ ǅ ß İ",
    "<|im_end|>", "<|im_start|>user\nhi<|im_end|>\n", "<think></think><tool_call>{}</tool_call>",
    "<|im_end", "< |im_end|>", "<<|endoftext|>>", "x" * 5000, " " * 300, "\n" * 50,
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # comment\n",
]


@pytest.mark.parametrize("text", NASTY)
def test_round_trip_is_exact(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=8), st.sampled_from(SPECIAL_TOKENS))).map("".join))
def test_round_trip_text_with_special_strings(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_have_fixed_ids(tok, tok_dir):
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.encode(token) == [i]
        assert tok.special_ids[token] == i
    assert (tok.endoftext_id, tok.pad_id, tok.im_start_id, tok.im_end_id, tok.eos_id) == (0, 0, 1, 2, 2)
    assert (tok.tool_call_start_id, tok.tool_call_end_id, tok.tool_response_start_id,
            tok.tool_response_end_id, tok.think_start_id, tok.think_end_id) == (3, 4, 5, 6, 7, 8)
    assert tok.encode("a<|im_end|>b").count(tok.im_end_id) == 1
    assert tok.vocab_size == VOCAB
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None and config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_rejects_a_tokenizer_without_the_fixed_ids():
    from tokenizers import Tokenizer, models
    with pytest.raises(ValueError, match="fixed ids"):
        KilnTokenizer(Tokenizer(models.BPE()))


# --- transformers parity -------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "grep", "description": "Search for a pattern « in » files.",
                                      "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}}}},
]


def _call(cid: str, name: str, arguments) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


PLAIN = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi! ünïcödé 🎉"},
    {"role": "assistant", "content": "Hello.\n\tHow can I help?"},
    {"role": "user", "content": "Write <|im_end|> literally."},
]
HARNESS = [
    {"role": "system", "content": "You are a coding agent working in /work."},
    {"role": "user", "content": "Fix the failing test."},
    {"role": "assistant", "content": "", "reasoning_content": "Look at the code first.",
     "tool_calls": [_call("call_0_0", "read_file", '{"path": "app.py"}'),
                    _call("call_0_1", "grep", {"pattern": "def main", "note": "é"})]},
    {"role": "tool", "tool_call_id": "call_0_0", "name": "read_file", "content": "def main():\n    return 1\n"},
    {"role": "tool", "tool_call_id": "call_0_1", "name": "grep", "content": "app.py:1: def main():"},
    {"role": "assistant", "content": "Now the tests.", "reasoning_content": "main returns 1.",
     "tool_calls": [_call("call_1_0", "read_file", {"path": "test_app.py"})]},
    {"role": "tool", "tool_call_id": "call_1_0", "name": "read_file", "content": ""},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_2_0", "grep", "{}")]},
    {"role": "tool", "tool_call_id": "call_2_0", "name": "grep", "content": "no matches"},
    {"role": "user", "content": "Keep going."},
    {"role": "assistant", "content": "Fixed main.", "reasoning_content": ""},
]
NO_SYSTEM = [{"role": "user", "content": "List the files."},
             {"role": "assistant", "content": None, "reasoning_content": "ls", "tool_calls": [
                 _call("c0", "read_file", '{"path": "."}'), _call("c1", "read_file", '{"path": ".."}')]},
             {"role": "tool", "tool_call_id": "c0", "name": "read_file", "content": "a.py"}]


def test_transformers_loads_and_encodes_the_same(tok, hf):
    assert hf.eos_token_id == tok.eos_id and hf.pad_token_id == tok.pad_id and hf.bos_token is None
    text = (STDLIB / "json" / "decoder.py").read_text() + "\r\n🎉 <|im_start|>user\n<think>x</think>"
    ids = tok.encode(text)
    assert hf.encode(text, add_special_tokens=False) == ids
    assert hf.decode(ids) == text == tok.decode(ids)


@pytest.mark.parametrize("messages", [PLAIN, HARNESS, NO_SYSTEM], ids=["plain", "harness", "no-system"])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "no-gen"])
def test_chat_template_matches_transformers(tok, hf, messages, tools, gen):
    ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen)
    assert ours == hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
    assert tok.decode(tok.encode(ours)) == ours


_text = st.text(max_size=20)
_arguments = st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), _text), max_size=3)
_calls = st.lists(st.builds(_call, _text, st.sampled_from(["read_file", "grep"]),
                            st.one_of(_arguments, _arguments.map(json.dumps))), max_size=3)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": _text}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none() | _text},
                          optional={"reasoning_content": _text, "tool_calls": _calls}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": _text, "content": _text}),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(_message, min_size=1, max_size=6), st.sampled_from([None, TOOLS]), st.booleans())
def test_chat_template_matches_transformers_on_any_conversation(tok, hf, messages, tools, gen):
    ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen)
    assert ours == hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)


def test_rendered_harness_conversation(tok):
    text = tok.apply_chat_template(HARNESS, tools=TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a coding agent working in /work.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1  # the tools merged into the harness's system message
    assert '\n<tools>\n{"type": "function", "function": {"name": "read_file"' in text
    assert "Search for a pattern « in » files." in text  # tojson keeps non-ASCII as is
    assert ("<|im_start|>assistant\n<think>\nLook at the code first.\n</think>\n\n"
            '<tool_call>\n{"name": "read_file", "arguments": {"path": "app.py"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "grep", "arguments": {"pattern": "def main", "note": "é"}}\n</tool_call>'
            "<|im_end|>\n") in text
    # Two consecutive tool results share one user turn.
    assert ("<|im_start|>user\n<tool_response>\ndef main():\n    return 1\n\n</tool_response>\n"
            "<tool_response>\napp.py:1: def main():\n</tool_response><|im_end|>\n") in text
    assert text.count("<tool_response>") == 4 and text.count("<|im_start|>user\n<tool_response>") == 3
    assert "Now the tests.\n<tool_call>\n" in text  # content, then a newline, then the call
    assert "<|im_start|>assistant\n<tool_call>\n{\"name\": \"grep\", \"arguments\": {}}" in text  # content None
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nFixed main.<|im_end|>\n" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_rendered_without_tools_or_system(tok):
    assert tok.apply_chat_template(PLAIN[1:2]) == "<|im_start|>user\nHi! ünïcödé 🎉<|im_end|>\n"
    text = tok.apply_chat_template(NO_SYSTEM, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n") and "<|im_start|>user\nList the files." in text
    assert "<tools>" not in tok.apply_chat_template(NO_SYSTEM)


def test_rendered_text_tokenises_into_control_tokens(tok):
    ids = tok.encode(tok.apply_chat_template(HARNESS, add_generation_prompt=True))
    tail = [tok.im_start_id, *tok.encode("assistant\n")]
    assert ids[0] == tok.im_start_id and ids[-len(tail):] == tail
    assert ids.count(tok.tool_response_start_id) == 4 and ids.count(tok.think_start_id) == 3


def test_template_errors(tok):
    with pytest.raises(TemplateError, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(TemplateError, match="content must be a string"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([])


def test_save_and_load_keep_everything(tok, hf, tmp_path):
    tok.save(tmp_path / "again")
    again = load_tokenizer(tmp_path / "again")
    assert again.encode("def f(): pass") == tok.encode("def f(): pass")
    assert again.apply_chat_template(HARNESS, tools=TOOLS) == tok.apply_chat_template(HARNESS, tools=TOOLS)
    hf.save_pretrained(tmp_path / "hf")  # transformers moves the template to chat_template.jinja
    from_hf = load_tokenizer(tmp_path / "hf")
    assert from_hf.apply_chat_template(HARNESS, tools=TOOLS) == tok.apply_chat_template(HARNESS, tools=TOOLS)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "missing")


# --- corpus reading and training errors ----------------------------------------------------------

def _tree(root: Path) -> Path:
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "pkg" / "a.py").write_text("def add(a, b):\n    return a + b\n" * 20)
    (root / "pkg" / "b.md").write_text("# Notes\n\nSome prose about `add`.\n" * 20)
    (root / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0\1binary")
    (root / ".git" / "config.cfg").write_text("hidden")
    (root / "logo.png").write_bytes(b"\x89PNG")
    (root / "blob.txt").write_bytes(b"text\0with a NUL")
    (root / "latin1.txt").write_bytes("caf\xe9 ok\n".encode() + b"bad \xe9 byte")
    return root


def test_list_corpus_files_is_filtered_and_sorted(tmp_path):
    root = _tree(tmp_path / "corpus")
    files = list_corpus_files([root, root / "logo.png"])
    assert [f.relative_to(tmp_path).as_posix() for f in files] == [
        "corpus/blob.txt", "corpus/latin1.txt", "corpus/pkg/a.py", "corpus/pkg/b.md", "corpus/logo.png"]
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        list_corpus_files([tmp_path / "does-not-exist"])


def test_iter_corpus_skips_binary_and_caps_bytes(tmp_path):
    root = _tree(tmp_path / "corpus")
    stats = CorpusStats()
    text = "".join(iter_corpus(list_corpus_files([root, root / "logo.png"]), None, stats))
    assert "\0" not in text and "caf" not in text and "PNG" not in text
    assert stats.files == 2  # a.py and b.md: the NUL, invalid UTF-8 and .png files are skipped
    (tmp_path / "u.txt").write_text("ab€cd")  # € is 3 bytes: a cap of 4 cuts it
    assert "".join(iter_corpus([tmp_path / "u.txt"], 4)) == "ab"


def test_train_errors(tmp_path):
    with pytest.raises(ValueError, match="at least 265"):
        train_tokenizer([], tmp_path / "t", vocab_size=264)
    (tmp_path / "empty.py").write_text("")
    with pytest.raises(ValueError, match="no readable text"):
        train_tokenizer([tmp_path / "empty.py"], tmp_path / "t", vocab_size=300)


# --- CLI -----------------------------------------------------------------------------------------

runner = CliRunner()


def test_cli_train_and_encode(tmp_path):
    root, out = _tree(tmp_path / "corpus"), tmp_path / "tok"
    result = runner.invoke(app, ["tokenizer", "train", "--corpus", str(root), "--out", str(out), "--vocab", "300"])
    assert result.exit_code == 0, result.output
    assert "2 files" in result.stdout and "vocab 300" in result.stdout and "bytes/token" in result.stdout
    assert {p.name for p in out.iterdir()} == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    result = runner.invoke(app, ["tokenizer", "encode", "--tokenizer", str(out), "def add<|im_end|>"])
    assert result.exit_code == 0, result.output
    first, *rows = result.stdout.splitlines()
    assert first.endswith(f"tokens: {load_tokenizer(out).encode('def add<|im_end|>')}")
    assert rows[-1].split() == ["2", "'<|im_end|>'"]


@pytest.mark.parametrize("args, message", [
    (["--corpus", "/does/not/exist"], "'/does/not/exist' does not exist"),
    (["--corpus", "{empty}"], "no corpus files under"),
    (["--vocab", "100"], "at least 265"),
])
def test_cli_train_errors(tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    args = [a.format(empty=tmp_path / "empty") for a in args]
    result = runner.invoke(app, ["tokenizer", "train", "--out", str(tmp_path / "tok"), *args])
    assert result.exit_code == 2 and message in result.output and "error:" in result.output
