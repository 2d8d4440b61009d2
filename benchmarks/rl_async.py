"""RL throughput, one run: synchronous against asynchronous, the same tiny configuration and the same
number of samples.

Both arms are `kiln rl` (kiln/rl/launcher.py: the trainer and rollout workers as Ray actors, the
weight store) on the same SFT checkpoint, prompts and settings; only `rl.max_lag` differs. The
baseline, max_lag = 0, is synchronous on-policy RL: a version's groups are all rolled out with
that version, the trainer waits for the last of them, and the workers wait for the next version.
The asynchronous arm admits rollouts up to `--lag` versions ahead, so rollouts and training
overlap and stragglers do not stall the step. The prompts are generated once and shared, and both
arms issue them in the same order (upsampling keeps a kind's order), so at a seed they roll out
the same tasks, often token for token the same rollouts.

    .venv/bin/python benchmarks/rl_async.py --checkpoint runs/tiny/sft/checkpoint [--steps 8] [key=value ...]

Placement (`--placement`): by default "split", the trainer on the first half of this machine's CPUs
and the workers on the rest, as the recipe runs them on separate hardware. Synchronous RL then
idles the trainer's CPUs while rollouts run and the workers' CPUs while it trains, which is the
cost asynchrony removes. "shared" lets every process use every CPU: on a machine this small the OS
gives an idle role's cores to the busy one, so the two arms mostly time-share the same cores and
asynchrony has little left to reclaim. The recipe's environments are a service of their own:
`--sandboxes all` (the default) lets the sandboxes run on any CPU (sandbox.cpus), taking what the
trainer and decoding leave; `workers` keeps them on the workers' CPUs. One worker per worker CPU
by default (a second engine on the same core only adds a second copy of the weights to its caches),
each with room (rl.worker_groups) for a step's groups and one more: asynchronously, the next
step's group then decodes beside a step's last, longest rollouts instead of after them
(synchronously, admission leaves that room empty).

32 samples a pair (the issue's), as 8 steps of one group of 4 by default: a run's first step
waits for its first rollouts and its last trains with none left to overlap, and at 4 steps of 2
groups that fill and drain took a quarter of the asynchronous arm's wall (15 s waiting for the
first groups and 14 s training the last step with every rollout done, of 125 s), where a real run
has hundreds of steps (docs/architecture.md, RL, Throughput).

samples/s counts rollouts over each arm's wall time (launch to the final checkpoint). Both arms
share one Ray, started before the first (or the one at --address / $RAY_ADDRESS), so its start-up
is in neither. The trainer
idle fraction is the async arm's time waiting for groups over its loop time; trainer_idle_after_fill
the same without the first step's wait (the pipeline filling, 15-20% of a loop of 8 steps here, paid
once by a run of hundreds); delta_fraction is the mean bytes published per step over the full
weights' bytes.

async_ceiling is what asynchrony could reach with the synchronous arm's own phases: its start-up,
then its rollouts (the trainer's waits) and the one step that must follow the last of them, or its
first wait and all its training, whichever is longer (`overlapped`); overlap_efficiency is
async_speedup over it. A ceiling near 1 says the work is unbalanced (one side has little to hide
behind the other), not that the pipeline fails to overlap it. The line before it gives that balance
(sync_rollout_s against sync_train_s: the synchronous trainer's waits against the rest of its loop)
and trainer_speed_ratio, the asynchronous trainer's trained tokens per second of its steps over the
synchronous one's: below 1 where the asynchronous trainer shares its CPUs with what the synchronous
one waits through (the sandboxes), and off 1 by the data too (the arms train other rollouts, whose
lengths and shared prefixes set the tokens per second).

Last line: `name=value` pairs including async_speedup, async_ceiling, trainer_idle_fraction, delta_fraction, and
async_token_speedup: the same ratio over generated tokens per second, since the two arms' rollouts
(sampled from different policy versions) need not be as long as each other.

`--seeds N` repeats the pair with N consecutive run.seed values (other prompts in another order,
other samples; each run keeps the same steps and samples) and pools them: a ratio is total samples
(or tokens) over total wall, an idle fraction total idle over total loop time. One pair's 32 rollouts are
decided by how long a few of them run; the arms alternate within each seed. Each seed's own ratio is
printed too, and their range is `async_speedup_seeds`: any change to drafting or numerics changes
which rollouts a seed samples, so that range, not the pooled ratio's last digits, says what a
difference between two runs means.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from kiln import cluster
from kiln.config import ConfigError, load_config
from kiln.rl.launcher import prepare_tasks, run_rl

GENERATED = ("thinking_tokens", "tool_call_tokens", "final_tokens")  # the policy's tokens (not tool outputs)


def arm(cfg, checkpoint: str, tasks: Path, out: Path) -> dict:
    """One `kiln rl` run -> `measured` of it."""
    out.mkdir(parents=True)
    shutil.copytree(tasks, out / "tasks")
    t = time.monotonic()
    s = run_rl(cfg, checkpoint, str(out), progress=False)
    return measured(s["metrics"], cfg.rl.group_size, time.monotonic() - t)


def measured(rows: list[dict], group_size: int, wall: float) -> dict:
    """A run's metrics rows and wall -> its samples, tokens, wall, the trainer's idle, loop, wait and
    step seconds and trained tokens."""
    samples = sum(len(r["groups"]) for r in rows) * group_size
    tokens = sum(r[f"tokens/{k}"] for r in rows for k in GENERATED)
    last = rows[-1]
    # The last step's own time after its wait: the training nothing can overlap.
    last_s = last["elapsed_s"] - (rows[-2]["elapsed_s"] if len(rows) > 1 else 0.0) - last["wait_s"]
    return {"samples": samples, "wall_s": wall, "tokens": tokens, "idle_s": last["idle_s"],
            "loop_s": max(last["elapsed_s"], 1e-9), "fill_s": rows[0]["wait_s"], "steps": len(rows),
            "rollout_s": sum(r["wait_s"] for r in rows), "last_s": last_s,
            "step_s": sum(r["step_s"] for r in rows), "train_tokens": sum(r["train_tokens"] for r in rows),
            "delta": sum(r["delta_fraction"] for r in rows), "reward": sum(r["reward_mean"] for r in rows),
            "lag": {x for r in rows for x in r["group_lag"]}}


def overlapped(sync: dict) -> float:
    """The wall a perfect overlap of a synchronous run's phases would take: its start-up, then its
    rollouts (the trainer's waits) followed by the one step that must come after them, or the first
    group's wait followed by all its training, whichever is longer. Asynchrony doing the same
    rollouts and steps at the same costs cannot beat this, so sync wall over it is async_speedup's
    ceiling (only nearly: the synchronous waits include each version's travel to the workers)."""
    start, train = sync["wall_s"] - sync["loop_s"], sync["loop_s"] - sync["rollout_s"]
    return start + max(sync["rollout_s"] + sync["last_s"], sync["fill_s"] + train)


def pooled(runs: list[dict]) -> dict:
    """One arm over its runs: rates are totals over total wall, means are over every step."""
    tot = {k: sum(r[k] for r in runs) for k in ("samples", "wall_s", "tokens", "idle_s", "loop_s", "fill_s", "steps",
                                                 "delta", "reward", "rollout_s", "step_s", "train_tokens")}
    return {**tot, "samples_per_s": tot["samples"] / tot["wall_s"], "tokens_per_s": tot["tokens"] / tot["wall_s"],
            "idle_fraction": tot["idle_s"] / tot["loop_s"],
            "idle_after_fill": (tot["idle_s"] - tot["fill_s"]) / max(tot["loop_s"] - tot["fill_s"], 1e-9),
            "delta_fraction": tot["delta"] / tot["steps"], "trained_tokens_per_s": tot["train_tokens"] / max(tot["step_s"], 1e-9),
            "reward_mean": tot["reward"] / tot["steps"], "lag": sorted(set().union(*(r["lag"] for r in runs)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="runs/tiny/sft/checkpoint", help="the SFT model both arms train")
    ap.add_argument("--config", default=None, help="a TOML config or preset (default: the tiny defaults)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4, help="rollouts per group (with --groups 1 and 8 steps: "
                    "the 32 samples the issue measured)")
    ap.add_argument("--groups", type=int, default=1, help="groups a step (the tiny preset trains 4)")
    ap.add_argument("--lag", type=int, default=2, help="the async arm's rl.max_lag")
    ap.add_argument("--workers", type=int, default=None, help="rollout workers (default: one per CPU they may use, "
                    "each with rl.worker_groups enough for a step's groups and one more)")
    ap.add_argument("--placement", choices=["split", "shared"], default="split",
                    help="split: trainer and workers on disjoint halves of the CPUs; shared: all on all")
    ap.add_argument("--sandboxes", choices=["all", "workers"], default="all",
                    help="all: sandboxes on any CPU; workers: on the workers' CPUs only")
    ap.add_argument("--out", default=None, help="keep both runs here (default: a temporary folder)")
    ap.add_argument("--address", default="", help="a Ray cluster to run on (default: $RAY_ADDRESS, else a local Ray)")
    ap.add_argument("--seeds", type=int, default=1, help="pairs of runs to pool, run.seed counting up from the config's")
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides for both arms, after the flags' "
                    "(e.g. engine.dtype=bfloat16)")
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    root = Path(args.out or tempfile.mkdtemp(prefix="kiln-rl-bench-"))
    cpus = sorted(os.sched_getaffinity(0))
    if args.placement == "split" and len(cpus) < 2:
        ap.error("--placement split needs at least 2 CPUs; use --placement shared")
    half = (len(cpus) + 1) // 2
    trainer, workers = (cpus[:half], cpus[half:]) if args.placement == "split" else ([], [])
    n_workers = len(workers or cpus) if args.workers is None else args.workers
    if n_workers < 1:
        ap.error("--workers must be at least 1")
    try:
        base = load_config(args.config, [f"rl.steps={args.steps}", f"rl.group_size={args.group_size}",
                                         f"rl.groups_per_step={args.groups}", f"rl.workers={n_workers}",
                                         f"rl.worker_groups={min(8, -(-args.groups // n_workers) + 1)}",
                                         f"rl.trainer_cpus={trainer}", f"rl.worker_cpus={workers}",
                                         f"sandbox.cpus={cpus if args.sandboxes == 'all' else []}",
                                         f"sandbox.state_dir={root / 'sandboxes'}", f'ray.address="{args.address}"',
                                         *args.overrides])
    except ConfigError as e:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
        ap.error(str(e))
    print(f"placement {args.placement}: trainer on CPUs {trainer or cpus}, {base.rl.workers} worker(s) with "
          f"{base.rl.worker_groups} group(s) in flight each on {workers or cpus}, sandboxes on "
          f"{base.sandbox.cpus or workers or cpus}", flush=True)
    tasks = prepare_tasks(base, root / "shared")
    rl = base.rl
    cluster.connect(base.ray, min_cpus=rl.trainer_resources.get("CPU", 0) + rl.workers * rl.worker_resources.get("CPU", 0))
    runs = {"sync": [], "async": []}
    for seed in range(args.seeds):
        for name, lag in (("sync", 0), ("async", args.lag)):
            cfg = base.model_copy(deep=True)
            cfg.rl.max_lag, cfg.run.seed = lag, base.run.seed + seed
            runs[name].append(arm(cfg, args.checkpoint, tasks, root / f"{name}-{seed}" if args.seeds > 1 else root / name))
            r = pooled(runs[name][-1:])
            print(f"{name} (max_lag {lag}, run.seed {cfg.run.seed}): {r['samples']} rollouts ({r['tokens']} generated tokens) in "
                  f"{r['wall_s']:.1f} s = {r['samples_per_s']:.3f}/s; trainer idle {r['idle_fraction']:.0%}; "
                  f"group lags {r['lag']}; delta {r['delta_fraction']:.1%} of the weights; "
                  f"mean reward {r['reward_mean']:+.3f}", flush=True)
    res = {name: pooled(rs) for name, rs in runs.items()}
    speedup = res["async"]["samples_per_s"] / res["sync"]["samples_per_s"]
    by_seed = [s["wall_s"] / a["wall_s"] for s, a in zip(runs["sync"], runs["async"])]  # a seed's arms: the same samples
    print(f"async_speedup by seed: {' '.join(f'{x:.2f}' for x in by_seed)}", flush=True)
    # The arms' rollouts differ (the async arm samples from older versions), and so do their lengths:
    # a few long failing rollouts among 32 move samples/s; generated tokens/s does not count length.
    token_speedup = res["async"]["tokens_per_s"] / res["sync"]["tokens_per_s"]
    ceiling = res["sync"]["wall_s"] / sum(overlapped(r) for r in runs["sync"])
    sync = res["sync"]
    rest = sync["loop_s"] - sync["rollout_s"]  # overlapped()'s training: the loop's time not waiting
    trainer_speed = res["async"]["trained_tokens_per_s"] / max(sync["trained_tokens_per_s"], 1e-9)
    print(f"balance: synchronously {sync['rollout_s']:.1f} s of rollouts (the trainer's waits) against {rest:.1f} s "
          f"of training and publishing ({rest / sync['rollout_s']:.2f} s a second of rollouts); the trainer's steps "
          f"{sync['trained_tokens_per_s']:.0f} trained tokens/s synchronously, "
          f"{res['async']['trained_tokens_per_s']:.0f} asynchronously ({trainer_speed:.0%})", flush=True)
    print(f"the synchronous arm's phases perfectly overlapped: async_speedup at most {ceiling:.3f} "
          f"(measured {speedup:.3f}, {speedup / ceiling:.0%} of it)", flush=True)
    print(f"async_speedup={speedup:.3f} async_speedup_seeds={min(by_seed):.2f}-{max(by_seed):.2f} "
          f"async_token_speedup={token_speedup:.3f} "
          f"sync_tokens={res['sync']['tokens']} async_tokens={res['async']['tokens']} "
          f"async_ceiling={ceiling:.3f} overlap_efficiency={speedup / ceiling:.3f} "
          f"sync_rollout_s={sync['rollout_s']:.1f} sync_train_s={rest:.1f} trainer_speed_ratio={trainer_speed:.3f} "
          f"trainer_idle_fraction={res['async']['idle_fraction']:.3f} "
          f"sync_trainer_idle_fraction={res['sync']['idle_fraction']:.3f} "
          f"trainer_idle_after_fill={res['async']['idle_after_fill']:.3f} "
          f"delta_fraction={res['async']['delta_fraction']:.4f} samples={res['async']['samples'] // args.seeds} "
          f"sync_samples_per_s={res['sync']['samples_per_s']:.4f} async_samples_per_s={res['async']['samples_per_s']:.4f} "
          f"placement={args.placement} sandbox_cpus={','.join(map(str, base.sandbox.cpus or workers or cpus))} "
          f"workers={base.rl.workers} cpus={len(cpus)} "
          f"seeds={args.seeds}")
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
