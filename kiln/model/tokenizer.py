"""The byte-level BPE tokenizer: training on code, the HF directory layout, and kiln's wrapper.

Byte-level BPE with no normalizer means every string round-trips exactly (decode(encode(s)) == s),
which token-in/token-out training relies on. The special tokens sit at fixed ids 0..8 so model
code can name them without a lookup. The directory written here is what `transformers` expects
(tokenizer.json, tokenizer_config.json with the chat template, special_tokens_map.json), but kiln
itself reads it with `tokenizers` and `jinja2` only, through `KilnTokenizer`.
"""
from __future__ import annotations

import codecs
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# Order is the id: <|endoftext|> = 0 ... </think> = 8. Never reorder; append new ones at the end.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>", "<think>", "</think>")
MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # the specials plus one token per byte
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"  # a chat turn ends generation; documents pad
DEFAULT_MAX_BYTES = 32_000_000  # about the whole stdlib's source: 10-20 s at vocab 8192 on 2 cores
# transformers only uses this to warn about (or truncate) long inputs; a checkpoint can save its own.
DEFAULT_MODEL_MAX_LENGTH = 4096
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text(encoding="utf-8")
# tokenizer_config.json keys an imported tokenizer keeps for transformers (kiln's encode never adds BOS/EOS)
_KEPT_CONFIG = ("add_bos_token", "add_eos_token")

# What list_corpus_files takes from a directory: source and prose a coding model reads.
CORPUS_SUFFIXES = frozenset({".py", ".pyi", ".md", ".rst", ".txt", ".toml", ".json", ".c", ".h", ".cpp",
                             ".js", ".ts", ".sh", ".yaml", ".yml", ".cfg", ".ini"})
# Caches, VCS metadata and installed third-party packages are not the corpus someone pointed at.
SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "dist-packages"})
_CHUNK = 1 << 20  # read files a MiB at a time so a huge file never sits in memory whole


def list_corpus_files(roots: Iterable[Path]) -> list[Path]:
    """Files under `roots` (directories recursed for CORPUS_SUFFIXES; files taken as they are).

    Sorted within each root, roots in the order given: the same corpus always trains the same
    tokenizer. Hidden directories and SKIP_DIRS are not entered. Missing paths raise
    FileNotFoundError naming the path.
    """
    files: list[Path] = []
    for root in map(Path, roots):
        if root.is_file():
            files.append(root)
            continue
        if not root.is_dir():
            raise FileNotFoundError(f"corpus path {str(root)!r} does not exist")
        found = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
            found += [Path(dirpath, f) for f in filenames if Path(f).suffix.lower() in CORPUS_SUFFIXES]
        files += sorted(found)
    return files


@dataclass
class CorpusStats:
    """What iter_corpus actually read: files that gave text, and their UTF-8 bytes."""
    files: int = 0
    bytes: int = 0


