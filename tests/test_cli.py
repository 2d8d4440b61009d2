"""The `kiln` command: help, --dry-run, config errors, and wiring into the stages."""

import json
import re
import subprocess
import sys

from typer.testing import CliRunner

from kiln.cli import app

runner = CliRunner()


def test_help_lists_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "speedrun" in result.stdout and "sandbox" in result.stdout


def test_dry_run_prints_resolved_toml():
    result = runner.invoke(app, ["speedrun", "--dry-run", "sandbox.memory_mb=512"])
    assert result.exit_code == 0, result.output
    assert "memory_mb = 512" in result.stdout and 'name = "tiny"' in result.stdout


def test_dry_run_with_preset_on_subcommand():
    result = runner.invoke(app, ["sandbox", "gc", "-c", "small", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert 'name = "small"' in result.stdout


def test_real_base_preset_resolves_for_its_commands():
    for command in (["sft"], ["pretrain"], ["bench"]):
        result = runner.invoke(app, [*command, "-c", "real-base", "--dry-run"])
        assert result.exit_code == 0, result.output
        assert 'name = "real-base"' in result.stdout and "mtp_depth = 0" in result.stdout


def test_misspelt_override_exits_2_naming_key():
    result = runner.invoke(app, ["speedrun", "--dry-run", "sandbox.memroy_mb=512"])
    assert result.exit_code == 2
    assert "error: unknown config key 'sandbox.memroy_mb'" in result.stderr
    assert "Traceback" not in result.output


def test_top_level_dry_run_and_preset_before_command():
    result = runner.invoke(app, ["--dry-run"])
    assert result.exit_code == 0 and 'name = "tiny"' in result.stdout
    result = runner.invoke(app, ["-c", "small", "speedrun", "--dry-run"])
    assert result.exit_code == 0 and 'name = "small"' in result.stdout


# Every stage, shrunk to seconds: a few steps each, two oracle tasks, one held-out task.
TINY_SPEEDRUN = [
    "corpus.max_mb=1", "pretrain.eval_points=2", "pretrain.eval_max_bytes=4000", "pretrain.device=cpu",
    ('pretrain.phases=[{name="bulk", kind="bulk", steps=4, seq_len=64, batch_size=4, lr=3e-4}, '
     '{name="extension", kind="extension", steps=2, seq_len=128, batch_size=2, lr=1e-4, rope_theta=20000.0}, '
     '{name="sft", kind="sft", steps=2, seq_len=2560, batch_size=1, lr=1e-3}]'),
    "sft.oracle_tasks=2", "speedrun.eval_tasks=1", "speedrun.passes=1", "harness.max_turns=6", "harness.max_turn_tokens=32",
    "rl.tasks=2", "rl.steps=1", "rl.groups_per_step=1", "rl.group_size=2", "rl.workers=1", "rl.timeout_s=300",
]


def test_speedrun_runs_every_stage_and_writes_the_report(tmp_path):
    result = runner.invoke(app, ["speedrun", f"sandbox.state_dir={tmp_path}", f"run.out_dir={tmp_path}",
                                 *TINY_SPEEDRUN])
    assert result.exit_code == 0, result.output
    run = tmp_path / "tiny"
    assert "1 failed" in result.stdout and "1 passed" in result.stdout  # the demo's bug, then its fix
    assert "new sandbox sees the fix: True" in result.stdout
    # pretraining continues the committed base (pretrain.init = bases/tiny), with its tokenizer
    assert "tokenizer: the base's" in result.stdout and (run / "tokenizer" / "tokenizer.json").exists()
    for stage in ("pretrain", "sft"):
        assert (run / stage / "checkpoint" / "model.safetensors").exists()
    assert "bench oracle: correctness 1.000 over 1 rollouts" in result.stdout
    assert "bench noop: correctness 0.000 over 1 rollouts" in result.stdout
    assert "bench local: correctness" in result.stdout and "bench rl: correctness" in result.stdout
    assert (run / "rl" / "checkpoint" / "model.safetensors").exists()
    report = (run / "report.md").read_text()
    for section in ("## Stages", "## Corpus", "## Pretraining", "## Copying from context", "## SFT", "## RL",
                    "## Evaluation on held-out toy tasks"):
        assert section in report
    assert "It continues the base `bases/tiny`" in report and "**RL against SFT.**" in report
    probes = json.loads((run / "copy_probe.json").read_text())
    assert set(probes) == {"pretrained", "sft", "rl"}
    # the base copies: after a few steps at this test's high lr (no copy practice) the second copy is
    # still predicted far better than the first
    assert probes["pretrained"]["random"]["second"] < probes["pretrained"]["random"]["first"] - 3.0
    edits = json.loads((run / "edit_probe.json").read_text())
    assert set(edits) == {"sft", "rl"} and edits["sft"]["n"] == 1  # the oracle control's one edit
    assert "The edit probe (`kiln probe edits`)" in report and "| sft | 1 |" in report
    assert "![held-out loss](pretrain/heldout_loss.png)" in report and (run / "pretrain" / "heldout_loss.png").exists()
    assert "![training loss](training_loss.png)" in report and (run / "training_loss.png").stat().st_size > 0
    assert "| oracle | 1 x 1 | 1.000 ± 0.000" in report and "| noop | 1 x 1 | 0.000 ± 0.000" in report
    assert "![rl](rl.png)" in report and (run / "rl.png").stat().st_size > 0
    assert re.search(r"The pretrained model predicts the second copy of a random span at \d+\.\d\d nats", report)
    assert re.search(r"The SFT model solves \d+\.\d% of its 1 rollouts", report)
    # what each model's one rollout did after its first failed call (or that none failed), by model
    after = report.split("After a rollout's first failed tool call")[1]
    for model in ("local", "rl"):
        cells = sorted(c.strip() for c in re.search(rf"\n\| {model} \|(.*)\|\n", after).group(1).split("|"))
        assert cells[:-1] == ["-"] * (len(cells) - 1)  # its one rollout, in one column
        assert re.fullmatch(r"1 \((0|100)%\)", cells[-1])
    assert re.search(r"\n[012] of 2 rollouts self-summarised at least once\.", report)  # 1 step, 1 group of 2

    again = runner.invoke(app, ["speedrun", f"sandbox.state_dir={tmp_path}", f"run.out_dir={tmp_path}",
                                *TINY_SPEEDRUN])  # a finished run resumes: every stage is reused
    assert again.exit_code == 0, again.output
    assert "tokenizer: reusing" in again.stdout and "corpus: reusing" in again.stdout


def test_sandbox_gc_removes_a_dead_owners_run_dir(tmp_path):
    (tmp_path / "run" / "999999999").mkdir(parents=True)  # no such process
    result = runner.invoke(app, ["sandbox", "gc", f"sandbox.state_dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    # At least this one: gc also removes what dead sandboxes left elsewhere on the host (cgroups).
    removed = re.fullmatch(r"removed (\d+) stale sandbox(es)?\n", result.stdout)
    assert removed and int(removed.group(1)) >= 1, result.stdout
    assert not (tmp_path / "run" / "999999999").exists()


def test_python_m_kiln_and_light_import():
    # `python -m kiln` works, and importing kiln pulls in neither torch nor pydantic.
    out = subprocess.run([sys.executable, "-m", "kiln", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "speedrun" in out.stdout
    code = "import kiln, sys; print(sorted({'torch', 'pydantic'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
