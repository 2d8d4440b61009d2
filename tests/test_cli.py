"""The `kiln` command: help, --dry-run, config errors, and wiring into the stages."""

import subprocess
import sys

from typer.testing import CliRunner

from kiln.cli import PLANNED, app

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


def test_speedrun_runs_demo_and_control_bench_then_lists_planned_stages(tmp_path):
    result = runner.invoke(app, ["speedrun", f"sandbox.state_dir={tmp_path}", f"run.out_dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    for suite in ("toy-eval", "toolz-mutate"):
        assert f"{suite} / oracle: correctness 1.000" in result.stdout
        assert f"{suite} / noop: correctness 0.000" in result.stdout
        assert (tmp_path / "tiny" / f"bench-{suite}-oracle" / "report.md").exists()
    assert "1 failed" in result.stdout and "1 passed" in result.stdout  # the demo's bug, then its fix
    assert "new sandbox sees the fix: True" in result.stdout
    assert "tokenizer: vocab 8192" in result.stdout and (tmp_path / "tiny" / "tokenizer" / "tokenizer.json").exists()
    assert "not yet available: " + ", ".join(PLANNED) in result.stdout


def test_sandbox_gc_removes_a_dead_owners_run_dir(tmp_path):
    (tmp_path / "run" / "999999999").mkdir(parents=True)  # no such process
    result = runner.invoke(app, ["sandbox", "gc", f"sandbox.state_dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    assert "removed 1 stale sandbox" in result.stdout
    assert not (tmp_path / "run" / "999999999").exists()


def test_python_m_kiln_and_light_import():
    # `python -m kiln` works, and importing kiln pulls in neither torch nor pydantic.
    out = subprocess.run([sys.executable, "-m", "kiln", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "speedrun" in out.stdout
    code = "import kiln, sys; print(sorted({'torch', 'pydantic'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
