"""`kiln pretrain`: continued pretraining of the run's model on the run's corpus (kiln/pretrain/trainer.py)."""
from __future__ import annotations

import os
from typing import Annotated

import typer

from kiln.cli import ConfigOpt, DryRun, Overrides, resolve


def pretrain_cmd(
    init: Annotated[str | None, typer.Option(
        "--init", help="Start from this HF-layout checkpoint (continued pretraining) instead of from scratch.")] = None,
    corpus: Annotated[str | None, typer.Option(
        "--corpus", help="A `kiln corpus build` folder; default: corpus.out_dir, else <run dir>/corpus.")] = None,
    tokenizer: Annotated[str | None, typer.Option(
        "--tokenizer", help="The tokenizer the corpus was built with; default: <run dir>/tokenizer.")] = None,
    overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False,
) -> None:
    """Train in phases (bulk, long-context extension) with MTP self-distillation, held-out codebase
    evaluations and resumable checkpoints; writes <run dir>/pretrain (the model in checkpoint/)."""
    cfg = resolve(config, overrides, dry_run)
    from kiln.model.checkpoint import CheckpointError
    from kiln.pretrain.data import CorpusError
    from kiln.pretrain.trainer import PretrainError, pretrain

    run_root = os.path.join(cfg.run.out_dir, cfg.run.name)
    corpus_dir = corpus or cfg.corpus.out_dir or os.path.join(run_root, "corpus")
    tokenizer_dir = tokenizer or os.path.join(run_root, "tokenizer")
    try:
        summary = pretrain(cfg, corpus_dir, tokenizer_dir, os.path.join(run_root, "pretrain"), init=init)
    except (PretrainError, CorpusError, CheckpointError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    final = summary["final_eval"]
    if final:
        typer.echo(f"held-out: {final['nll_per_token']:.4f} nats/token, {final['bits_per_byte']:.4f} bits/byte")
    typer.echo(f"checkpoint: {summary['checkpoint']}")
