"""Held-out codebase loss: the rolling window against hand computations, bits per byte, the fit."""
import math
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.model.moe import MoeForCausalLM
from kiln.model.tokenizer import list_corpus_files, train_tokenizer
from kiln.pretrain.heldout import (
    fit_log_linear,
    heldout_eval,
    log_spaced_steps,
    plot_heldout,
)
from tests.tiny_model import tiny_config

EOT = 0
TEXT = "def f(x):\n    return x + 1  # café ☃\n" * 3


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoeForCausalLM(tiny_config(vocab_size=300)).eval()


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 300, (37,), generator=g).tolist()


def nll(model, seq: list[int]) -> float:
    """Summed NLL of seq[1:] given everything before, in one forward."""
    x = torch.tensor([seq])
    with torch.no_grad():
        logits = model(x[:, :-1])
    return float(F.cross_entropy(logits[0], x[0, 1:], reduction="sum"))


def test_window_longer_than_text_is_full_context_nll(model, ids):
    r = heldout_eval(model, ids, TEXT, window=64, stride=64)
    assert r["tokens"] == len(ids)
    assert r["nll_sum"] == pytest.approx(nll(model, [EOT, *ids]), rel=1e-5)
    assert r["nll_per_token"] == pytest.approx(r["nll_sum"] / len(ids))


def test_disjoint_windows_score_each_token_once(model, ids):
    # window == stride: chunks of 8 predictions, each with only its own chunk as context
    ids = ids[:32]
    r = heldout_eval(model, ids, TEXT, window=8, stride=8)
    seq = [EOT, *ids]
    by_hand = sum(nll(model, seq[i:i + 9]) for i in range(0, len(ids), 8))
    assert r["tokens"] == len(ids) and r["nll_sum"] == pytest.approx(by_hand, rel=1e-5)


def test_stride_one_gives_every_token_its_full_window(model, ids):
    seq, w = [EOT, *ids], 6
    by_hand = 0.0
    for j in range(1, len(seq)):  # token j with the (up to) w tokens before it
        x = torch.tensor([seq[max(0, j - w):j]])
        with torch.no_grad():
            by_hand += float(F.cross_entropy(model(x)[0, -1:], torch.tensor([seq[j]])))
    r = heldout_eval(model, ids, TEXT, window=w, stride=1, batch_tokens=30)  # several batches, some padded
    assert r["nll_sum"] == pytest.approx(by_hand, rel=1e-5)


def test_bits_per_byte_counts_utf8_bytes(model, ids):
    r = heldout_eval(model, ids, TEXT, window=16, stride=12)
    assert len(TEXT.encode()) > len(TEXT)  # the non-ASCII characters count by their bytes
    assert r["bits_per_byte"] == pytest.approx(r["nll_sum"] / math.log(2) / len(TEXT.encode()))
    assert r["bytes"] == len(TEXT.encode())


def test_tokenizer_path_equals_ids_path(model, tmp_path):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = train_tokenizer(list_corpus_files([stdlib / "json" / "__init__.py"]), tmp_path, vocab_size=300).tokenizer
    assert heldout_eval(model, tok, TEXT, 16, 8) == heldout_eval(model, tok.encode(TEXT), TEXT, 16, 8)


def test_mode_is_restored_and_bad_windows_rejected(model, ids):
    model.train()
    heldout_eval(model, ids, TEXT, window=16, stride=16)
    assert model.training
    model.eval()
    with pytest.raises(ValueError, match="stride <= window"):
        heldout_eval(model, ids, TEXT, window=4, stride=8)
    with pytest.raises(ValueError, match="empty"):
        heldout_eval(model, [], "", window=4, stride=4)


def test_fit_recovers_a_log_linear_curve():
    tokens = [1e3, 1e4, 1e5, 1e6]
    slope, intercept, r2 = fit_log_linear(tokens, [5.0 - 0.2 * math.log(t) for t in tokens])
    assert (slope, intercept, r2) == pytest.approx((-0.2, 5.0, 1.0))
    _, _, noisy = fit_log_linear(tokens, [3.6, 3.3, 2.6, 2.3])
    assert 0.9 < noisy < 1.0
    with pytest.raises(ValueError, match="two or more"):
        fit_log_linear([10, 10], [1.0, 2.0])


def test_log_spaced_steps():
    assert log_spaced_steps(1, 1000, 4) == [1, 10, 100, 1000]
    assert log_spaced_steps(0, 5, 1) == [5] and log_spaced_steps(3, 3, 4) == [3] and log_spaced_steps(1, 9, 0) == []


def test_plot_is_a_png(tmp_path):
    evals = [{"tokens_seen": t, "nll_per_token": 5 - 0.2 * math.log(t), "bits_per_byte": 2.0 - 0.05 * math.log(t)}
             for t in (1e3, 1e4, 1e5)]
    out = plot_heldout(evals, fit_log_linear([1e3, 1e4, 1e5], [r["nll_per_token"] for r in evals]), tmp_path / "p.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
