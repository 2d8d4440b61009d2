"""Supervised fine-tuning (`kiln sft`): the last phase of continued pretraining, on chat-format
agent trajectories (sft_data.py), with the pretraining step and state (trainer.py): loss on the
assistant's tokens only, samples packed without attending to each other (a step's samples as one
tree over their common prompt, computed once), MTP still trained by self-distillation, resumable."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kiln.model.tokenizer import load_tokenizer
from kiln.pretrain import checkpointing as ckpt
from kiln.pretrain.sft_data import batch_rows, load_trajectories, pack, samples_from
from kiln.pretrain.trainer import (
    _RESUMABLE_EDITS,
    PretrainError,
    _device,
    _finish,
    _fresh,
    _resume,
    _train_step,
    _trainer_state,
)
from kiln.progress import tqdm


def sft(cfg, checkpoint, trajectories, run_dir, progress: bool = True) -> dict:
    """Fine-tune `checkpoint` (with its MTP, which keeps training by self-distillation) on the
    trajectory files/folders, through the config's phases of kind "sft"; resumable like pretrain.
    Returns the summary also written to <run_dir>/summary.json."""
    p, checkpoint, run_dir = cfg.pretrain, Path(checkpoint), Path(run_dir)
    phases = [ph for ph in p.phases if ph.kind == "sft"]
    if not phases:
        raise PretrainError('pretrain.phases has no phase of kind "sft": add one, e.g. pretrain.phases=[..., '
                            '{name="sft", kind="sft", steps=60, seq_len=2048, batch_size=4, lr=5e-4}]')
    if not (checkpoint / "config.json").is_file():
        raise PretrainError(f"no checkpoint at {str(checkpoint)!r}: run `kiln pretrain` first, or pass --checkpoint DIR")
    if not trajectories:
        raise PretrainError("no trajectories to train on: give --trajectories PATH or --oracle-tasks N (> 0)")
    tok = load_tokenizer(checkpoint)
    samples = samples_from(load_trajectories(trajectories), tok)
    device, autocast = _device(p)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = ckpt.MetricsLog(run_dir / ckpt.METRICS)
    packs = [pack(samples, ph.seq_len, tok.pad_id) for ph in phases]
    data_hash = hashlib.sha256(b"".join(t.numpy().tobytes() for d in packs for t in (d.ids, d.mask))).hexdigest()
    fingerprint = json.dumps({"sft": {**p.model_dump(mode="json", exclude=_RESUMABLE_EDITS | {"phases"}),
                                      "phases": [ph.model_dump(mode="json") for ph in phases]},
                              "model": {"init": str(checkpoint.resolve()), "mtp_depth": cfg.model.mtp_depth},
                              "data": {"samples": len(samples), "sha256": data_hash}}, sort_keys=True)
    run = _resume(run_dir, fingerprint, p, device, metrics) or _fresh(cfg, tok, str(checkpoint), device, metrics)
    for ph, d in zip(phases, packs):
        if ph.seq_len > run.model.config.max_position_embeddings:
            raise PretrainError(f"phase {ph.name!r} has seq_len {ph.seq_len} but the model's context is "
                                f"{run.model.config.max_position_embeddings}: shorten the phase")
        tqdm.write(f"{ph.name}: {len(samples)} samples packed into {len(d)} rows of {ph.seq_len + 1} tokens, "
                   f"{int(d.mask.sum()):,} assistant tokens" + (f", {d.truncated} cut to fit" if d.truncated else ""))
    starts = [sum(ph.steps for ph in phases[:i]) for i in range(len(phases) + 1)]
    run.tick()
    depth = run.mtp.depth if run.mtp is not None else 0  # a tree's prompt stops this short of the first target
    bar = tqdm(total=starts[-1], initial=run.step, desc="sft", unit="step", disable=not progress, dynamic_ncols=True)
    with bar:
        for ph, d, start, end in zip(phases, packs, starts, starts[1:]):
            while run.step < end:
                def rows(step=run.step - start, ph=ph, d=d):
                    b = d.rows(batch_rows(len(d), step, ph.batch_size, p.seed)).trees(ph.grad_accum, depth, tok.pad_id)
                    return b.ids, b.docs, b.pos, b.mask, b.shared
                train_mtp = run.mtp is not None and (run.step - start) % ph.mtp_every == 0
                _train_step(run, ph, start, p, rows, train_mtp, device, autocast, metrics, bar)
                if run.step % p.checkpoint_every == 0 or run.step == end:
                    run.tick()
                    ckpt.save_state(run_dir, run.model, run.mtp, checkpoint, _trainer_state(run, fingerprint))
    return _finish(run, run_dir, checkpoint, metrics, [ph.name for ph in phases], what="sft")
