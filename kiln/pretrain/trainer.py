"""Continued pretraining (`kiln pretrain`): the config's phases, in order, on one model.

A step: a batch of packed windows drawn by (seed, step) from the corpus shards (so a resumed run
sees the data the uninterrupted one would), split into grad_accum micro-batches; positions restart
and attention stops at every <|endoftext|>; loss = next-token cross-entropy + router_aux_loss_coef
x the Switch balance loss; AdamW at the phase's scheduled rate, global gradient-norm clipping.

Phases: bulk at a short sequence length; extension with longer sequences and the RoPE base the
phase names (set when it starts). Phases of kind "sft" are `kiln sft`'s (sft.py): the same step
on packed agent trajectories (sft_data.py), from a checkpoint, loss on assistant tokens only.

MTP, the report's recipe kept simple: the module (model.mtp_depth layers) is created from scratch
when the run reaches `mtp_start` of the first bulk phase (a state is saved there: the mid-bulk
checkpoint), kept in every checkpoint from then on, and trained by self-distillation jointly with
the main model from the start of the next phase to the end of the run. Its inputs from the trunk,
embedding and head are detached, and it has its own optimizer and clipping, so the main model's
weights are bit-identical with or without it.

Held-out codebase loss (heldout.py) at log-spaced steps and at every phase end; at the end, a fit
of that loss against ln(tokens) is printed and plotted. The state is saved every checkpoint_every
steps, at the MTP cut and at every phase end; a run dir holding a state resumes from it.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.config import project_path
from kiln.model import gemm
from kiln.model.causal_lm import CausalLM
from kiln.model.checkpoint import load_checkpoint, save_checkpoint
from kiln.model.config import ModelConfig
from kiln.model.moe import MoeForCausalLM
from kiln.model.mtp import MTP, MTP_FAMILIES, mtp_loss
from kiln.model.tokenizer import load_tokenizer
from kiln.pretrain import checkpointing as ckpt
from kiln.pretrain.copying import copy_probe, copy_rows
from kiln.pretrain.data import TokenShards, doc_ids
from kiln.pretrain.heldout import (
    fit_log_linear,
    heldout_eval,
    log_spaced_steps,
    plot_heldout,
)
from kiln.pretrain.schedule import lr_at
from kiln.progress import tqdm

# Changing these between a run and its resume does not change the training itself.
HISTORY = "history.json"  # beside a final checkpoint's weights: see read_history
_RESUMABLE_EDITS = {"publish", "init", "eval_points", "eval_window", "eval_stride", "eval_max_bytes", "checkpoint_every", "device"}


class PretrainError(ValueError):
    """A pretraining run that cannot start; the message says what to do."""


@dataclass
class Run:
    """Everything a step changes; `trainer_state` saves it and `_resume` restores it."""
    model: CausalLM
    mtp: MTP | None
    opt: torch.optim.Optimizer
    mtp_opt: torch.optim.Optimizer | None
    step: int = 0  # optimizer steps done, over all phases
    tokens_seen: int = 0
    wall: float = 0.0  # seconds since the run started, evaluations and saves included, summed over resumes
    train_s: float = 0.0  # seconds spent in training steps alone (what tokens/s is measured over)
    started: float | None = None  # monotonic time the run would have started without interruptions

    def tick(self) -> None:
        if self.started is None:
            self.started = time.monotonic() - self.wall
        self.wall = time.monotonic() - self.started


def pretrain(cfg, corpus_dir, tokenizer_dir, run_dir, init: str | None = None, progress: bool = True) -> dict:
    """Run (or resume) the phases of cfg.pretrain; returns the summary also written to summary.json."""
    p, run_dir, tokenizer_dir = cfg.pretrain, Path(run_dir), Path(tokenizer_dir)
    init = str(project_path(init or p.init)) if (init or p.init) else None
    phases = [ph for ph in p.phases if ph.kind != "sft"]
    if not phases:
        raise PretrainError("pretrain.phases has no bulk or extension phase to run (sft phases run with `kiln sft`)")
    for ph in p.phases:
        if ph.kind == "sft":
            tqdm.write(f"phase {ph.name!r} is an SFT phase: `kiln sft` runs it, not `kiln pretrain`")
    shards, tok, heldout = _inputs(cfg, Path(corpus_dir), tokenizer_dir)
    device, autocast = _device(p)
    fingerprint = json.dumps({"pretrain": {**p.model_dump(mode="json", exclude=_RESUMABLE_EDITS), "phases":
                                           [ph.model_dump(mode="json") for ph in phases]},
                              "model": {"init": str(Path(init).resolve())} if init else cfg.model.model_dump(mode="json"),
                              "corpus": {k: shards.meta[k] for k in ("shards", "train_tokens", "vocab_size")}},
                             sort_keys=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = ckpt.MetricsLog(run_dir / ckpt.METRICS)
    run = _resume(run_dir, fingerprint, p, device, metrics) or _fresh(cfg, tok, init, device, metrics)
    for ph in phases:
        if ph.seq_len > run.model.config.max_position_embeddings:
            raise PretrainError(f"phase {ph.name!r} has seq_len {ph.seq_len} but the model's context is "
                                f"{run.model.config.max_position_embeddings}: raise model.context or shorten the phase")

    starts = [sum(ph.steps for ph in phases[:i]) for i in range(len(phases) + 1)]
    total = starts[-1]
    bulk = next((i for i, ph in enumerate(phases) if ph.kind == "bulk"), None)
    cut = None if cfg.model.mtp_depth == 0 else (
        0 if bulk is None else starts[bulk] + round(p.mtp_start * phases[bulk].steps))
    train_from = 0 if bulk is None else starts[bulk + 1]  # the MTP trains from the phase after the bulk
    eval_at = set(log_spaced_steps(phases[0].warmup_steps, total, p.eval_points)) | set(starts[1:])
    if heldout is None:
        eval_at = set()

    run.tick()

    def save() -> None:
        run.tick()
        ckpt.save_state(run_dir, run.model, run.mtp, tokenizer_dir, _trainer_state(run, fingerprint))

    heldout_ids = tok.encode(heldout) if heldout else None

    def evaluate(phase: str) -> None:
        r = heldout_eval(run.model, heldout_ids, heldout, p.eval_window, p.eval_stride, endoftext_id=tok.endoftext_id)
        probe = copy_probe(run.model, heldout_ids, tok.vocab_size, endoftext_id=tok.endoftext_id, seed=p.seed)
        run.tick()
        metrics.append({"kind": "eval", "step": run.step, "phase": phase, "tokens_seen": run.tokens_seen,
                        **r, "copy": probe, "wall": round(run.wall, 3)})
        tqdm.write(f"eval @ step {run.step} ({run.tokens_seen:,} tokens): held-out loss {r['nll_per_token']:.4f} "
                   f"nats/token, {r['bits_per_byte']:.4f} bits/byte; copy probe (second vs first copy, nats): "
                   f"random {probe['random']['second']:.2f} vs {probe['random']['first']:.2f}, "
                   f"code {probe['code']['second']:.2f} vs {probe['code']['first']:.2f}")

    bar = tqdm(total=total, initial=run.step, desc="pretrain", unit="step", disable=not progress, dynamic_ncols=True)
    with bar:
        for i, ph in enumerate(phases):
            start, end = starts[i], starts[i + 1]
            if run.step >= end:
                continue
            if ph.rope_theta is not None:
                run.model.set_rope_theta(ph.rope_theta)  # idempotent: also right when resuming mid-phase
            tqdm.write(f"phase {ph.name} ({ph.kind}): steps {run.step + 1}-{end} of {total}, {ph.batch_size} x "
                       f"{ph.seq_len} tokens a step, rope_theta {run.model.config.rope_theta:g}")
            while run.step < end:
                if cut is not None and run.mtp is None and run.step >= cut:
                    _attach_mtp(run, cfg.model.mtp_depth, p, device)
                    when = "from the next phase" if train_from > run.step else "from now"
                    tqdm.write(f"MTP: {run.mtp.depth} layer(s) attached at step {run.step}, trained {when}")
                    save()
                train_mtp = run.mtp is not None and run.step >= train_from
                _train_step(run, ph, start, p, lambda ph=ph: _windows(shards, run.step, ph, p.seed), train_mtp,
                            device, autocast, metrics, bar)
                if run.step in eval_at:
                    evaluate(ph.name)
                if run.step % p.checkpoint_every == 0 or run.step == end:
                    save()
    return _finish(run, run_dir, tokenizer_dir, metrics, [ph.name for ph in phases], base=read_history(init),
                   publish=str(project_path(p.publish)) if p.publish else None)


def _device(p) -> tuple[torch.device, contextlib.AbstractContextManager]:
    """The training device, and bf16 autocast on a GPU (none on a CPU)."""
    device = torch.device("cuda" if p.device == "cuda" or (p.device == "auto" and torch.cuda.is_available()) else "cpu")
    return device, (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext())


def _inputs(cfg, corpus_dir: Path, tokenizer_dir: Path):
    """The corpus, the tokenizer and the held-out text, checked against each other."""
    if not (corpus_dir / "meta.json").is_file():
        raise PretrainError(f"no corpus at {str(corpus_dir)!r} (meta.json missing): run `kiln corpus build` first")
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise PretrainError(f"no tokenizer at {str(tokenizer_dir)!r}: run `kiln tokenizer train --out {tokenizer_dir}` "
                            "first (`kiln speedrun` does both)")
    shards, tok = TokenShards(corpus_dir), load_tokenizer(tokenizer_dir)
    if shards.meta["vocab_size"] != tok.vocab_size:
        raise PretrainError(f"the corpus at {str(corpus_dir)!r} was tokenised with a {shards.meta['vocab_size']}-token "
                            f"vocabulary but the tokenizer at {str(tokenizer_dir)!r} has {tok.vocab_size}: rebuild the "
                            "corpus with this tokenizer (`kiln corpus build`)")
    path = corpus_dir / (shards.meta.get("heldout") or {}).get("path", "heldout.txt")
    heldout = path.read_text(encoding="utf-8") if path.is_file() else ""
    cap = cfg.pretrain.eval_max_bytes
    if cap:  # cut at a byte budget, dropping a character split by the cut
        heldout = heldout.encode("utf-8")[:cap].decode("utf-8", errors="ignore")
    if not heldout.strip():
        if cfg.pretrain.eval_points:
            raise PretrainError(f"the corpus at {str(corpus_dir)!r} has no held-out text ({path.name}): rebuild it with "
                                "`kiln corpus build`, or set pretrain.eval_points=0 to train without evaluation")
        return shards, tok, None
    return shards, tok, heldout


def _fresh(cfg, tok, init: str | None, device: torch.device, metrics: ckpt.MetricsLog) -> Run:
    """A new run: the model from cfg.model (from scratch) or from an HF checkpoint (--init)."""
    p = cfg.pretrain
    if init:
        try:
            model, mtp = load_checkpoint(init, device=device)
        except (ValueError, OSError) as e:  # CheckpointError is a ValueError
            raise PretrainError(f"--init {init}: {e}") from None
        if model.config.vocab_size < tok.vocab_size:
            raise PretrainError(f"--init {init} has a {model.config.vocab_size}-token vocabulary, smaller than the "
                                f"tokenizer's {tok.vocab_size}: use the tokenizer the checkpoint was trained with")
        if cfg.model.mtp_depth and model.config.model_type not in MTP_FAMILIES:
            raise PretrainError(f"--init {init} is a {model.config.model_type} model; kiln's MTP layers are built for "
                                f"{', '.join(MTP_FAMILIES)} models: set model.mtp_depth=0")
        mtp = mtp if cfg.model.mtp_depth else None
    else:
        mcfg = ModelConfig.from_section(cfg.model)
        if mcfg.vocab_size != tok.vocab_size:
            raise PretrainError(f"model.vocab_size is {mcfg.vocab_size} but the tokenizer has {tok.vocab_size} tokens: "
                                f"set model.vocab_size={tok.vocab_size}, or train a tokenizer with --vocab {mcfg.vocab_size}")
        mcfg.eos_token_id, mcfg.pad_token_id = tok.eos_id, tok.pad_id  # what serving stops and pads on
        torch.manual_seed(p.seed)
        model, mtp = MoeForCausalLM(mcfg).to(device), None
    n_params = sum(q.numel() for q in model.parameters())
    tqdm.write(f"model: {n_params / 1e6:.1f}M parameters, " + (f"from {init} (model.* ignored)" if init else "from scratch"))
    metrics.truncate(0)  # rows of an earlier run that never saved a state
    run = Run(model.train(), None, _adamw(model, p), None)
    if mtp is not None:
        run.mtp, run.mtp_opt = mtp.train(), _adamw(mtp, p)
    return run


def _resume(run_dir: Path, fingerprint: str, p, device: torch.device, metrics: ckpt.MetricsLog) -> Run | None:
    state_dir = ckpt.find_state(run_dir)
    if state_dir is None:
        return None
    st = ckpt.read_trainer_state(state_dir)
    if st["fingerprint"] != fingerprint:
        old, new = json.loads(st["fingerprint"]), json.loads(fingerprint)
        diff = [f"{k}.{n}" for k in new for n in new[k] if old.get(k, {}).get(n) != new[k][n]]
        raise PretrainError(f"{run_dir} holds a run with a different setup (changed: {', '.join(diff) or 'see config'}); "
                            f"resume it with the same config, or start fresh in another folder (run.name=...) "
                            f"or after deleting {state_dir}")
    model, mtp = load_checkpoint(state_dir, device=device)
    run = Run(model.train(), None, _adamw(model, p), None, st["step"], st["tokens_seen"], st["wall"], st["train_s"])
    run.opt.load_state_dict(st["optimizer"])
    if mtp is not None:
        run.mtp, run.mtp_opt = mtp.train(), _adamw(mtp, p)
        run.mtp_opt.load_state_dict(st["mtp_optimizer"])
    torch.set_rng_state(st["rng"]["torch"])
    if device.type == "cuda" and st["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(st["rng"]["cuda"])
    metrics.truncate(run.step)
    tqdm.write(f"resuming from {state_dir} at step {run.step} ({run.tokens_seen:,} tokens seen)")
    return run


def _trainer_state(run: Run, fingerprint: str) -> dict:
    return {"version": 1, "fingerprint": fingerprint, "step": run.step, "tokens_seen": run.tokens_seen,
            "wall": run.wall, "train_s": run.train_s, "optimizer": run.opt.state_dict(),
            "mtp_optimizer": run.mtp_opt.state_dict() if run.mtp_opt else None,
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}}


def _adamw(module: torch.nn.Module, p) -> torch.optim.AdamW:
    # Weight decay on matrices only: decaying norm gains toward 0 only fights the normalisation.
    params = [q for q in module.parameters() if q.requires_grad]
    groups = [{"params": [q for q in params if q.ndim >= 2], "weight_decay": p.weight_decay},
              {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=p.phases[0].lr, betas=tuple(p.betas))


def _attach_mtp(run: Run, depth: int, p, device: torch.device) -> None:
    # Its own seeded RNG: the initialisation is the same whether the run was resumed or not.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(p.seed + 1)
        mtp = MTP(run.model.config, depth)
    run.mtp, run.mtp_opt = mtp.to(device).train(), _adamw(mtp, p)


def _windows(shards: TokenShards, step: int, ph, seed: int) -> tuple:
    """A pretraining batch: corpus windows, documents split at every <|endoftext|>, every token a
    target; with ph.copy_frac, that share of the rows is copy practice (loss on second copies)."""
    n_copy = round(ph.batch_size * ph.copy_frac)
    ids, mask = shards.batch(step, ph.batch_size - n_copy, ph.seq_len, seed), None
    if n_copy:
        practice, practice_mask = copy_rows(shards, step, n_copy, ph.seq_len, seed, shards.meta["vocab_size"],
                                            endoftext_id=shards.endoftext_id)
        ids, mask = torch.cat([ids, practice]), torch.cat([torch.ones_like(ids), practice_mask])
    docs, pos = doc_ids(ids, shards.endoftext_id)
    return ids, docs, pos, mask


def _train_step(run: Run, ph, start: int, p, make_batch, train_mtp: bool, device, autocast,
                metrics: ckpt.MetricsLog, bar) -> None:
    """One optimizer step of phase `ph` (which began at step `start`) on make_batch()'s batch, logged."""
    lr = lr_at(run.step - start, ph.steps, ph.lr, ph.warmup_steps, p.min_lr_ratio, p.schedule, p.decay_frac)
    t0 = time.perf_counter()
    batch = make_batch()
    row = _step(run, batch, lr, train_mtp, p.grad_clip, ph.grad_accum, device, autocast)
    dt = time.perf_counter() - t0
    tokens = batch[0][:, :-1].numel()
    run.step += 1
    run.tokens_seen += tokens
    run.train_s += dt
    run.tick()
    metrics.append({"kind": "train", "step": run.step, "phase": ph.name, "lr": lr, **row,
                    "tokens_seen": run.tokens_seen, "tokens_per_s": round(tokens / dt, 1), "wall": round(run.wall, 3)})
    bar.update(1)
    bar.set_postfix(phase=ph.name, loss=f"{row['loss']:.3f}", tok_s=f"{tokens / dt:.0f}")


