"""What the server answers: the assistant message built from generated text, logprobs, stream deltas.

With tools in play the text is split the way kiln's harness splits it (`format.parse_reply`, the
Hermes format): `<think>` becomes reasoning_content, well-formed `<tool_call>` blocks become
tool_calls, the rest is content. If any block is malformed no tool_calls are returned and every
block stays in the content verbatim, so a client (kiln's harness, say) still sees what the model
wrote and can tell it what was wrong, as vLLM's hermes parser falls back to text. Without tools
(or with tool_choice "none") the text is returned exactly as generated.

`lead` is what the prompt already opened: THINK_OPEN when a chat template starts the reply inside
a think block (kiln's never does). A `</think>` that nothing opened is text, not the end of
reasoning: otherwise everything before it, already streamed as content, would turn into reasoning.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kiln.harness.format import (
    CALL_CLOSE,
    CALL_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    openai_tool_calls,
    parse_reply,
)


def build_message(text: str, parse_tools: bool, id_prefix: str, lead: str = "") -> dict:
    if not parse_tools:
        return {"role": "assistant", "content": text}
    text = lead + text
    if THINK_OPEN not in text and THINK_CLOSE in text:
        text = THINK_OPEN + THINK_CLOSE + text  # an empty think block: parse_reply then leaves the tag in
    reply = parse_reply(text, id_prefix)
    msg: dict = {"role": "assistant"}
    if reply.errors:
        msg["content"] = "\n".join(part for part in (reply.content, reply.tool_text) if part)
    elif reply.calls:
        msg["content"] = reply.content or None
        msg["tool_calls"] = openai_tool_calls(reply.calls)
    else:
        msg["content"] = reply.content
    if reply.thinking:
        msg["reasoning_content"] = reply.thinking
    return msg


def finish_reason(message: dict, engine_reason: str) -> str:
    return "tool_calls" if message.get("tool_calls") else engine_reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Envelope:
    """The fields every response and chunk of one request share."""
    id: str
    created: int
    model: str
    version: int  # the policy version when the request arrived, as system_fingerprint

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": f"kiln-v{self.version}"}

    def completion(self, choices: list[dict], usage_: dict) -> dict:
        return {**self._head("chat.completion"), "choices": choices, "usage": usage_}

    def chunk(self, choices: list[dict], usage_: dict | None = None, with_usage: bool = False) -> dict:
        body = {**self._head("chat.completion.chunk"), "choices": choices}
        if with_usage:  # stream_options.include_usage: null on every chunk, the totals on the last
            body["usage"] = usage_
        return body


def kiln_extras(token_ids: list[int], versions: list[int]) -> dict:
    """What RL needs and OpenAI has no field for: the tokens and the policy version of each."""
    return {"token_ids": list(token_ids), "versions": list(versions)}


# ---- logprobs -------------------------------------------------------------------------------

@cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it stands for (GPT-2's table)."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """Each token's bytes, read from the checkpoint's tokenizer.json on first use. A byte-level
    token can hold part of a character, so decoding it alone would lose bytes OpenAI's `bytes` keeps."""

    def __init__(self, tokenizer_json: Path):
        self.path, self._table = tokenizer_json, None

    def __call__(self, token_id: int) -> bytes:
        if self._table is None:
            from tokenizers import Tokenizer

            tok, table = Tokenizer.from_file(str(self.path)), _byte_decoder()
            added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
            self._table = [added[i].encode() if i in added else
                           bytes(table.get(c, 0) for c in tok.id_to_token(i) or "")
                           for i in range(tok.get_vocab_size(with_added_tokens=True))]
        return self._table[token_id] if token_id < len(self._table) else b""


def logprob_entries(token_ids: list[int], logprobs: list[float], token_bytes: TokenBytes) -> list[dict]:
    out = []
    for tok, lp in zip(token_ids, logprobs):
        raw = token_bytes(tok)
        out.append({"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw), "top_logprobs": []})
    return out


# ---- streaming -------------------------------------------------------------------------------

class StreamSplitter:
    """Raw text deltas -> reasoning_content and content deltas that add up to `build_message`'s
    fields. Reasoning inside <think> and content before the first tool-call tag stream as they
    come; whitespace the final strip may drop and partial tags are held back; everything from the
    first tool-call tag on waits for the end, when the whole text says whether the blocks parse."""

    def __init__(self, lead: str = ""):
        self.text = lead
        self.sent = {"reasoning_content": "", "content": ""}

    def push(self, delta: str) -> dict[str, str]:
        self.text += delta
        return self._advance(*_stable(self.text))

    def finish(self, message: dict) -> dict[str, str]:
        return self._advance(message.get("reasoning_content") or "", message.get("content") or "")

    def _advance(self, reasoning: str, content: str) -> dict[str, str]:
        out = {}
        for key, full in (("reasoning_content", reasoning), ("content", content)):
            sent = self.sent[key]
            if len(full) > len(sent) and full.startswith(sent):
                out[key], self.sent[key] = full[len(sent):], full
        return out


def _stable(text: str) -> tuple[str, str]:
    """(reasoning, content) of a partial reply that later text cannot change, as parse_reply splits it."""
    before, opened, after = text.partition(THINK_OPEN)
    reasoning = ""
    if opened:
        think, closed, tail = after.partition(THINK_CLOSE)
        reasoning = think.strip() if closed else _settled(think.lstrip(), (THINK_CLOSE,))
        before = before + tail if closed else before
    content = before.partition(CALL_OPEN)[0].partition(CALL_CLOSE)[0]  # a stray close tag is an error
    return reasoning, _settled(content.lstrip(), (THINK_OPEN, CALL_OPEN, CALL_CLOSE))


def _settled(text: str, tags: tuple[str, ...]) -> str:
    """`text` without a trailing partial tag and trailing whitespace (both may yet change)."""
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:n]):
                text = text[:-n]
                break
    return text.rstrip()
