"""`kiln corpus build|stats`: the continued-pretraining corpus. cli.py mounts `corpus_app`."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from kiln.cli import ConfigOpt, DryRun, Overrides, fail, resolve

corpus_app = typer.Typer(help="Build and describe the continued-pretraining corpus.", no_args_is_help=True)


@corpus_app.command("build")
def build(overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False,
          tokenizer: Annotated[str | None, typer.Option(
              "--tokenizer", help="A tokenizer folder; default: <run dir>/tokenizer, trained first if missing.")] = None):
    """Read, filter, dedup and mix the sources (corpus.*), tokenise them into shards, and write the
    held-out project to heldout.txt; into corpus.out_dir (default <run dir>/corpus)."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.model.tokenizer import load_tokenizer
    from kiln.pretrain.corpus import build_corpus, corpus_dir, describe_corpus

    if tokenizer is None:
        from kiln.speedrun import train_run_tokenizer
        tokenizer = train_run_tokenizer(cfg, echo=typer.echo)
    try:
        tok = load_tokenizer(Path(tokenizer))
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    out, start = corpus_dir(cfg), time.monotonic()
    try:
        meta = build_corpus(cfg.corpus, tok, out, cfg.run.seed, progress=True, tokenizer_path=str(tokenizer))
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    typer.echo(describe_corpus(meta))
    typer.echo(f"corpus -> {out} in {time.monotonic() - start:.1f} s")


@corpus_app.command("stats")
def stats(corpus: Annotated[str, typer.Argument(help="A folder written by `kiln corpus build`.")]):
    """Print a built corpus's sources, shares, filters, dedup and held-out project."""
    from kiln.pretrain.corpus import describe_corpus
    from kiln.pretrain.data import CorpusError, TokenShards

    try:
        meta = TokenShards(corpus).meta
    except CorpusError as e:
        fail(str(e))
    typer.echo(describe_corpus(meta))
