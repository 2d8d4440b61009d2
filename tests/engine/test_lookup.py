"""Prompt-lookup speculative decoding (engine/lookup.py) on real tiny models: greedy output is plain
greedy's, samples follow the model's distribution exactly, and the cache's end is respected."""
from __future__ import annotations

import pytest
import torch

from kiln.engine import Engine, SamplingParams
from kiln.engine.lookup import propose
from kiln.engine.request import Request
from tests.engine.test_speculative import bigram, bigram_kernel, markov_chi_square_p  # noqa: F401 - bigram is a fixture
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.tiny_model import tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=())
LOOP = [(5 * i) % 37 + 3 for i in range(12)]  # a stretch the prompts repeat, so drafts exist at once


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)[0]


def test_propose_copies_what_followed_the_latest_earlier_occurrence():
    r = Request([1, 2, 5, 1, 2, 7, 1], SamplingParams())
    r.tokens = [2]
    assert propose(r, 3) == [7]  # (1, 2) last occurred at 3-4, after a 5 where this one follows a 7: one draft
    r.tokens = [2, 9]
    assert propose(r, 3) == []  # (2, 9) never occurred before
    r.tokens = [2, 9, 1, 2]
    assert propose(r, 2) == [9]  # the index grew with the tokens


def test_a_longer_match_drafts_more():
    """2^m drafts, m the tokens before the matched pair that match too, at most `depth`."""
    text = [8, 3, 4, 1, 2, 5, 6, 7, 9, 9]
    for m, want in ((0, 1), (1, 2), (2, 4), (3, 4)):
        r = Request(text + [0] + text[3 - m:4], SamplingParams())  # ends with m of text's tokens, then 1
        r.tokens = [2]
        assert propose(r, 4) == text[5:5 + want], m
    r = Request(text + [3, 4, 1], SamplingParams())
    r.tokens = [2]
    assert propose(r, 3) == [5, 6, 7]  # at most depth
    assert propose(r, 0) == []


@pytest.mark.parametrize("native", [True, False])
def test_greedy_lookup_equals_plain_greedy(model, native):
    prompts = [LOOP * 3, [11, 12] + LOOP * 2 + [13], LOOP[:7] + [20, 21] + LOOP]
    plain = Engine(model, max_batch=4, native=native).generate(prompts, GREEDY)
    engine = Engine(model, max_batch=4, native=native, lookup=4)
    got = engine.generate(prompts, GREEDY)
    for a, b in zip(plain, got):
        assert b.token_ids == a.token_ids
        assert b.routes == a.routes  # router replay sees every fed position, accepted drafts included
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
    s = engine.spec_stats
    assert s.steps > 0 and s.proposed[0] == s.steps and 0 < sum(s.accepted) <= sum(s.proposed)


def test_native_runs_draft_as_propose_does(model):
    """native.c's lookup runs choose the drafts propose() does: the same positions checked and accepted."""
    prompts = [LOOP * 3, [11, 12] + LOOP * 2 + [13], LOOP[:7] + [20, 21] + LOOP]
    stats = []
    for native in (True, False):
        engine = Engine(model, max_batch=4, native=native, lookup=4)
        engine.generate(prompts, GREEDY)
        s = engine.spec_stats
        stats.append((s.steps, s.proposed, s.accepted))
    assert stats[0][0] > 0 and stats[0] == stats[1]


@pytest.mark.parametrize("mode", ["plain", "lookup", "lookup top_k=8"])
def test_sampled_lookup_is_exact(bigram, mode):  # noqa: F811 - the fixture
    """As the MTP drafter's test: every token of a 16-token bigram model is one draw from a known
    kernel, and with drafts copied from each sequence's own history (16 tokens: they recur
    constantly) acceptance, the residual resample and the bonus token all shape the output."""
    model, _, logits = bigram
    top_k = 8 if "top_k" in mode else 0
    kernel = bigram_kernel(logits, top_k)
    engine = Engine(model, max_batch=64, capture_routes=False, lookup=0 if mode == "plain" else 3)
    v, n_seq = model.config.vocab_size, 64
    params = [SamplingParams(temperature=1.0, top_k=top_k, max_tokens=48, seed=s, stop_token_ids=())
              for s in range(n_seq)]
    outs = engine.generate([[s % v, (s * 7) % v] for s in range(n_seq)], params)
    seqs = torch.tensor([[s % v, (s * 7) % v] + c.token_ids for s, c in enumerate(outs)])
    assert markov_chi_square_p(seqs[:, :-1].flatten(), seqs[:, 1:].flatten(), kernel) > 1e-4
    if mode != "plain":
        assert 0.05 < engine.spec_stats.acceptance[0] < 0.95  # both paths (accept and resample) exercised


def test_drafts_stop_at_the_cache_end(model):
    prompt = LOOP * 2
    short = SamplingParams(temperature=0.0, max_tokens=100, stop_token_ids=())
    plain = Engine(model, max_batch=2, max_len=40).generate([prompt, prompt[:20]], short)
    got = Engine(model, max_batch=2, max_len=40, lookup=8).generate([prompt, prompt[:20]], short)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    assert [c.finish_reason for c in got] == ["length", "length"]


def test_lookup_is_refused_with_an_mtp_drafter_or_past_a_native_call():
    model, mtp = tiny_model(0)
    with pytest.raises(ValueError, match="lookup must be 0-15 drafts, and 0 with an MTP drafter"):
        Engine(model, mtp=mtp, lookup=2)
    with pytest.raises(ValueError, match=r"\(got 16\)"):
        Engine(model, lookup=16)
