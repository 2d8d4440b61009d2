"""Incremental detokenisation with stop strings, for streaming.

Byte-level BPE tokens can end inside a UTF-8 character, so text is released only once it decodes
cleanly; text that could be the start of a stop string is held back until it is known not to be.
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""  # decoded so far, stop string excluded
        # ids[:clean] decode to clean_text, which ends on a whole character: byte-level BPE decodes
        # piecewise there, so each token decodes only the few ids after it (not all of them again)
        self.clean, self.clean_text = 0, ""
        self.sent = 0  # characters of text already released as deltas
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the newly releasable text."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        text = self.clean_text + self.tok.decode(self.ids[self.clean:])
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return ""
        self.clean, self.clean_text = len(self.ids), text
        for s in self.stop:
            at = text.find(s, max(0, len(self.text) - len(s)))
            if at >= 0:
                text, self.stopped = text[:at], True
        self.text = text
        hold = 0 if self.stopped else self._partial_stop(text)
        delta = text[self.sent: len(text) - hold]
        self.sent += len(delta)
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever was held back."""
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta

    def _partial_stop(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
