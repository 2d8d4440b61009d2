"""HTTP for `kiln serve`: the stdlib's ThreadingHTTPServer in front of one engine.

Routes:
  GET  /health               {"status": "ok", "version", "running", "waiting", "peak_running"}; 500 once
                             the engine has failed
  GET  /v1/models            the one served model (default id: the checkpoint folder's name)
  POST /v1/chat/completions  OpenAI's chat completions: tools, tool_choice, stream (+ include_usage), n,
                             temperature, top_p, max_tokens / max_completion_tokens, stop, seed,
                             logprobs (top_logprobs answered with empty lists); vLLM's top_k and
                             ignore_eos. Each choice (and each stream chunk that carries tokens) has
                             a `kiln` field: {"token_ids", "versions"}, the policy version per token.
  POST /admin/load_weights   {"checkpoint": DIR, "version"?: int} -> {"version", "checkpoint", "mtp"}:
                             new weights without a restart; bearer-token guarded when a token is set.
Errors are OpenAI's body, `{"error": {"message", "type", "param", "code"}}`. HTTP/1.1 with
keep-alive; streams are server-sent events in chunked transfer encoding. `serve()` returns a
handle, so tests and tools run the server in-process.
"""
from __future__ import annotations

import json
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self
from urllib.parse import urlsplit

import torch

from kiln.engine import Engine
from kiln.engine.runner import EngineRunner
from kiln.model.checkpoint import CheckpointError, load_checkpoint
from kiln.model.tokenizer import load_tokenizer

from .app import App
from .protocol import APIError
from .responses import TokenBytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MAX_BODY = 64 << 20  # a request larger than this is refused before it is read
ROUTES = {  # path -> (method, App method name, admin only)
    "/health": ("GET", "health", False),
    "/v1/models": ("GET", "models", False),
    "/v1/chat/completions": ("POST", "chat", False),
    "/admin/load_weights": ("POST", "load_weights", True),
}


class _Server(ThreadingHTTPServer):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.connections: dict = {}  # open client socket -> the thread handling it
        self.connections_lock = threading.Lock()

    def process_request_thread(self, request, client_address) -> None:
        with self.connections_lock:
            self.connections[request] = threading.current_thread()
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.connections_lock:
                self.connections.pop(request, None)

    def close_connections(self, timeout: float = 10.0) -> None:
        """End every open connection (a keep-alive client's included) and wait for its thread: one
        still blocked in a read when the interpreter exits is killed in its teardown, which can
        abort the process while it frees a request's tensors."""
        with self.connections_lock:
            open_now = dict(self.connections)
        for sock in open_now:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already gone
        for thread in open_now.values():
            thread.join(timeout)

    def handle_error(self, request, client_address) -> None:
        """A client that left (a reset or closed pipe, e.g. between keep-alive requests) is not the
        server's error: no traceback for it; anything else is reported as the stdlib does."""
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kiln-serve"

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        app: App = self.server.app
        path = urlsplit(self.path).path.rstrip("/") or "/"
        try:
            raw = self._body() if method == "POST" else b""
            if path not in ROUTES:
                raise APIError(404, f"no route {method} {path}; this server has "
                                    + ", ".join(f"{m} {p}" for p, (m, _, _) in ROUTES.items()), code="not_found")
            want, name, admin = ROUTES[path]
            if method != want:
                raise APIError(405, f"{path} takes {want}, not {method}", code="method_not_allowed")
            if admin:
                app.check_admin(self.headers.get("Authorization"))
            result = getattr(app, name)(raw) if method == "POST" else getattr(app, name)()
        except APIError as e:
            return self._json(e.status, e.body())
        except Exception as e:  # noqa: BLE001 - a bug here must answer, not drop the connection
            traceback.print_exc()
            return self._json(500, APIError(500, f"internal error: {e!r}", type="server_error").body())
        if isinstance(result, dict):
            return self._json(200, result)
        self._stream(result)

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True  # whatever body there is cannot be skipped safely
            raise APIError(411, "send the request body with a Content-Length header")
        if int(length) > MAX_BODY:
            self.close_connection = True
            raise APIError(413, f"the request body is {int(length)} bytes; at most {MAX_BODY} are accepted")
        return self.rfile.read(int(length))

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, chunks: Iterator[dict]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            try:
                for chunk in chunks:
                    self._event(json.dumps(chunk))
                self._event("[DONE]")
            except APIError as e:  # headers are gone: the error travels as an event, as OpenAI sends it
                self._event(json.dumps(e.body()))
            except Exception as e:  # noqa: BLE001 - as above, but headers are sent
                traceback.print_exc()
                self._event(json.dumps(APIError(500, f"internal error: {e!r}", type="server_error").body()))
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            # The client left; its engine request runs on to its end (the engine has no cancel).
            self.close_connection = True

    def _event(self, data: str) -> None:
        payload = f"data: {data}\n\n".encode()
        self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
        self.wfile.flush()

    def log_message(self, format: str, *args) -> None:
        if self.server.app_log:
            sys.stderr.write(f"{self.address_string()} - {format % args}\n")


class ServerHandle:
    """A running server: `.url` (http://host:port), `.port`, `.close()`; a context manager."""

    def __init__(self, httpd: ThreadingHTTPServer, runner: EngineRunner, app: App):
        self.httpd, self.runner, self.app = httpd, runner, app
        self.host, self.port = httpd.server_address[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._thread = threading.Thread(target=httpd.serve_forever, name="kiln-http", daemon=True)
        self._closed = threading.Event()
        self._thread.start()

    @property
    def engine(self) -> Engine:
        return self.runner.engine

    def wait(self) -> None:
        """Block until close() (the CLI waits here; Ctrl-C interrupts it)."""
        while not self._closed.wait(1.0):  # a timed wait keeps Ctrl-C responsive
            pass

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.httpd.shutdown()  # no new requests
        self.runner.close()  # fails whatever still waits on the engine
        self.httpd.close_connections()
        self.httpd.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(checkpoint: str | Path, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8,
          max_len: int | None = None, model_name: str | None = None, admin_token: str | None = None,
          request_timeout: float = 600.0, dtype: str = "float32", device: str = "auto",
          access_log: bool = False) -> ServerHandle:
    """Load a checkpoint and serve it; returns once it answers. port=0 picks a free port.
    Raises CheckpointError / FileNotFoundError / ValueError for a checkpoint or setting that
    cannot be served, OSError when the address cannot be bound."""
    ckpt = Path(checkpoint)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: no such checkpoint directory")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if request_timeout <= 0 or max_batch < 1:
        raise ValueError("request_timeout must be > 0 and max_batch >= 1")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model, mtp = load_checkpoint(ckpt, DTYPES[dtype], device)
    tokenizer = load_tokenizer(ckpt)
    if max_len is not None and not 2 <= max_len <= model.config.max_position_embeddings:
        raise ValueError(f"max_len must be in 2..{model.config.max_position_embeddings} (the model's context)")
    runner = EngineRunner(Engine(model, tokenizer, mtp, max_batch=max_batch, max_len=max_len))
    app = App(runner, tokenizer, TokenBytes(ckpt / "tokenizer.json"), model_name or ckpt.resolve().name,
              request_timeout, admin_token, started=int(time.time()))
    httpd = _Server((host, port), _Handler)
    httpd.app, httpd.app_log = app, access_log
    runner.start()
    return ServerHandle(httpd, runner, app)