def _read_text(path: Path, budget: int) -> Iterator[tuple[str, int]]:
    """(text, bytes) chunks of one UTF-8 file, at most `budget` bytes; nothing for binary files.

    A NUL byte or invalid UTF-8 in the first chunk (so, for nearly every source file, anywhere)
    skips the file: the stdlib's tests hold deliberately mis-encoded files. Past the first chunk a
    bad byte or a read error ends the file there, keeping what was already read. The incremental
    decoder holds back a character cut by a chunk boundary.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as f:
            raw = f.read(min(_CHUNK, budget))
            if b"\0" in raw:
                return
            while raw:
                yield decoder.decode(raw), len(raw)
                budget -= len(raw)
                raw = f.read(min(_CHUNK, budget)) if budget > 0 else b""
    except (OSError, UnicodeDecodeError):
        return


def iter_corpus(files: Iterable[Path], max_bytes: int | None = DEFAULT_MAX_BYTES,
                stats: CorpusStats | None = None, progress: bool = False) -> Iterator[str]:
    """Stream the files' text in chunks until `max_bytes` (None: no cap) have been read.

    `stats`, when given, is filled in as reading goes (the trainer consumes this iterator, so
    counting here is the only way to know what it saw).
    """
    files = list(files)
    budget = sys.maxsize if max_bytes is None else max_bytes
    stats = stats if stats is not None else CorpusStats()
    bar = None
    if progress:
        from kiln.progress import tqdm
        total = min(budget, sum(p.stat().st_size for p in files if p.is_file()))
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="reading corpus", leave=False)
    try:
        for path in files:
            used = 0
            for text, n in _read_text(path, budget):
                used += n
                if bar is not None:
                    bar.update(n)
                yield text
            if used:
                stats.files += 1
                stats.bytes += used
            budget -= used
            if budget <= 0:
                break
    finally:
        if bar is not None:
            bar.close()


@dataclass
class TrainResult:
    """The trained tokenizer (already saved) and what it was trained on."""
    tokenizer: KilnTokenizer
    files: int  # files that gave text
    bytes_read: int
    seconds: float


def train_tokenizer(files: Iterable[Path], out_dir: Path, vocab_size: int = 8192,
                    max_bytes: int | None = DEFAULT_MAX_BYTES, progress: bool = False) -> TrainResult:
    """Train byte-level BPE on `files` (streamed, at most `max_bytes`), save it to `out_dir`.

    The byte alphabet is seeded in full, so text never seen in training still encodes. `progress`
    shows a tqdm bar on stderr while the corpus is read (most of the training time). Raises
    ValueError for a vocabulary too small to hold the specials and bytes, or a corpus with no text.
    """
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab size {vocab_size} is too small: the {len(SPECIAL_TOKENS)} special tokens "
                         f"and 256 byte tokens need at least {MIN_VOCAB}")
    files = list(files)
    tok = Tokenizer(models.BPE())
    # No normalizer and no prefix space: the bytes in are the bytes out.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[_added(t) for t in SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # its bars print blank lines to stdout off a TTY
    stats, start = CorpusStats(), time.monotonic()
    tok.train_from_iterator(iter_corpus(files, max_bytes, stats, progress), trainer)
    if not stats.files:
        raise ValueError(f"the corpus has no readable text ({len(files)} files, all empty, binary or unreadable)")
    kiln_tok = KilnTokenizer(tok)
    kiln_tok.save(out_dir)
    return TrainResult(kiln_tok, stats.files, stats.bytes, time.monotonic() - start)


def _added(token: str) -> AddedToken:
    # Matched verbatim wherever it appears, never stripped of neighbouring spaces: exact round trip.
    return AddedToken(token, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter (utils/chat_template_utils.py); Jinja's own escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise TemplateError(message)


def _compile_template(source: str):
    """The template compiled as transformers compiles it, so both render the same bytes.

    Sandboxed because a template read from a checkpoint directory is code from elsewhere.
    """
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def _template_message(message: dict) -> dict:
    """The message as transformers hands it to a template: keys whose value is None dropped (OpenAI
    replies carry content=None beside tool_calls), reasoning found under any of its usual names."""
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in ("reasoning_content", "thinking", "reasoning") if k in out), None)
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out


class KilnTokenizer:
    """What the engine and trainers use: encode, decode, the special ids, the chat template.

    Special-token strings inside text encode to their special ids (the rendered chat template is
    plain text and must tokenise into control tokens), and decode keeps specials, so
    decode(encode(s)) == s for every string s.

    A vocabulary kiln did not train (an imported model's: `kiln model import-gguf`) names its own
    special tokens (`special_tokens`: bos/eos/pad/unk as tokenizer_config.json has them): eos_id is
    its eos token (what ends a reply), pad_id its pad token (else eos), endoftext_id its
    `<|endoftext|>` where it has one, else eos (what separates documents); kiln's other ids are
    looked up by string and are None where the vocabulary lacks them.
    """
    endoftext_id = pad_id = 0
    im_start_id = 1
    im_end_id = eos_id = 2
    tool_call_start_id, tool_call_end_id = 3, 4
    tool_response_start_id, tool_response_end_id = 5, 6
    think_start_id, think_end_id = 7, 8
    special_ids: ClassVar[dict[str, int]] = {token: i for i, token in enumerate(SPECIAL_TOKENS)}

    def __init__(self, tokenizer: Tokenizer, chat_template: str = CHAT_TEMPLATE,
                 model_max_length: int = DEFAULT_MODEL_MAX_LENGTH, special_tokens: dict | None = None,
                 extra_config: dict | None = None):
        self._tok = tokenizer
        self.special_tokens = special_tokens
        self.extra_config = dict(extra_config or {})  # tokenizer_config.json keys kept as they are (add_bos_token)
        if special_tokens is None:
            found = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
            if found != self.special_ids:
                raise ValueError(f"special tokens are not at kiln's fixed ids: expected {self.special_ids}, found {found}")
        else:
            self._own_specials(special_tokens)
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self._template = _compile_template(chat_template)

    def _own_specials(self, special_tokens: dict) -> None:
        def token_id(key: str) -> int | None:
            token = special_tokens.get(key)
            if token is None:
                return None
            i = self._tok.token_to_id(token)
            if i is None:
                raise ValueError(f"the {key} {token!r} is not in the vocabulary")
            return i

        ids = {t: self._tok.token_to_id(t) for t in SPECIAL_TOKENS}
        self.special_ids = {t: i for t, i in ids.items() if i is not None}
        (self.endoftext_id, self.im_start_id, self.im_end_id, self.tool_call_start_id, self.tool_call_end_id,
         self.tool_response_start_id, self.tool_response_end_id, self.think_start_id, self.think_end_id) = ids.values()
        self.eos_id = token_id("eos_token")
        if self.eos_id is None:
            raise ValueError("the tokenizer names no eos_token (tokenizer_config.json): kiln needs one to end replies")
        self.pad_id = token_id("pad_token")
        self.pad_id = self.eos_id if self.pad_id is None else self.pad_id
        self.endoftext_id = self.eos_id if self.endoftext_id is None else self.endoftext_id

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers` object underneath (to edit the vocabulary: trim_vocab.py)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = False) -> str:
        """The conversation as prompt text; identical to transformers' apply_chat_template(tokenize=False)."""
        if not messages:
            raise ValueError("cannot render an empty conversation")
        return self._template.render(messages=[_template_message(m) for m in messages], tools=tools,
                                     add_generation_prompt=add_generation_prompt)

    def save(self, out_dir: Path) -> None:
        """Write the directory transformers' AutoTokenizer loads (and load_tokenizer reads back)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(out / "tokenizer.json"))
        if self.special_tokens is None:
            specials = {"bos_token": None, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": None,
                        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)]}
        else:
            specials = {k: self.special_tokens.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        added = {i: t for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "added_tokens_decoder": {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                                              "rstrip": t.rstrip, "single_word": t.single_word, "special": True}
                                     for i, t in sorted(added.items())},
            "model_max_length": self.model_max_length,
            "clean_up_tokenization_spaces": False,  # any cleanup would break the exact round trip
            **self.extra_config,
            "chat_template": self.chat_template,
        }
        _write_json(out / "tokenizer_config.json", config)
        _write_json(out / "special_tokens_map.json", specials)
        # A template file left by transformers' save_pretrained would shadow the one just written.
        (out / "chat_template.jinja").unlink(missing_ok=True)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def load_tokenizer(path: Path) -> KilnTokenizer:
    """Read a tokenizer directory written by `save` (or by transformers' save_pretrained): kiln's
    own vocabulary, or an imported one with its own special tokens."""
    d = Path(path)
    if not (d / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {str(d)!r}: train one with `kiln tokenizer train`")
    config = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    # transformers' save_pretrained writes the template to its own file, which wins over the config key.
    template_file = d / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
    if template is None:
        raise ValueError(f"no chat template in {str(d)!r} (tokenizer_config.json or chat_template.jinja)")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    specials = None
    if any(tok.token_to_id(t) != i for i, t in enumerate(SPECIAL_TOKENS)):
        # older transformers files write a special token as {"content": ...}
        specials = {k: v.get("content") if isinstance(v, dict) else v
                    for k in ("bos_token", "eos_token", "pad_token", "unk_token") if (v := config.get(k)) is not None}
    extra = {k: config[k] for k in _KEPT_CONFIG if k in config}
    return KilnTokenizer(tok, template, config.get("model_max_length", DEFAULT_MODEL_MAX_LENGTH), specials, extra)


def bytes_per_token(tokenizer: KilnTokenizer, texts: Iterable[str]) -> float:
    """UTF-8 bytes per token over `texts`: how much text a context window holds."""
    n_bytes = n_tokens = 0
    for text in texts:
        n_bytes += len(text.encode("utf-8"))
        n_tokens += len(tokenizer.encode(text))
    return n_bytes / max(n_tokens, 1)
