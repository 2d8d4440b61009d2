"""Speculative decoding with MTP drafts: greedy output identical to plain decoding, sampled output
distributed exactly as plain sampling, the acceptance rule itself, and the statistics."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.engine import Engine, SamplingParams, speculative
from kiln.engine import engine as engine_module
from kiln.engine.speculative import verify
from kiln.model.mtp import MTP
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.tiny_model import (
    tiny_model,
)

PROMPTS = [[5, 17, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7] * 17, [300, 2, 9, 11, 13], [1]]


@pytest.fixture(scope="module")
def models():
    return tiny_model(0)


def mtp_of_depth(model, mtp: MTP, depth: int) -> MTP:
    """The tiny model's MTP cut to its first `depth` layers."""
    out = MTP(model.config, depth).eval()
    for k in range(depth):
        out.layers[k].load_state_dict(mtp.layers[k].state_dict())
    return out


def check_stats(stats, depth: int) -> None:
    assert stats.steps > 0 and stats.proposed[0] == stats.steps  # the first draft is always checked
    for j in range(depth):
        assert 0 <= stats.accepted[j] <= stats.proposed[j]
        assert 0.0 <= stats.acceptance[j] <= 1.0
    for j in range(depth - 1):
        assert stats.proposed[j + 1] == stats.accepted[j]  # draft j+1 is checked iff draft j was accepted


# ---- greedy: identical to plain decoding --------------------------------------------------------

@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_speculative_equals_plain_greedy(models, depth):
    model, mtp = models
    lengths = [14, 6, 9, 20, 11]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in lengths]
    plain = Engine(model, max_batch=2).generate(PROMPTS, params)
    engine = Engine(model, mtp=mtp_of_depth(model, mtp, depth), max_batch=2)  # slots reused and compacted
    spec = engine.generate(PROMPTS, params)
    for p, s, prompt in zip(plain, spec, PROMPTS):
        assert s.token_ids == p.token_ids and s.finish_reason == p.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=1e-4, rtol=0)
        assert s.versions == p.versions
        assert len(s.routes) == len(prompt) + len(s.token_ids)
        assert s.routes == p.routes
    check_stats(engine.spec_stats, depth)


def with_counts(mtp: MTP, favoured: list[int]) -> MTP:
    """`mtp` with training counts that rank `favoured` first (a copy: the fixture stays as it was)."""
    out = MTP(mtp.config, mtp.depth).eval()
    out.load_state_dict(mtp.state_dict())
    out.token_counts.zero_()
    out.token_counts[torch.tensor(favoured)] = torch.arange(len(favoured), 0, -1)
    return out


def test_a_draft_vocabulary_changes_the_drafts_never_the_output(models, monkeypatch):
    """The drafter proposes only its draft_vocab most counted tokens: every draft is one of them
    (the untrained drafter over all 512 would stray), and the greedy output is plain greedy's,
    also when the vocabulary leaves out every token greedy decoding emits."""
    model, mtp = models
    params = SamplingParams(temperature=0, max_tokens=16)
    plain = Engine(model).generate(PROMPTS, params)
    wanted = sorted({t for c in plain for t in c.token_ids})
    others = [t for t in range(model.config.vocab_size) if t not in wanted][:64]
    proposed, real = [], speculative.draft

    def spy(engine, start, reqs, *args, **kwargs):
        real(engine, start, reqs, *args, **kwargs)
        proposed.extend(d for r in reqs for d in r.drafts)
    monkeypatch.setattr(speculative, "draft", spy)
    monkeypatch.setattr(engine_module, "draft", spy)
    for favoured in (wanted, others):
        engine = Engine(model, mtp=with_counts(mtp, favoured), draft_vocab=len(favoured))
        engine.runs = False  # every step's drafts through the spied draft()
        assert engine.draft_ids.tolist() == sorted(favoured)
        proposed.clear()
        spec = engine.generate(PROMPTS, params)
        assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
        assert len(proposed) > 20 and set(proposed) <= set(favoured)
    assert Engine(model, mtp=mtp, draft_vocab=64).draft_ids is None  # nothing counted: the whole vocabulary


