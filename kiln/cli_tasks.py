"""`kiln tasks ...` and `kiln bench`: task generators, formats, suite stats, the benchmark.

Kept apart from cli.py so the main command file stays a screen long; cli.py mounts `tasks_app`
and `bench`. Each command resolves the config through cli.resolve like every other.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Annotated, Optional

import typer

from kiln.cli import ConfigOpt, DryRun, Overrides, fail, make_out, resolve

tasks_app = typer.Typer(help="Make, import, export and describe task suites.", no_args_is_help=True)

Out = Annotated[str, typer.Option("--out", help="Folder to write task folders into.")]
Repo = Annotated[str, typer.Option("--repo", help="A Python repository, or builtin:NAME (`kiln tasks sources`).")]
# Every generator counts its tasks with --n; mutate, delete-feature and mine once spelt it --max.
MaxN = Annotated[Optional[int], typer.Option("--n", min=1, help="Stop after this many kept tasks (default: all).")]
OldMax = Annotated[Optional[int], typer.Option("--max", min=1, hidden=True, help="The old spelling of --n.")]
Seed = Annotated[int, typer.Option("--seed", help="Seeds sampling; the same seed gives the same tasks.")]
Workers = Annotated[int, typer.Option("--workers", help="Validations in parallel.")]


def _repo(path: str, work: str) -> str:
    """A repository path, or a built-in real-code source (kiln/tasks/sources.py) materialised into `work`."""
    if path.startswith("builtin:"):
        from kiln.tasks.sources import SourceError, materialize
        name = path.split(":", 1)[1]
        try:
            return materialize(name, os.path.join(work, f"{name}-repo"))
        except SourceError as e:
            fail(str(e))
    if not os.path.isdir(path):
        fail(f"--repo {path!r} is not a directory")
    return path


@tasks_app.command("toy")
def toy(out: Out, n: Annotated[int, typer.Option("--n", min=1, help="Number of tasks.")] = 30, seed: Seed = 0,
        level: Annotated[Optional[int], typer.Option("--level", help="1, 2 or 3; default cycles all.")] = None,
        split: Annotated[str, typer.Option("--split", help="eval or train: disjoint seed ranges.")] = "eval",
        workers: Workers = 2, overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False):
    """Procedurally generated mini-repositories with one defect or missing feature each."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.tasks.toy import generate_toy
    make_out(out)
    try:  # level, split and seed are checked before any work; a failing candidate is counted, not raised
        y = generate_toy(out, n, seed=seed, level=level, split=split, sandbox_cfg=cfg.sandbox, workers=workers)
    except ValueError as e:
        fail(str(e))
    typer.echo(str(y))


def _count(n: int | None, old_max: int | None) -> int | None:
    """--n, else its old spelling --max; None keeps every task that validates."""
    return n if n is not None else old_max


def _real(repo: str, out: str, generate) -> None:
    """Run `generate(path, source)` on --repo into --out; a repository it cannot work from is an error line."""
    from kiln.tasks.gen import GeneratorError
    with tempfile.TemporaryDirectory(prefix="kiln-src-") as work:
        path = _repo(repo, work)
        make_out(out)
        try:
            y = generate(path, repo if repo.startswith("builtin:") else None)
        except GeneratorError as e:
            fail(str(e))
    typer.echo(str(y))


@tasks_app.command("mutate")
def mutate(repo: Repo, out: Out, max_n: MaxN = None, old_max: OldMax = None, seed: Seed = 0, workers: Workers = 2,
           overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False):
    """Bug injection into a repository whose tests pass; keeps mutants that break some tests."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.tasks.mutate import generate_mutants
    n = _count(max_n, old_max)
    _real(repo, out, lambda path, source: generate_mutants(path, out, cfg.sandbox, max_tasks=n, seed=seed,
                                                      workers=workers, source=source))


@tasks_app.command("delete-feature")
def delete_feature(repo: Repo, out: Out, max_n: MaxN = None, old_max: OldMax = None, seed: Seed = 0,
                   workers: Workers = 2, overrides: Overrides = None, config: ConfigOpt = None,
                   dry_run: DryRun = False):
    """Remove a function or class; its tests become the hidden tests; the prompt asks for it."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.tasks.delete_feature import generate_feature_deletions
    n = _count(max_n, old_max)
    _real(repo, out, lambda path, source: generate_feature_deletions(path, out, cfg.sandbox, max_tasks=n, seed=seed,
                                                                workers=workers, source=source))


