"""Calls between the launcher (which owns the orchestrator) and the trainer and rollout worker
processes: `multiprocessing.connection` on loopback with an auth key, one thread per connection.

This is the seam a distributed backend replaces: every process only ever calls `RpcClient.call`.
Every wait has a timeout and a clear error (DESIGN.md: nothing blocks forever).
"""
from __future__ import annotations

import threading
from multiprocessing.connection import Client, Listener


class RpcError(RuntimeError):
    """The other side failed, timed out or went away."""


class RpcServer:
    def __init__(self, handlers: dict, authkey: bytes, on_disconnect=None):
        self.handlers, self.on_disconnect = handlers, on_disconnect
        self.listener = Listener(("127.0.0.1", 0), authkey=authkey)
        self.address = self.listener.address
        self._thread = threading.Thread(target=self._accept, name="kiln-rpc", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError):
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        who = None
        try:
            while True:
                op, kw = conn.recv()
                if op == "_who":  # the handshake: who is on this connection
                    who = kw["who"]
                    conn.send(("ok", None))
                    continue
                try:
                    conn.send(("ok", self.handlers[op](**kw)))
                except Exception as e:  # noqa: BLE001 - the caller gets the error, the server stays up
                    conn.send(("error", f"{op}: {type(e).__name__}: {e}"))
        except (EOFError, OSError):
            if who is not None and self.on_disconnect is not None:
                self.on_disconnect(who)
        finally:
            conn.close()


class RpcClient:
    def __init__(self, address, authkey: bytes, who: str, timeout: float):
        self.timeout = timeout
        try:
            self.conn = Client(tuple(address), authkey=authkey)
        except OSError as e:
            raise RpcError(f"cannot reach the launcher at {address}: {e}") from None
        self.call("_who", who=who)

    def call(self, op: str, timeout: float | None = None, **kw):
        timeout = self.timeout if timeout is None else timeout
        try:
            self.conn.send((op, kw))
            if not self.conn.poll(timeout):
                raise RpcError(f"the launcher did not answer {op!r} within {timeout:.0f} s "
                               "(raise rl.timeout_s if it is just slow)")
            status, value = self.conn.recv()
        except (EOFError, OSError) as e:
            raise RpcError(f"lost the launcher during {op!r}: {e}") from None
        if status != "ok":
            raise RpcError(value)
        return value

    def close(self) -> None:
        self.conn.close()
