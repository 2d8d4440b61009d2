"""Speculative decoding on real agent turns, one run: the MTP drafter against plain decoding, both
with prefix reuse (Engine(prefix_slots=...)), as RL workers and the bench decode.

An agent's turns are token-in, token-out: each turn's prompt extends the last turn's prompt and
completion with the tool's output. This replays recorded conversations (the `prompt_ids` of each
turn of RL groups or bench rollouts, in order) through a checkpoint's engine, greedy, each turn
generating as many tokens as it did when recorded (capped at --max-tokens, no stop tokens, so both
arms decode the same count). Arms, each run in turn --repeats times from empty prefix caches
(medians):

1. plain decoding with prefix reuse (the baseline);
2. speculative decoding with prefix reuse (its drafter's cache is kept and restored too);
3. speculative decoding without prefix reuse (the only way the drafter ran before: each turn's
   drafter re-reads the whole conversation).

At batch 1 (conversations one after another) and batch --batch (that many conversations decoded
together, turn by turn, as a worker's rollouts share its engine's batches).

    .venv/bin/python benchmarks/agent_turns.py --checkpoint runs/tiny/sft/checkpoint \\
        --groups runs/tiny/rl/groups [--conversations 8] [--turns 4]

The checkpoint needs an MTP module (mtp.safetensors: the tiny preset's SFT checkpoint has one);
--groups is a folder of trajectory JSON files (an RL run's `groups/`, a bench run's folder).

Last line: `name=value` pairs including agent_spec_speedup_b1 and agent_spec_speedup_b8 (arm 1 over
arm 2), agent_spec_noreuse_speedup_b1 (arm 1 over arm 3), spec_mean_accepted, greedy_identical,
reused_fraction (prompt tokens restored from kept prefixes, arm 2).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kiln.config import project_path
from kiln.engine import Engine, SamplingParams
from kiln.engine.speculative import SpecStats
from kiln.harness.trajectory import Trajectory
from kiln.model.checkpoint import load_checkpoint


def conversations(folder: Path, n: int, turns: int, max_len: int) -> list[list[tuple[list[int], int]]]:
    """n recorded conversations of at least `turns` turns: per turn (prompt ids, tokens generated)."""
    out = []
    for path in sorted(folder.rglob("*.json")):
        try:
            traj = Trajectory.load(str(path))
        except (KeyError, TypeError, ValueError):
            continue  # a group's index file, a summary: not a trajectory
        for seg in traj.segments:
            ts = [(t.prompt_ids, len(t.completion_ids)) for t in seg.turns if t.prompt_ids]
            if len(ts) >= turns and len(ts[turns - 1][0]) + 2 * max(c for _, c in ts) < max_len:
                out.append(ts[:turns])
            if len(out) == n:
                return out
    raise SystemExit(f"{folder}: only {len(out)} recorded conversations of {turns} turns or more "
                     f"(need {n}; give --groups an RL run's groups/ folder, or lower --conversations/--turns)")


def replay(engine: Engine, convs, batch: int, cap: int) -> list[list[int]]:
    """Every conversation's turns through `engine`, `batch` conversations at a time; -> tokens."""
    if engine.prefix is not None:
        engine.prefix.clear()
    if engine.mtp is not None:
        engine.spec_stats = SpecStats(engine.mtp.depth)
    out = []
    for c0 in range(0, len(convs), batch):
        group = convs[c0:c0 + batch]
        for t in range(len(group[0])):
            params = [SamplingParams(temperature=0, max_tokens=max(1, min(n, cap)), stop_token_ids=())
                      for _, n in (conv[t] for conv in group)]
            out += [c.token_ids for c in engine.generate([conv[t][0] for conv in group], params)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a checkpoint with an MTP module")
    ap.add_argument("--groups", required=True, help="a folder of recorded trajectories (an RL run's groups/)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4, help="the first N turns of each conversation")
    ap.add_argument("--max-tokens", type=int, default=64, help="cap on the tokens a turn generates")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ckpt = project_path(args.checkpoint)
    model, mtp = load_checkpoint(ckpt)
    if mtp is None:
        raise SystemExit(f"{ckpt} has no MTP module (mtp.safetensors): nothing drafts")
    model.eval()
    max_len = model.config.max_position_embeddings
    convs = conversations(project_path(args.groups), args.conversations, args.turns, max_len)
    prompt_tokens = sum(len(p) for conv in convs for p, _ in conv)
    gen_tokens = sum(max(1, min(n, args.max_tokens)) for conv in convs for _, n in conv)
    print(f"{len(convs)} conversations x {args.turns} turns: {prompt_tokens} prompt tokens, "
          f"{gen_tokens} generated; MTP depth {mtp.depth}", flush=True)
    r = {}
    for b in (1, args.batch):
        slots = 2 * b
        arms = {"plain": Engine(model, max_batch=b, max_len=max_len, prefix_slots=slots),
                "spec": Engine(model, mtp=mtp, max_batch=b, max_len=max_len, prefix_slots=slots),
                "spec_noreuse": Engine(model, mtp=mtp, max_batch=b, max_len=max_len)}
        times = {k: [] for k in arms}
        outs = {}
        for _ in range(args.repeats):
            for k, e in arms.items():
                t0 = time.perf_counter()
                outs[k] = replay(e, convs, b, args.max_tokens)
                times[k].append(time.perf_counter() - t0)
        s = {k: statistics.median(v) for k, v in times.items()}
        spec = arms["spec"]
        r[f"plain_tokens_per_s_b{b}"] = gen_tokens / s["plain"]
        r[f"agent_spec_speedup_b{b}"] = s["plain"] / s["spec"]
        r[f"agent_spec_noreuse_speedup_b{b}"] = s["plain"] / s["spec_noreuse"]
        r[f"greedy_identical_b{b}"] = outs["plain"] == outs["spec"] == outs["spec_noreuse"]
        r[f"spec_mean_accepted_b{b}"] = spec.spec_stats.mean_accepted
        r[f"reused_fraction_b{b}"] = spec.prefix.reused_tokens / prompt_tokens
        print(f"batch {b}: plain {s['plain']:.2f} s, speculative {s['spec']:.2f} s (x{s['plain'] / s['spec']:.2f}), "
              f"speculative without reuse {s['spec_noreuse']:.2f} s (x{s['plain'] / s['spec_noreuse']:.2f}); "
              f"{spec.spec_stats.mean_accepted:.2f} drafts accepted a step; prompt tokens restored "
              f"{spec.prefix.reused_tokens / prompt_tokens:.1%} (plain {arms['plain'].prefix.reused_tokens / prompt_tokens:.1%}); "
              f"greedy identical {r[f'greedy_identical_b{b}']}", flush=True)
    r["greedy_identical"] = all(v for k, v in r.items() if k.startswith("greedy_identical_b"))
    r["spec_mean_accepted"] = r["spec_mean_accepted_b1"]
    r["reused_fraction"] = r["reused_fraction_b1"]
    r.update(mtp_depth=mtp.depth, threads=torch.get_num_threads(), conversations=len(convs), turns=args.turns)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