@gemm.routed()
def _step(run: Run, batch: tuple, lr: float, train_mtp: bool, clip: float, accum: int, device: torch.device,
          autocast) -> dict:
    """One optimizer step over `accum` micro-batches of batch = (ids, docs, positions, mask[,
    shared]), each [B, T + 1]: token t + 1 is the target at t where mask (None: all ones) is 1 at
    t + 1; shared: each row is a tree (sft_data.Packed.trees), one row per micro-batch. The loss is
    the mean over the whole batch's targets, so splitting it into micro-batches changes nothing.
    Returns the row's loss fields."""
    model, mtp = run.model, run.mtp
    opts = [run.opt] + ([run.mtp_opt] if train_mtp else [])
    for opt in opts:
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
    coef = model.config.router_aux_loss_coef
    sums = {"loss": 0.0, "aux": 0.0, "mtp_loss": 0.0}
    shared = len(batch) > 4 and batch[4]
    ids, docs, pos, mask = (t if t is None else t.to(device) for t in batch[:4])
    targets = ids[:, 1:] if mask is None else ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    n_targets = max(1, int((targets != -100).sum()))
    for x, y, d, ps in zip(*(t.chunk(accum) for t in (ids[:, :-1], targets, docs[:, :-1], pos[:, :-1]))):
        ps, d = (ps, d) if shared else unpacked(ps, d)
        # With a loss mask (SFT) the heads run only where there is a target: most of an agent
        # sample is prompt and tool output, and the vocabulary projection dominates a tiny model.
        keep = None if mask is None else y != -100
        at = None if train_mtp else keep  # the MTP reads every position's hidden state
        with autocast:
            out = model.trunk(x, positions=ps, doc_ids=d, shared_prefix=shared, at=at)
            logits = model.head(out.hidden if keep is None or at is not None else out.hidden[keep])
            # Summed and divided by the batch's target count: this micro-batch's share of the mean.
            loss = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten() if keep is None else y[keep],
                                   ignore_index=-100, reduction="sum") / n_targets
            total = loss if out.aux_loss is None else loss + coef * out.aux_loss / accum
            if train_mtp:  # self-distillation wherever the main head ran (pretraining: every position)
                m_loss, _ = mtp_loss(logits, mtp(model, out.hidden, x, ps, d, keep=keep, shared=shared), x, d, keep=keep)
                total = total + m_loss / accum
                sums["mtp_loss"] += float(m_loss.detach()) / accum
        total.backward()
        sums["loss"] += float(loss.detach())
        sums["aux"] += 0.0 if out.aux_loss is None else float(out.aux_loss.detach()) / accum
    # Clipped apart: the MTP's gradients never scale the main model's step.
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else math.inf)
    if train_mtp:
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), clip if clip > 0 else math.inf)
    for opt in opts:
        opt.step()
    return {**sums, "mtp_loss": sums["mtp_loss"] if train_mtp else None, "grad_norm": float(norm)}