@pytest.mark.parametrize("prompt", [PROMPTS[1], list(range(40, 80))])
def test_mtp_cache_holds_no_entry_computed_from_a_draft(models, prompt):
    """After every step, each MTP layer's cached keys at positions whose input tokens are known
    equal a fresh MTP pass over the accepted sequence: no entry is left from a rejected draft.
    A prompt of 40 tokens goes through native.c's MTP layers 16 positions a call."""
    from kiln.engine.kvcache import KVCache
    from kiln.model.layers import rope_tables

    model, mtp = models  # depth 2: layer 2's last entry is the one a draft could leave behind
    depth, cfg = mtp.depth, model.config
    engine = Engine(model, mtp=mtp, max_batch=1)
    r = engine.submit(prompt, SamplingParams(temperature=1.0, seed=0, max_tokens=40))
    checked = 0
    while not r.done.is_set():
        engine.step()
        if r.done.is_set():
            break
        seq, n = r.prompt_ids + r.tokens, r.length  # the last token is known but not yet fed
        with torch.inference_mode():
            hidden = model.trunk(torch.tensor([seq[:n]])).hidden
            fresh = KVCache(depth, 1, n + depth, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
            pos = torch.arange(n)[None]
            fresh.begin(0, pos)
            rope = rope_tables(model.model.inv_freq(hidden.device), pos, hidden.dtype)
            h = hidden
            for k, layer in enumerate(mtp.layers, start=1):
                ids = [seq[i + k] if i + k < len(seq) else 0 for i in range(n)]
                h = layer(h, mtp.embed(model, torch.tensor([ids])), rope, cache=fresh)
                final = n - k + 1  # positions whose token i + k is known
                torch.testing.assert_close(engine.mtp_cache.k[k - 1, 0, :, :final], fresh.k[k - 1, 0, :, :final],
                                           atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked >= 5


def test_native_drafts_over_a_long_prompt_equal_torch_drafts(models):
    """Drafts after a 40-token prompt (native.c: 16 positions a call) are torch's."""
    model, mtp = models
    drafts = []
    for native in (True, False):
        engine = Engine(model, mtp=mtp, max_batch=1, native=native)
        engine.runs = False  # one speculative step, as the torch engine's
        r = engine.submit(list(range(40, 80)), SamplingParams(temperature=0, max_tokens=8))
        engine.step()  # admission (prefill, first token, drafts over the prompt), then one speculative step
        drafts.append(list(r.drafts))
    assert engine.native is None and len(drafts[0]) == mtp.depth and drafts[0] == drafts[1]


def test_native_drafting_never_falls_back_to_torch(models, monkeypatch):
    """With native.c, every drafting pass runs natively: steps whose drafts were all rejected
    (this untrained drafter's usual case) and a prompt longer than one native call alike."""
    model, mtp = models
    monkeypatch.setattr(speculative, "_torch_layers", lambda *a: pytest.fail("drafted through torch"))
    engine = Engine(model, mtp=mtp, max_batch=2)
    assert engine.native is not None
    engine.generate([PROMPTS[0], list(range(40, 80))], SamplingParams(temperature=0, max_tokens=12))
    assert engine.spec_stats.steps > 10 and engine.spec_stats.accepted[0] < engine.spec_stats.steps


def oracle_drafter(continuations: dict[tuple, list[int]], wrong=lambda k, j: False):
    """Replaces the MTP drafter: proposes the known greedy continuation (token k + j of the
    completion as draft j), except where `wrong(k, j)`, so tests choose what gets accepted."""
    def draft(engine, start, reqs, hidden, start_positions, n_valid):
        for r in reqs:
            cont, k = continuations[tuple(r.prompt_ids)], len(r.tokens)
            v = engine.model.config.vocab_size
            r.drafts = [(cont[k + j] + 1) % v if wrong(k, j) else cont[k + j] for j in range(engine.mtp.depth)]
            r.draft_probs = [None] * engine.mtp.depth
    return draft


def continuations(model, n: int) -> dict[tuple, list[int]]:
    outs = Engine(model).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=n, stop_token_ids=()))
    return {tuple(p): c.token_ids for p, c in zip(PROMPTS, outs)}


