"""The one thread that steps an engine, and hot weight loading.

Every caller (HTTP requests in `kiln serve`, rollout threads through the local policy) submits to
the same engine, so concurrent requests share decoding steps (continuous batching). If a step
raises, every waiting request is failed with the error, and so is every later one: a dead engine
must never leave callers hanging.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from kiln.model.checkpoint import read_weights

IDLE_POLL_S = 0.05  # how often an idle loop looks at its stop flag


class EngineRunner:
    def __init__(self, engine):
        self.engine = engine
        self.error: BaseException | None = None  # set once the loop died
        self.peak_running = 0  # most sequences decoded together so far: shows batching happens
        self._stop = threading.Event()
        self._load_lock = threading.Lock()  # one weight load at a time, versions in order
        self._last_version = engine.version
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def thread_id(self) -> int | None:
        """The engine thread's OS id once started (what CPU placement pins)."""
        return self._thread.native_id

    def close(self) -> None:
        self._stop.set()
        self.engine.wake.set()
        self._thread.join(timeout=30)
        # The loop is gone: wake anyone still waiting rather than leave them to their timeouts.
        self.engine.fail_all(RuntimeError("the server is shutting down"))

    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                if not eng.busy and not eng.wake.wait(IDLE_POLL_S):
                    continue
                # Cleared just before the step, which takes all work that arrived until now (requests,
                # and a weight update, which `busy` does not count); later work sets it again.
                eng.wake.clear()
                eng.step()
                self.peak_running = max(self.peak_running, len(eng.running))
        except BaseException as e:  # noqa: BLE001 - whatever killed the loop goes to every client
            self.error = e
            eng.fail_all(e)
            while not self._stop.is_set():  # requests that slipped in after the failure fail too
                eng.wake.wait(IDLE_POLL_S)
                eng.wake.clear()
                eng.fail_all(e)

    # ---- weights ---------------------------------------------------------------------------
    def load_weights(self, ckpt_dir: str, version: int | None, timeout: float) -> dict:
        """Read a checkpoint's weights, check they fit the served model, swap them in between two
        decoding steps (running requests carry on under the new version) and return once applied.
        Raises CheckpointError for a missing or mismatched checkpoint; the old weights stay."""
        eng = self.engine
        with self._load_lock:
            state, mtp_state = read_weights(Path(ckpt_dir), eng.model, eng.mtp)
            version = self._last_version + 1 if version is None else version
            eng.update_weights(state, version, mtp_state)
            self._last_version = version
            deadline = time.monotonic() + timeout
            while eng.version != version:
                if self.error is not None:
                    raise RuntimeError(f"the engine failed: {self.error}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weights were queued but not applied within {timeout} s")
                time.sleep(0.005)
        return {"version": version, "checkpoint": str(ckpt_dir), "mtp": mtp_state is not None}

