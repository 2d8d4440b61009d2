"""The local policy: a kiln checkpoint decoded by kiln's own engine, with the token data RL needs.

Token-in, token-out (DESIGN.md "Principles"): within one conversation, each turn's prompt is the
previous turn's prompt ids and completion ids exactly as sampled, then the tokens of the messages
appended since. Re-tokenising the rendered conversation instead would feed the trainer tokens the
model never produced: the harness keeps a parsed reply (thinking, content and tool calls, which
the template renders back in its own layout), and BPE may split the same text differently.

One policy object serves one conversation at a time (one agent). Alone, it steps its engine on
the caller's thread; given an `EngineRunner`, it only submits and waits, so the policies of many
concurrent rollouts share one engine and its batches.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from kiln.engine import Engine, SamplingParams
from kiln.harness.agent import ContextFull
from kiln.harness.trajectory import TurnRecord

_PROBE = "\x00kiln-probe\x00"  # text no real reply contains, to find where the template closes a turn


@dataclass
class _Turn:
    """The previous call: what the next call's prompt may continue."""
    messages: list[dict]  # a copy: the harness appends to its list in place
    prompt_text: str  # the rendered prompt, generation prompt included
    ids: list[int]  # prompt ids + completion ids
    ended_turn: bool  # the completion ends with the end-of-turn token


class LocalPolicy:
    name = "local"

    def __init__(self, engine: Engine, tokenizer, params: SamplingParams | None = None, runner=None,
                 timeout_s: float = 600.0):
        self.engine, self.tok, self.runner, self.timeout_s = engine, tokenizer, runner, timeout_s
        self.params = params or SamplingParams()
        if self.params.stop:
            raise ValueError("the local policy ends a turn at the end-of-turn token; stop strings would cut "
                             "text out of the reply that its tokens still hold (give stop_token_ids instead)")
        self.turn_end = _assistant_turn_end(tokenizer)
        self.eos_text = tokenizer.decode([tokenizer.eos_id])
        self._last: _Turn | None = None
        self._calls = 0

    @classmethod
    def from_checkpoint(cls, path: str | Path, params: SamplingParams | None = None, speculative: bool = True,
                        max_len: int | None = None, device: str = "cpu") -> LocalPolicy:
        """Model, MTP drafter (speculative decoding, when the checkpoint has one) and tokenizer
        from a checkpoint directory; each turn reuses the last one's keys and values (prefix reuse)."""
        from kiln.model.checkpoint import load_checkpoint
        from kiln.model.tokenizer import load_tokenizer

        model, mtp = load_checkpoint(path, device=device, with_mtp=speculative)
        tok = load_tokenizer(path)
        return cls(Engine(model, tok, mtp=mtp, max_batch=1, max_len=max_len, prefix_slots=1), tok, params)

    @property
    def context_window(self) -> int:
        """The engine's context (tokens): the harness summarises at a fraction of it."""
        return self.engine.max_len

    def count_tokens(self, text: str) -> int:
        return len(self.tok.encode(text))

    def generate(self, messages: list[dict], tools: list[dict], max_tokens: int) -> TurnRecord:
        start = time.monotonic()
        # No tools=: the harness's system message already lists the tool schemas, and the template
        # would render them a second time.
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        prompt = self._continuation(messages, text)
        if prompt is None:  # a new conversation, or a self-summary's fresh segment
            prompt = self.tok.encode(text)
        lookahead = self.engine.mtp.depth if self.engine.mtp is not None else 0  # draft positions
        if len(prompt) + lookahead + 1 >= self.engine.max_len:
            raise ContextFull(f"the prompt has {len(prompt)} tokens; the engine's context is {self.engine.max_len}")
        # A seeded policy is reproducible, but each call draws from its own stream (seed + call
        # number): one seed for every turn would repeat the same random choices turn after turn.
        seed = None if self.params.seed is None else self.params.seed + self._calls
        self._calls += 1
        params = dataclasses.replace(self.params, max_tokens=max_tokens, seed=seed)
        if self.runner is None:
            c = self.engine.generate([prompt], params)[0]
        else:  # the runner's thread steps the engine; other rollouts' turns share the batch
            c = self.engine.submit(prompt, params).wait(self.timeout_s)
        ended = c.token_ids[-1] == self.tok.eos_id
        self._last = _Turn(copy.deepcopy(messages), text, prompt + c.token_ids, ended)
        # The text of exactly the tokens (a reply cut inside a character keeps its partial bytes),
        # less the stop token that ended it.
        reply = self.tok.decode(c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids)
        return TurnRecord(text=reply, finish_reason=c.finish_reason, prompt_tokens=len(prompt),
                          completion_tokens=len(c.token_ids), duration_s=time.monotonic() - start,
                          prompt_ids=prompt, completion_ids=c.token_ids, logprobs=c.logprobs,
                          versions=c.versions, routes=c.routes)

    def _continuation(self, messages: list[dict], text: str) -> list[int] | None:
        """The prompt ids when `messages` are the previous call's messages + the assistant reply
        + new messages: the previous ids, the rest of the assistant turn's closing, then the new
        messages' rendered text. None when they are not, or the renderings do not line up."""
        last = self._last
        if last is None:
            return None
        n = len(last.messages)
        if len(messages) < n + 2 or messages[:n] != last.messages or messages[n].get("role") != "assistant":
            return None
        through_reply = self.tok.apply_chat_template(messages[: n + 1])
        if not (through_reply.startswith(last.prompt_text) and through_reply.endswith(self.turn_end)
                and text.startswith(through_reply)):
            return None
        # The sampled end-of-turn token already stands for the start of the closing; a reply cut
        # off by max_tokens (or ended by another stop token) gets the whole closing.
        closing = self.turn_end
        if last.ended_turn and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text):]
        return last.ids + self.tok.encode(closing + text[len(through_reply):])


def _assistant_turn_end(tokenizer) -> str:
    """What the chat template writes after an assistant message's content ("<|im_end|>\\n")."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}])
    return text[text.index(_PROBE) + len(_PROBE):]
