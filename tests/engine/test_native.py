"""The native decoding step (kiln/engine/native.c) against the torch trunk it replaces for one
sequence: same hidden states, routes, cache entries and logits; a k-token call bit-identical to k
one-token calls (what keeps speculative and plain greedy decoding equal); weight swaps seen."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from kiln.engine import Engine, SamplingParams
from kiln.engine.fast import FastTrunk
from kiln.engine.kvcache import KVCache
from kiln.engine.native import MAX_TOKENS, NATIVE_PREFILL, NativeTrunk, library
from kiln.model.layers import rope_tables
from kiln.model.moe import MoeForCausalLM
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.tiny_model import tiny_config, tiny_model

HAVE_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
pytestmark = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the engine falls back to torch")
LIB = library()


def test_the_native_step_builds_where_there_is_a_compiler():
    assert LIB is not None  # a build failure is a warning for users, but a failure here


def caches(cfg, n=2, max_len=64):
    return [KVCache(cfg.num_hidden_layers, 2, max_len, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
            for _ in range(n)]


@pytest.mark.parametrize("dense_layer", [False, True])
@torch.inference_mode()
def test_native_steps_match_the_torch_trunk(dense_layer):
    if dense_layer:  # layer 0 a dense SwiGLU MLP, as `mlp_only_layers` makes it
        torch.manual_seed(1)
        model = MoeForCausalLM(tiny_config(mlp_only_layers=[0])).eval()
    else:
        model = tiny_model(0)[0]
    fast, native = FastTrunk(model), NativeTrunk(model, LIB, 64)
    ref, nat = caches(model.config)
    prompt = torch.randint(0, 512, (1, 9))
    pos = torch.arange(9)[None]
    for c in (ref, nat):  # the same prefill into slot 1 of both caches
        c.begin(1, pos)
        fast(prompt, pos, c)
    for step in range(6):
        ids, p = torch.randint(0, 512, (1, 1)), torch.tensor([[9 + step]])
        ref.begin(1, p)
        want, want_routes = fast(ids, p, ref)
        got, got_routes = native(ids, p, nat, 1)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(native.head(got), model.head(want), atol=5e-5, rtol=1e-5)
        assert torch.equal(got_routes.long(), want_routes)
    torch.testing.assert_close(nat.k[:, 1, :, :15], ref.k[:, 1, :, :15], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(nat.v[:, 1, :, :15], ref.v[:, 1, :, :15], atol=2e-5, rtol=1e-5)
    assert nat.k[:, 0].abs().sum() == 0  # the other slot is untouched


@pytest.mark.parametrize("k,each", [(5, 1), (NATIVE_PREFILL, MAX_TOKENS)])  # a decoding step; a prefill in one call
@torch.inference_mode()
def test_a_k_token_call_is_bit_identical_to_shorter_calls(k, each):
    model = tiny_model(2)[0]
    native = NativeTrunk(model, LIB, NATIVE_PREFILL)
    one, many = caches(model.config, max_len=NATIVE_PREFILL)
    ids = torch.randint(0, 512, (1, k))
    parts = [native(ids[:, i:i + each], torch.arange(i, i + each)[None], one, 0) for i in range(0, k, each)]
    hidden, routes = native(ids, torch.arange(k)[None], many, 0)
    assert torch.equal(hidden, torch.cat([h for h, _ in parts], dim=1))
    assert torch.equal(routes, torch.cat([r for _, r in parts], dim=1))
    assert torch.equal(one.k, many.k) and torch.equal(one.v, many.v)


@torch.inference_mode()
def test_the_engine_decodes_one_sequence_natively_and_sees_weight_updates():
    model = tiny_model(3)[0]
    engine, plain = Engine(model, max_batch=1), Engine(model, max_batch=1, native=False)
    assert engine.native is not None and plain.native is None
    greedy = SamplingParams(temperature=0, max_tokens=12)
    a, b = engine.generate([[5, 6, 7]], greedy)[0], plain.generate([[5, 6, 7]], greedy)[0]
    assert a.token_ids == b.token_ids and a.routes == b.routes
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)

    new = {k: v * 1.5 if v.ndim > 1 else v for k, v in model.state_dict().items()}
    engine.update_weights(new, version=1)
    out = engine.generate([[5, 6, 7]], greedy)[0]
    other = MoeForCausalLM(model.config).eval()
    other.load_state_dict(new)
    want = Engine(other, max_batch=1, native=False).generate([[5, 6, 7]], greedy)[0]
    assert out.versions == [1] * 12 and out.token_ids == want.token_ids


def test_positions_past_the_cache_are_refused():
    model = tiny_model(0)[0]
    native = NativeTrunk(model, LIB, 16)
    (cache,) = caches(model.config, n=1, max_len=16)
    with pytest.raises(ValueError, match="outside the cache"):
        native(torch.tensor([[1, 2]]), torch.tensor([[15, 16]]), cache, 0)


def test_kiln_native_0_falls_back_to_torch():
    code = ("from kiln.engine import Engine; from tests.tiny_model import tiny_model; "
            "assert Engine(tiny_model(0)[0], max_batch=1).native is None; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KILN_NATIVE": "0"},
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@torch.inference_mode()
def test_native_mtp_layers_and_heads_match_torch():
    model, mtp = tiny_model(4)
    rows = torch.tensor([0, 3, 7, 200, 511])  # a draft vocabulary: the head reads these rows only
    native = NativeTrunk(model, LIB, 64, mtp, draft_ids=rows)
    ref, nat = caches(model.config)
    hidden = torch.randn(1, 6, model.config.hidden_size)
    ids = torch.randint(0, 512, (1, 6))
    pos = torch.arange(3, 9)[None]
    ref.begin(0, pos)
    rope = rope_tables(model.model.inv_freq(torch.device("cpu")), pos, hidden.dtype)
    for k, layer in enumerate(mtp.layers):
        want = layer(hidden, mtp.embed(model, ids), rope, cache=ref)
        got = native.mtp_layer(k, hidden, ids.tolist(), [3], nat, 0)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(native.head(got, norm=layer.norm.weight), mtp.logits(model, k, want),
                                   atol=5e-5, rtol=1e-5)
        full = native.head(got, norm=layer.norm.weight)
        assert torch.equal(native.head(got, norm=layer.norm.weight, drafts=True), full[..., rows])
    torch.testing.assert_close(nat.k[:, 0, :, 3:9], ref.k[:, 0, :, 3:9], atol=2e-5, rtol=1e-5)


@torch.inference_mode()
def test_an_mtp_layer_that_needs_some_rows_computes_them_and_every_cache_entry_exactly():
    """The drafter's last layer runs the feed-forward only for the rows it drafts from: those rows
    and the whole cache are bit-identical to a call that computes every row."""
    model, mtp = tiny_model(4)
    native = NativeTrunk(model, LIB, 64, mtp)
    hidden, ids = torch.randn(2, 5, model.config.hidden_size), torch.randint(0, 512, (2, 5))
    need = torch.zeros(2, 5, dtype=torch.bool)
    need[0, 4], need[1, 2] = True, True
    (full_cache, part_cache) = caches(model.config, n=2)
    full = native.mtp_layer(1, hidden, ids.tolist(), [3, 3], full_cache, 0)
    part = native.mtp_layer(1, hidden, ids.tolist(), [3, 3], part_cache, 0, need.tolist())
    assert torch.equal(part[need], full[need]) and not torch.equal(part, full)
    assert torch.equal(part_cache.k, full_cache.k) and torch.equal(part_cache.v, full_cache.v)


def test_a_forked_child_decodes_natively_after_its_parent_did():
    # The parent's helper thread does not survive fork(); the child must start its own, not wait
    # forever on a thread it does not have. (One torch thread: torch's own OpenMP pool is not
    # fork-safe, whatever kiln does.)
    code = ("import os, torch; from kiln.engine import Engine, SamplingParams; from kiln.model.moe import MoeForCausalLM;"
            "from kiln.model.config import ModelConfig; torch.set_num_threads(1); torch.manual_seed(0);"
            "m = MoeForCausalLM(ModelConfig.from_depth(4, vocab_size=8192)).eval();"
            "g = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=());"
            "a = Engine(m, max_batch=1, max_len=32).generate([[1, 2, 3]], g)[0].token_ids; pid = os.fork();"
            "b = Engine(m, max_batch=1, max_len=32).generate([[1, 2, 3]], g)[0].token_ids;"
            "os._exit(0 if a == b else 3) if pid == 0 else print(os.waitpid(pid, 0)[1] == 0 and a == b)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to compare against one")
@pytest.mark.parametrize("cpus", [1, 2])
def test_the_helper_thread_starts_only_with_a_second_cpu(cpus):
    # Confined to one CPU (an RL worker), a helper could only spin on the caller's core.
    code = ("import os, torch; from kiln.engine import Engine, SamplingParams; from kiln.model.moe import MoeForCausalLM;"
            "from kiln.model.config import ModelConfig; torch.set_num_threads(1); torch.manual_seed(0);"
            f"os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:{cpus}]);"
            "m = MoeForCausalLM(ModelConfig.from_depth(4, vocab_size=8192)).eval();"
            "e = Engine(m, max_batch=1, max_len=32); before = len(os.listdir('/proc/self/task'));"
            "e.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, stop_token_ids=()));"
            "print(len(os.listdir('/proc/self/task')) - before)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == (0 if cpus == 1 else 1)


def prefilled_pair(native, cfg, lengths: list[int], kv_dtype=torch.float32) -> tuple[KVCache, KVCache]:
    """Two caches holding the same random prompts of these lengths, one per slot."""
    one, many = (KVCache(cfg.num_hidden_layers, len(lengths), 64, cfg.num_key_value_heads, cfg.head_dim,
                         kv_dtype) for _ in range(2))
    for slot, n in enumerate(lengths):
        prompt = torch.randint(0, 512, (1, n))
        for c in (one, many):
            native(prompt[:, :16], torch.arange(min(n, 16))[None], c, slot)
            if n > 16:
                native(prompt[:, 16:], torch.arange(16, n)[None], c, slot)
    return one, many


@pytest.mark.parametrize("tokens, kv_dtype", [(1, torch.float32), (3, torch.float32), (3, torch.bfloat16)])
@torch.inference_mode()
def test_a_batched_call_is_bit_identical_to_one_row_calls(tokens, kv_dtype):
    # Rows of different lengths in consecutive slots, T tokens each (decoding, or speculative
    # verification): one call streams each weight once for all rows, and every row's hidden
    # states, routes and cache entries equal those of its own one-row call, bit for bit.
    model = tiny_model(5)[0]
    native = NativeTrunk(model, LIB, 64)
    cfg = model.config
    rows, lengths = 5, [9, 3, 17, 1, 30]
    one, many = prefilled_pair(native, cfg, lengths, kv_dtype)
    ids = torch.randint(0, 512, (rows, tokens))
    pos = torch.tensor(lengths)[:, None] + torch.arange(tokens)
    singles = [native(ids[i:i + 1], pos[i:i + 1], one, i) for i in range(rows)]
    hidden, routes = native(ids, pos, many, 0)
    assert torch.equal(hidden, torch.cat([h for h, _ in singles]))
    assert torch.equal(routes, torch.cat([r for _, r in singles]))
    assert torch.equal(one.k, many.k) and torch.equal(one.v, many.v)
    assert torch.equal(native.head(hidden), torch.cat([native.head(h) for h, _ in singles]))
    # and the batch against the torch trunk, row by row
    fast = FastTrunk(model)
    for i in range(rows):
        ref = KVCache(cfg.num_hidden_layers, 1, 64, cfg.num_key_value_heads, cfg.head_dim, kv_dtype)
        ref.k[:, 0], ref.v[:, 0] = one.k[:, i], one.v[:, i]
        ref.begin(0, pos[i:i + 1])
        want, want_routes = fast(ids[i:i + 1], pos[i:i + 1], ref)
        # (a bf16 cache: a new key or value 1e-6 apart between the two may round one bf16 step apart)
        tol = (2e-5, 1e-5) if kv_dtype == torch.float32 else (1e-3, 1e-3)
        torch.testing.assert_close(hidden[i:i + 1], want, atol=tol[0], rtol=tol[1])
        assert torch.equal(routes[i:i + 1].long(), want_routes)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_a_ragged_call_is_bit_identical_to_one_row_calls(kv_dtype):
    # Rows fed only their own tokens (speculative rows with their own drafts, others their last
    # token): one call, and every row's outputs and cache entries are its own call's, bit for bit.
    model = tiny_model(5)[0]
    native = NativeTrunk(model, LIB, 64)
    lengths, tokens = [9, 3, 17, 1, 30], [3, 1, 5, 1, 2]
    one, many = prefilled_pair(native, model.config, lengths, kv_dtype)
    ids = [torch.randint(0, 512, (t,)).tolist() for t in tokens]
    singles = [native.trunk([ids[i]], [lengths[i]], one, i) for i in range(len(ids))]
    hidden, routes = native.trunk_ragged(ids, lengths, many, 0)
    assert hidden.shape[0] == sum(tokens)
    assert torch.equal(hidden, torch.cat([h[0] for h, _ in singles]))
    assert torch.equal(routes, torch.cat([r[0] for _, r in singles]))
    assert torch.equal(one.k, many.k) and torch.equal(one.v, many.v)
    with pytest.raises(ValueError):  # an empty row
        native.trunk_ragged([[1], []], [0, 0], many, 0)


@torch.inference_mode()
def test_batched_engine_decoding_equals_one_sequence_at_a_time():
    # The engine decodes its running sequences in one native call; each sequence's greedy tokens,
    # logprobs and routes are exactly those it gets decoding alone.
    model = tiny_model(6)[0]
    prompts = [[5, 6, 7], [9] * 20, list(range(40, 52)), [3]]
    greedy = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=())
    together = Engine(model, max_batch=4).generate(prompts, greedy)
    alone = [Engine(model, max_batch=1).generate([p], greedy)[0] for p in prompts]
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.routes == b.routes
