"""Every `kiln` command's --help, and the `kiln tasks` / `kiln bench` paths run for real on small
inputs: imports that skip bad rows and folders, exports, stats, and the one `error:` line (exit 2,
no traceback) each user mistake gets."""
from __future__ import annotations

import json
import os
import re

import pytest
import typer.main
from typer.testing import CliRunner

from kiln.cli import app
from kiln.tasks.record import load_suite
from kiln.tasks.swebench import export_swebench, write_rows
from tests.tasks.test_harbor import harbor_folder
from tests.tasks.test_stats import small_suite  # noqa: F401 (a fixture: three unvalidated toy tasks)
from tests.tasks.test_swebench import row_file  # noqa: F401 (a fixture: a local clone and its row)

runner = CliRunner()


def commands(cmd, path=()):
    """(path, click command) for the app and every command and subcommand under it."""
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from commands(sub, (*path, name))


COMMANDS = list(commands(typer.main.get_command(app)))


@pytest.mark.parametrize("path, cmd", COMMANDS, ids=[" ".join(p) or "kiln" for p, _ in COMMANDS])
def test_help(path, cmd):
    result = runner.invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    shown = " ".join(result.stdout.split())  # rich wraps the text to the terminal
    assert cmd.help and " ".join(cmd.help.split("\n\n")[0].split()) in shown
    for name in getattr(cmd, "commands", {}):
        assert name in shown


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result


# The session's Ray (tests/conftest.py, log_to_driver) forwards its raylet's and actors' lines to this
# process's stderr whenever they come, so into a command's captured stderr too: a disk over 95% full
# once put the raylet's warning into one.
RAY_LINE = re.compile(r"^(?:\x1b\[[\d;]*m)?\((?:raylet|[^)]* ?pid=\d+)\)")


def err(result) -> str:
    """A command's own stderr: without lines Ray forwarded meanwhile."""
    return "".join(line for line in result.stderr.splitlines(True) if not RAY_LINE.match(line))


def test_import_harbor_imports_good_folders_and_skips_bad_ones(tmp_path, tcfg):
    good, out = harbor_folder(tmp_path / "add-fix"), tmp_path / "suite"
    (tmp_path / "empty").mkdir()
    result = invoke("tasks", "import-harbor", good, tmp_path / "empty", "--out", out,
                    f"sandbox.state_dir={tcfg.state_dir}")
    assert result.exit_code == 0, result.output
    assert "imported add-fix" in result.stdout and f"imported 1 task into {out}; skipped 1" in result.stdout
    assert err(result) == f"skipped {tmp_path / 'empty'}: no instruction.md (is this a Harbor task folder?)\n"
    [task] = load_suite(str(out))
    assert task.id == "add-fix" and "+    return a + b" in task.solution  # solve.sh ran in the sandbox

    result = invoke("tasks", "import-harbor", tmp_path / "empty", "--out", out)
    assert result.exit_code == 2
    assert err(result).splitlines()[-1] == f"error: nothing imported into {out}; skipped 1 (reasons above)"
    result = invoke("tasks", "import-harbor", good, "--out", out, "sandbox.memroy_mb=1")  # overrides still parse
    assert result.exit_code == 2 and "error: unknown config key 'sandbox.memroy_mb'" in err(result)


