"""`kiln env build-base|build`: task environments built from Dockerfiles without Docker (Debian roots
in the environment cache, kiln/tasks/env_build.py). cli.py mounts `env_app`."""
from __future__ import annotations

import os
import time
from typing import Annotated

import typer

from kiln.cli import ConfigOpt, DryRun, Overrides, fail, resolve

env_app = typer.Typer(help="Task environments built from Dockerfiles without Docker.", no_args_is_help=True)


@env_app.command("build-base")
def build_base(overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False,
               suite: Annotated[list[str] | None, typer.Option(
                   "--suite", help="Debian release(s) to bootstrap (bullseye, bookworm, trixie).")] = None):
    """Bootstrap the Debian base root(s) into the environment cache (sandbox.env_cache, or
    $KILN_ENV_CACHE, else ~/.cache/kiln/envs): once, with mmdebstrap; a second run does nothing."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.tasks import env_base, env_images
    from kiln.tasks.record import TaskError

    suite = suite or [env_base.DEFAULT_SUITE]
    for s in suite:
        if s not in env_images.SUITES:
            fail(f"--suite {s}: kiln builds Debian {', '.join(env_images.SUITES)}")
    try:
        cache = env_base.cache_dir(cfg.sandbox.env_cache)
        for s in suite:
            start = time.monotonic()
            layer = env_base.ensure_base(cache, s, log=typer.echo)
            typer.echo(f"{s}: {env_base.layer_tree(cache, layer)} ({time.monotonic() - start:.1f} s)")
    except TaskError as e:
        fail(str(e))


@env_app.command("build")
def build(folder: Annotated[str, typer.Argument(
              help="A Docker build context (with a Dockerfile), or a Harbor task folder (its environment/).")],
          overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False):
    """Build the environment a Dockerfile describes, every layer the cache lacks, and print its layers."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.tasks import env_base, env_build
    from kiln.tasks.record import TaskError

    context = os.path.join(folder, "environment") if os.path.isdir(os.path.join(folder, "environment")) else folder
    path = os.path.join(context, "Dockerfile")
    if not os.path.isfile(path):
        fail(f"{folder}: no Dockerfile (give a build context or a Harbor task folder)")
    start = time.monotonic()
    try:
        with open(path, encoding="utf-8") as f:
            recipe = env_build.parse(f.read(), path)
        cache = env_base.cache_dir(cfg.sandbox.env_cache)
        env = env_build.build(recipe, context, cache, log=typer.echo)
    except TaskError as e:
        fail(str(e))
    typer.echo(f"{path}: {env.image} as Debian {env.suite}, {len(env.layers)} layers, WORKDIR {env.workdir}, "
               f"uid {env.uid} ({time.monotonic() - start:.1f} s)")
