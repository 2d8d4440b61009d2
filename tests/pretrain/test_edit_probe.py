"""The edit probe: it scores exactly the tokens of the edit's old text, new text and first change,
and a model fine-tuned on the trajectories writes their edits where the untrained one does not."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kiln.cli import app
from kiln.model.checkpoint import load_checkpoint
from kiln.model.tokenizer import load_tokenizer
from kiln.pretrain.edit_probe import edit_case, edit_probe
from kiln.pretrain.sft import sft
from kiln.pretrain.sft_data import load_trajectories
from tests.pretrain.test_sft import oracle_like, sft_cfg
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module


@pytest.fixture(scope="module")
def trajs(tmp_path_factory):
    d = tmp_path_factory.mktemp("edit-trajs")
    for i in range(4):
        oracle_like(f"Fix the bug in pkg/m{i}.py.", i).save(str(d / f"t{i}.json"))
    return d


def test_the_spans_are_the_edits_tokens(tiny_checkpoint, trajs):
    tok = load_tokenizer(tiny_checkpoint)
    for traj in load_trajectories([str(trajs)]):
        case = edit_case(traj, tok)
        ids = case["ids"]
        old, new = tok.decode(ids[slice(*case["old"])]), tok.decode(ids[slice(*case["new"])])
        # token edges may take in a neighbouring quote, never a token of anything else
        assert old.strip('"') == "a - b" and new.strip('"') == "a + b"
        assert "+" in tok.decode([ids[case["change"]]])
        a, b = case["reply"]
        assert '"edit_file"' in tok.decode(ids[a:b]) and b == len(ids)


def test_fine_tuning_on_the_trajectories_makes_the_model_write_their_edits(tiny_checkpoint, trajs, tmp_path):
    tok = load_tokenizer(tiny_checkpoint)
    cases = load_trajectories([str(trajs)])
    before = edit_probe(load_checkpoint(tiny_checkpoint)[0], tok, cases)
    summary = sft(sft_cfg(tmp_path, 'pretrain.phases=[{name="sft", kind="sft", steps=30, seq_len=320, batch_size=2, '
                                    'lr=3e-3, warmup_steps=1}]'), tiny_checkpoint, [str(trajs)], tmp_path, progress=False)
    after = edit_probe(load_checkpoint(summary["checkpoint"])[0], tok, cases)
    assert before["n"] == after["n"] == 4
    assert before["old_text"] == 0.0 and before["reply_tokens"] < 0.3
    assert after["old_text"] == 1.0 and after["change"] == 1.0 and after["reply_tokens"] > 0.9
    # the command prints the same figures
    result = CliRunner().invoke(app, ["probe", "edits", summary["checkpoint"], "--trajectories", str(trajs), "--json"])
    assert result.exit_code == 0 and '"old_text": 1.0' in result.output


def test_bad_input_gets_an_error_line(tiny_checkpoint, tmp_path):
    result = CliRunner().invoke(app, ["probe", "edits", str(tiny_checkpoint), "--trajectories", str(tmp_path / "none")])
    assert result.exit_code == 2 and "error:" in result.output and "no trajectory file or folder" in result.output
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(app, ["probe", "edits", str(tiny_checkpoint), "--trajectories", str(tmp_path / "empty")])
    assert result.exit_code == 2 and "no trajectory has an edit_file call" in result.output
