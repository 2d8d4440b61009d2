"""The bf16 sampler (Engine(weight_dtype=torch.bfloat16), engine.dtype): native.c reads bf16 weight
matrices and widens them in registers, activations and sums stay fp32. Widening is exact, so a bf16
step is the fp32 step on the rounded weights bit for bit; against torch's own bf16 model (which also
rounds every activation) it is as close as that model is to exact arithmetic."""
from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

from kiln.engine import Engine, SamplingParams
from kiln.engine.fast import FastTrunk
from kiln.engine.kvcache import KVCache
from kiln.engine.native import FLAGS, NativeTrunk, build, library
from kiln.model.config import ModelConfig
from kiln.model.moe import MoeForCausalLM
from kiln.model.mtp import MTP
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.tiny_model import tiny_model

HAVE_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
pytestmark = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the engine falls back to torch")


def rounded(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every parameter rounded to bf16 (kept in fp32), in place."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16())
    return model


def odd_model(seed: int = 0):
    """Widths that are not multiples of 64 or 16, so every load path (64-float strides, 16-float
    steps, the scalar tail) reads bf16; layer 0 dense, layer 1 MoE; an MTP layer."""
    torch.manual_seed(seed)
    cfg = ModelConfig.from_depth(2, vocab_size=300, hidden_size=88, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, moe_intermediate_size=70, intermediate_size=90, mlp_only_layers=[0],
                                 max_position_embeddings=256)
    model, mtp = MoeForCausalLM(cfg).eval(), MTP(cfg, depth=1).eval()
    with torch.no_grad():
        for p in list(model.parameters()) + list(mtp.parameters()):
            p.mul_(4.0 if p.ndim > 1 else 1.0)
    return rounded(model), rounded(mtp)


def run(native: NativeTrunk, ids: torch.Tensor, mtp: bool = False, kv_dtype=torch.float32):
    """Chunks of 5 tokens of every row through the trunk (then the MTP layer), head included."""
    cfg = native.model.config
    cache = KVCache(cfg.num_hidden_layers, ids.shape[0], 64, cfg.num_key_value_heads, cfg.head_dim, kv_dtype)
    mcache = KVCache(1, ids.shape[0], 64, cfg.num_key_value_heads, cfg.head_dim, kv_dtype)
    out = []
    for s in range(0, ids.shape[1] - 1, 5):
        chunk, pos = ids[:, s:s + 5], torch.arange(s, s + 5).expand(ids.shape[0], 5)
        hidden, routes = native(chunk, pos, cache, 0)
        out += [hidden, routes, native.head(hidden)]
        if mtp:
            out.append(native.mtp_layer(0, hidden, ids[:, s + 1:s + 6].tolist(), [s] * ids.shape[0], mcache, 0))
    return out + [cache.k, cache.v, mcache.k]


@torch.inference_mode()
def test_a_bf16_step_is_the_fp32_step_on_the_rounded_weights_bit_for_bit():
    model, mtp = odd_model()
    ids = torch.randint(0, 300, (3, 21), generator=torch.Generator().manual_seed(0))
    bf16 = NativeTrunk(model, library(), 64, mtp, dtype=torch.bfloat16)
    assert bf16.struct.wbf16 == 1 and {t.dtype for t in bf16.held.values()} == {torch.bfloat16}
    # the embedding and the tied head are one tensor, so one copy
    assert len(bf16.held) == sum(p.ndim > 1 for p in list(model.parameters()) + list(mtp.parameters()))
    got, want = run(bf16, ids, mtp=True), run(NativeTrunk(model, library(), 64, mtp), ids, mtp=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@torch.inference_mode()
def test_a_bf16_drafter_is_the_fp32_drafter_on_its_rounded_weights_bit_for_bit():
    """The drafter's own matrices and head rows read as bf16 over an fp32 model (Engine's default
    draft_dtype): its layer is the fp32 one on the rounded drafter and its draft logits the fp32 ones
    on the rounded head rows, bit for bit; the trunk, the head and the drafter's embedding rows stay
    the model's fp32 values."""
    model, mtp = odd_model()
    with torch.no_grad():  # a model that bf16 cannot hold: reading any of it as bf16 would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    ids = torch.randint(0, 300, (3, 21), generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([0, 5, 17, 299])
    drafter = NativeTrunk(model, library(), 64, mtp, draft_ids=rows, draft_dtype=torch.bfloat16)
    assert (drafter.struct.wbf16, drafter.struct.ebf16, drafter.mtp_struct.wbf16, drafter.mtp_struct.ebf16) == (0, 0, 1, 0)
    assert len(drafter.held) == sum(p.ndim > 1 for p in mtp.parameters()) and drafter.draft_head.dtype == torch.bfloat16
    fp32 = NativeTrunk(model, library(), 64, mtp, draft_ids=rows)
    got, want = run(drafter, ids, mtp=True), run(fp32, ids, mtp=True)
    norm, head_rounded = mtp.layers[0].norm.weight, copy.deepcopy(model)
    rounded(head_rounded.lm_head)
    got.append(drafter.head(got[3], norm=norm, drafts=True))
    want.append(NativeTrunk(head_rounded, library(), 64, mtp, draft_ids=rows).head(want[3], norm=norm, drafts=True))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_engine_drafts_in_bf16_unless_told_not_to():
    """Engine's draft_dtype: bfloat16 by default rounds the drafter's parameters in place (never the
    model's), float32 leaves them, and anything else is refused."""
    model, mtp = tiny_model(2)
    before = [p.clone() for p in model.parameters()]
    kept = copy.deepcopy(mtp)
    Engine(model, mtp=kept, max_batch=1, draft_dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(kept.parameters(), mtp.parameters()))
    engine = Engine(model, mtp=mtp, max_batch=1)
    assert engine.draft_dtype == torch.bfloat16 and all(torch.equal(p, p.bfloat16().float()) for p in mtp.parameters())
    assert not all(torch.equal(p, p.bfloat16().float()) for p in kept.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="draft_dtype must be torch.float32 or torch.bfloat16"):
        Engine(model, mtp=mtp, max_batch=1, draft_dtype=torch.float16)


@torch.inference_mode()
def test_bf16_native_matches_torch_on_the_same_weights():
    model = rounded(tiny_model(1)[0])
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    native = NativeTrunk(model, library(), 64, dtype=torch.bfloat16)
    cfg = model.config
    cache = KVCache(cfg.num_hidden_layers, 1, 64, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    hidden = torch.cat([native(ids[:, s:s + 4], torch.arange(s, s + 4)[None], cache, 0)[0] for s in (0, 4, 8)], 1)
    logits = native.head(hidden)
    # torch on the bf16 weights in fp32 (the engine's prefill path): the fp32 parity tolerance
    ref = KVCache(cfg.num_hidden_layers, 1, 64, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    ref.begin(0, torch.arange(12)[None])
    want, _ = FastTrunk(model)(ids, torch.arange(12)[None], ref)
    torch.testing.assert_close(hidden, want, atol=2e-5, rtol=1e-5)
    # torch's bf16 model also rounds every activation to bf16, and so differs from exact arithmetic on
    # the same weights (fp64) by far more than the native step, which keeps them fp32: each logit is
    # within torch bf16's own error of it (plus the fp32 step's 1e-4).
    exact = copy.deepcopy(model).double()
    exact = exact.head(exact.trunk(ids).hidden).float()
    bf = copy.deepcopy(model).to(torch.bfloat16)
    torch_bf16 = bf.head(bf.trunk(ids).hidden).float()
    assert (logits - exact).abs().max() < 1e-4 < (torch_bf16 - exact).abs().max()
    assert ((logits - torch_bf16).abs() <= (torch_bf16 - exact).abs() + 1e-4).all()


@torch.inference_mode()
def test_a_bf16_engine_samples_as_fp32_on_rounded_weights_and_rounds_its_updates():
    model = tiny_model(2)[0]
    ref = rounded(copy.deepcopy(model))
    engine = Engine(model, max_batch=2, weight_dtype=torch.bfloat16)
    assert engine.native is not None and engine.dtype == torch.float32  # fp32 activations and KV cache
    prompts = [list(range(3, 40)), [7, 8, 9]]  # 37 tokens: a native prefill, then native steps
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3, stop_token_ids=())
    a, b = engine.generate(prompts, params), Engine(ref, max_batch=2).generate(prompts, params)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.logprobs == y.logprobs and x.routes == y.routes
    held = engine.sampler_weights()
    assert all(v.dtype == torch.bfloat16 and torch.equal(v.float(), ref.state_dict()[k]) for k, v in held.items())
    assert held["lm_head.weight"].data_ptr() in {t.data_ptr() for t in engine.native.held.values()}

    new = {k: v * 1.01 for k, v in model.state_dict().items()}  # an fp32 update is rounded too
    engine.update_weights(new, version=1)
    engine.generate([[5, 6]], SamplingParams(max_tokens=1))
    assert all(torch.equal(v, new[k].bfloat16()) for k, v in engine.sampler_weights().items())


@torch.inference_mode()
def test_a_bf16_kv_cache_holds_the_fp32_entries_rounded_to_nearest_even():
    # Layer 0's keys and values depend only on the embeddings, so with an fp32 and a bf16 cache they
    # are computed from the same bits: the bf16 cache must hold exactly torch's rounding of the fp32
    # entries, natively (native.c rounds as it writes) and through torch (KVCache.update).
    model, mtp = odd_model(2)
    cfg = model.config
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(4))
    native = NativeTrunk(model, library(), 64, mtp)
    fp32, bf16 = run(native, ids, kv_dtype=torch.float32), run(native, ids, kv_dtype=torch.bfloat16)
    (k32, v32), (k16, v16) = fp32[-3:-1], bf16[-3:-1]
    assert k16.dtype == torch.bfloat16 and k16[:, :, :, :10].abs().sum() > 0
    assert torch.equal(k16[0], k32[0].bfloat16()) and torch.equal(v16[0], v32[0].bfloat16())
    assert not torch.equal(k16[0].float(), k32[0])  # rounding happened
    # through torch: the same rounding, and fp32 keys and values handed to attention
    fast = FastTrunk(model)
    caches = [KVCache(cfg.num_hidden_layers, 2, 64, cfg.num_key_value_heads, cfg.head_dim, d)
              for d in (torch.float32, torch.bfloat16)]
    for c in caches:
        c.begin(0, torch.arange(10).expand(2, 10))
        hidden, _ = fast(ids[:, :10], torch.arange(10).expand(2, 10), c)
        assert hidden.dtype == torch.float32
    assert torch.equal(caches[1].k[0], caches[0].k[0].bfloat16())
    assert torch.equal(caches[1].v[0], caches[0].v[0].bfloat16())


@torch.inference_mode()
def test_an_engine_with_a_bf16_kv_cache_keeps_every_cache_in_bf16_and_samples_close_to_fp32():
    model, mtp = tiny_model(3, scale=1.0)  # (at scale 4 attention is sharp enough for bf16 keys to move a
    prompts = [list(range(3, 40)), [7, 8, 9]]  # logprob by 0.46) 37 tokens: a native prefill, then native steps
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3, stop_token_ids=())
    engine = Engine(model, mtp=mtp, max_batch=2, prefix_slots=2, kv_dtype=torch.bfloat16)
    caches = (engine.cache, engine.mtp_cache, engine.prefix.kv, engine.prefix.drafter)
    assert {c.k.dtype for c in caches} == {torch.bfloat16}
    got = engine.generate(prompts, params)
    want = Engine(model, mtp=mtp, max_batch=2).generate(prompts, params)
    # the first token of each prompt: the same distribution up to bf16 keys and values
    same = [(g, w) for g, w in zip(got, want) if g.token_ids[0] == w.token_ids[0]]
    assert same and all(abs(g.logprobs[0] - w.logprobs[0]) < 1e-3 for g, w in same)
    assert all(len(g.token_ids) == 8 for g in got)
    with pytest.raises(ValueError, match=r"kv_dtype must be the model's dtype \(torch.float32\) or, for an fp32 "
                                         r"model, torch.bfloat16 \(got torch.float16\)"):
        Engine(model, kv_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"kv_dtype must be the model's dtype \(torch.bfloat16\) .*\(got torch.float32\)"):
        Engine(tiny_model(0)[0].to(torch.bfloat16), kv_dtype=torch.float32)


def test_a_bf16_sampler_needs_an_fp32_model():
    model = tiny_model(0)[0].to(torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 model"):
        Engine(model, weight_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 or torch.bfloat16"):
        Engine(tiny_model(0)[0], weight_dtype=torch.float16)


@pytest.mark.parametrize("width", [4, 8, 16])
@torch.inference_mode()
def test_every_vector_width_computes_the_same_bits(width):
    # native.c defines its arithmetic on 16-float chunks, whatever registers hold them: builds for
    # 128-bit, AVX and AVX-512 registers (KILN_VW; a width the CPU lacks is emulated by the
    # compiler) give the same bits, with fp32 and bf16 weights and KV caches, heads of 16 and of 64
    # (the tiny preset's), the MTP layers included. Both builds without contraction: where GCC fuses a * b + c
    # into one multiply-add follows its register allocation, which differs between widths (1.3e-6
    # apart on the odd model, AVX-512). The engine's own build keeps contraction (docs: "Engine").
    strict = FLAGS + ["-ffp-contract=off"]
    narrow, native = build(strict + [f"-DKILN_VW={width}"]), build(strict)
    assert narrow is not None and native is not None
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    cfg = ModelConfig.from_depth(2, vocab_size=300, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=64, moe_intermediate_size=96, max_position_embeddings=256)
    for model, mtp in (odd_model(1), (MoeForCausalLM(cfg).eval(), MTP(cfg, depth=1).eval())):
        for dtype, kv in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                          (torch.bfloat16, torch.bfloat16)):
            got = run(NativeTrunk(model, narrow, 64, mtp, dtype=dtype), ids, mtp=True, kv_dtype=kv)
            want = run(NativeTrunk(model, native, 64, mtp, dtype=dtype), ids, mtp=True, kv_dtype=kv)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