@tasks_app.command("mine")
def mine(repo: Repo, out: Out, max_n: MaxN = None, old_max: OldMax = None, overrides: Overrides = None,
         config: ConfigOpt = None, dry_run: DryRun = False):
    """Commits that change source and tests together become tasks (repo at the parent commit)."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.tasks.mine import mine_commits
    n = _count(max_n, old_max)
    _real(repo, out, lambda path, source: mine_commits(path, out, cfg.sandbox, max_tasks=n, source=source))


@tasks_app.command("sources")
def sources_cmd(fetch: Annotated[bool, typer.Option("--fetch", help="Download the pinned source distributions the "
                                                     "cache lacks (pip; sha256 checked), then list.")] = False,
                quiet: Annotated[bool, typer.Option("--quiet", "-q", help="With --fetch: print nothing but errors.")] = False,
                no_count: Annotated[bool, typer.Option("--no-count", help="Skip collecting tests (faster).")] = False):
    """The built-in real-code sources (`--repo builtin:NAME`): version, licence, split, files, lines, tests."""
    from kiln.tasks import sources as S
    if fetch:
        try:
            S.fetch(log=(lambda m: None) if quiet else typer.echo)
        except S.SourceError as e:
            fail(str(e))
        if quiet:
            return
    rows = [("name", "version", "licence", "split", "src files", "src lines", "test files", "test lines", "tests", "cached")]
    for name in S.BUILTIN:
        why = S.missing_reason(name)
        if why:
            s = S.get(name)
            rows.append((name, s.version, s.license, s.split, "-", "-", "-", "-", "-", "no"))
            continue
        d = S.describe(name, count_tests=not no_count)
        rows.append((name, d["version"], d["license"], d["split"], str(d["source_files"]), f"{d['source_lines']:,}",
                     str(d["test_files"]), f"{d['test_lines']:,}", "-" if d["tests"] is None else str(d["tests"]),
                     "installed" if name == "toolz" else "yes"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    typer.echo(f"cache: {S.cache_dir()} (${S.SOURCES_ENV})")


@tasks_app.command("build-suite")
def build_suite_cmd(name: Annotated[str, typer.Argument(help="The suite, e.g. kiln-bench-v1.")], out: Out,
                    workers: Workers = 2,
                    projects: Annotated[Optional[list[str]], typer.Option(
                        "--project", help="Only this project (repeatable): a partial build.")] = None,
                    cap: Annotated[Optional[int], typer.Option("--cap", min=1, help="At most this many tasks per "
                                                               "project and category: a small build.")] = None,
                    categories: Annotated[Optional[list[str]], typer.Option(
                        "--category", help="Only this category (repeatable): bugfix, feature, refactor, "
                        "tests.")] = None,
                    overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False):
    """Rebuild a frozen suite from the pinned sources: the same task folders, byte for byte, every time.
    Writes DIR/train/, DIR/eval/ (split by project) and DIR/suite.json."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.tasks.sources import SourceError
    from kiln.tasks.suite import build_suite
    try:
        build_suite(name, out, cfg.sandbox, workers=workers, projects=projects, cap=cap, log=typer.echo,
                    categories=categories)
    except (SourceError, ValueError) as e:
        fail(str(e))


@tasks_app.command("stats")
def stats(suites: Annotated[list[str], typer.Argument(help="Suite folders.")],
          plots: Annotated[Optional[str], typer.Option(
              "--plots", help="Also draw prompt_chars.png, gold_lines.png and gold_files.png (by category, with the "
              "CursorBench and SWE-bench medians) into this folder; one subfolder per suite when given several.")] = None,
          details: Annotated[bool, typer.Option("--details", help="Per-category medians and per-project counts.")] = False):
    """Tasks, median prompt characters, gold lines and files changed, projects, categories, next to CursorBench and SWE-bench."""
    from kiln.tasks.record import TaskError
    from kiln.tasks.stats import format_details, format_stats, plot_stats, suite_stats
    try:
        typer.echo(format_stats({s: suite_stats(s) for s in suites}))
        for s in suites if details else []:
            typer.echo(f"\n{s}:\n{format_details(s)}")
        for s in suites if plots else []:
            dest = plots if len(suites) == 1 else os.path.join(plots, os.path.basename(os.path.abspath(s)))
            for png in plot_stats(s, dest):
                typer.echo(f"wrote {png}")
    except TaskError as e:
        fail(str(e))


