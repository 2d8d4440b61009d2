"""`kiln pretrain` (continued pretraining on the run's corpus) and `kiln sft` (fine-tuning on agent
trajectories): kiln/pretrain/trainer.py and sft.py."""
from __future__ import annotations

import os
from typing import Annotated

import typer

from kiln.cli import ConfigOpt, DryRun, Overrides, fail, resolve


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
        fail(str(e))
    final = summary["final_eval"]
    if final:
        typer.echo(f"held-out: {final['nll_per_token']:.4f} nats/token, {final['bits_per_byte']:.4f} bits/byte")
    typer.echo(f"checkpoint: {summary['checkpoint']}")


def sft_cmd(
    checkpoint: Annotated[str | None, typer.Option(
        "--checkpoint", help="The model to fine-tune; default: sft.checkpoint, else <run dir>/pretrain/checkpoint.")] = None,
    trajectories: Annotated[list[str] | None, typer.Option(
        "--trajectories", help="Trajectory JSON files or folders (e.g. a `kiln bench` out_dir); repeatable.")] = None,
    oracle_tasks: Annotated[int | None, typer.Option(
        "--oracle-tasks", help="Toy train-split tasks the oracle solves for SFT data (default: sft.oracle_tasks).")] = None,
    overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False,
) -> None:
    """Supervised fine-tuning on agent trajectories (the oracle on toy tasks, plus any given), loss
    on assistant tokens only; writes <run dir>/sft (the model in checkpoint/)."""
    extra = [] if oracle_tasks is None else [f"sft.oracle_tasks={oracle_tasks}"]
    cfg = resolve(config, extra + (overrides or []), dry_run)
    from kiln.bench.run import BenchError
    from kiln.model.checkpoint import CheckpointError
    from kiln.pretrain.sft import sft
    from kiln.pretrain.sft_data import SftDataError, collect_oracle_trajectories
    from kiln.pretrain.trainer import PretrainError

    run_root = os.path.join(cfg.run.out_dir, cfg.run.name)
    ckpt = checkpoint or cfg.sft.checkpoint or os.path.join(run_root, "pretrain", "checkpoint")
    sources = list(cfg.sft.trajectories) + list(trajectories or [])
    try:
        if not os.path.isfile(os.path.join(ckpt, "config.json")):  # before minutes of oracle rollouts
            raise PretrainError(f"no checkpoint at {ckpt!r}: run `kiln pretrain` first, or pass --checkpoint DIR")
        if cfg.sft.oracle_tasks:
            typer.echo(f"collecting oracle trajectories on {cfg.sft.oracle_tasks} toy tasks")
            sources += [str(p) for p in collect_oracle_trajectories(
                cfg, os.path.join(run_root, "sft-data"), cfg.sft.oracle_tasks, cfg.sft.oracle_seed,
                cfg.sft.oracle_level or None)]
        summary = sft(cfg, ckpt, sources, os.path.join(run_root, "sft"))
    except (PretrainError, SftDataError, CheckpointError, BenchError) as e:
        fail(str(e))
    typer.echo(f"final loss on assistant tokens: {summary['final_loss']:.4f}")
    typer.echo(f"checkpoint: {summary['checkpoint']}")


def rl_cmd(
    checkpoint: Annotated[str | None, typer.Option(
        "--checkpoint", help="The policy to train; default: rl.checkpoint, else <run dir>/sft/checkpoint.")] = None,
    address: Annotated[str | None, typer.Option(
        "--address", help="A Ray cluster to run on (ray.address), e.g. head-node:6379; default $RAY_ADDRESS, "
                          "else a local Ray on this machine.")] = None,
    overrides: Overrides = None, config: ConfigOpt = None, dry_run: DryRun = False,
) -> None:
    """Asynchronous RL in the harness: a trainer and rl.workers rollout workers as Ray actors, groups
    of rl.group_size rollouts per toy prompt (single epoch), weights shipped as deltas through a store
    (rl.store: a folder, or s3://bucket/prefix across machines) and swapped in mid-rollout; writes
    <run dir>/rl (metrics.jsonl, the model in checkpoint/). A rerun resumes.

    On this machine it starts a local Ray. On a cluster: `ray start --head` on one node, `ray start
    --address HEAD:6379` on the others, then `kiln rl --address HEAD:6379 rl.store=s3://...` (roles go
    where rl.trainer_resources / rl.worker_resources fit; see README, "Running on a cluster")."""
    cfg = resolve(config, (overrides or []) + ([f'ray.address="{address}"'] if address else []), dry_run)
    from kiln.rl.launcher import RLError, rl_dir_of, run_rl

    run_root = os.path.join(cfg.run.out_dir, cfg.run.name)
    ckpt = checkpoint or cfg.rl.checkpoint or os.path.join(run_root, "sft", "checkpoint")
    try:
        summary = run_rl(cfg, ckpt, rl_dir_of(cfg))
    except RLError as e:
        fail(str(e))
    last = summary["metrics"][-1] if summary["metrics"] else {}
    typer.echo(f"rl: {len(summary['metrics'])} steps; last reward {last.get('reward_mean', float('nan')):+.3f}")
    where = f" (on {summary['checkpoint_node']})" if summary.get("checkpoint_node") else ""
    typer.echo(f"checkpoint: {summary['checkpoint']}{where}")
