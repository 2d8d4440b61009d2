"""The `kiln` command: one subcommand per stage, all sharing --config, overrides and --dry-run.

Stage modules are imported inside their commands so `kiln --help` and `--dry-run` stay fast.
"""

from __future__ import annotations

import os
from typing import Annotated, NoReturn, Optional

import typer

from kiln.config import Config, ConfigError, load_config
from kiln.config_io import config_to_toml

HELP = (
    "kiln trains and evaluates coding agents with the Composer 2 recipe.\n\n"
    "Stages: tokenizer -> corpus -> pretrain (continued pretraining, MTP) -> sft -> rl (async RL in "
    "sandboxes) -> bench (CursorBench-style evaluation). `kiln speedrun` chains them all.\n\n"
    "Every command takes --config/-c (a TOML file or preset name: tiny, small), dotted overrides such "
    "as sandbox.memory_mb=512, and --dry-run to print the resolved config and exit."
)

# Plain tracebacks: complete and greppable in CI logs.
app = typer.Typer(name="kiln", help=HELP, add_completion=False, pretty_exceptions_enable=False)
sandbox_app = typer.Typer(help="Isolated copy-on-write workspaces where agents run.", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")

# The options every command shares, declared once.
ConfigOpt = Annotated[Optional[str], typer.Option(
    "--config", "-c", help="TOML file or preset name (configs/<name>.toml); default: tiny.")]
Overrides = Annotated[Optional[list[str]], typer.Argument(help="dotted key=value overrides, e.g. run.seed=1")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the resolved config as TOML and exit.")]


_root_config: str | None = None  # `kiln -c NAME <command>`: set by the app callback


def fail(message: str) -> NoReturn:
    """A user mistake: one `error:` line on stderr and exit 2, no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def make_out(path: str, flag: str = "--out") -> str:
    """Create an output folder before any work, so a path that cannot be one is an error line now,
    not a traceback after minutes of work."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        fail(f"{flag} {path}: {e.strerror or e}")
    return path


def resolve(config: str | None, overrides: list[str] | None, dry_run: bool) -> Config:
    """Load the config for a command; print it and exit on --dry-run; exit 2 on a config error.
    Without a command-level --config, one given before the command (`kiln -c small speedrun`) applies."""
    config = config or _root_config or "tiny"
    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        for line in str(e).splitlines():  # one line per problem
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(2) from None
    if dry_run:
        typer.echo(config_to_toml(cfg), nl=False)
        raise typer.Exit(0)
    return cfg


@app.callback(invoke_without_command=True)
def main(ctx: typer.Context, config: ConfigOpt = None, dry_run: DryRun = False) -> None:
    """`kiln --dry-run [-c NAME]` prints a resolved config; with no command, the help."""
    global _root_config
    _root_config = config
    if ctx.invoked_subcommand is None:
        if dry_run:
            resolve(config, [], dry_run)
        typer.echo(ctx.get_help())
        raise typer.Exit(2)


@app.command()
def speedrun(overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False) -> None:
    """Run every stage end to end on one config: sandbox demo, tokenizer, corpus, pretrain, SFT, a
    bench of the SFT model against the controls on held-out toy tasks, RL, and the same bench of the
    RL model; writes <run dir>/report.md. Stages resume where an interrupted run stopped."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.sandbox.demo import run_demo

    typer.echo("== sandbox demo")
    run_demo(cfg)
    from kiln.bench.run import BenchError
    from kiln.model.checkpoint import CheckpointError
    from kiln.pretrain.data import CorpusError
    from kiln.pretrain.sft_data import SftDataError
    from kiln.pretrain.trainer import PretrainError
    from kiln.rl.launcher import RLError
    from kiln.speedrun import speedrun as run_all

    try:
        run_all(cfg, echo=typer.echo)
    except (PretrainError, CorpusError, SftDataError, CheckpointError, BenchError, RLError) as e:
        fail(str(e))


@app.command()
def agent(
    repo: Annotated[str, typer.Option("--repo", help="Local repository to work on (copied into a sandbox).")],
    prompt: Annotated[str, typer.Option("--prompt", help="The task, as you would type it.")],
    policy: Annotated[Optional[str], typer.Option("--policy", help="openai or oracle (default: policy.kind).")] = None,
    patch: Annotated[Optional[str], typer.Option("--patch", help="Gold patch file (oracle policy).")] = None,
    test: Annotated[Optional[str], typer.Option("--test", help="Test command the oracle runs after editing.")] = None,
    apply: Annotated[bool, typer.Option("--apply", help="Apply the final diff to --repo.")] = False,
    out: Annotated[Optional[str], typer.Option("--out", help="Write the trajectory JSON here.")] = None,
    overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False,
) -> None:
    """Run the agent on a local repository in a sandbox: turns live, then the final diff."""
    extra = [f"policy.kind={policy}"] if policy else []
    cfg = resolve(config, extra + (overrides or []), dry_run)
    from kiln.harness.session import run_session
    from kiln.policies import make_policy

    if out and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        fail(f"--out {out}: no folder {os.path.dirname(os.path.abspath(out))!r} to write it in")

    try:
        gold = open(patch).read() if patch else None
    except OSError as e:
        fail(f"--patch {patch}: {e.strerror or e}")
    try:
        pol = make_policy(cfg.policy, patch=gold, test_command=test)
    except (ValueError, OSError) as e:
        fail(str(e))
    from kiln.policies.openai import PolicyError
    try:
        run_session(cfg, pol, repo, prompt, apply=apply, out=out)
    except FileNotFoundError as e:  # --repo
        fail(str(e))
    except PolicyError as e:  # the endpoint is down, refuses, or answers nonsense: the user's server or URL
        fail(f"{e} (check the server, policy.base_url and policy.model)")


@sandbox_app.command("demo")
def sandbox_demo(overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False) -> None:
    """A short tour of what a sandbox does."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.sandbox.demo import run_demo

    run_demo(cfg)


@sandbox_app.command("gc")
def sandbox_gc(overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False) -> int:
    """Remove sandboxes left behind by processes that died."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.sandbox.gc import gc

    n = gc(cfg)
    typer.echo(f"removed {n} stale sandbox{'es' if n != 1 else ''}")
    return n


def _mount_tasks() -> None:
    # Imported last: cli_tasks uses this module's shared option types and resolve().
    from kiln.cli_tasks import bench, tasks_app
    app.add_typer(tasks_app, name="tasks")
    from kiln.cli_env import env_app
    app.add_typer(env_app, name="env")
    app.command()(bench)
    from kiln.cli_model import model_app, probe_app, serve, tokenizer_app
    app.add_typer(tokenizer_app, name="tokenizer")
    app.add_typer(model_app, name="model")
    app.add_typer(probe_app, name="probe")
    app.command()(serve)
    from kiln.cli_pretrain import corpus_app
    app.add_typer(corpus_app, name="corpus")
    from kiln.cli_train import pretrain_cmd, rl_cmd, sft_cmd
    app.command("pretrain")(pretrain_cmd)
    app.command("sft")(sft_cmd)
    app.command("rl")(rl_cmd)


_mount_tasks()
