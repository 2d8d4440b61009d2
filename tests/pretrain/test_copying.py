"""The copy probe and copy practice (kiln/pretrain/copying.py), on real tensors and a real corpus.

The probe's arithmetic is checked with an exact induction model built here: it predicts, at each
position, the token one span back. Scored on the right positions, its second copy costs ~0 nats
and its first copy far more; an off-by-one in the probe would make both large.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kiln.cli import app
from kiln.pretrain.copying import copy_loss, copy_probe, copy_rows
from kiln.pretrain.data import TokenShards
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.tiny_model import tiny_model


class Induction(torch.nn.Module):
    """logits[p] puts all its mass on the token `span - 1` positions before p + 1, i.e. the token
    that followed the previous occurrence of this position's context in [eot][span][span]."""

    def __init__(self, vocab: int, span: int):
        super().__init__()
        self.vocab, self.span, self.w = vocab, span, torch.nn.Parameter(torch.zeros(1))

    def trunk(self, ids):
        return type("Out", (), {"hidden": ids})

    def head(self, ids):
        back = torch.nn.functional.pad(ids, (self.span - 1, 0))[:, :ids.shape[1]]  # back[p] = ids[p - span + 1]
        return torch.nn.functional.one_hot(back, self.vocab).float() * 50.0


def test_probe_scores_the_second_copy_against_the_first():
    vocab, span = 300, 16
    r = copy_probe(Induction(vocab, span), list(range(9, 200)) * 3, vocab, n=8, span=span)
    assert r["random"]["second"] < 1e-3 and r["random"]["second_top1"] == 1.0
    assert r["random"]["first"] > 10  # the first copy has nothing to copy from
    assert r["code"]["second"] < 1e-3
    assert r["chance"] == pytest.approx(math.log(vocab - 9))


def test_probe_of_an_untrained_model_is_at_chance():
    model, _ = tiny_model(scale=1.0)
    r = copy_probe(model, None, model.config.vocab_size, n=8, span=16)
    assert "code" not in r
    assert abs(r["random"]["second"] - r["random"]["first"]) < 0.5
    assert abs(r["random"]["first"] - r["chance"]) < 1.0


def test_probe_is_reproducible_and_seeded():
    model, _ = tiny_model()
    a, b, c = (copy_loss(model, torch.randint(9, 100, (4, 8), generator=torch.Generator().manual_seed(s)))
               for s in (1, 1, 2))
    assert a == b and a != c


@pytest.fixture
def corpus(tmp_path):
    ids = np.arange(1, 5001, dtype=np.uint16) % 400  # includes <|endoftext|> (0) every 400 tokens
    ids.tofile(tmp_path / "train-00000.bin")
    (tmp_path / "meta.json").write_text('{"vocab_size": 400, "dtype": "uint16", "endoftext_id": 0, '
                                        '"shards": ["train-00000.bin"], "train_tokens": 5000}')
    return TokenShards(tmp_path)


def test_copy_rows_repeat_each_span_and_mask_the_second_copy(corpus):
    ids, mask = copy_rows(corpus, step=3, n=4, seq_len=255, seed=0, vocab=400)
    assert ids.shape == mask.shape == (4, 256)
    for row, m in zip(ids.tolist(), mask.tolist()):
        docs, cur = [], []
        for t in row:  # split at <|endoftext|>
            if t == 0:
                docs.append(cur)
                cur = []
            else:
                cur.append(t)
        full = [d for d in docs if d]
        assert full and all(len(d) % 2 == 0 and d[:len(d) // 2] == d[len(d) // 2:] for d in full)
        assert all(8 <= len(d) // 2 <= 64 for d in full)
        at = 0
        for d in docs:  # the mask covers the second copy after its first token, nothing else
            half = len(d) // 2
            want = [0] * (half + 1) + [1] * (half - 1) + [0] if d else [0]
            assert m[at:at + len(d) + 1] == want[:len(m) - at]
            at += len(d) + 1
        assert min(t for t in row if t) >= 9  # no special tokens inside spans
    again, _ = copy_rows(corpus, step=3, n=4, seq_len=255, seed=0, vocab=400)
    other, _ = copy_rows(corpus, step=4, n=4, seq_len=255, seed=0, vocab=400)
    assert torch.equal(ids, again) and not torch.equal(ids, other)  # a pure function of (seed, step)


def test_probe_cli(tmp_path, tiny_checkpoint):
    held = tmp_path / "held.txt"
    held.write_text("def f(x):\n    return x + 1\n" * 200)
    r = CliRunner().invoke(app, ["probe", "copy", str(tiny_checkpoint), "--heldout", str(held), "--n", "4", "--span", "8"])
    assert r.exit_code == 0, r.output
    assert "second copy" in r.output and "random" in r.output and "code" in r.output
    r = CliRunner().invoke(app, ["probe", "copy", str(tiny_checkpoint), "--heldout", str(held), "--n", "2", "--json"])
    assert r.exit_code == 0 and '"second"' in r.output
    r = CliRunner().invoke(app, ["probe", "copy", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "error:" in r.output and "Traceback" not in r.output
    assert CliRunner().invoke(app, ["probe", "copy", "--help"]).exit_code == 0
