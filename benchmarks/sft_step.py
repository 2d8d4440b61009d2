"""SFT step speed, one run, same weights and batches: an SFT step's samples as one tree over their
common prompt (`Packed.trees`, what `kiln sft` runs) against the baseline, the same rows as
they are (`Packed.trimmed`: one sample per row, padding past the longest cut).

The samples are real agent trajectories: the oracle's, on toy train-split tasks, through the
harness in sandboxes (`collect_oracle_trajectories`, as the speedrun's SFT data), or those given
with `--trajectories`, so they open with the system message and tool schemas a deployment shows.
The model is the tiny preset's (random weights, an MTP layer trained by self-distillation, as in
the SFT stage) with a tokenizer trained on the stdlib at the preset's vocabulary, or `--checkpoint
DIR`'s model, MTP and tokenizer. A
step is the trainer's own (`trainer._step`): forward, loss on the assistant tokens, MTP
distillation, backward, clipping, AdamW. The two arms alternate block by block, so load from
other processes falls on both alike; each figure is the median over repeats of `--steps` steps.
The first batch's loss and MTP loss are compared between the arms: the tree computes the same
targets, so they agree to float rounding (the router's balance loss differs: it is over the tokens
computed, the prompt once).

    .venv/bin/python benchmarks/sft_step.py [--tasks 24] [--steps 4] [--repeats 3] [--checkpoint DIR]
        [--trajectories PATH ...]

About 5 minutes on 2 cores.

Last line: `name=value` pairs: tree_speedup (rows' step time over the tree's), rows_step_s,
tree_step_s, tokens_per_step_rows, tokens_per_step_tree, loss_diff, mtp_loss_diff.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from kiln.config import load_config
from kiln.model.checkpoint import load_checkpoint
from kiln.model.config import ModelConfig
from kiln.model.moe import MoeForCausalLM
from kiln.model.mtp import MTP
from kiln.model.tokenizer import list_corpus_files, load_tokenizer, train_tokenizer
from kiln.pretrain import trainer
from kiln.pretrain.sft_data import (
    batch_rows,
    collect_oracle_trajectories,
    load_trajectories,
    pack,
    samples_from,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CPU = torch.device("cpu")


def model_and_tokenizer(cfg, checkpoint: str | None, tmp: Path):
    if checkpoint:
        model, mtp = load_checkpoint(checkpoint)
        if mtp is None:
            raise SystemExit(f"{checkpoint} has no MTP layers; the SFT stage trains one: pass a checkpoint with them")
        return model, mtp, load_tokenizer(checkpoint)
    tok = train_tokenizer(list_corpus_files([STDLIB]), tmp / "tok", vocab_size=cfg.model.vocab_size,
                          max_bytes=4_000_000).tokenizer
    mcfg = ModelConfig.from_section(cfg.model)
    mcfg.eos_token_id, mcfg.pad_token_id = tok.eos_id, tok.pad_id
    torch.manual_seed(0)
    return MoeForCausalLM(mcfg), MTP(mcfg, cfg.model.mtp_depth or 1), tok


def fresh_run(model, mtp, p) -> trainer.Run:
    model, mtp = copy.deepcopy(model).train(), copy.deepcopy(mtp).train()
    return trainer.Run(model, mtp, trainer._adamw(model, p), trainer._adamw(mtp, p))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=24, help="toy tasks whose oracle trajectories are the samples")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per arm and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--checkpoint", help="a checkpoint with MTP layers (default: the tiny preset, random weights)")
    ap.add_argument("--trajectories", nargs="*", default=[],
                    help="trajectory files or folders to use instead of collecting --tasks (e.g. a speedrun's sft-data)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kiln-sft-step-"))
    cfg = load_config("configs/tiny.toml", [f"sandbox.state_dir={tmp / 'sandboxes'}"])
    ph = next(ph for ph in cfg.pretrain.phases if ph.kind == "sft")
    model, mtp, tok = model_and_tokenizer(cfg, args.checkpoint, tmp)
    paths = args.trajectories or [str(p) for p in collect_oracle_trajectories(
        cfg, tmp / "data", args.tasks, seed=0, level=cfg.sft.oracle_level or None, progress=False)]
    samples = samples_from(load_trajectories(paths), tok)
    d = pack(samples, ph.seq_len, tok.pad_id)
    print(f"{len(samples)} samples, {len(d)} rows of {ph.seq_len + 1}; step of {ph.batch_size} rows, "
          f"grad_accum {ph.grad_accum}; model {sum(q.numel() for q in model.parameters()) / 1e6:.1f}M, "
          f"MTP depth {mtp.depth}", flush=True)
    arms = {"rows": lambda b: b.trimmed(), "tree": lambda b: b.trees(ph.grad_accum, mtp.depth, tok.pad_id)}
    runs = {a: fresh_run(model, mtp, cfg.pretrain) for a in arms}
    times: dict[str, list[float]] = {a: [] for a in arms}
    tokens: dict[str, list[int]] = {a: [] for a in arms}
    first: dict[str, dict] = {}
    for rep in range(args.repeats):
        for arm, shape in arms.items():
            t = 0.0
            for s in range(rep * args.steps, (rep + 1) * args.steps):
                b = shape(d.rows(batch_rows(len(d), s, ph.batch_size, cfg.pretrain.seed)))
                t0 = time.perf_counter()
                row = trainer._step(runs[arm], (b.ids, b.docs, b.pos, b.mask, b.shared), ph.lr, True,
                                    cfg.pretrain.grad_clip, ph.grad_accum, CPU, contextlib.nullcontext())
                t += time.perf_counter() - t0
                first.setdefault(arm, row)
                tokens[arm].append(b.ids[:, :-1].numel())
            times[arm].append(t / args.steps)
            print(f"repeat {rep + 1}: {arm} {t / args.steps:.2f} s a step", flush=True)
    rows_s, tree_s = statistics.median(times["rows"]), statistics.median(times["tree"])
    r = {"tree_speedup": rows_s / tree_s, "rows_step_s": rows_s, "tree_step_s": tree_s,
         "tokens_per_step_rows": round(statistics.mean(tokens["rows"])),
         "tokens_per_step_tree": round(statistics.mean(tokens["tree"])),
         "loss_diff": abs(first["rows"]["loss"] - first["tree"]["loss"]),
         "mtp_loss_diff": abs(first["rows"]["mtp_loss"] - first["tree"]["mtp_loss"])}
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