def test_accepted_drafts_are_emitted_and_counted(models, monkeypatch):
    model, mtp = models
    cont = continuations(model, 40)
    monkeypatch.setattr(speculative, "draft", oracle_drafter(cont))
    monkeypatch.setattr(engine_module, "draft", oracle_drafter(cont))
    engine = Engine(model, mtp=mtp, max_batch=3)
    engine.runs = False  # every step's drafts from the oracle (a native run drafts with the MTP)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=13))
    for prompt, c in zip(PROMPTS, outs):
        assert c.token_ids == cont[tuple(prompt)][:13]
    stats = engine.spec_stats
    assert stats.acceptance == [1.0, 1.0] and stats.mean_accepted == 2.0
    assert stats.steps == len(PROMPTS) * 4  # token 0 from the prefill, then 3 tokens a step

    # partly wrong drafts: the accepted prefix plus the main model's correction, still greedy's output
    wrong = oracle_drafter(cont, wrong=lambda k, j: (k + 2 * j) % 3 == 1)
    monkeypatch.setattr(speculative, "draft", wrong)
    monkeypatch.setattr(engine_module, "draft", wrong)
    engine = Engine(model, mtp=mtp, max_batch=3)
    engine.runs = False
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=13))
    for prompt, c in zip(PROMPTS, outs):
        assert c.token_ids == cont[tuple(prompt)][:13]
    check_stats(engine.spec_stats, 2)
    assert 0 < engine.spec_stats.acceptance[0] < 1


def test_stop_inside_an_accepted_run_drops_the_rest(models, monkeypatch):
    """A stop token or max_tokens reached among accepted drafts ends the completion there; the
    stream and the routes cover exactly prompt + completion (the drafts after the end were fed,
    but are not part of it)."""
    model, mtp = models
    cont = continuations(model, 40)
    monkeypatch.setattr(speculative, "draft", oracle_drafter(cont))
    monkeypatch.setattr(engine_module, "draft", oracle_drafter(cont))
    for prompt in PROMPTS:
        full = cont[tuple(prompt)]
        # steps emit completion tokens 1-3, 4-6, ...: pick a stop that lands before a run's end
        at = next(i for i in range(1, 30) if i % 3 != 0 and full.index(full[i]) == i)
        cases = [(SamplingParams(temperature=0, max_tokens=40, stop_token_ids=(full[at],)), at + 1, "stop"),
                 (SamplingParams(temperature=0, max_tokens=8, stop_token_ids=()), 8, "length")]
        for params, n, reason in cases:
            engine = Engine(model, mtp=mtp)
            engine.runs = False  # the oracle's drafts at every step
            r = engine.submit(prompt, params, stream=True)
            while engine.busy:
                engine.step()
            c = r.wait(1)
            assert c.finish_reason == reason and c.token_ids == full[:n]
            streamed = []
            while (event := r.events.get(timeout=1)) is not None:
                streamed += event[1]
            assert streamed == c.token_ids
            assert len(c.logprobs) == len(c.versions) == n
            seq = prompt + c.token_ids
            assert len(c.routes) == len(seq)
            assert c.routes[:-1] == model.trunk(torch.tensor([seq])).routes[0].tolist()[:-1]
            assert all(e == -1 for layer in c.routes[-1] for e in layer)


