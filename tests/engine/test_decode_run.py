"""Decoding runs (kiln/engine/runs.py: several steps a native.c call) against the engine's step at
a time (`engine.runs = False`): the same tokens, logprobs, routes, versions, finish reasons and
text, whatever ends a row (a stop id, a stop string, max_tokens, the cache's end) and whatever else
shares its batch; speculatively also the same drafts, statistics and drafter cache."""
from __future__ import annotations

import copy
import dataclasses
import os
import shutil

import pytest
import torch

from kiln.engine import Engine, SamplingParams, runs
from kiln.engine.native import DECODE_RUN
from kiln.engine.speculative import SpecStats
from kiln.model.mtp import MTP
from kiln.model.tokenizer import load_tokenizer
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.tiny_model import tiny_model

HAVE_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
pytestmark = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the engine decodes a step at a time")


@pytest.fixture(scope="module")
def models():
    return tiny_model(0)


@pytest.fixture
def counted(monkeypatch):
    """The runs made, by kind."""
    made = {"plain": 0, "speculative": 0, "lookup": 0}

    def counted_run(name, real):
        def run(engine, rs, *args):
            ran = real(engine, rs, *args)
            made[name] += ran
            return ran
        return run

    for name in made:
        monkeypatch.setattr(runs, name, counted_run(name, getattr(runs, name)))
    return made


def generate(model, tok, prompts, params, use_runs: bool, **kw):
    """-> (each completion's fields, the engine)."""
    engine = Engine(model, tok, version=2, **kw)
    assert engine.native is not None
    engine.runs = use_runs
    outs = engine.generate(prompts, params)
    return [(c.token_ids, c.logprobs, c.routes, c.versions, c.finish_reason, c.text) for c in outs], engine


