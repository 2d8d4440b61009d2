"""The native decoding step (native.c): a batch of sequences, a few tokens each, on the CPU: fp32
activations, weight matrices in fp32 or (a bf16 sampler) bf16.

Built once per machine with the system C compiler into `~/.cache/kiln/native/` (keyed by the
source, the compiler and the CPU, since it is compiled for this CPU's vector units) and loaded
with ctypes; it reads the model's parameters in place, so a weight update (`Engine.update_weights`
copies into them) needs no rebuild. Where no compiler is found, or `KILN_NATIVE=0`, the engine
decodes with `FastTrunk` as before.

The engine uses it for forwards of at most `MAX_TOKENS` tokens per sequence (decoding and
speculative verification, so both take the same per-token arithmetic) over a batch of up to
NATIVE_MAX_BATCH sequences in one call, each weight read once for all of them, and for prefills
of up to NATIVE_PREFILL tokens in one call; longer ones go through torch.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from kiln.engine.fast import supports as fast_supports
from kiln.model.causal_lm import CausalLM
from kiln.model.moe import MoeBlock

MAX_TOKENS = 16  # of one row in a decoding or verification call: its last token and its drafts
# Prefills of up to this many tokens (nearly every agent turn's new tokens) go through native.c in one
# call, longer ones through torch: what ran fastest on recorded RL conversations (docs: "Native
# prefills"; 1.09-1.15x over 256 on a Zen 5). A call's scratch grows ~84 KB a token (88 MB at 1,024).
NATIVE_PREFILL = 1024
# Up to this many sequences decode in one native.c call (each weight streamed once for all of them);
# more share torch's batched matmuls.
NATIVE_MAX_BATCH = 64
# Decoding (plain, prompt lookup, or greedy with the MTP drafter: runs.py) runs up to this many steps
# in one native.c call; a request or new weights arriving end it after its current step. Streamed
# text comes a run at a time (~7 ms of plain decoding at batch 1 on 2 cores).
DECODE_RUN = 16
SOURCE = Path(__file__).with_name("native.c")
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-pthread"]
_P = ctypes.POINTER(ctypes.c_float)
_PP = ctypes.POINTER(_P)


# The weight matrices' dtypes the C code reads (norm weights and RoPE frequencies are always fp32).
DTYPES = (torch.float32, torch.bfloat16)


class _Model(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int) for n in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "n_experts",
                                             "top_k", "moe_inner", "dense_inner", "norm_topk", "max_tokens",
                                             "wbf16", "ebf16")]
                + [("eps", ctypes.c_float)]
                + [(n, _P) for n in ("embed", "head", "inv_freq")]
                + [(n, _PP) for n in ("ln1", "q_norm", "k_norm", "ln2", "wq", "wk", "wv", "wo", "router", "gate_up",
                                      "down", "gate", "up", "down_dense", "hnorm", "enorm", "eh_proj")])


_lib: ctypes.CDLL | None | bool = False  # False: not tried yet


def library() -> ctypes.CDLL | None:
    """The compiled step, building it on first use; None (with one warning) where it cannot be built."""
    global _lib
    if _lib is False:
        _lib = None if os.environ.get("KILN_NATIVE", "1") == "0" else build()
    return _lib


def build(flags: list[str] = FLAGS) -> ctypes.CDLL | None:
    """The step compiled with `flags` (cached by source, flags, compiler and CPU); None, with one
    warning, where it cannot be built. Tests build other flags (e.g. without AVX-512) next to the default."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        warnings.warn("kiln: no C compiler (cc/gcc) found; decoding uses the slower torch path", stacklevel=3)
        return None
    try:
        version = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags + [version, _cpu_id()]).encode()).hexdigest()[:16]
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln" / "native"
        so = cache / f"decode-{key}.so"
        if not so.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # concurrent builders never see half a file
                out = Path(tmp) / so.name
                subprocess.run([cc, *flags, "-o", str(out), str(SOURCE), "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                os.replace(out, so)
        lib = ctypes.CDLL(str(so))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        warnings.warn(f"kiln: building the native decoding step failed ({detail}); decoding uses the torch path",
                      stacklevel=3)
        return None
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.kiln_scratch_floats.restype = i64
    lib.kiln_scratch_floats.argtypes = [ctypes.POINTER(_Model), i32, i32]
    lib.kiln_trunk.restype = None
    lib.kiln_trunk.argtypes = [ctypes.POINTER(_Model), i32, i32, vp, vp, vp, vp, vp, i64, i64, i32, i32, vp, vp, vp]
    lib.kiln_mtp_layer.restype = None
    lib.kiln_mtp_layer.argtypes = [ctypes.POINTER(_Model), i32, i32, i32, vp, vp, vp, vp, vp, i64, i64, i32, i32, vp, vp,
                                   vp]
    lib.kiln_head.restype = None
    lib.kiln_head.argtypes = [ctypes.POINTER(_Model), vp, vp, vp, i32, i32, vp, vp]
    lib.kiln_decode.restype = i32
    lib.kiln_decode.argtypes = [ctypes.POINTER(_Model), vp, i32, i32, vp, vp, vp, vp, vp, vp, vp, vp, i64, i64, i32, i32,
                                i32, i32, vp, vp, vp, vp, vp, vp]
    lib.kiln_spec_work_floats.restype = i64
    lib.kiln_spec_work_floats.argtypes = [vp, i32, i32]
    lib.kiln_spec_decode.restype = i32
    lib.kiln_spec_decode.argtypes = [vp, i32, i32] + [vp] * 17
    lib.kiln_lookup_work_floats.restype = i64
    lib.kiln_lookup_work_floats.argtypes = [ctypes.POINTER(_Model), i32, i32, i32, i32]
    lib.kiln_lookup_decode.restype = i32
    lib.kiln_lookup_decode.argtypes = [ctypes.POINTER(_Model), vp, i32, i32, i32, i32, vp, vp, i32, vp, vp, vp, vp, i32,
                                       vp, vp, vp, vp, vp, i64, i64, i32, i32, i32, i32] + [vp] * 8
    lib.kiln_sample.restype = i64
    lib.kiln_sample.argtypes = [vp, i32, ctypes.c_float, ctypes.c_float, i64, ctypes.POINTER(ctypes.c_float), vp]
    lib.kiln_logprob.restype = ctypes.c_float
    lib.kiln_logprob.argtypes = [vp, i32, ctypes.c_float, i64, vp]
    return lib


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        return "\n".join(dict.fromkeys(ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))))
    except OSError:
        return platform.processor() or platform.machine()


