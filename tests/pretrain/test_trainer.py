"""`kiln pretrain`: phases, MTP cut-in, held-out evaluations, checkpoints, and bit-exact resume.

Every run trains a real one-layer MoE (width 64, vocab 512) on a real corpus made here: a tokenizer
trained on the stdlib's json package, and the text of a few stdlib packages tokenised into one
uint16 shard with the layout `kiln corpus build` writes (meta.json, train-00000.bin, heldout.txt).
"""
from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kiln.cli import app
from kiln.config import load_config
from kiln.model.checkpoint import load_checkpoint
from kiln.model.tokenizer import (
    iter_corpus,
    list_corpus_files,
    load_tokenizer,
    train_tokenizer,
)
from kiln.pretrain import trainer
from kiln.pretrain.trainer import PretrainError, pretrain
from tests.tiny_model import dense_checkpoint

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# 20 bulk steps of 8 x 32 tokens, then 4 extension steps of 2 x 96 (2 micro-batches) at a new RoPE base.
PHASES = ('[{name="bulk", kind="bulk", steps=20, seq_len=32, batch_size=8, lr=0.02, warmup_steps=2}, '
          '{name="ext", kind="extension", steps=4, seq_len=96, batch_size=2, grad_accum=2, lr=0.01, rope_theta=40000.0}]')
BULK, TOTAL = 20, 24