def unpacked(positions: torch.Tensor, docs: torch.Tensor):
    """(positions, doc_ids) for the trunk, or (None, None) when every row is one document starting
    at position 0, followed at most by padding (doc id -1, which causal attention already keeps out
    of the real tokens): then attention takes SDPA's causal path, not an explicit [B, T, T] mask."""
    first = docs[:, :1]
    if bool((first >= 0).all() and ((docs == first) | (docs < 0)).all() and (positions[:, 0] == 0).all()):
        return None, None
    return positions, docs


def read_history(checkpoint: str | None) -> dict | None:
    """The pretraining history a checkpoint carries (history.json: tokens seen and held-out
    evaluations, over every run it continues), or None."""
    path = Path(checkpoint) / HISTORY if checkpoint else None
    return json.loads(path.read_text()) if path and path.is_file() else None


def _finish(run: Run, run_dir: Path, tokenizer_dir: Path, metrics: ckpt.MetricsLog, phases: list[str],
            what: str = "pretrain", base: dict | None = None, publish: str | None = None) -> dict:
    """The final checkpoint with its history, the fit of held-out loss against ln(tokens), its plot,
    summary.json. A run that continues a base with a history fits the base's evaluations and its own
    together, its tokens counted on top of the base's: one curve of continued pretraining."""
    rows = metrics.rows()
    own = list({r["step"]: r for r in rows if r["kind"] == "eval"}.values())
    offset = base["tokens_seen"] if base else 0
    evals = (base["evals"] if base else []) + [
        {**{k: r.get(k) for k in ("step", "phase", "nll_per_token", "bits_per_byte", "copy")},
         "tokens_seen": r["tokens_seen"] + offset} for r in own]
    history = {"tokens_seen": offset + run.tokens_seen, "steps": (base["steps"] if base else 0) + run.step,
               "evals": evals}

    def write(d: Path, dtype=None) -> None:
        save_checkpoint(run.model, d, mtp=run.mtp, tokenizer_dir=tokenizer_dir, dtype=dtype)
        if what == "pretrain":  # fine-tuning is not pretraining: an SFT model carries no history
            (d / HISTORY).write_text(json.dumps(history) + "\n")
    final = ckpt.write_dir_atomically(run_dir / "checkpoint", write)
    if publish:
        ckpt.write_dir_atomically(Path(publish), lambda d: write(d, torch.bfloat16))
        tqdm.write(f"published (bf16) -> {publish}")
    train = [r for r in rows if r["kind"] == "train"]
    fit = plot = None
    if len({r["tokens_seen"] for r in evals}) >= 2:
        fit = fit_log_linear([r["tokens_seen"] for r in evals], [r["nll_per_token"] for r in evals])
        plot = str(plot_heldout(evals, fit, run_dir / "heldout_loss.png"))
        tqdm.write(f"held-out loss vs ln(tokens) over {len(evals)} evaluations: slope {fit[0]:.4f} nats per e-fold "
                   f"of tokens, R² {fit[2]:.3f} (plot: {plot})")
    summary = {"steps": run.step, "tokens_seen": run.tokens_seen, "wall_s": round(run.wall, 1), "phases": phases,
               "tokens_per_s": round(run.tokens_seen / run.train_s, 1) if run.train_s else None,
               "final_loss": train[-1]["loss"] if train else None, "final_eval": evals[-1] if evals else None,
               "fit": dict(zip(("slope", "intercept", "r2"), fit)) if fit else None, "mtp": run.mtp is not None,
               "checkpoint": str(final), "metrics": str(metrics.path), "plot": plot, "evals": evals,
               "base_tokens": offset}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    tqdm.write(f"{what}: {run.step} steps, {run.tokens_seen:,} tokens in {run.wall:.0f} s -> {final}")
    return summary