def test_cache_end_with_drafts_finishes_with_length(models):
    model, mtp = models
    engine = Engine(model, mtp=mtp, max_len=16)  # depth 2: a step feeds 3 positions, all must fit
    greedy = SamplingParams(temperature=0, max_tokens=100)
    for n in (6, 13, 14, 15):
        prompt = list(range(20, 20 + n))
        c = engine.generate([prompt], greedy)[0]
        plain = Engine(model, max_len=16).generate([prompt], greedy)[0]
        assert c.finish_reason == "length" and c.token_ids == plain.token_ids[: len(c.token_ids)]
        assert n + len(c.token_ids) - 1 <= 16  # every fed position was inside the cache
        assert len(c.token_ids) == 1 if n >= 14 else len(c.token_ids) > 1


# ---- the acceptance rule ------------------------------------------------------------------------

def fake_request(drafts, draft_probs, params, gen):
    """What verify reads of a request."""
    return SimpleNamespace(params=params, drafts=drafts, draft_probs=draft_probs, gen=gen)


def test_verify_greedy_accepts_exactly_the_argmax_prefix():
    logits = torch.log(torch.tensor([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]))
    greedy = SamplingParams(temperature=0)
    r = fake_request([1, 0], [None, None], greedy, torch.Generator())
    new, a = verify(r, logits, 2)
    assert a == 2 and [t for t, _ in new] == [1, 0, 2]  # both drafts, then the bonus argmax
    torch.testing.assert_close(torch.tensor([lp for _, lp in new]), torch.log(torch.tensor([0.7, 0.6, 0.6])))
    r = fake_request([1, 2], [None, None], greedy, torch.Generator())
    new, a = verify(r, logits, 2)
    assert a == 1 and [t for t, _ in new] == [1, 0]  # second draft wrong: the correction, nothing after


def test_verify_accepts_with_min_1_p_over_q_and_resamples_the_residual():
    p = torch.tensor([0.4, 0.1, 0.3, 0.2])
    q = torch.tensor([0.1, 0.5, 0.1, 0.3])
    residual = (p - q).clamp(min=0) / (p - q).clamp(min=0).sum()  # [0.6, 0, 0.4, 0]
    logits = torch.log(torch.stack([p, p]))
    params, gen, n = SamplingParams(temperature=1.0), torch.Generator().manual_seed(0), 2000
    for d, trials in [(0, 50), (1, n), (3, n)]:  # p(d) >= q(d): always accepted; else p(d)/q(d)
        outs = [verify(fake_request([d], [q], params, gen), logits, 1) for _ in range(trials)]
        rate = min(1.0, float(p[d] / q[d]))
        accepted = sum(a == 1 for _, a in outs) / trials
        assert abs(accepted - rate) <= 5 * (rate * (1 - rate) / trials) ** 0.5
        rejected = torch.tensor([new[0][0] for new, a in outs if a == 0], dtype=torch.long)
        if len(rejected):  # a rejected draft is replaced by a draw from norm(max(0, p - q))
            assert chi_square_p(torch.bincount(rejected, minlength=4), residual) > 1e-4
            assert set(rejected.tolist()) <= {0, 2}
    # drafts drawn from q, then verified: the first token is distributed as p
    firsts = []
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=gen))
        firsts.append(verify(fake_request([d], [q], params, gen), logits, 1)[0][0][0])
    assert chi_square_p(torch.bincount(torch.tensor(firsts), minlength=4), p) > 1e-4


# ---- sampling: exactly the plain distribution ---------------------------------------------------

