"""`kiln corpus build|stats`: the continued-pretraining corpus. cli.py mounts `corpus_app`."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from kiln.cli import ConfigOpt, DryRun, Overrides, resolve

corpus_app = typer.Typer(help="Build and describe the continued-pretraining corpus.", no_args_is_help=True)


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@corpus_app.command("build")
def build(overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False,
          tokenizer: Annotated[str | None, typer.Option(
              "--tokenizer", help="A tokenizer folder; default: <run dir>/tokenizer, trained first if missing.")] = None):
    """Read, filter, dedup and mix the sources (corpus.*), tokenise them into shards, and write the
    held-out project to heldout.txt; into corpus.out_dir (default <run dir>/corpus)."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.model.tokenizer import load_tokenizer
    from kiln.pretrain.corpus import build_corpus, corpus_dir

    if tokenizer is None:
        from kiln.speedrun import train_run_tokenizer
        tokenizer = train_run_tokenizer(cfg, echo=typer.echo)
    try:
        tok = load_tokenizer(Path(tokenizer))
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    out, start = corpus_dir(cfg), time.monotonic()
    try:
        meta = build_corpus(cfg.corpus, tok, out, cfg.run.seed, progress=True, tokenizer_path=str(tokenizer))
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    typer.echo(describe(meta))
    typer.echo(f"corpus -> {out} in {time.monotonic() - start:.1f} s")


@corpus_app.command("stats")
def stats(corpus: Annotated[str, typer.Argument(help="A folder written by `kiln corpus build`.")]):
    """Print a built corpus's sources, shares, filters, dedup and held-out project."""
    from kiln.pretrain.data import CorpusError, TokenShards

    try:
        meta = TokenShards(corpus).meta
    except CorpusError as e:
        _fail(str(e))
    typer.echo(describe(meta))


def describe(meta: dict) -> str:
    """The meta as a table of sources, then one line each for filters, dedup, held-out and shards."""
    head = f"{'source':<14} {'kind':<5} {'weight':>6} {'files':>7} {'read':>6} {'kept':>6} {'docs':>6} " \
           f"{'MB':>8} {'tokens':>11} {'share':>6}"
    lines = [head, "-" * len(head)]
    for name, s in meta["sources"].items():
        lines.append(f"{name:<14} {s['kind']:<5} {s['weight']:>6g} {s['files']:>7} {s['sampled']:>6} {s['kept']:>6} "
                     f"{s['docs']:>6} {s['bytes'] / 1e6:>8.2f} {s['tokens']:>11,} {s['share']:>6.1%}")
    lines.append(f"{'total':<14} {'':<5} {'':>6} {'':>7} {'':>6} {'':>6} {'':>6} "
                 f"{sum(s['bytes'] for s in meta['sources'].values()) / 1e6:>8.2f} {meta['train_tokens']:>11,}")
    lines.append("filtered: " + ", ".join(f"{k} {v}" for k, v in meta["filtered"].items()))
    lines.append("dedup: " + ", ".join(f"{k} {v}" for k, v in meta["dedup"].items()))
    h = meta["heldout"]
    lines.append(f"held out: {h['project']}, {h['files']} files, {h['bytes'] / 1e6:.2f} MB -> {h['path']}")
    if meta["skipped_roots"]:
        lines.append("docs roots not found (skipped): " + ", ".join(meta["skipped_roots"]))
    lines.append(f"shards: {len(meta['shards'])} x {meta['dtype']}, vocab {meta['vocab_size']}, seed {meta['seed']}")
    return "\n".join(lines)