def _batch_done(imported: int, skipped: list[str], out: str, table: list[tuple[str, ...]] | None = None) -> None:
    """End a batch import: each bad item was skipped and is named with its reason here, then the
    `table` of every item's outcome (header first) if given; only a batch that imported nothing
    fails, so one bad row or folder costs itself, not the batch."""
    for reason in skipped:
        typer.echo(f"skipped {reason}", err=True)
    if table:
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        for r in table:
            typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    tail = f"; skipped {len(skipped)} (reasons above)" if skipped else ""
    if not imported:
        fail(f"nothing imported into {out}{tail}")
    typer.echo(f"imported {imported} task{'s' if imported != 1 else ''} into {out}{tail}")


@tasks_app.command("import-swebench")
def import_swebench_cmd(rows: Annotated[str, typer.Argument(help="JSONL of SWE-bench instance rows.")],
                        repos: Annotated[str, typer.Option("--repos", help="Folder of local clones.")], out: Out,
                        validate: Annotated[bool, typer.Option(
                            "--validate/--no-validate", help="Run the tests before and after the gold patch: "
                            "the row's fail-to-pass tests must fail, then pass; its pass-to-pass tests must "
                            "keep passing.")] = True,
                        env: Annotated[bool, typer.Option(
                            "--env/--no-env", help="Build each row's own environment when an install spec "
                            "knows its repository and version (kiln's table, then --specs); else kiln's.")] = True,
                        specs: Annotated[Optional[str], typer.Option(
                            "--specs", help="A TOML or JSON table of install specs, [\"owner/name\".\"version\"] "
                            "with python, pip, apt, install, env (kiln/tasks/swebench_env.py).")] = None,
                        overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False):
    """Import SWE-bench instance rows (with local clones of their repositories), each validated unless
    --no-validate and run in its own environment when kiln has its install spec. A bad row is skipped
    and named with its row number, instance_id and reason; the command fails only if none imports."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.tasks.swebench import import_swebench
    from kiln.tasks.swebench_env import load_specs
    if not os.path.isdir(repos):
        fail(f"--repos {repos!r} is not a directory")
    errors: list[tuple[str, str]] = []
    try:
        table = load_specs(specs) if specs else None
        tasks = import_swebench(rows, repos, out, sandbox_cfg=cfg.sandbox, validate=validate, errors=errors,
                                envs=env, specs=table, log=lambda m: typer.echo(m, err=True))
    except OSError as e:
        fail(f"{rows}: {e.strerror or e}")
    except ValueError as e:  # the file as a whole: not UTF-8, not JSON rows, empty
        fail(str(e))
    _batch_done(len(tasks), [msg for _, msg in errors], out)


# click allows one variadic argument per command, so the folders share it with the overrides,
# told apart by the overrides' dotted `section.key=` form.
_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")


@tasks_app.command("import-harbor")
def import_harbor_cmd(args: Annotated[list[str], typer.Argument(
                          metavar="FOLDER", help="Task folders, then any dotted key=value overrides.")],
                      out: Out, validate: Annotated[bool, typer.Option(
                          "--validate/--no-validate", help="Validate each task that has a solution (the oracle must "
                          "pass, doing nothing must fail) and derive its test lists from the runs.")] = True,
                      config: ConfigOpt = None, dry_run: DryRun = False):
    """Import Harbor (Terminal-Bench 2) or Terminal-Bench 1 task folders, validating each one that has
    a solution unless --no-validate. A folder that cannot be imported is skipped and named with its
    reason; a table of every folder's outcome ends the output; the command fails only if none imports."""
    folders = [a for a in args if not _OVERRIDE.match(a)]
    cfg = resolve(config, [a for a in args if _OVERRIDE.match(a)], dry_run)
    if not folders:
        fail("no task folders given")
    from kiln.tasks.harbor import import_folder
    rows, skipped = [], []
    for f in folders:
        name = os.path.basename(os.path.normpath(f))
        try:
            task, outcome, why = import_folder(f, out, cfg.sandbox, validate=validate,
                                               warn=lambda msg: typer.echo(f"warning: {msg}", err=True))
            typer.echo(f"imported {task.id}")
            rows.append((name, outcome, why))
        except (ValueError, OSError) as e:  # TaskError is a ValueError
            skipped.append(str(e))
            lines = str(e).splitlines()
            why = lines[0].removeprefix(f"{f}: ").removeprefix(f"{f}/")
            rows.append((name, "skipped", why.rstrip(":") + " (listed above)" if len(lines) > 1 else why))
    table = [("folder", "outcome", "reason"), *[(n, o, w if len(w) <= 100 else w[:97] + "...") for n, o, w in rows]]
    _batch_done(len(rows) - len(skipped), skipped, out, table)