def test_import_harbor_validates_by_default_and_ends_with_a_table(tmp_path, tcfg):
    good, out = harbor_folder(tmp_path / "add-fix"), tmp_path / "suite"
    unsolved = harbor_folder(tmp_path / "no-solution")
    os.remove(os.path.join(unsolved, "solution", "solve.sh"))
    with open(os.path.join(unsolved, "task.toml"), "a") as f:
        f.write("allow_internet = true\n")
    (tmp_path / "empty").mkdir()
    state = f"sandbox.state_dir={tcfg.state_dir}"
    result = invoke("tasks", "import-harbor", good, unsolved, tmp_path / "empty", "--out", out, state)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    table = [r.split(None, 2) for r in lines[lines.index("folder       outcome    reason"):-1]]
    assert table == [["folder", "outcome", "reason"], ["add-fix", "validated"],
                     ["no-solution", "imported", "not validated: no solution to run"],
                     ["empty", "skipped", "no instruction.md (is this a Harbor task folder?)"]]
    assert lines[-1] == f"imported 2 tasks into {out}; skipped 1 (reasons above)"
    assert "warning: " in err(result) and "allow_internet = true" in err(result)
    tasks = {t.id: t for t in load_suite(str(out))}
    assert ".harbor/tests/test_outputs.py::test_add" in tasks["add-fix"].fail_to_pass  # derived by validation
    assert tasks["no-solution"].fail_to_pass == ["harbor::reward"]

    result = invoke("tasks", "import-harbor", good, "--no-validate", "--out", tmp_path / "raw", state)
    assert result.exit_code == 0, result.output
    assert ["add-fix", "imported", "not validated: validation off"] in [r.split(None, 2) for r in
                                                                         result.stdout.splitlines()]
    [task] = load_suite(str(tmp_path / "raw"))
    assert task.fail_to_pass == ["harbor::reward"] and "+    return a + b" in task.solution  # the oracle still ran


def test_import_swebench_imports_good_rows_and_names_each_bad_one(row_file, tmp_path):  # noqa: F811
    root, row = row_file
    rows, out = tmp_path / "rows.jsonl", tmp_path / "suite"
    no_patch = {k: v for k, v in row.items() if k != "patch"} | {"instance_id": "acme__calc-3"}
    write_rows([dict(row, instance_id="other-1", repo="acme/nowhere"), row, no_patch], str(rows))
    with open(rows, "a") as f:
        f.write("{not json\n")
    result = invoke("tasks", "import-swebench", rows, "--repos", root / "repos", "--out", out)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"imported 1 task into {out}; skipped 3 (reasons above)\n"
    skipped = err(result).splitlines()
    assert len(skipped) == 3 and all(s.startswith(f"skipped {rows}:") for s in skipped)
    assert f"{rows}:1 (other-1): no local clone of 'acme/nowhere'" in skipped[0]
    assert f"{rows}:3 (acme__calc-3): missing field(s) ['patch']" in skipped[1]
    assert f"{rows}:4 (?): not JSON" in skipped[2]
    assert [t.id for t in load_suite(str(out))] == ["acme__calc-1"]

    write_rows([no_patch], str(rows))
    result = invoke("tasks", "import-swebench", rows, "--repos", root / "repos", "--out", tmp_path / "none")
    assert result.exit_code == 2
    assert err(result).splitlines() == [
        f"skipped {rows}:1 (acme__calc-3): missing field(s) ['patch']",
        f"error: nothing imported into {tmp_path / 'none'}; skipped 1 (reasons above)"]