def pearson(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom of `counts` against exact `probs`. The rarest
    cells are pooled until the pool expects at least `min_expected`, so the chi-square
    approximation holds; (0, 0) when too few counts to test."""
    counts, expected = counts.double(), probs.double() / probs.double().sum() * counts.double().sum()
    order = expected.argsort()
    pooled = int((expected[order].cumsum(0) < min_expected).sum()) + 1
    if pooled >= len(order):
        return 0.0, 0
    small, big = order[:pooled], order[pooled:]
    obs = torch.cat([counts[big], counts[small].sum()[None]])
    exp = torch.cat([expected[big], expected[small].sum()[None]])
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def chi2_sf(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return chi2_sf(*pearson(counts, probs))


def markov_chi_square_p(prev: torch.Tensor, nxt: torch.Tensor, kernel: torch.Tensor) -> float:
    """Goodness of fit of observed transitions prev -> nxt to a Markov kernel [V, V]: Pearson's
    statistic row by row (each row's total taken as given), summed with the degrees of freedom."""
    v = kernel.shape[0]
    counts = torch.zeros(v, v).index_put_((prev, nxt), torch.ones(len(prev)), accumulate=True)
    rows = [pearson(row, probs) for row, probs in zip(counts, kernel)]
    return chi2_sf(sum(r[0] for r in rows), sum(r[1] for r in rows))


def bigram_kernel(logits: torch.Tensor, top_k: int = 0) -> torch.Tensor:
    """The exact next-token kernel [V, V] of a bigram model's logits at temperature 1, truncated to
    each row's top_k tokens when given."""
    kernel = torch.softmax(logits.double(), -1)
    if top_k:
        kept = logits >= logits.topk(top_k, -1).values[:, -1:]
        kernel = kernel * kept / (kernel * kept).sum(-1, keepdim=True)
    return kernel


@pytest.fixture(scope="module")
def bigram():
    """A 16-token model whose next-token distribution depends on the current token only:
    attention outputs are zeroed, so the residual stream holds the token's embedding and what the
    MoE layers make of it. Every generated token is then one draw from a known kernel [V, V]
    (sampled speculative decoding must reproduce it exactly), so one long generation gives many
    samples for the price of one admission. Its MTP is left whole: it drafts from its own cached
    history, and the output must follow the kernel whatever the drafts are."""
    model, mtp = tiny_model(3, vocab_size=16)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        v = model.config.vocab_size
        logits = model(torch.arange(v)[:, None])[:, 0]
        walk = torch.randint(0, v, (1, 40), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(model(walk)[0], logits[walk[0]])  # really a bigram model
    return model, mtp, logits


@pytest.mark.parametrize("mode", ["plain", "speculative", "speculative top_k=8", "speculative draft_vocab=6"])
def test_sampled_speculative_decoding_is_exact(bigram, mode):
    """Sampled transitions against the exact kernel (temperature 1, and with top-k truncation),
    for plain decoding (the control for the test itself) and speculative decoding with two drafts
    per step, where acceptance, the residual resample and the bonus token all shape the output.
    Seeds are fixed, so the outcome is deterministic. Under a correct implementation the p-value
    is uniform: the 1e-4 bound rejects one seed set in 10,000. Wrong rules tried by hand (always
    accept; resample from p instead of the residual) land below 1e-6."""
    model, mtp, logits = bigram
    top_k = 8 if "top_k" in mode else 0
    kernel = bigram_kernel(logits, top_k)
    if "draft_vocab" in mode:  # drafts from 6 of the 16 tokens: q is 0 where p is not
        mtp = with_counts(mtp, [3, 9, 0, 14, 5, 7])
    engine = Engine(model, mtp=None if mode == "plain" else mtp, max_batch=64, capture_routes=False, draft_vocab=6)
    v, n_seq = model.config.vocab_size, 64
    params = [SamplingParams(temperature=1.0, top_k=top_k, max_tokens=48, seed=s, stop_token_ids=())
              for s in range(n_seq)]
    outs = engine.generate([[s % v] for s in range(n_seq)], params)
    seqs = torch.tensor([[s % v] + c.token_ids for s, c in enumerate(outs)])
    assert markov_chi_square_p(seqs[:, :-1].flatten(), seqs[:, 1:].flatten(), kernel) > 1e-4
    if mode != "plain":
        check_stats(engine.spec_stats, 2)
        assert 0.1 < engine.spec_stats.acceptance[0] < 0.95  # both paths (accept and resample) exercised
