"""Prefix reuse on a real tiny MoE: a conversation's next turn and a group's shared prompt prefill
only their new tokens, and give the same tokens, logprobs and routes as prefilling everything."""
from __future__ import annotations

import pytest
import torch

from kiln.engine import Engine, SamplingParams
from tests.engine.test_engine import perturbed
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.tiny_model import tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SYSTEM = [(7 * i) % 500 + 3 for i in range(40)]  # a shared opening, longer than min_tokens


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)[0]


def turns(engine: Engine, n: int = 3) -> list:
    """A token-in, token-out conversation: each prompt is the last prompt, its completion and a
    new 'observation'."""
    prompt, out = SYSTEM + [11, 12, 13], []
    for t in range(n):
        c = engine.generate([prompt], GREEDY)[0]
        out.append(c)
        prompt = prompt + c.token_ids + [20 + t] * (5 + t)
    return out


@pytest.mark.parametrize("native", [True, False])
def test_later_turns_reuse_the_conversation_and_match_full_prefill(model, native):
    plain = turns(Engine(model, max_batch=2, native=native))
    engine = Engine(model, max_batch=2, native=native, prefix_slots=2)
    reused = turns(engine)
    for a, b in zip(plain, reused):
        assert a.prompt_ids == b.prompt_ids and a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
        assert b.routes == a.routes  # router replay sees every position, reused ones included
    # Turns 2 and 3 restored everything the previous turn held: its prompt and all but its last token.
    assert engine.prefix.hits == 2
    want = sum(len(c.prompt_ids) + len(c.token_ids) - 1 for c in reused[:2])
    assert engine.prefix.reused_tokens == want
    assert sum(e is not None for e in engine.prefix.entries) == 1  # each turn replaced the one it extends


def test_a_group_shares_its_prompt_and_seeded_samples_do_not_change(model):
    prompt = SYSTEM + [9, 8, 7]
    params = [SamplingParams(temperature=1.0, max_tokens=6, seed=s) for s in range(4)]
    plain = Engine(model, max_batch=4).generate([prompt] * 4, params)
    engine = Engine(model, max_batch=4, prefix_slots=4)
    engine.generate([prompt], params[:1])  # the group's first rollout, alone
    reused = engine.generate([prompt] * 4, params)
    assert [c.token_ids for c in reused] == [c.token_ids for c in plain]
    assert engine.prefix.hits == 4 and engine.prefix.reused_tokens == 4 * (len(prompt) - 1)


def test_prompts_admitted_together_prefill_once(model):
    """A group's rollouts send the same prompt at once (the task; often the same first tool output):
    the first is kept when it is admitted, the others prefill only its last token."""
    prompt = SYSTEM + [9, 8, 7]
    params = [SamplingParams(temperature=1.0, max_tokens=6, seed=s) for s in range(4)]
    plain = Engine(model, max_batch=4).generate([prompt] * 4, params)
    engine = Engine(model, max_batch=4, prefix_slots=4)
    together = engine.generate([prompt] * 4, params)
    assert engine.prefix.hits == 3 and engine.prefix.reused_tokens == 3 * (len(prompt) - 1)
    assert [c.token_ids for c in together] == [c.token_ids for c in plain]
    assert [c.routes for c in together] == [c.routes for c in plain]
    for a, b in zip(plain, together):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)


def test_new_weights_leave_kept_prefixes_unused():
    model = tiny_model(0)[0]  # its own: an update writes into the engine's model
    new = perturbed(model)
    engine = Engine(model, max_batch=1, prefix_slots=2)
    first = turns(engine, 1)[0]
    engine.update_weights(new, version=1)
    engine.step()  # applies the update
    nxt = first.prompt_ids + first.token_ids + [20] * 5
    got = engine.generate([nxt], GREEDY)[0]
    assert engine.prefix.hits == 0 and got.versions == [1] * len(got.token_ids)
    fresh = Engine(tiny_model(0)[0], max_batch=1)
    fresh.update_weights(new, version=1)
    assert got.token_ids == fresh.generate([nxt], GREEDY)[0].token_ids


def test_carried_turns_serve_only_their_own_conversation_after_new_weights():
    model = tiny_model(0)[0]
    engine = Engine(model, max_batch=1, prefix_slots=4, carry_turns=True)
    first = turns(engine, 1)[0]
    engine.update_weights(perturbed(model), version=1)
    engine.step()
    # Another prompt sharing only the opening prefills it under the new weights ...
    engine.generate([SYSTEM + [40, 41, 42]], GREEDY)
    assert engine.prefix.hits == 0
    # ... while the conversation's next turn restores all its last turn held, as a running sequence
    # would have carried it on; its new tokens are the new version's.
    held = len(first.prompt_ids) + len(first.token_ids) - 1
    nxt = first.prompt_ids + first.token_ids + [20] * 5
    got = engine.generate([nxt], GREEDY)[0]
    assert engine.prefix.hits == 1 and engine.prefix.reused_tokens == held
    assert got.versions == [1] * len(got.token_ids)
    # That turn holds version-0 keys and values: it too serves no other prompt (this one gets only the
    # opening, from the new version's entry), only its continuation.
    engine.generate([nxt[:held - 3] + [50, 51, 52, 53]], GREEDY)
    assert engine.prefix.hits == 2 and engine.prefix.reused_tokens == held + len(SYSTEM)
    engine.generate([nxt + got.token_ids + [21] * 4], GREEDY)
    assert engine.prefix.reused_tokens == held + len(SYSTEM) + len(nxt) + len(got.token_ids) - 1