@tasks_app.command("export")
def export_cmd(suite: Annotated[str, typer.Argument(help="A kiln suite (or one task folder).")],
               fmt: Annotated[str, typer.Option("--format", help="harbor or swebench.")], out: Out):
    """Export kiln tasks as Harbor folders or SWE-bench rows (out/rows.jsonl)."""
    if fmt not in ("harbor", "swebench"):
        fail(f"--format {fmt!r}: use harbor or swebench")
    from kiln.tasks.harbor import export_harbor
    from kiln.tasks.record import load_suite
    from kiln.tasks.swebench import export_swebench, write_rows
    try:
        tasks = load_suite(suite)
        os.makedirs(out, exist_ok=True)
        if fmt == "harbor":
            for t in tasks:
                export_harbor(t, out)
        else:
            write_rows([export_swebench(t) for t in tasks], os.path.join(out, "rows.jsonl"))
    except (ValueError, OSError) as e:  # TaskError is a ValueError
        fail(str(e))
    typer.echo(f"exported {len(tasks)} tasks to {out}")


def bench(suite: Annotated[Optional[str], typer.Option("--suite", help="Suite folder (bench.suite).")] = None,
          policy: Annotated[Optional[str], typer.Option("--policy", help="oracle, noop, openai or local (bench.policy).")] = None,
          checkpoint: Annotated[Optional[str], typer.Option(
              "--checkpoint", help="The local policy's kiln checkpoint (policy.checkpoint).")] = None,
          endpoint: Annotated[Optional[str], typer.Option(
              "--endpoint", help="The openai policy's OpenAI-compatible base URL, e.g. http://host:8000/v1 "
              "(policy.base_url; the key is read from $OPENAI_API_KEY, policy.api_key_env).")] = None,
          model: Annotated[Optional[str], typer.Option("--model", help="The openai policy's model name (policy.model).")] = None,
          passes: Annotated[Optional[int], typer.Option("--passes", help="Passes per task (bench.passes).")] = None,
          workers: Annotated[Optional[int], typer.Option("--workers", help="Parallel rollouts (bench.workers).")] = None,
          out: Annotated[Optional[str], typer.Option("--out", help="Output folder (bench.out_dir).")] = None,
          use_ray: Annotated[bool, typer.Option("--ray", help="Rollouts as Ray tasks across the cluster (bench.ray): "
                                                "a local Ray, or the one at --address / $RAY_ADDRESS.")] = False,
          address: Annotated[Optional[str], typer.Option("--address", help="A Ray cluster to run on (ray.address), "
                                                         "e.g. head-node:6379; implies --ray.")] = None,
          overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False):
    """Run a suite with a policy over several passes; resumable; writes results, summary, report and plots."""
    flags = {"suite": suite, "policy": policy, "passes": passes, "workers": workers, "out_dir": out}
    extra = [f"bench.{k}={v}" if not isinstance(v, str) else f'bench.{k}="{v}"' for k, v in flags.items() if v is not None]
    extra += [f"policy.checkpoint={checkpoint}"] if checkpoint is not None else []  # a str field: kept as typed
    extra += [f'policy.base_url="{endpoint}"'] if endpoint is not None else []
    extra += [f'policy.model="{model}"'] if model is not None else []
    extra += ["bench.ray=true"] if use_ray or address else []
    extra += [f'ray.address="{address}"'] if address else []
    cfg = resolve(config, extra + (overrides or []), dry_run)
    b = cfg.bench
    if not b.suite:
        fail("no suite: pass --suite DIR (a folder of task folders)")
    out_dir = b.out_dir or os.path.join(cfg.run.out_dir, cfg.run.name, f"bench-{b.policy}")
    from kiln.bench.run import BenchError, run_bench
    from kiln.tasks.record import TaskError
    try:
        s = run_bench(b.suite, b.policy, passes=b.passes, workers=b.workers, out_dir=out_dir, config=cfg)
    except (TaskError, BenchError) as e:
        fail(str(e))
    if s["errors"]:  # a rollout that raised is not scored: say so rather than report its 0 as a result
        errors = os.path.join(out_dir, "errors.jsonl")
        with open(errors, encoding="utf-8") as f:
            last = json.loads(f.readlines()[-1])["error"]
        note = f"{s['errors']} rollout(s) failed, the last with {last}; see {errors} (a rerun retries them)"
        if not s["n_rollouts"]:
            fail(note)
        typer.echo(f"warning: {note}", err=True)
    typer.echo(f"{s['n_tasks']} tasks x {s['passes']} passes: correctness {s['correctness_mean']:.3f}; "
               f"report: {os.path.join(out_dir, 'report.md')}")
