"""The routes' logic, free of HTTP: health, models, chat completions (whole or streamed), admin.

A chat request's n choices are submitted to the engine together, so they batch with each other and
with every other request in flight. Every wait has a deadline (`timeout`): past it the client gets
a 504 rather than a hung connection. A streamed request with n > 1 sends its choices one after the
other (they still generate concurrently; the later ones are already buffered).
"""
from __future__ import annotations

import hmac
import queue
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

from safetensors import SafetensorError

from kiln.engine.runner import EngineRunner
from kiln.harness.format import THINK_OPEN
from kiln.model.checkpoint import CheckpointError

from .protocol import (
    APIError,
    ChatRequest,
    LoadWeights,
    parse_body,
    render_prompt,
    sampling_params,
)
from .responses import (
    Envelope,
    StreamSplitter,
    TokenBytes,
    build_message,
    finish_reason,
    kiln_extras,
    logprob_entries,
    usage,
)


@dataclass
class App:
    runner: EngineRunner
    tokenizer: object  # KilnTokenizer
    token_bytes: TokenBytes
    model_name: str
    timeout: float  # seconds any request may wait on the engine
    admin_token: str | None = None
    started: int = 0

    @property
    def engine(self):
        return self.runner.engine

    def _alive(self) -> None:
        if self.runner.error is not None:
            raise APIError(500, f"the engine failed and this server cannot generate: {self.runner.error!r}; "
                                "restart it", type="server_error")

    # ---- GET --------------------------------------------------------------------------------
    def health(self) -> dict:
        self._alive()
        eng = self.engine
        return {"status": "ok", "model": self.model_name, "version": eng.version, "running": len(eng.running),
                "waiting": eng.waiting.qsize(), "peak_running": self.runner.peak_running}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.started,
                                            "owned_by": "kiln", "max_model_len": self.engine.max_len}]}

    # ---- admin ------------------------------------------------------------------------------
    def check_admin(self, authorization: str | None) -> None:
        if self.admin_token is None:
            return
        if not hmac.compare_digest((authorization or "").encode(), f"Bearer {self.admin_token}".encode()):
            raise APIError(401, "admin routes need the header `Authorization: Bearer <admin token>` "
                                "(the token given to --admin-token)", type="authentication_error")

    def load_weights(self, raw: bytes) -> dict:
        req = parse_body(raw, LoadWeights)
        self._alive()
        try:
            return self.runner.load_weights(req.checkpoint, req.version, self.timeout)
        except (CheckpointError, SafetensorError, OSError) as e:
            raise APIError(400, f"weights not loaded, still serving version {self.engine.version}: {e}",
                           param="checkpoint") from None
        except TimeoutError as e:
            raise APIError(504, str(e), type="timeout_error") from None
        except RuntimeError as e:
            raise APIError(500, str(e), type="server_error") from None

    # ---- chat completions -------------------------------------------------------------------
    def chat(self, raw: bytes) -> dict | Iterator[dict]:
        """The response body, or for stream=True an iterator of chunks (which may raise APIError
        after the first, for the server to send as an error event)."""
        req = parse_body(raw, ChatRequest)
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        self._alive()
        prompt = render_prompt(req, self.tokenizer)
        ids = self.tokenizer.encode(prompt)
        lead = THINK_OPEN if prompt.rstrip().endswith(THINK_OPEN) else ""  # the template opened a think block
        room = self.engine.max_len - len(ids)
        if room <= 0:
            raise APIError(400, f"the prompt is {len(ids)} tokens; this server's context is {self.engine.max_len} "
                                "(shorten the messages, or restart with a larger --max-len)",
                           param="messages", code="context_length_exceeded")
        try:
            reqs = [self.engine.submit(ids, sampling_params(req, i, room), stream=req.stream) for i in range(req.n)]
        except ValueError as e:
            raise APIError(400, str(e)) from None
        env = Envelope(f"chatcmpl-{secrets.token_hex(12)}", int(time.time()), self.model_name, self.engine.version)
        deadline = time.monotonic() + self.timeout
        if req.stream:
            return self._stream(req, reqs, env, len(ids), deadline, lead)
        choices, generated = [], 0
        for i, r in enumerate(reqs):
            c = self._wait(r, deadline)
            generated += len(c.token_ids)
            msg = build_message(c.text, req.parse_tools, _call_prefix(i), lead)
            lps = {"content": logprob_entries(c.token_ids, c.logprobs, self.token_bytes)} if req.logprobs else None
            choices.append({"index": i, "message": msg, "logprobs": lps,
                            "finish_reason": finish_reason(msg, c.finish_reason),
                            "kiln": kiln_extras(c.token_ids, c.versions)})
        return env.completion(choices, usage(len(ids), generated))

    def _stream(self, req: ChatRequest, reqs: list, env: Envelope, n_prompt: int, deadline: float,
                lead: str) -> Iterator[dict]:
        with_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(index: int, delta: dict, reason: str | None = None, **extra) -> dict:
            return env.chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason, **extra}],
                             None, with_usage)

        generated = 0
        for i, r in enumerate(reqs):
            yield chunk(i, {"role": "assistant", "content": ""})
            splitter, sent = StreamSplitter(lead) if req.parse_tools else None, 0  # sent: tokens already streamed
            while (event := self._next_event(r, deadline)) is not None:
                text, tokens = event
                delta = splitter.push(text) if splitter else ({"content": text} if text else {})
                if not delta and not tokens:
                    continue
                extra = {}
                if tokens:  # their logprobs and versions were appended before the event was queued
                    extra["kiln"] = kiln_extras(tokens, r.versions[sent: sent + len(tokens)])
                    if req.logprobs:
                        extra["logprobs"] = {"content": logprob_entries(
                            tokens, r.logprobs[sent: sent + len(tokens)], self.token_bytes)}
                    sent += len(tokens)
                yield chunk(i, delta, **extra)
            c = self._wait(r, deadline)
            generated += len(c.token_ids)
            msg = build_message(c.text, req.parse_tools, _call_prefix(i), lead)
            last = splitter.finish(msg) if splitter else {}
            if msg.get("tool_calls"):
                last["tool_calls"] = [{"index": k, **call} for k, call in enumerate(msg["tool_calls"])]
            yield chunk(i, last, finish_reason(msg, c.finish_reason))
        if with_usage:
            yield env.chunk([], usage(n_prompt, generated), with_usage)

    def _next_event(self, r, deadline: float):
        try:
            return r.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise self._timed_out() from None

    def _wait(self, r, deadline: float):
        try:
            return r.wait(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise self._timed_out() from None
        except Exception as e:  # noqa: BLE001 - the engine failed while this request was in it
            raise APIError(500, f"the engine failed: {e!r}", type="server_error") from None

    def _timed_out(self) -> APIError:
        return APIError(504, f"no answer within {self.timeout:g} s (the server is overloaded or the generation "
                             "is long: lower max_tokens, or restart with a larger --request-timeout)",
                        type="timeout_error")


def _call_prefix(choice: int) -> str:
    """Tool-call ids unique across a conversation: clients send them back with the results."""
    return f"call_{secrets.token_hex(4)}_{choice}_"