def test_plain_runs_equal_steps(tiny_checkpoint, models, counted):
    model, tok = models[0], load_tokenizer(tiny_checkpoint)
    prompts = [tok.encode(t) for t in ("def main():\n    return", "import os\n", "class A:\n    x = [", "# a")]
    free = [SamplingParams(temperature=0, max_tokens=45, stop_token_ids=()),
            SamplingParams(temperature=0.8, max_tokens=60, seed=1, stop_token_ids=()),
            SamplingParams(temperature=1.0, max_tokens=60, seed=2, stop_token_ids=()),
            SamplingParams(temperature=0.7, max_tokens=23, seed=3, stop_token_ids=())]
    (_, sampled, other, _), _ = generate(model, tok, prompts, free, False)
    # Row 1 ends on a stop id mid-run, row 2 on a stop string; rows 0 and 3 carry on past both.
    stop_id, text = sampled[0][21], other[5]
    stop_text = text[len(text) // 3: len(text) // 3 + 3]
    params = [free[0], SamplingParams(temperature=0.8, max_tokens=60, seed=1, stop_token_ids=(stop_id,)),
              SamplingParams(temperature=1.0, max_tokens=60, seed=2, stop_token_ids=(), stop=(stop_text,)), free[3]]
    for max_batch in (1, 4):
        want, _ = generate(model, tok, prompts, params, False, max_batch=max_batch)
        assert counted["plain"] == 0
        got, _ = generate(model, tok, prompts, params, True, max_batch=max_batch)
        assert got == want
        assert [c[4] for c in got] == ["length", "stop", "stop", "length"]
        assert len(got[1][0]) == sampled[0].index(stop_id) + 1 < 60 and len(got[2][0]) < 60
        assert 0 < counted["plain"] < sum(len(c[0]) for c in got) / 4  # most steps ran in runs
        counted["plain"] = 0


def test_plain_runs_stop_at_the_cache_end(models):
    prompts = [[5, 17, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    params = [SamplingParams(temperature=0, max_tokens=100), SamplingParams(temperature=0.9, max_tokens=100, seed=4)]
    want, _ = generate(models[0], None, prompts, params, False, max_len=DECODE_RUN + 20)
    got, _ = generate(models[0], None, prompts, params, True, max_len=DECODE_RUN + 20)
    assert got == want and [c[4] for c in got] == ["length", "length"]
    # every position of the cache fed, and the last token (never fed) after them
    assert [len(p) + len(c[0]) for p, c in zip(prompts, got)] == [DECODE_RUN + 21] * 2


def drafter(model, mtp: MTP, depth: int, favoured: list[int]) -> MTP:
    """The tiny MTP's layers as `depth` layers (the last repeated), counting `favoured` as its most
    frequent tokens: with the draft vocabulary those, the untrained drafter's drafts are often right."""
    out = MTP(model.config, depth).eval()
    for k in range(depth):
        out.layers[k].load_state_dict(mtp.layers[min(k, mtp.depth - 1)].state_dict())
    out.token_counts.zero_()
    out.token_counts[torch.tensor(favoured)] = torch.arange(len(favoured), 0, -1)
    return out


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_speculative_runs_equal_steps(models, depth, counted):
    model, mtp = models
    prompts = [[5, 17, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7] * 17, [300, 2, 9, 11, 13], [1]]
    lengths = [40, 26, 9, 37, 50]
    params = [SamplingParams(temperature=0, max_tokens=n, stop_token_ids=()) for n in lengths]
    plain, _ = generate(model, None, prompts, params, True)
    # Drafting only greedy's most frequent token: row 3 repeats it, so its drafts are mostly accepted.
    favoured = [max(range(512), key=lambda x: sum(c[0].count(x) for c in plain))]
    # a stop id in the middle of row 1's output; the cache's end cuts row 4 short
    stop = next(t for i, t in enumerate(plain[1][0]) if i >= 15 and t not in plain[1][0][:i])
    params[1] = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=(stop,))
    kw = {"mtp": drafter(model, mtp, depth, favoured), "draft_vocab": 1, "max_batch": 3, "max_len": 48, "prefix_slots": 4}
    want, steps = generate(model, None, prompts, params, False, **kw)
    assert counted["speculative"] == 0
    got, ran = generate(model, None, prompts, params, True, **kw)
    assert got == want and 0 < counted["speculative"] < ran.spec_stats.steps
    assert [c[0] for c in got] == [c[0][:len(g[0])] for c, g in zip(plain, got)]  # plain greedy's tokens
    assert [c[4] for c in got] == ["length", "stop", "length", "length", "length"] and len(got[4][0]) < 50
    assert vars(ran.spec_stats) == vars(steps.spec_stats) and ran.spec_stats.accepted[depth - 1] >= 5
    # the drafter's cache and what the prefix cache kept of it, bit for bit
    assert torch.equal(ran.mtp_cache.k, steps.mtp_cache.k) and torch.equal(ran.mtp_cache.v, steps.mtp_cache.v)
    assert [e.drafted for e in ran.prefix.entries] == [e.drafted for e in steps.prefix.entries]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculative_runs_after_new_weights_use_them(dtype, counted):
    """A speculative run reuses its view of the drafter and caches between runs (runs._spec) until
    new weights move what it points to (the native structs, the drafter's head rows, a bf16
    sampler's copies): after update_weights, the same tokens and drafts as an engine built on the
    new weights."""
    prompts, params = [[5, 17, 3], [7] * 17], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=())
    new_model = tiny_model(1)[0]
    plain = [c.token_ids for c in Engine(copy.deepcopy(new_model), max_batch=2).generate(prompts, params)]
    # Both drafters draft only the new model's most frequent greedy token (an engine keeps its draft
    # vocabulary), so the new one is often right.
    favoured = [max(range(512), key=lambda x: sum(c.count(x) for c in plain))]
    model, mtp = copy.deepcopy(tiny_model(0)[0]), drafter(*tiny_model(0), 2, favoured)
    new_mtp = drafter(*tiny_model(1), 2, favoured)
    kw = {"max_batch": 2, "max_len": 64, "draft_vocab": 1, "weight_dtype": dtype}
    engine = Engine(model, mtp=copy.deepcopy(mtp), **kw)
    engine.generate(prompts, params)
    engine.update_weights(new_model.state_dict(), version=1, mtp_state=new_mtp.state_dict())
    engine.spec_stats = SpecStats(2)
    got = [c.token_ids for c in engine.generate(prompts, params)]
    fresh = Engine(copy.deepcopy(new_model), mtp=copy.deepcopy(new_mtp), **kw)
    assert got == [c.token_ids for c in fresh.generate(prompts, params)] and counted["speculative"] > 0
    assert vars(engine.spec_stats) == vars(fresh.spec_stats) and sum(fresh.spec_stats.accepted) > 0


@pytest.mark.parametrize("depth,dtypes", [(1, {}), (4, {}),
                                          (4, {"weight_dtype": torch.bfloat16, "kv_dtype": torch.bfloat16})])
def test_lookup_runs_equal_steps(models, depth, dtypes, counted):
    """Prompt lookup as RL workers run it (sampled, seeded rows, prefix reuse), beside greedy rows
    whose output repeats itself (so drafts are found and accepted); also with the bf16 sampler and
    a bf16 KV cache."""
    model = copy.deepcopy(models[0]) if dtypes else models[0]  # a bf16 sampler rounds its model in place
    prompts = [[5, 17, 3, 5, 17, 3, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7] * 17, [300, 2, 9, 11, 13], [1]]
    sampled = [SamplingParams(temperature=t, max_tokens=40, seed=i, stop_token_ids=()) for i, t in enumerate((0.7, 1.0))]
    greedy = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=())
    params = [sampled[0], greedy, sampled[1], greedy, SamplingParams(temperature=0.7, max_tokens=60, seed=4)]
    free, _ = generate(model, None, prompts, params, False, lookup=depth, **dtypes)
    # a stop id in the middle of row 0's output; the cache's end cuts row 4 short
    stop = next(t for i, t in enumerate(free[0][0]) if i >= 12 and t not in free[0][0][:i])
    params[0] = SamplingParams(temperature=0.7, max_tokens=40, seed=0, stop_token_ids=(stop,))
    kw = {"lookup": depth, "max_batch": 3, "max_len": 44, "prefix_slots": 4, "carry_turns": True, **dtypes}
    want, steps = generate(model, None, prompts, params, False, **kw)
    assert counted["lookup"] == 0
    got, ran = generate(model, None, prompts, params, True, **kw)
    assert got == want and counted["lookup"] > 0
    assert [c[4] for c in got] == ["stop", "length", "length", "length", "length"] and len(got[4][0]) < 60
    accepted = ran.spec_stats.accepted  # first drafts, and (depth 4) second ones too
    assert vars(ran.spec_stats) == vars(steps.spec_stats) and accepted[0] >= 10 and accepted[min(1, depth - 1)] > 0
    # each sampled row's generator is left where the steps leave it: a longer turn draws the same
    params = [dataclasses.replace(p, max_tokens=p.max_tokens + 3) for p in params]
    assert generate(model, None, prompts, params, True, **kw)[0] == generate(model, None, prompts, params, False, **kw)[0]


def test_new_weights_or_a_request_end_a_run_after_its_step(models):
    """update_weights and submit (from any thread) set the flag a native run checks after each step,
    so what arrives waits one step, not a run; step() clears it first."""
    model = models[0]
    engine = Engine(model, max_batch=4)
    engine.submit([5, 17, 3], SamplingParams(temperature=0, max_tokens=100))
    engine.step()  # prefilled, then a whole run
    assert len(engine.running[0].tokens) == 1 + DECODE_RUN
    for arrive in (lambda: engine.update_weights(model.state_dict(), version=1),
                   lambda: engine.submit([40, 41], SamplingParams(temperature=0, max_tokens=100))):
        r = engine.running[0]
        before = len(r.tokens)
        arrive()
        runs.plain(engine, engine.running)  # what step() would run, with the arrival not yet taken
        assert len(r.tokens) == before + 1
        engine.step()  # takes it, then runs again
        assert len(r.tokens) == before + 1 + DECODE_RUN
    assert engine.version == 1 and len(engine.running) == 2