def test_a_sequence_running_across_new_weights_is_kept_for_its_conversation_only():
    model = tiny_model(0)[0]
    engine = Engine(model, max_batch=1, prefix_slots=2)
    engine.runs = False  # a token a step, so the swap lands mid-generation
    r = engine.submit(SYSTEM + [11, 12], SamplingParams(temperature=0.0, max_tokens=6))
    engine.step()  # prefilled under version 0
    engine.update_weights(perturbed(model), version=1)
    while not r.done.is_set():
        engine.step()
    c = r.wait()
    assert c.versions[0] == 0 and c.versions[-1] == 1
    engine.generate([SYSTEM + [11, 12] + c.token_ids[:2] + [30] * 3], GREEDY)  # a prompt sharing its prefix
    assert engine.prefix.hits == 0  # its version-0 keys are not new weights' prefix


def test_least_recently_used_entry_is_evicted_and_short_prompts_are_not_kept(model):
    engine = Engine(model, max_batch=1, prefix_slots=1)
    a, b = SYSTEM + [1, 2], [x + 1 for x in SYSTEM] + [1, 2]
    engine.generate([a], GREEDY)
    engine.generate([b], GREEDY)  # evicts a's entry
    engine.generate([a], GREEDY)
    assert engine.prefix.hits == 0
    engine.generate([[5, 6, 7]], GREEDY)  # shorter than min_tokens: not kept, a's entry stays
    engine.generate([a], GREEDY)
    assert engine.prefix.hits == 1


def first_step(engine: Engine, prompt: list[int]):
    """Admit `prompt` and run one decoding step; -> the request (its drafts are the next step's)."""
    r = engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=32))
    engine.step()
    return r


@pytest.mark.parametrize("depth", [1, 2])
def test_a_drafter_restores_its_cache_and_drafts_as_after_a_full_prefill(model, depth):
    """The next turn restores the drafter's exact entries (D positions short of the shared
    prefix) with the trunk's, and then drafts what an engine that prefilled everything drafts."""
    from tests.engine.test_speculative import mtp_of_depth

    mtp = mtp_of_depth(model, tiny_model(0)[1], depth)
    engine = Engine(model, mtp=mtp, max_batch=1, prefix_slots=2)
    plain = Engine(model, max_batch=1, prefix_slots=2)
    first = engine.generate([SYSTEM + [11, 12, 13]], GREEDY)[0]
    assert first.token_ids == plain.generate([SYSTEM + [11, 12, 13]], GREEDY)[0].token_ids
    nxt = first.prompt_ids + first.token_ids + [20] * 5
    kept = len(first.prompt_ids) + len(first.token_ids) - 1  # the trunk's cache held all but the last token
    reused = first_step(engine, nxt)
    assert engine.prefix.hits == 1 and engine.prefix.reused_tokens == kept - depth
    fresh = Engine(model, mtp=mtp, max_batch=1)
    full = first_step(fresh, nxt)
    assert reused.tokens == full.tokens and reused.drafts == full.drafts and reused.drafted == full.drafted
    n = full.drafted
    assert n == len(nxt) + len(full.tokens) - depth
    torch.testing.assert_close(engine.mtp_cache.k[:, 0, :, :n], fresh.mtp_cache.k[:, 0, :, :n], atol=1e-5, rtol=0)
    torch.testing.assert_close(engine.mtp_cache.v[:, 0, :, :n], fresh.mtp_cache.v[:, 0, :, :n], atol=1e-5, rtol=0)


def test_speculative_turns_with_reuse_give_plain_greedy_and_seeded_samples(model):
    """Whole conversations and a sampled group through a drafter with prefix reuse: greedy output
    is plain greedy's, and seeded samples are those of the same drafter without reuse."""
    mtp = tiny_model(0)[1]
    engine = Engine(model, mtp=mtp, max_batch=2, prefix_slots=2)
    for a, b in zip(turns(Engine(model, max_batch=2)), turns(engine)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
        assert b.routes == a.routes
    assert engine.prefix.hits == 2
    prompt = SYSTEM + [9, 8, 7]
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=s) for s in range(4)]
    want = Engine(model, mtp=mtp, max_batch=4).generate([prompt] * 4, params)
    engine = Engine(model, mtp=mtp, max_batch=4, prefix_slots=4)
    engine.generate([prompt], params[:1])
    got = engine.generate([prompt] * 4, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert engine.prefix.hits == 4
