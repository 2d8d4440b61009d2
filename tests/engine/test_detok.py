"""Incremental detokenisation for streaming: whole characters only, stop strings never leaked;
and the engine's stream agreeing with its completions."""
from __future__ import annotations

import pytest

from kiln.engine import Engine, SamplingParams
from kiln.engine.detok import Detokenizer
from kiln.model.tokenizer import load_tokenizer
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.tiny_model import (
    tiny_model,
)

TEXT = 'def naïve(x):\n    return {"ключ": x, "emoji": "😀"}  # €5 ✓\n'


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


def stream(detok: Detokenizer, ids: list[int]) -> list[str]:
    """Every delta, one per pushed token, then the flush."""
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_deltas_concatenate_to_the_text_and_never_split_a_character(tok):
    ids = tok.encode(TEXT)
    # the case under test: some characters' bytes are spread over several byte-level tokens
    assert any(tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))
    detok = Detokenizer(tok)
    out = ""
    for i in ids:
        out += detok.push(i)
        assert "\ufffd" not in out and TEXT.startswith(out)
    assert out + detok.flush() == TEXT and detok.text == TEXT and not detok.stopped


def test_text_equals_decoding_all_ids_at_once_for_any_token_sequence(tok):
    # The detokenizer decodes only the ids after the last whole character; random ids (bytes that
    # are not UTF-8 included) must still give exactly what one decode of every id gives.
    import random

    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        detok = Detokenizer(tok)
        out = "".join(detok.push(i) for i in ids) + detok.flush()
        full = tok.decode(ids)
        assert out == detok.text == (full if not full.endswith("\ufffd") else out)
        assert full.startswith(out)


def test_stop_string_split_across_tokens_is_held_back_and_never_emitted(tok):
    text, stop = "x = 1  # STOP_HERE then more", "STOP_HERE"
    ids = tok.encode(text)
    assert not any(stop in tok.decode([i]) for i in ids)  # the stop string spans several tokens
    detok = Detokenizer(tok, stop=("never", stop))
    deltas = stream(detok, ids)
    assert "".join(deltas) == "x = 1  # " == detok.text and detok.stopped
    assert detok.push(tok.encode("more")[0]) == ""  # nothing after a stop


def test_partial_stop_is_released_when_it_turns_out_not_to_be_one(tok):
    text, stop = "a STOP_HEX b", "STOP_HERE"
    detok = Detokenizer(tok, stop=(stop,))
    out, held = "", False
    for i in tok.encode(text):
        out += detok.push(i)
        held |= detok.text.endswith("STOP") and not out.endswith("STOP")
    assert held  # "STOP" was kept back while it could still become the stop string
    assert out + detok.flush() == text and not detok.stopped
    # a stop prefix still pending when generation ends is released by flush
    detok = Detokenizer(tok, stop=(stop,))
    deltas = stream(detok, tok.encode("a STOP_H"))
    assert "".join(deltas[:-1]) == "a " and deltas[-1] == "STOP_H"


def test_earliest_stop_string_wins(tok):
    detok = Detokenizer(tok, stop=("then", "# "))
    assert "".join(stream(detok, tok.encode("x = 1  # STOP then"))) == "x = 1  "


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_stream_matches_its_completion(tok, speculative):
    model, mtp = tiny_model(0, vocab_size=tok.vocab_size)
    engine = Engine(model, tok, mtp=mtp if speculative else None)
    prompt = tok.encode("import json\n")
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=()))[0]
    stop = free.text[10:13]
    r = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(), stop=(stop,)),
                      stream=True)
    while engine.busy:
        engine.step()
    c = r.wait(1)
    events = []
    while (e := r.events.get(timeout=1)) is not None:
        events.append(e)
    assert c.finish_reason == "stop" and c.text == free.text[: free.text.index(stop)]
    assert "".join(d for d, _ in events) == c.text
    assert [t for _, ts in events for t in ts] == c.token_ids  # no token past the stop is streamed