@pytest.mark.parametrize("fmt", ["swebench", "harbor"])
def test_export_writes_every_task(small_suite, tmp_path, fmt):  # noqa: F811
    tasks = load_suite(small_suite)
    result = invoke("tasks", "export", small_suite, "--format", fmt, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"exported 3 tasks to {tmp_path}\n"
    if fmt == "swebench":
        with open(tmp_path / "rows.jsonl") as f:
            rows = [json.loads(line) for line in f]
        assert rows == [export_swebench(t) for t in tasks]
        assert [(r["instance_id"], r["problem_statement"], r["patch"]) for r in rows] == \
            [(t.id, t.prompt, t.solution) for t in tasks]
    else:
        assert all(os.path.isfile(tmp_path / t.id / "instruction.md") for t in tasks)


def test_stats_on_a_suite(small_suite):  # noqa: F811
    result = invoke("tasks", "stats", small_suite)
    assert result.exit_code == 0, result.output
    assert "bugfix 2, feature 1" in result.stdout and "CursorBench" in result.stdout


MISTAKES = [  # (command line, its error line); {tmp} is the test's folder, {suite} a real suite
    ("tasks stats {tmp}/nope", "error: {tmp}/nope: no such folder"),
    ("tasks stats {tmp}/empty.jsonl", "error: {tmp}/empty.jsonl: not a folder"),
    ("tasks export {tmp}/nope --format swebench --out {tmp}/x", "error: {tmp}/nope: no such folder"),
    ("tasks export {suite} --format csv --out {tmp}/x", "error: --format 'csv': use harbor or swebench"),
    ("bench --suite {tmp}/nope", "error: {tmp}/nope: no such folder"),
    ("bench --suite {tmp}/empty", "error: {tmp}/empty: no task folders (each needs a task.toml)"),
    ("bench --suite {suite} --policy local", "error: the local policy decodes a kiln checkpoint"),
    ("tasks import-swebench {tmp}/nope.jsonl --repos {tmp} --out {tmp}/x",
     "error: {tmp}/nope.jsonl: No such file or directory"),
    ("tasks import-swebench {tmp}/empty.jsonl --repos {tmp} --out {tmp}/x", "error: {tmp}/empty.jsonl: no rows"),
    ("tasks import-swebench {tmp}/bad.json --repos {tmp} --out {tmp}/x",
     "error: {tmp}/bad.json: not a JSON array: Expecting value: line 1 column 5 (char 4)"),
    ("tasks import-swebench {tmp}/bad.json --repos {tmp}/nope --out {tmp}/x",
     "error: --repos '{tmp}/nope' is not a directory"),
    ("tasks import-harbor sandbox.memory_mb=512 --out {tmp}/x", "error: no task folders given"),
    ("tasks toy --out {tmp}/x --level 5", "error: level must be 1, 2, 3 or None (cycle), not 5"),
    ("tasks mine --repo {tmp}/empty --out {tmp}/x",
     "error: git rev-parse --git-dir in {tmp}/empty: fatal: not a git repository"),
    ("tasks mutate --repo {tmp}/nope --out {tmp}/x", "error: --repo '{tmp}/nope' is not a directory"),
    ("tasks delete-feature --repo {tmp}/nope --out {tmp}/x", "error: --repo '{tmp}/nope' is not a directory"),
    ("sandbox demo sandbox.memory_mb=1", "error: sandbox.memory_mb: Input should be greater than or equal to 16"),
    ("tasks toy --out {tmp}/empty.jsonl/x", "error: --out {tmp}/empty.jsonl/x: Not a directory"),
    ("tasks mutate --repo {tmp}/empty --out {tmp}/empty.jsonl/x", "error: --out {tmp}/empty.jsonl/x: Not a directory"),
    ("bench --suite {suite} --policy noop --out {tmp}/empty.jsonl/x",
     "error: out_dir {tmp}/empty.jsonl/x: Not a directory"),
    ("tokenizer train --out {tmp}/empty.jsonl/tok", "error: --out {tmp}/empty.jsonl/tok: Not a directory"),
    ("agent --repo {tmp}/empty --prompt x --out {tmp}/nope/t.json", "error: --out {tmp}/nope/t.json: no folder"),
    ("sft --checkpoint {tmp}/nope", "error: no checkpoint at '{tmp}/nope': run `kiln pretrain` first"),
    ("rl --checkpoint {tmp}/nope run.out_dir={tmp}", "error: no checkpoint at '{tmp}/nope': run `kiln sft` first"),
    ("rl rl.trainer_cpus=[9999] run.out_dir={tmp}", "error: rl.trainer_cpus names CPU(s) [9999]"),
    ("env build {tmp}/nope", "error: {tmp}/nope: no Dockerfile"),
    ("env build-base --suite sid", "error: --suite sid: kiln builds Debian bullseye, bookworm, trixie"),
]


@pytest.mark.parametrize("command, error", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_user_mistake_is_one_error_line(small_suite, tmp_path, command, error):  # noqa: F811
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.json").write_text("[1, ")
    fill = {"tmp": tmp_path, "suite": small_suite}
    result = invoke(*command.format(**fill).split())
    assert result.exit_code == 2, result.output
    [line] = err(result).splitlines()
    assert line.startswith(error.format(**fill))
