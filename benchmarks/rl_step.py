"""The RL trainer's step, one run: each group's rollouts as one tree over their shared prompt against
the baseline, the same rows padded and run four at a time (kiln/rl/trainer.py, `RLTrainer.trees`);
and the tree step with its fp32 products in oneDNN (kiln/model/gemm.py, the default where it keeps
fp32) against the same step in MKL, torch's default.

Both arms replay the same saved groups of a finished `kiln rl` run (`<rl dir>/groups/*/group.json`),
two a step as the preset trains, from the same checkpoint, with the optimizer's update skipped so
every step starts from the same weights. The arms alternate step by step, so load from other
processes falls on them alike; a figure is the median over steps. The losses must agree: a tree
computes the same logprobs, summed in another order, and the libraries round differently.

    .venv/bin/python benchmarks/rl_step.py --groups runs/tiny/rl/groups --checkpoint runs/tiny/sft/checkpoint

About 5 minutes on 2 cores at the default 6 steps.

Last line: `name=value` pairs: step_s, rows_step_s and mkl_step_s (medians), tree_speedup (rows /
tree), gemm (where the default sends fp32 products here: onednn, or mkl where oneDNN would not keep
fp32), gemm_speedup (mkl / tree), prompt_fraction (the share of the rollouts' tokens that are their
group's shared prompt), loss_rel_diff (the largest over steps and arms).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

from kiln.config import load_config
from kiln.model import gemm
from kiln.model.checkpoint import load_checkpoint
from kiln.rl.batch import collate, sequences
from kiln.rl.rollout import load_group
from kiln.rl.trainer import RLTrainer, shared_prompt


def prompt_fraction(groups) -> float:
    """Of all the rollouts' tokens, the share a tree does not repeat: each group's prompt but once."""
    total = repeated = 0
    for g in groups:
        seqs = [s for i, t in enumerate(g.trajectories) for s in sequences(t, i)]
        batch = collate(seqs)
        total += sum(len(s.ids) for s in seqs)
        repeated += shared_prompt(batch, torch.arange(len(batch.ids))) * (len(batch.ids) - 1)
    return repeated / max(total, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default="runs/tiny/rl/groups", help="a kiln rl run's groups folder")
    ap.add_argument("--checkpoint", default="runs/tiny/sft/checkpoint", help="the model the step trains")
    ap.add_argument("--steps", type=int, default=6, help="steps per arm, two groups each")
    args = ap.parse_args()
    paths = sorted(Path(args.groups).glob("*/group.json"))[:2 * args.steps]
    if len(paths) < 2 * args.steps:
        sys.exit(f"error: {args.groups!r} holds {len(paths)} groups, {2 * args.steps} are needed: "
                 "run `kiln rl` first, or pass --steps with fewer")
    if not (Path(args.checkpoint) / "config.json").is_file():
        sys.exit(f"error: no checkpoint at {args.checkpoint!r}: pass --checkpoint DIR")
    groups = [load_group(str(p)) for p in paths]
    rl = load_config(None, []).rl
    model, _ = load_checkpoint(args.checkpoint, with_mtp=False)
    trainer = RLTrainer(model, rl)
    trainer.opt.step = lambda: None  # every step from the same weights: both arms see the same model
    default = gemm.backend()
    arms = {"tree": (True, default), "rows": (False, default), "mkl": (True, "mkl")}
    times: dict[str, list[float]] = {a: [] for a in arms}
    worst = 0.0
    for s in range(args.steps):
        pair, loss = groups[2 * s:2 * s + 2], {}
        for arm, (trees, backend) in arms.items():
            trainer.trees = trees
            os.environ["KILN_FP32_GEMM"] = backend  # what the step's gemm.routed() reads
            m = trainer.step(pair)
            times[arm].append(m["step_s"])
            loss[arm] = m["loss"]
        worst = max([worst] + [abs(loss["tree"] - v) / max(abs(v), 1e-12) for v in loss.values()])
        print(f"step {s + 1}/{args.steps}: " + " ".join(f"{a} {times[a][-1]:.2f}s" for a in arms)
              + " loss " + " / ".join(f"{v:.6f}" for v in loss.values()), flush=True)
    tree, rows, mkl = (statistics.median(times[a]) for a in arms)
    print(f"step_s={tree:.3f} rows_step_s={rows:.3f} mkl_step_s={mkl:.3f} tree_speedup={rows / tree:.3f} "
          f"gemm={default} gemm_speedup={mkl / tree:.3f} prompt_fraction={prompt_fraction(groups):.3f} "
          f"loss_rel_diff={worst:.2e}")


if __name__ == "__main__":
    main()