def supported(model, mtp=None) -> bool:
    """fp32 parameters on the CPU, contiguous, top-k within the C code's bound, and layers the C
    code computes: the shared pre-norm block (q/k norms optional) with full attention at the
    default scale, no biases, SwiGLU (Qwen3-MoE, Qwen3, Llama; not Gemma 3)."""
    cfg = model.config
    params = list(model.parameters()) + (list(mtp.parameters()) if mtp is not None else [])
    return (family_supported(model) and cfg.num_experts_per_tok <= 16
            and cfg.num_attention_heads % cfg.num_key_value_heads == 0
            and all(p.dtype == torch.float32 and p.device.type == "cpu" and p.is_contiguous() for p in params))


def family_supported(model) -> bool:
    cfg = model.config
    return (fast_supports(model) and type(model).embed is CausalLM.embed and cfg.final_logit_softcapping is None
            and not cfg.attention_bias and not cfg.mlp_bias and cfg.hidden_act == "silu")


def _ptr(t: torch.Tensor | None):
    return ctypes.cast(t.data_ptr(), _P) if t is not None else None


def _struct(model, layers, max_len: int, keep: list, weight, mtp_layers=None, shared=None) -> _Model:
    """The C view of decoder `layers` (the trunk's, or the MTP blocks with `mtp_layers` giving
    their input norms and projection) over the model's embedding and output head; `weight(t)` is
    the tensor the C code reads for weight matrix t (t itself, or its bf16 copy), `shared(t)`
    (default `weight`) for the embedding and head."""
    shared = shared or weight
    cfg = model.config
    moe = [isinstance(layer.mlp, MoeBlock) for layer in layers]

    def per_layer(get, over=layers, matrix=True):
        arr = (_P * len(over))(*[_ptr(weight(t) if matrix and t is not None else t) for t in map(get, over)])
        keep.append(arr)
        return arr

    def dense(layer, name):
        return None if isinstance(layer.mlp, MoeBlock) else getattr(layer.mlp, name).weight

    def expert(layer, name):
        return getattr(layer.mlp.experts, name) if isinstance(layer.mlp, MoeBlock) else None

    inv_freq = model.model.inv_freq(torch.device("cpu")).contiguous()
    keep.append(inv_freq)
    mtp = mtp_layers or [None] * len(layers)
    return _Model(
        n_layers=len(layers), dim=cfg.hidden_size, n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, n_experts=max(cfg.num_experts, 1),
        top_k=cfg.num_experts_per_tok, moe_inner=cfg.moe_intermediate_size if any(moe) else 0,
        dense_inner=cfg.intermediate_size if not all(moe) else 0, norm_topk=int(cfg.norm_topk_prob),
        max_tokens=max_len, wbf16=int(weight(layers[0].self_attn.q_proj.weight).dtype == torch.bfloat16),
        ebf16=int(shared(model.lm_head.weight).dtype == torch.bfloat16), eps=cfg.rms_norm_eps,
        embed=_ptr(shared(model.model.embed_tokens.weight)), head=_ptr(shared(model.lm_head.weight)),
        inv_freq=_ptr(inv_freq),
        ln1=per_layer(lambda la: la.input_layernorm.weight, matrix=False),
        wq=per_layer(lambda la: la.self_attn.q_proj.weight),
        wk=per_layer(lambda la: la.self_attn.k_proj.weight), wv=per_layer(lambda la: la.self_attn.v_proj.weight),
        q_norm=per_layer(lambda la: la.self_attn.q_norm.weight if la.self_attn.qk_norm else None, matrix=False),
        k_norm=per_layer(lambda la: la.self_attn.k_norm.weight if la.self_attn.qk_norm else None, matrix=False),
        wo=per_layer(lambda la: la.self_attn.o_proj.weight),
        ln2=per_layer(lambda la: la.post_attention_layernorm.weight, matrix=False),
        router=per_layer(lambda la: la.mlp.gate.weight if isinstance(la.mlp, MoeBlock) else None),
        gate_up=per_layer(lambda la: expert(la, "gate_up_proj")), down=per_layer(lambda la: expert(la, "down_proj")),
        gate=per_layer(lambda la: dense(la, "gate_proj")), up=per_layer(lambda la: dense(la, "up_proj")),
        down_dense=per_layer(lambda la: dense(la, "down_proj")),
        hnorm=per_layer(lambda ml: ml and ml.hnorm.weight, mtp, False),
        enorm=per_layer(lambda ml: ml and ml.enorm.weight, mtp, False),
        eh_proj=per_layer(lambda ml: ml and ml.eh_proj.weight, mtp))


