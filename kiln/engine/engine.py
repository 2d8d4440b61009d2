"""The decoding engine: continuous batching over a preallocated KV cache.

Each `step()` applies any pending weight update (in-flight: running sequences keep their cache and
carry on under the new version), prefills newly admitted requests into free slots, then decodes
one token for every running sequence (or, with an MTP module, drafts and verifies several: see
speculative.py). Where the rows allow it, a step runs up to DECODE_RUN such steps in one native
call (runs.py: the same tokens), ending early when a request or new weights arrive. Per generated
token it records the logprob, the policy version that produced it and, per fed position, the
routed experts, so RL never recomputes any of it.

`submit` and `update_weights` may be called from any thread; `step` runs on one thread (the
caller's, `generate`'s, or `serve`'s loop).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading

import torch

from kiln.engine import runs
from kiln.engine.detok import Detokenizer
from kiln.engine.fast import FastTrunk
from kiln.engine.fast import supports as fast_supports
from kiln.engine.kvcache import KVCache
from kiln.engine.lookup import lookup_step
from kiln.engine.native import (
    MAX_TOKENS,
    NATIVE_MAX_BATCH,
    NATIVE_PREFILL,
    NativeSampler,
    NativeTrunk,
    family_supported,
    library,
    supported,
)
from kiln.engine.prefix import PrefixCache
from kiln.engine.request import Completion, Request, finish_events
from kiln.engine.sampling import (
    SamplingParams,
    make_generator,
    policy_logprobs,
    sample_row,
    uniform,
    untruncated,
)
from kiln.engine.speculative import SpecStats, draft, spec_step
from kiln.model import gemm

DRAFT_SHARE = 8  # the MTP drafter proposes from its 1/8 most frequent training tokens (docs: "Speculative decoding")
log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model, tokenizer=None, mtp=None, max_batch: int = 8, max_len: int | None = None,
                 version: int = 0, capture_routes: bool = True, native: bool = True, prefix_slots: int = 0,
                 weight_dtype: torch.dtype = torch.float32, draft_vocab: int | None = None,
                 carry_turns: bool = False, lookup: int = 0, kv_dtype: torch.dtype | None = None,
                 draft_dtype: torch.dtype = torch.bfloat16):
        """lookup: prompt-lookup drafts a step (lookup.py), without an MTP drafter; 0 = none.
        prefix_slots: finished sequences kept for prefix reuse (prefix.py); 0 = none. carry_turns:
        after new weights a kept sequence still serves its own conversation's next turn (prefix.py).
        draft_vocab: the MTP drafter proposes only the draft_vocab tokens it saw most in training
        (its head reads that many rows); default an eighth of the vocabulary, 0 = all of it. The
        output never depends on it, only the share of drafts accepted.
        weight_dtype bfloat16 (an fp32 model): a bf16 sampler. The model's (and MTP's) parameters are
        rounded to bf16 in place, here and at every weight update; the native step reads bf16 copies
        of the weight matrices, torch (prefills) the rounded fp32 values, activations stay fp32.
        kv_dtype bfloat16 (an fp32 model): keys and values are cached rounded to bf16, half the bytes
        a decoding step reads from a long context; attention's arithmetic stays fp32. Default: the
        model's dtype.
        draft_dtype bfloat16 (the default): the MTP drafter's parameters are rounded to bf16 in place
        (here and at every weight update) and the native step reads bf16 copies of its matrices and
        of its head rows, half the bytes a draft reads; the embedding it reads is the model's. Drafts
        never change the output, only the share accepted. float32 keeps an fp32 model's drafter."""
        cfg = model.config
        if not 0 <= lookup < MAX_TOKENS or (lookup and mtp is not None):
            raise ValueError(f"lookup must be 0-{MAX_TOKENS - 1} drafts, and 0 with an MTP drafter (got {lookup})")
        for name, dt in (("weight_dtype", weight_dtype), ("draft_dtype", draft_dtype)):
            if dt not in (torch.float32, torch.bfloat16):
                raise ValueError(f"{name} must be torch.float32 or torch.bfloat16, not {dt}")
        p = next(model.parameters())
        if weight_dtype == torch.bfloat16 and p.dtype != torch.float32:
            raise ValueError(f"a bf16 sampler keeps fp32 activations: give an fp32 model (this one is {p.dtype})")
        kv_dtype = kv_dtype or p.dtype
        if kv_dtype != p.dtype and (kv_dtype != torch.bfloat16 or p.dtype != torch.float32):
            raise ValueError(f"kv_dtype must be the model's dtype ({p.dtype}) or, for an fp32 model, torch.bfloat16 "
                             f"(got {kv_dtype})")
        self.model, self.tok, self.mtp, self.lookup = model, tokenizer, mtp, lookup
        self.version, self.capture_routes = version, capture_routes
        self.max_batch = max_batch
        self.max_len = max_len or cfg.max_position_embeddings
        self.device, self.dtype, self.weight_dtype = p.device, p.dtype, weight_dtype
        self.draft_dtype = torch.bfloat16 if torch.bfloat16 in (weight_dtype, draft_dtype) else torch.float32
        self._round()
        self.cache = KVCache(cfg.num_hidden_layers, max_batch, self.max_len, cfg.num_key_value_heads,
                             cfg.head_dim, kv_dtype, self.device)
        self.mtp_cache = None if mtp is None else KVCache(
            mtp.depth, max_batch, self.max_len, cfg.num_key_value_heads, cfg.head_dim, kv_dtype, self.device)
        self.prefix = PrefixCache(prefix_slots, self.cache, drafter=self.mtp_cache, version=version,
                                  carry_turns=carry_turns) if prefix_slots > 0 else None
        self.default_stop_ids = _stop_ids(tokenizer, cfg)
        self.fast = FastTrunk(model) if self.dtype == torch.float32 and fast_supports(model) else None
        # Few sequences on the CPU: native.c's step (no per-op dispatch); `native=False` opts out.
        if native and self.device.type == "cpu" and not family_supported(model):
            log.warning("kiln: the native decoding step does not cover %s models; this engine decodes through torch",
                        cfg.model_type)
        lib = library() if native and self.device.type == "cpu" and supported(model, mtp) else None
        if draft_vocab is None:
            draft_vocab = cfg.vocab_size // DRAFT_SHARE
        self.draft_ids = mtp.draft_ids(draft_vocab) if mtp is not None else None
        self._draft_list = self.draft_ids.tolist() if self.draft_ids is not None else None
        self.native = NativeTrunk(model, lib, self.max_len, mtp, weight_dtype, self.draft_ids,
                                  self.draft_dtype) if lib is not None else None
        self.sampler = NativeSampler(lib) if lib is not None else None  # untruncated rows; the rest through torch
        self.runs = True  # several steps a native call where the rows allow it (runs.py); False: a step a call
        self._spec_struct = None  # runs.py's view of the drafter and caches for native.c, kept between runs
        self.running: list[Request] = []
        self.waiting: queue.Queue[Request] = queue.Queue()
        self._pending: tuple | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.spec_stats = SpecStats(mtp.depth if mtp is not None else lookup)
        self.wake = threading.Event()  # set when work arrives (serve's loop sleeps on it)
        self._applied = threading.Condition()  # notified when new weights take effect

    # ---- called from any thread -------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, stream: bool = False) -> Request:
        r = self._request(prompt_ids, params, stream)
        self.waiting.put(r)
        self._wake()
        return r

    def _wake(self) -> None:
        """New work: the loop's next step takes it (a native decoding run ends after its current step)."""
        if self.native is not None:
            self.native.yield_run.value = 1
        self.wake.set()

    def _request(self, prompt_ids: list[int], params: SamplingParams | None, stream: bool) -> Request:
        """A validated request, not yet queued."""
        params = params or SamplingParams()
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(prompt_ids) >= self.max_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; this engine's context is {self.max_len} "
                             f"(raise max_len, or shorten the prompt)")
        vocab = self.model.config.vocab_size
        if max(prompt_ids) >= vocab or min(prompt_ids) < 0:
            raise ValueError(f"prompt holds token ids outside the vocabulary 0..{vocab - 1}")
        if params.stop and self.tok is None:
            raise ValueError("stop strings need a tokenizer; give stop_token_ids instead")
        return Request(list(prompt_ids), params, id=next(self._ids), events=queue.Queue() if stream else None)

    def update_weights(self, state: dict[str, torch.Tensor], version: int,
                       mtp_state: dict[str, torch.Tensor] | None = None) -> None:
        """Queue new weights; they take effect between two decoding steps."""
        with self._lock:
            self._pending = (state, version, mtp_state)
        self._wake()

    def wait_version(self, than: int, timeout: float) -> int:
        """The weights version once it is no longer `than` (newer weights applied), or after `timeout` s."""
        with self._applied:
            self._applied.wait_for(lambda: self.version != than, timeout)
            return self.version

    # ---- the engine thread ------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.running) or not self.waiting.empty()

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One scheduling round; returns the requests that finished in it."""
        if self.native is not None:  # what arrives from here on ends this round's native run early
            self.native.yield_run.value = 0
        self._apply_pending()
        self._admit()
        finished = self._retire()  # some finish on their first token
        if self.running:
            if self.mtp is not None:
                spec_step(self)
            elif self.lookup:
                lookup_step(self)
            else:
                self._decode()
            finished += self._retire()
        return finished

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Run prompts to completion (batched up to max_batch) and return them in order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        reqs = [self._request(p, sp, False) for p, sp in zip(prompts, plist)]  # all valid before any runs
        for r in reqs:
            self.waiting.put(r)
        while not all(r.done.is_set() for r in reqs):
            self.step()
        return [r.wait() for r in reqs]

    def fail_all(self, err: BaseException) -> None:
        """The loop died: wake every waiter with the error instead of leaving it hanging."""
        reqs = self.running + _drain(self.waiting)
        self.running = []
        for r in reqs:
            r.error = err
            finish_events(r)
            r.done.set()

    # ---- internals -------------------------------------------------------------------------
    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        state, version, mtp_state = pending
        _copy_into(self.model, state)
        if mtp_state is not None and self.mtp is not None:
            _copy_into(self.mtp, mtp_state)
        self._round()
        for trunk in (self.fast, self.native):
            if trunk is not None:
                trunk.refresh()
        if self.prefix is not None:  # older entries now serve their own conversations at most
            self.prefix.version = version
        with self._applied:
            self.version = version
            self._applied.notify_all()

    def _round(self) -> None:
        """A bf16 sampler's (or drafter's) parameters hold bf16 values (exact in fp32, so torch computes
        on them as they are); a no-op for the bf16 weights the trainer publishes."""
        with torch.no_grad():
            for module, dtype in ((self.model, self.weight_dtype), (self.mtp, self.draft_dtype)):
                for t in (module.parameters() if module is not None and dtype != torch.float32 else ()):
                    t.copy_(t.to(dtype))

    def sampler_weights(self) -> dict[str, torch.Tensor]:
        """The model's weights as this engine samples with them, by state-dict name, in its weight
        dtype: with a bf16 native step, the very copies it reads (the rest rounded from the model)."""
        held = self.native.held if self.native is not None else {}
        return {k: held.get(v.data_ptr(), v.to(self.weight_dtype)) for k, v in self.model.state_dict().items()}

    def _admit(self) -> None:
        while len(self.running) < self.max_batch:
            try:
                r = self.waiting.get_nowait()
            except queue.Empty:
                break
            r.gen = make_generator(r.params.seed)
            r.stop_ids = set(r.params.stop_token_ids if r.params.stop_token_ids is not None else self.default_stop_ids)
            r.detok = Detokenizer(self.tok, r.params.stop) if self.tok is not None else None
            slot = len(self.running)
            self.running.append(r)
            done, r.kv_version = 0, self.version
            if self.prefix is not None:
                done, routes, r.kv_version = self.prefix.restore(r.prompt_ids, self.cache, slot, self.mtp_cache)
                r.route_prefix = routes if self.capture_routes else []
                r.drafted = done
            hidden = self.forward(slot, [r.prompt_ids[done:]], [done], [r])
            r.length = len(r.prompt_ids)
            if self.prefix is not None and self.mtp is None:
                # Kept now, not only when it finishes: a group's rollouts often send the same prompt
                # (the task, then the same first tool output) in the same step, and the others then
                # prefill only its last token. (Without a drafter: this entry has no drafter cache.)
                fed = r.pending_routes.tolist() if r.pending_routes is not None else []
                self.prefix.park(self.cache, slot, r.prompt_ids, r.route_prefix + fed if self.capture_routes else None,
                                 version=r.kv_version)
            self.emit(r, [self.sample(r, self.head(hidden[0, -1]).float().cpu())])
            if self.mtp is not None and r.finish_reason is None:
                draft(self, slot, [r], hidden, start_positions=[done], n_valid=[r.length - done])

    def forward(self, start: int, ids: list[list[int]], starts: list[int], reqs: list[Request]):
        """The main trunk over slots start.. with the cache -> hidden states [B, T, D]; row b holds
        ids[b] at positions starts[b]..starts[b] + T - 1."""
        t = len(ids[0])
        if self.native is not None and len(ids) <= NATIVE_MAX_BATCH and t <= NATIVE_PREFILL:
            hidden, routes = self.native.trunk(ids, starts, self.cache, start)
        else:
            ids_t = torch.tensor(ids, device=self.device)
            positions = torch.tensor(starts, device=self.device)[:, None] + torch.arange(t, device=self.device)
            self.cache.begin(start, positions)
            # A long prefill's products are large enough for oneDNN (1.2x on 257-1,500 tokens);
            # decoding's small ones, of a new size each step, are not (kiln/model/gemm.py).
            with gemm.routed() if t > NATIVE_PREFILL else contextlib.nullcontext():
                if self.fast is not None:
                    hidden, routes = self.fast(ids_t, positions, self.cache)
                else:
                    out = self.model.trunk(ids_t, positions=positions, cache=self.cache)
                    hidden, routes = out.hidden, out.routes
        if self.capture_routes and routes is not None:
            for r, rr in zip(reqs, routes.to(torch.int16).cpu()):
                r.pending_routes = rr
        return hidden

    def forward_rows(self, ids: list[list[int]], starts: list[int], reqs: list[Request]) -> list[torch.Tensor]:
        """`forward` over slots 0.. where each row has its own number of tokens -> each row's hidden
        states [T_b, D]. Natively one ragged call, so a row pays only for its own tokens; through
        torch the rows are padded to the longest with copies of their last token (positions past
        a row's own are later overwritten)."""
        lens = [len(row) for row in ids]
        if self.native is None or len(ids) > NATIVE_MAX_BATCH or max(lens) > MAX_TOKENS:
            hidden = self.forward(0, [row + row[-1:] * (max(lens) - len(row)) for row in ids], starts, reqs)
            return [hidden[b, :n] for b, n in enumerate(lens)]
        hidden, routes = self.native.trunk_ragged(ids, starts, self.cache, 0)
        if self.capture_routes and routes is not None:
            for r, rr in zip(reqs, routes.to(torch.int16).split(lens)):
                r.pending_routes = rr
        return list(hidden.split(lens))

    def _decode(self) -> None:
        rs = self.running
        if not runs.plain(self, rs):
            self._decode_step(rs)

    def _decode_step(self, rs: list[Request]) -> None:
        """One token for every running sequence."""
        logits = self.head(self.forward(0, [[r.tokens[-1]] for r in rs], [r.length for r in rs], rs)[:, -1]).float().cpu()
        for i, r in enumerate(rs):
            r.length += 1
            self.emit(r, [self.sample(r, logits[i])], fed=1)

    def draft_tokens(self, columns: list[int]) -> list[int]:
        """The token ids of columns of the drafter's logits (its vocabulary's)."""
        return [self._draft_list[c] for c in columns]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of hidden states (the native head where the native step runs)."""
        return self.native.head(hidden) if self.native is not None else self.model.head(hidden)

    def sample(self, r: Request, logits: torch.Tensor) -> tuple[int, float]:
        """logits: one contiguous row on the CPU (each request's generator is a CPU generator)."""
        p = r.params
        if self.sampler is not None and untruncated(p):
            return self.sampler.sample(logits, p.temperature, 0.0 if p.greedy else uniform(r.gen))
        tok = sample_row(logits, p, r.gen)
        return tok, float(policy_logprobs(logits, p.temperature)[tok])

    def emit(self, r: Request, new: list[tuple[int, float]], fed: int | None = None) -> None:
        """Append generated tokens (stopping at a stop token, max_tokens or the context end) and
        the routes of the `fed` positions just computed (default: all, as after a prefill)."""
        before, delta = len(r.tokens), ""
        for tok, lp in new:
            r.tokens.append(tok)
            r.logprobs.append(lp)
            r.versions.append(self.version)
            if tok in r.stop_ids:
                r.finish_reason = "stop"
                break
            if r.detok is not None:
                delta += r.detok.push(tok)
                if r.detok.stopped:
                    r.finish_reason = "stop"
                    break
            if len(r.tokens) >= r.params.max_tokens:
                r.finish_reason = "length"
                break
        lookahead = self.mtp.depth if self.mtp is not None else 0
        if r.finish_reason is None and r.length + lookahead >= self.max_len:  # the cache is full
            r.finish_reason = "length"
        added = r.tokens[before:]  # accepted drafts past a stop or max_tokens are dropped
        if r.pending_routes is not None:
            # The fed positions still in the sequence: the previous last token and the kept drafts
            # but the new last token (never fed by convention, even when it was a fed draft).
            r.routes.append(r.pending_routes[: r.pending_routes.shape[0] if fed is None else min(fed, len(added))])
            r.pending_routes = None
        if r.events is not None and (delta or added):
            r.events.put((delta, added))

    def _retire(self) -> list[Request]:
        done = [r for r in self.running if r.finish_reason is not None]
        for r in done:
            slot, last = self.running.index(r), len(self.running) - 1
            routes = self._route_list(r)
            if self.prefix is not None:  # the cache holds the prompt and every token but the last
                self.prefix.park(self.cache, slot, (r.prompt_ids + r.tokens)[:r.length], routes, self.mtp_cache,
                                 r.drafted, r.kv_version)
            if slot != last:  # keep running sequences in slots 0..n-1
                moved = self.running[last]
                self.cache.move(last, slot, moved.length)
                if self.mtp_cache is not None:
                    self.mtp_cache.move(last, slot, moved.length)
                self.running[slot] = moved
            self.running.pop()
            self._complete(r, routes)
        return done

    def _route_list(self, r: Request) -> list | None:
        """The routes of every position of r's prompt and tokens ([n_moe][k] each; the last token,
        never fed, all -1), or None when none were captured."""
        if not (self.capture_routes and (r.route_prefix or r.routes)):
            return None
        fed = r.route_prefix + (torch.cat(r.routes).tolist() if r.routes else [])
        n = len(r.prompt_ids) + len(r.tokens)
        blank = [[-1] * len(fed[0][0])] * len(fed[0])
        return fed + [blank] * (n - len(fed))

    def _complete(self, r: Request, routes: list | None) -> None:
        text = ""
        if r.detok is not None:
            tail = r.detok.flush()
            if r.events is not None and tail:
                r.events.put((tail, []))
            text = r.detok.text
        r.result = Completion(r.prompt_ids, r.tokens, r.logprobs, r.versions, text, r.finish_reason, routes)
        finish_events(r)
        r.done.set()


def _stop_ids(tokenizer, cfg) -> set[int]:
    if tokenizer is not None:
        return {tokenizer.eos_id, tokenizer.endoftext_id}
    eos = cfg.eos_token_id
    return set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())


def _copy_into(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    own = module.state_dict()
    unknown = set(state) - set(own)
    if unknown:
        raise ValueError(f"weight update names tensors the model lacks: {sorted(unknown)[:5]}")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


def _drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
