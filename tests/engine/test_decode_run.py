"""Plain decoding in native runs (Engine._decode_run: several steps a native.c call) against the
engine's one-step-a-round Python loop: the same tokens, logprobs, routes, versions, finish reasons
and text, whatever ends a row (a stop id, a stop string, max_tokens, the cache's end) and whatever
else shares its batch."""
from __future__ import annotations

import os
import shutil

import pytest

from kiln.engine import Engine, SamplingParams
from kiln.engine.engine import DECODE_RUN
from kiln.model.tokenizer import load_tokenizer
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.tiny_model import tiny_model

HAVE_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
pytestmark = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the engine decodes a step at a time")


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)[0]


def generate(model, tok, prompts, params, runs: bool, max_batch=8, max_len=None):
    """-> (each completion's fields, native runs made)."""
    engine = Engine(model, tok, max_batch=max_batch, max_len=max_len, version=2)
    assert engine.native is not None
    calls = []
    if runs:
        decode = engine.native.decode
        engine.native.decode = lambda *a, **k: calls.append(1) or decode(*a, **k)
    else:
        engine._decode_run = engine._decode_step
    outs = engine.generate(prompts, params)
    return [(c.token_ids, c.logprobs, c.routes, c.versions, c.finish_reason, c.text) for c in outs], len(calls)


def test_runs_equal_step_by_step_decoding(tiny_checkpoint, model):
    tok = load_tokenizer(tiny_checkpoint)
    prompts = [tok.encode(t) for t in ("def main():\n    return", "import os\n", "class A:\n    x = [", "# a")]
    free = [SamplingParams(temperature=0, max_tokens=45, stop_token_ids=()),
            SamplingParams(temperature=0.8, max_tokens=60, seed=1, stop_token_ids=()),
            SamplingParams(temperature=1.0, max_tokens=60, seed=2, stop_token_ids=()),
            SamplingParams(temperature=0.7, max_tokens=23, seed=3, stop_token_ids=())]
    (_, sampled, other, _), _ = generate(model, tok, prompts, free, runs=False)
    # Row 1 ends on a stop id mid-run, row 2 on a stop string; rows 0 and 3 carry on past both.
    stop_id, text = sampled[0][21], other[5]
    stop_text = text[len(text) // 3: len(text) // 3 + 3]
    params = [free[0], SamplingParams(temperature=0.8, max_tokens=60, seed=1, stop_token_ids=(stop_id,)),
              SamplingParams(temperature=1.0, max_tokens=60, seed=2, stop_token_ids=(), stop=(stop_text,)), free[3]]
    for max_batch in (1, 4):
        want, _ = generate(model, tok, prompts, params, runs=False, max_batch=max_batch)
        got, calls = generate(model, tok, prompts, params, runs=True, max_batch=max_batch)
        assert got == want
        assert [c[4] for c in got] == ["length", "stop", "stop", "length"]
        assert len(got[1][0]) == sampled[0].index(stop_id) + 1 < 60 and len(got[2][0]) < 60
        assert calls < sum(len(c[0]) for c in got) / 4  # most steps ran in runs


def test_runs_stop_at_the_cache_end(model):
    prompts = [[5, 17, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    params = [SamplingParams(temperature=0, max_tokens=100), SamplingParams(temperature=0.9, max_tokens=100, seed=4)]
    want, _ = generate(model, None, prompts, params, runs=False, max_len=DECODE_RUN + 20)
    got, _ = generate(model, None, prompts, params, runs=True, max_len=DECODE_RUN + 20)
    assert got == want and [c[4] for c in got] == ["length", "length"]
    # every position of the cache fed, and the last token (never fed) after them
    assert [len(p) + len(c[0]) for p, c in zip(prompts, got)] == [DECODE_RUN + 21] * 2


def test_new_weights_or_a_request_end_a_run_after_its_step(model):
    """update_weights and submit (from any thread) set the flag a native run checks after each step,
    so what arrives waits one step, not a run; step() clears it first."""
    engine = Engine(model, max_batch=4)
    engine.submit([5, 17, 3], SamplingParams(temperature=0, max_tokens=100))
    engine.step()  # prefilled, then a whole run
    assert len(engine.running[0].tokens) == 1 + DECODE_RUN
    for arrive in (lambda: engine.update_weights(model.state_dict(), version=1),
                   lambda: engine.submit([40, 41], SamplingParams(temperature=0, max_tokens=100))):
        r = engine.running[0]
        before = len(r.tokens)
        arrive()
        engine._decode_run(engine.running)  # what step() would run, with the arrival not yet taken
        assert len(r.tokens) == before + 1
        engine.step()  # takes it, then runs again
        assert len(r.tokens) == before + 1 + DECODE_RUN
    assert engine.version == 1 and len(engine.running) == 2
