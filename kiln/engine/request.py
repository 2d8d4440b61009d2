"""What the engine takes and returns: a request (its sampling parameters, and the engine's state of
it while it runs) and the completion it ends with."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import torch

from kiln.engine.detok import Detokenizer
from kiln.engine.sampling import SamplingParams


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    routes: list | None = None  # per position of prompt + completion: [n_moe_layers][k]; -1 = not fed


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    id: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    route_prefix: list = field(default_factory=list)  # routes of the positions restored from a kept prefix, as lists
    routes: list[torch.Tensor] = field(default_factory=list)  # chunks [n, L, k] over the positions fed since, in order
    finish_reason: str | None = None
    events: queue.Queue | None = None  # streaming: (text_delta, token_ids) tuples, then None
    done: threading.Event = field(default_factory=threading.Event)
    result: Completion | None = None
    error: BaseException | None = None
    # engine state
    length: int = 0  # positions in the KV cache (the last generated token is not yet among them)
    gen: torch.Generator | None = None
    stop_ids: set[int] = field(default_factory=set)
    detok: Detokenizer | None = None
    pending_routes: torch.Tensor | None = None  # routes of the last forward, until emit knows how many count
    drafts: list[int] = field(default_factory=list)  # speculative: tokens proposed by MTP
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)
    mtp_tail: torch.Tensor | None = None  # main hidden rows of the last MTP-depth - 1 fed positions
    drafted: int = 0  # leading positions whose MTP-cache entries read only known tokens (prefix reuse keeps them)
    kv_version: int = 0  # the oldest weights version among its cached keys and values (prefix reuse keeps it)
    ngrams: dict = field(default_factory=dict)  # prompt lookup: n-gram -> the position after its latest occurrence
    indexed: int = 0  # positions of prompt + tokens already in ngrams

    def wait(self, timeout: float | None = None) -> Completion:
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result


def finish_events(r: Request) -> None:
    """End a streaming request's events."""
    if r.events is not None:
        r.events.put(None)