def tiny_cfg(*overrides: str):
    return load_config(None, ["pretrain.init=", "model.depth=1", "model.vocab_size=512", "model.context=256", f"pretrain.phases={PHASES}",
                              "pretrain.eval_points=3", "pretrain.eval_window=32", "pretrain.eval_stride=16",
                              "pretrain.eval_max_bytes=3000", "pretrain.checkpoint_every=3", "pretrain.device=cpu",
                              *overrides])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(corpus dir, tokenizer dir)."""
    root = tmp_path_factory.mktemp("pretrain")
    tok = train_tokenizer(list_corpus_files([STDLIB / "json"]), root / "tok", vocab_size=512).tokenizer
    ids = []
    for text in iter_corpus([f for f in list_corpus_files([STDLIB / "json", STDLIB / "logging"]) if f.suffix == ".py"]):
        ids += tok.encode(text) + [tok.endoftext_id]
    corpus = root / "corpus"
    corpus.mkdir()
    np.asarray(ids, dtype=np.uint16).tofile(corpus / "train-00000.bin")
    held = sorted(f for f in list_corpus_files([STDLIB / "email"]) if f.suffix == ".py")
    (corpus / "heldout.txt").write_text("\n".join(f.read_text() for f in held))
    meta = {"version": 1, "vocab_size": tok.vocab_size, "dtype": "uint16", "endoftext_id": tok.endoftext_id,
            "shards": ["train-00000.bin"], "train_tokens": len(ids), "heldout": {"path": "heldout.txt"}}
    (corpus / "meta.json").write_text(json.dumps(meta))
    return corpus, root / "tok"


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    """One uninterrupted run: (run dir, summary, metric rows)."""
    run = tmp_path_factory.mktemp("straight")
    summary = pretrain(tiny_cfg(), *data, run, progress=False)
    return run, summary, _rows(run)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train(rows, key="loss"):
    return [r[key] for r in rows if r["kind"] == "train"]


def test_metrics_rows_are_well_formed(straight):
    run, summary, rows = straight
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, TOTAL + 1))
    assert [r["phase"] for r in train] == ["bulk"] * BULK + ["ext"] * (TOTAL - BULK)
    keys = {"kind", "step", "phase", "lr", "loss", "mtp_loss", "aux", "grad_norm", "tokens_seen", "tokens_per_s", "wall"}
    for r in train:
        assert set(r) == keys
        assert r["loss"] > 0 and r["aux"] > 0 and r["tokens_per_s"] > 0 and r["lr"] > 0
    assert [r["tokens_seen"] for r in train][:2] == [256, 512]  # 8 x 32 a bulk step
    evals = [r for r in rows if r["kind"] == "eval"]
    # log-spaced from the end of warmup (2, 7, 24), plus each phase's end (20, 24), each once
    assert [r["step"] for r in evals] == [2, 7, 20, 24]
    for r in evals:
        assert r["tokens"] > 500 and r["bits_per_byte"] > 0 and r["nll_per_token"] == pytest.approx(r["nll_sum"] / r["tokens"])
    assert summary["steps"] == TOTAL and summary["tokens_seen"] == train[-1]["tokens_seen"]
    assert summary["fit"] is not None and (run / "heldout_loss.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((run / "summary.json").read_text()) == summary


def test_training_lowers_train_and_heldout_loss(straight):
    _, _, rows = straight
    losses = _train(rows)
    assert losses[0] > 6.0  # about ln(512) at initialisation
    assert sum(losses[-4:]) / 4 < losses[0] - 1.0  # (single batches are noisy)
    evals = [r["nll_per_token"] for r in rows if r["kind"] == "eval"]
    assert evals[-1] < evals[0] - 0.25


def test_extension_changes_sequence_length_and_rope_base(straight):
    run, _, rows = straight
    seen = [r["tokens_seen"] for r in rows if r["kind"] == "train"]
    assert seen[BULK] - seen[BULK - 1] == 2 * 96  # the extension's 2 x 96 tokens a step
    model, mtp = load_checkpoint(run / "checkpoint")
    assert model.config.rope_theta == 40000.0 and json.loads((run / "checkpoint" / "config.json").read_text())[
        "rope_parameters"]["rope_theta"] == 40000.0
    assert mtp is not None and mtp.depth == 1


def test_mtp_trains_from_the_extension_by_self_distillation(straight):
    _, _, rows = straight
    mtp = _train(rows, "mtp_loss")
    assert mtp[:BULK] == [None] * BULK  # attached at mid-bulk, trained from the next phase
    assert all(v is not None and v > 0 for v in mtp[BULK:])


def test_mtp_never_changes_the_main_model(straight, data, tmp_path):
    run, _, rows = straight
    pretrain(tiny_cfg("model.mtp_depth=0"), *data, tmp_path, progress=False)
    assert _train(_rows(tmp_path)) == _train(rows)
    (a, a_mtp), (b, b_mtp) = load_checkpoint(run / "checkpoint"), load_checkpoint(tmp_path / "checkpoint")
    assert a_mtp is not None and b_mtp is None
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


class Killed(BaseException):
    """Stands in for SIGKILL / Ctrl-C arriving in the middle of a step."""


def _run_until_killed(monkeypatch, cfg, data, run: Path, at_call: int) -> None:
    real, calls = trainer._step, []

    def step(*args, **kw):
        calls.append(1)
        if len(calls) == at_call:
            raise Killed
        return real(*args, **kw)

    monkeypatch.setattr(trainer, "_step", step)
    with pytest.raises(Killed):
        pretrain(cfg, *data, run, progress=False)
    monkeypatch.setattr(trainer, "_step", real)


def test_resume_after_kills_is_bit_identical(straight, data, tmp_path, monkeypatch):
    ref_run, _, ref_rows = straight
    cfg = tiny_cfg()
    _run_until_killed(monkeypatch, cfg, data, tmp_path, at_call=4)  # during step 4: the state is step 3's
    st = torch.load(tmp_path / "state" / "trainer_state.pt", weights_only=True)
    assert st["step"] == 3 and st["mtp_optimizer"] is None
    assert not (tmp_path / "state" / "mtp.safetensors").exists()  # before the mid-bulk cut (step 10)
    # resumed at 3, killed again during step 12: the last state is the cut's, step 10, with the MTP
    _run_until_killed(monkeypatch, cfg, data, tmp_path, at_call=9)
    st = torch.load(tmp_path / "state" / "trainer_state.pt", weights_only=True)
    assert st["step"] == 10 and st["mtp_optimizer"] is not None and (tmp_path / "state" / "mtp.safetensors").exists()
    assert max(r["step"] for r in _rows(tmp_path)) == 11  # the log holds rows up to the kill
    summary = pretrain(cfg, *data, tmp_path, progress=False)
    assert summary["steps"] == TOTAL

    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows]  # replayed steps were logged once
    for key in ("loss", "mtp_loss", "aux", "grad_norm", "lr", "tokens_seen"):
        assert _train(rows, key) == _train(ref_rows, key), key
    assert [r["nll_sum"] for r in rows if r["kind"] == "eval"] == [r["nll_sum"] for r in ref_rows if r["kind"] == "eval"]
    (a, a_mtp), (b, b_mtp) = load_checkpoint(ref_run / "checkpoint"), load_checkpoint(tmp_path / "checkpoint")
    for x, y in [*zip(a.state_dict().values(), b.state_dict().values()),
                 *zip(a_mtp.state_dict().values(), b_mtp.state_dict().values())]:
        assert torch.equal(x, y)


def test_finished_run_resumes_to_the_same_summary(straight, data):
    run, summary, _ = straight
    again = pretrain(tiny_cfg(), *data, run, progress=False)
    assert {k: v for k, v in again.items() if k != "wall_s"} == {k: v for k, v in summary.items() if k != "wall_s"}


def test_crash_between_state_renames_keeps_the_previous_state(straight, data, tmp_path):
    run, summary, _ = straight
    shutil.copytree(run, tmp_path / "run")
    (tmp_path / "run" / "state").rename(tmp_path / "run" / "state.old")  # the new state was never renamed in
    (tmp_path / "run" / "state.tmp").mkdir()  # and a half-written one lies beside it
    again = pretrain(tiny_cfg(), *data, tmp_path / "run", progress=False)
    assert again["steps"] == summary["steps"] and again["final_eval"] == summary["final_eval"]


def test_init_continues_from_a_checkpoint(straight, data, tmp_path):
    run, _, rows = straight
    pretrain(tiny_cfg(), *data, tmp_path, init=str(run / "checkpoint"), progress=False)
    again = _rows(tmp_path)
    assert _train(again)[0] < _train(rows)[0] - 1.0  # starts where the first run ended, not at ln(512)
    assert all(v is not None for v in _train(again, "mtp_loss")[BULK:])  # the checkpoint's MTP keeps training


def test_checkpoint_loads_in_transformers(straight):
    transformers = pytest.importorskip("transformers")
    run, _, _ = straight
    ours, _ = load_checkpoint(run / "checkpoint")
    hf = transformers.AutoModelForCausalLM.from_pretrained(run / "checkpoint", dtype=torch.float32).eval()
    ids = torch.tensor([list(range(10, 60))])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-4, rtol=1e-4)
    tok = load_tokenizer(run / "checkpoint")  # the tokenizer travels with the weights
    assert tok.vocab_size == ours.config.vocab_size and ours.config.eos_token_id == tok.eos_id


def test_changed_config_refuses_to_resume(straight, data):
    run, _, _ = straight
    with pytest.raises(PretrainError, match=r"different setup \(changed: pretrain.seed\)"):
        pretrain(tiny_cfg("pretrain.seed=5"), *data, run, progress=False)


def test_clear_errors_before_training(data, tmp_path):
    corpus, tok = data
    with pytest.raises(PretrainError, match=r"set model.vocab_size=512"):
        pretrain(tiny_cfg("model.vocab_size=600"), corpus, tok, tmp_path / "a", progress=False)
    with pytest.raises(PretrainError, match=r"--init .*no config.json"):
        pretrain(tiny_cfg(), corpus, tok, tmp_path / "b", init=str(tmp_path), progress=False)
    with pytest.raises(PretrainError, match=r"seq_len 96 but the model's context is 64"):
        pretrain(tiny_cfg("model.context=64"), corpus, tok, tmp_path / "c", progress=False)
    with pytest.raises(PretrainError, match=r"no tokenizer at .*kiln tokenizer train"):
        pretrain(tiny_cfg(), corpus, tmp_path, tmp_path / "d", progress=False)


def test_cli_without_a_corpus_says_to_build_one(tmp_path):
    result = CliRunner().invoke(app, ["pretrain", f"run.out_dir={tmp_path}"])
    assert result.exit_code == 2
    assert "error: no corpus at" in result.stderr and "run `kiln corpus build` first" in result.stderr
    assert "Traceback" not in result.output


def test_cli_dry_run_shows_the_phases():
    result = CliRunner().invoke(app, ["pretrain", "--dry-run", "pretrain.mtp_start=0.25"])
    assert result.exit_code == 0, result.output
    assert "[pretrain]" in result.stdout and 'name = "extension"' in result.stdout and "mtp_start = 0.25" in result.stdout


def test_rows_without_a_document_boundary_skip_the_attention_mask():
    """One document per row from position 0, trailing padding allowed: no mask, and the logits of
    the real tokens are the masked path's; a boundary inside a row or a window starting mid-way
    keeps the mask."""
    from tests.tiny_model import tiny_model

    model, _ = tiny_model(0)
    ids = torch.randint(0, 512, (2, 12))
    docs = torch.tensor([[0] * 12, [0] * 9 + [-1] * 3])
    pos = torch.arange(12).expand(2, 12)
    assert trainer.unpacked(pos, docs) == (None, None)
    with torch.no_grad():
        masked = model(ids, positions=pos, doc_ids=docs)
        plain = model(ids)
    torch.testing.assert_close(plain[0], masked[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(plain[1, :9], masked[1, :9], atol=1e-5, rtol=0)
    two = torch.tensor([[0] * 6 + [1] * 6])
    assert trainer.unpacked(pos[:1], two)[1] is two
    assert trainer.unpacked(pos[:1] + 3, docs[:1])[0] is not None


def test_sigkilled_cli_run_resumes_on_the_same_data_and_losses(data, tmp_path):
    """A real `kill -9` of `kiln pretrain` mid-phase, then the same command again: the resumed run
    logs the losses of an uninterrupted one, step for step, and ends with the same weights."""
    longer = PHASES.replace("steps=20", "steps=60")
    over = ["model.depth=1", "model.vocab_size=512", "model.context=256", f"pretrain.phases={longer}",
            "pretrain.eval_points=3", "pretrain.eval_window=32", "pretrain.eval_stride=16", "pretrain.eval_max_bytes=3000",
            "pretrain.checkpoint_every=3", "pretrain.device=cpu"]
    ref = pretrain(load_config(None, over), *data, tmp_path / "ref", progress=False)
    run = tmp_path / "runs" / "tiny" / "pretrain"
    cmd = [sys.executable, "-m", "kiln", "pretrain", "--corpus", str(data[0]), "--tokenizer", str(data[1]),
           f"run.out_dir={tmp_path / 'runs'}", *over]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (run / "state" / "trainer_state.pt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (run / "summary.json").exists()  # killed mid-run
    killed_at = max(r["step"] for r in _rows(run))
    assert 0 < killed_at < 64
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows, ref_rows = _rows(run), _rows(tmp_path / "ref")
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows]
    assert _train(rows) == _train(ref_rows) and _train(rows, "tokens_seen") == _train(ref_rows, "tokens_seen")
    a, b = load_checkpoint(tmp_path / "ref" / "checkpoint")[0], load_checkpoint(run / "checkpoint")[0]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert json.loads((run / "summary.json").read_text())["steps"] == ref["steps"]


def test_copy_practice_history_publish_and_continuation(data, tmp_path):
    """A tied base with copy practice publishes (bf16) with its history; a run continuing it counts
    its tokens on top of the base's and fits the held-out loss over both runs' evaluations."""
    pub = tmp_path / "bases" / "b"
    bulk = '[{name="bulk", kind="bulk", steps=6, seq_len=32, batch_size=8, lr=0.02, copy_frac=0.5}]'
    base = pretrain(tiny_cfg(f"pretrain.phases={bulk}", f"pretrain.publish={pub}", "model.tie_embeddings=true",
                             "model.mtp_depth=0"), *data, tmp_path / "base", progress=False)
    evals = [r for r in _rows(tmp_path / "base") if r["kind"] == "eval"]
    assert evals and all(r["copy"]["random"]["second"] > 0 and "code" in r["copy"] for r in evals)
    history = json.loads((pub / "history.json").read_text())
    assert history["tokens_seen"] == base["tokens_seen"] and len(history["evals"]) == len(evals)
    assert json.loads((pub / "config.json").read_text())["dtype"] == "bfloat16"
    model, _ = load_checkpoint(pub)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    cont = pretrain(tiny_cfg(f"pretrain.init={pub}"), *data, tmp_path / "cpt", progress=False)
    assert cont["base_tokens"] == base["tokens_seen"]
    assert cont["evals"][:len(evals)] == history["evals"]
    assert cont["evals"][-1]["tokens_seen"] == base["tokens_seen"] + cont["tokens_seen"]
    assert json.loads((Path(cont["checkpoint"]) / "history.json").read_text())["evals"] == cont["evals"]



@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text"])
def test_init_from_a_dense_family_trains(data, tmp_path, model_type):
    corpus, tok = data
    init = dense_checkpoint(tmp_path / "init", model_type, 512, tok)
    phases = 'pretrain.phases=[{name="bulk", kind="bulk", steps=6, seq_len=32, batch_size=8, lr=0.01, warmup_steps=1}]'
    mtp = "model.mtp_depth=0" if model_type == "gemma3_text" else "model.mtp_depth=1"
    summary = pretrain(tiny_cfg(phases, mtp), corpus, tok, tmp_path / "run", init=str(init), progress=False)
    rows = _rows(tmp_path / "run")
    assert summary["steps"] == 6 and _train(rows)[-1] < _train(rows)[0]
    assert [r["aux"] for r in rows if r["kind"] == "train"] == [0.0] * 6  # nothing routed, no balance loss
    model, mtp_module = load_checkpoint(tmp_path / "run" / "checkpoint")
    assert model.config.model_type == model_type
    assert (mtp_module is None) == (model_type == "gemma3_text")  # MTP cut in for the dense Qwen3/Llama block
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and all(math.isfinite(r["nll_per_token"]) for r in evals)


def test_init_from_gemma_with_mtp_says_to_turn_it_off(data, tmp_path):
    corpus, tok = data
    init = dense_checkpoint(tmp_path / "init", "gemma3_text", 512, tok)
    with pytest.raises(PretrainError, match=r"gemma3_text model; kiln's MTP layers are built for .*model\.mtp_depth=0"):
        pretrain(tiny_cfg(), corpus, tok, tmp_path / "run", init=str(init), progress=False)