class NativeSampler:
    """sampling.py's rule for untruncated rows (no top-k, no top-p) in one native pass a row:
    `sample(row, T, u, skip)` -> (token, log softmax(row / T)[token]) (T = 0: the argmax and its
    log softmax(row)), u the row's uniform draw, skip a rejected draft to draw without (-1 when
    nothing else has mass); `logprob(row, T, token)`. Rows: contiguous fp32 [V] on the CPU."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib, self._scratch, self._out = lib, torch.empty(0), ctypes.c_float()

    def _buffer(self, v: int) -> int:
        if self._scratch.numel() < v + v // 16:
            self._scratch = torch.empty(v + v // 16)
        return self._scratch.data_ptr()

    def sample(self, row: torch.Tensor, temperature: float, u: float = 0.0, skip: int = -1) -> tuple[int, float]:
        _check(row)
        v = row.shape[-1]
        tok = self.lib.kiln_sample(row.data_ptr(), v, temperature, u, skip, ctypes.byref(self._out), self._buffer(v))
        return tok, self._out.value

    def logprob(self, row: torch.Tensor, temperature: float, token: int) -> float:
        _check(row)
        return self.lib.kiln_logprob(row.data_ptr(), row.shape[-1], temperature, token, self._buffer(row.shape[-1]))


def _check(row: torch.Tensor) -> None:
    if row.dim() != 1 or row.dtype != torch.float32 or not row.is_contiguous() or row.device.type != "cpu":
        raise ValueError(f"the native sampler takes one contiguous fp32 CPU row, not {row.dtype} {tuple(row.shape)}")


def _bf16(cache) -> int:
    """1 when the KV cache holds bf16 (native.c rounds what it writes, widens what it reads)."""
    return int(cache.k.dtype == torch.bfloat16)


class NativeTrunk:
    """native.c for a batch of sequences in consecutive cache slots: (hidden, routes) =
    trunk(ids, starts, cache, slot) from lists (the engine's call), or from tensors as `FastTrunk`
    takes them, native(ids, positions, cache, slot); `head(hidden)` for the logits; with an
    MTP module, `mtp_layer` runs one of its layers (the drafter).

    `dtype` bfloat16: the weight matrices are read from bf16 copies of the model's parameters,
    made by `refresh` (`held`, by parameter); everything else stays fp32. `draft_dtype` (default
    `dtype`) the same for the drafter's own matrices and its head rows (its embedding and head are
    the model's)."""

    def __init__(self, model, lib: ctypes.CDLL, max_len: int, mtp=None, dtype: torch.dtype = torch.float32,
                 draft_ids: torch.Tensor | None = None, draft_dtype: torch.dtype | None = None):
        draft_dtype = draft_dtype or dtype
        if dtype not in DTYPES or draft_dtype not in DTYPES:
            raise ValueError(f"the native step reads float32 or bfloat16 weights, not {dtype} / {draft_dtype}")
        self.model, self.mtp, self.lib, self.max_len, self.dtype = model, mtp, lib, max_len, dtype
        self.draft_dtype = draft_dtype
        self.draft_ids = draft_ids  # the drafter's vocabulary (head rows), None = all
        self._scratch = torch.empty(0)
        self._sizes: dict[tuple[int, int], int] = {}  # scratch floats by (rows, tokens)
        self.yield_run = ctypes.c_int(0)  # nonzero: a native run (runs.py) returns after its current step
        self.refresh()

    def refresh(self) -> None:
        """Point the C structs at the model's (and MTP's) current parameter memory (bf16: at fresh
        copies of it)."""
        self._keep: list = []  # what the structs point into must live as long as they do
        self.held: dict[int, torch.Tensor] = {}  # bf16: parameter data_ptr -> its copy (tied ones share it)
        layers = self.model.model.layers
        self.struct = _struct(self.model, layers, self.max_len, self._keep, self._weight)
        self.ref = ctypes.byref(self.struct)  # what each call passes; built once (a call's overhead counts here)
        cfg = self.model.config
        self.dim, self.vocab, self.top_k = cfg.hidden_size, cfg.vocab_size, cfg.num_experts_per_tok
        self.final_norm = self.model.model.norm.weight
        self.n_moe = sum(isinstance(layer.mlp, MoeBlock) for layer in layers)
        # The drafter's head rows, contiguous (and in its dtype), copied again at every refresh.
        self.draft_head = None if self.draft_ids is None else \
            self.model.lm_head.weight.detach()[self.draft_ids].to(self.draft_dtype).contiguous()
        self.mtp_struct = None if self.mtp is None else _struct(
            self.model, [ml.block for ml in self.mtp.layers], self.max_len, self._keep,
            lambda t: self._weight(t, self.draft_dtype), list(self.mtp.layers), shared=self._weight)
        self.mtp_ref = None if self.mtp is None else ctypes.byref(self.mtp_struct)

    def _weight(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        if (dtype or self.dtype) == torch.float32:
            return t
        key = t.data_ptr()
        if key not in self.held:
            self.held[key] = t.detach().to(torch.bfloat16)
        return self.held[key]

    def scratch(self, b: int, t: int) -> int:
        """The address of scratch memory for a call over b sequences of t tokens (grown as needed)."""
        n = self._sizes.get((b, t))
        if n is None:
            n = self._sizes[b, t] = self.lib.kiln_scratch_floats(self.ref, b, t)
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n)
        return self._scratch.data_ptr()

    def slots(self, starts: list[int], t: int, cache, slot: int, lens: list[int] | None = None):
        """Check a call over rows starting at positions `starts` (t tokens each, or lens[b]) in slots
        slot..; -> (their first positions as C int32s, the slots' key and value cache addresses)."""
        b = len(starts)
        if cache.k.dtype not in DTYPES:
            raise ValueError(f"the native step keeps keys and values in float32 or bfloat16, not {cache.k.dtype}")
        end = max(s + (lens[i] if lens else t) for i, s in enumerate(starts)) if b else 0
        if t > NATIVE_PREFILL or end > min(cache.max_len, self.max_len) or (b and min(starts) < 0) \
                or not (0 <= slot and slot + b <= cache.slots):
            raise ValueError(f"positions up to {end - 1} of slots {slot}..{slot + b - 1} are outside the cache "
                             f"({cache.slots} slots of {cache.max_len} positions) or over {NATIVE_PREFILL} tokens")
        off = slot * cache.k.stride(1) * cache.k.element_size()
        return (ctypes.c_int32 * b)(*starts), cache.k.data_ptr() + off, cache.v.data_ptr() + off

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache, slot: int):
        """`trunk` over tensors: ids, positions [B, T] (consecutive positions in a row)."""
        return self.trunk(ids.tolist(), positions[:, 0].tolist(), cache, slot)

    def trunk(self, ids: list[list[int]], starts: list[int], cache, slot: int):
        """ids [B][T] (T <= NATIVE_PREFILL) of the sequences in slots slot..slot+B-1, row b at positions
        starts[b]..+T-1 -> (hidden [B, T, D] before the final norm, routes [B, T, n_moe, k] int32 or
        None). Lists, not tensors: at a token a step, building small tensors was much of the step."""
        b, t = len(ids), len(ids[0])
        hidden, routes = self._trunk(ids, starts, cache, slot, None)
        return hidden.view(b, t, self.dim), (routes.view(b, t, *routes.shape[1:]) if routes is not None else None)

    def trunk_ragged(self, ids: list[list[int]], starts: list[int], cache, slot: int):
        """`trunk` with rows of their own lengths (1..MAX_TOKENS tokens each; speculative rows fed
        only their own drafts) -> (hidden [N, D], routes [N, n_moe, k] or None), N their total, row
        after row. Each row's outputs and cache entries are the bits a call of that row alone gives."""
        return self._trunk(ids, starts, cache, slot, [len(row) for row in ids])

    def _trunk(self, ids: list[list[int]], starts: list[int], cache, slot: int, lens: list[int] | None):
        b, t = len(ids), max(map(len, ids))
        if lens and min(lens) < 1:
            raise ValueError("every row of a ragged call needs at least one token")
        pos0, k, v = self.slots(starts, t, cache, slot, lens)
        n = sum(lens) if lens else b * t
        flat = (ctypes.c_int64 * n)(*(i for row in ids for i in row))
        hidden = torch.empty(n, self.dim)
        routes = torch.empty(n, max(self.n_moe, 1), self.top_k, dtype=torch.int32)
        self.lib.kiln_trunk(self.ref, b, t, None if lens is None else (ctypes.c_int32 * b)(*lens), flat, pos0, k, v,
                            cache.k.stride(1), cache.k.stride(0), cache.max_len, _bf16(cache), hidden.data_ptr(),
                            routes.data_ptr(), self.scratch(b, t))
        return hidden, (routes if self.n_moe else None)

    def mtp_layer(self, k: int, hidden: torch.Tensor, ids: list[list[int]], starts: list[int], cache, slot: int,
                  need: list[list[bool]] | None = None) -> torch.Tensor:
        """MTP layer k (0-based) over hidden [B, T, D] and the next tokens' ids [B][T], row b at
        positions starts[b].. of slot slot + b in the MTP cache -> its output [B, T, D]. With `need`
        ([B][T]), a MoE layer's feed-forward runs only where it is true: elsewhere only the cache
        entries are right, not the output (the drafter's last layer feeds only its drafting positions on)."""
        b, t = len(ids), len(ids[0])
        pos0, kc, vc = self.slots(starts, t, cache, slot)
        flat = (ctypes.c_int64 * (b * t))(*(i for row in ids for i in row))
        flags = None if need is None else (ctypes.c_uint8 * (b * t))(*(f for row in need for f in row))
        h_in = hidden.contiguous()
        out = torch.empty_like(h_in)
        self.lib.kiln_mtp_layer(self.mtp_ref, k, b, t, h_in.data_ptr(), flat, pos0, kc, vc, cache.k.stride(1),
                                cache.k.stride(0), cache.max_len, _bf16(cache), out.data_ptr(), self.scratch(b, t), flags)
        return out

    def head(self, hidden: torch.Tensor, norm: torch.Tensor | None = None, drafts: bool = False) -> torch.Tensor:
        """Logits [..., V] of hidden states [..., D]: `norm` (default the final norm's weight), then
        the output head (each weight row read once for all rows); with `drafts`, only the drafter's
        rows: [..., len(draft_ids)]."""
        flat = hidden.reshape(-1, self.dim).contiguous()
        w = self.draft_head if drafts else None
        vocab = self.vocab if w is None else w.shape[0]
        logits = torch.empty(flat.shape[0], vocab)
        self.lib.kiln_head(self.mtp_ref if drafts else self.ref, (self.final_norm if norm is None else norm).data_ptr(),
                           None if w is None else w.data_ptr(), flat.data_ptr(), flat.shape[0], vocab,
                           logits.data_ptr(), self.scratch(flat.shape[0], 1))
        return logits.view(*hidden.shape[:-1], vocab)
