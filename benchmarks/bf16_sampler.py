"""The bf16 sampler in RL, one run: the weight delta a step publishes and the train/inference
mismatch, fp32 and bf16 samplers side by side on the same steps.

The trainer (kiln/rl/trainer.py, RL's default lr and Adam) keeps an fp32 master. Each step, both
samplers get the master's new version through their own weight store, as a rollout worker does
(WeightSubscriber -> Engine.update_weights): the fp32 sampler the master itself, the bf16 sampler
(engine.dtype = "bfloat16") the master rounded to bf16, and the bf16 engine's weights are checked
bit for bit against what its store rebuilt. Then both roll out the same groups (same prompts and
sampling seeds, each its own tokens, so each KL estimate is over its own samples); the master
scores both, as the trainer does (router replay of each sampler's routes), and the mismatch
metrics are the trainer's own (`mismatch`: k1 and k3 estimates of KL(sampler || trainer)). The
step then trains on the bf16 sampler's groups. Mismatch is measured at versions 1..steps (a last
round of rollouts follows the last step): at version 0 a master loaded from a bf16 checkpoint
(bases/tiny is one) is its own bf16 rounding, so both samplers are the same model there.

Rollouts are single turns of `--tokens` tokens continuing the first lines of a function from
kiln's own source (held out of the base's corpus); reward: the continuation, up to its last whole
line, is valid Python so far (`codeop`). The model defaults to the committed base, bases/tiny.

    .venv/bin/python benchmarks/bf16_sampler.py [--checkpoint bases/tiny] [--steps 5]

Last line: `name=value` pairs including delta_fraction (the bf16 sampler's mean published delta
over full bf16 bytes), delta_fraction_fp32, mismatch_kl_bf16 and mismatch_kl_fp32 (k3, the mean
over steps), bit_exact.
"""
from __future__ import annotations

import argparse
import codeop
import re
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from kiln.config import PROJECT_DIR, Config, project_path
from kiln.engine import Engine, SamplingParams
from kiln.harness.trajectory import Segment, Trajectory, TurnRecord
from kiln.model.checkpoint import load_checkpoint
from kiln.model.tokenizer import load_tokenizer
from kiln.rl.batch import collate, sequences
from kiln.rl.store import WeightStore, WeightSubscriber
from kiln.rl.trainer import Group, RLTrainer, mismatch, sampler_weights, target_logp

DTYPES = ("float32", "bfloat16")


def prompts(tok, n: int, lines: int = 8) -> list[list[int]]:
    """The first `lines` lines of n top-level functions of kiln's source, one per file."""
    out = []
    for f in sorted((PROJECT_DIR / "kiln").rglob("*.py")):
        m = re.search(rf"^def .*(?:\n.*){{{lines - 1}}}", f.read_text(), re.MULTILINE)
        if m:
            out.append(tok.encode(m.group(0) + "\n"))
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} prompts found")


def valid_so_far(text: str) -> float:
    """1 when the text up to its last newline is Python that is valid or merely unfinished."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in generated strings
        try:
            codeop.compile_command(text[:text.rfind("\n") + 1], symbol="exec")
        except (SyntaxError, ValueError, OverflowError):
            return 0.0
    return 1.0


def rollouts(engine, tok, group_prompts, group_size, step, params) -> list[Group]:
    reqs = [(g, p, SamplingParams(temperature=params.temperature, max_tokens=params.max_tokens,
                                  seed=1000 * step + 10 * g + i))
            for g, p in enumerate(group_prompts) for i in range(group_size)]
    done = engine.generate([p for _, p, _ in reqs], [sp for _, _, sp in reqs])
    groups = []
    for g, p in enumerate(group_prompts):
        cs = [c for (gg, _, _), c in zip(reqs, done) if gg == g]
        trajs = [Trajectory(task_id=f"s{step}g{g}", segments=[Segment(turns=[TurnRecord(
            text=c.text, prompt_ids=c.prompt_ids, completion_ids=c.token_ids, logprobs=c.logprobs,
            versions=c.versions, routes=c.routes)])]) for c in cs]
        rewards = [{"correctness": valid_so_far(tok.decode(p + c.token_ids))} for c in cs]
        groups.append(Group(g, f"s{step}g{g}", "code", trajs, rewards, started_version=step))
    return groups


def measure(model, groups, temperature: float, replay_ratio: float) -> dict:
    """The trainer's mismatch metrics over every row of the groups, under the master."""
    seqs = [s for i, t in enumerate(t for g in groups for t in g.trajectories) for s in sequences(t, i)]
    batch = collate(seqs)
    with torch.no_grad():
        lp, _ = target_logp(model, batch, slice(0, len(seqs)), temperature, True, replay_ratio)
    return mismatch(lp, batch, torch.ones(len(seqs), dtype=torch.bool))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="bases/tiny")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--groups", type=int, default=2, help="groups per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128, help="generated tokens per rollout (at most)")
    args = ap.parse_args()
    torch.manual_seed(0)
    rl = Config().rl
    ckpt = project_path(args.checkpoint)
    tok = load_tokenizer(ckpt)
    master, _ = load_checkpoint(ckpt, with_mtp=False)
    trainer = RLTrainer(master, rl, version=0)
    root = Path(tempfile.mkdtemp(prefix="kiln-bf16-"))
    stores = {d: WeightStore(str(root / d), anchor_every=rl.anchor_every) for d in DTYPES}
    subs = {d: WeightSubscriber(stores[d], "sampler") for d in DTYPES}
    for d in DTYPES:
        stores[d].publish(0, sampler_weights(master, d))
    engines = {}
    for d in DTYPES:
        model, _ = load_checkpoint(ckpt, with_mtp=False)
        model.load_state_dict(subs[d].poll()[1])
        engines[d] = Engine(model, tok, max_batch=args.group_size * args.groups, max_len=1024,
                            weight_dtype=getattr(torch, d))
    all_prompts = prompts(tok, (args.steps + 1) * args.groups)
    params = SamplingParams(temperature=rl.temperature, max_tokens=args.tokens)
    rows, bit_exact = [], True
    print(f"{ckpt}: {args.steps} steps of {args.groups} x {args.group_size} rollouts, lr {rl.lr}, "
          f"temperature {rl.temperature}", flush=True)
    for step in range(args.steps + 1):
        t = time.monotonic()
        group_prompts = all_prompts[step * args.groups:(step + 1) * args.groups]
        arms = {d: rollouts(engines[d], tok, group_prompts, args.group_size, step, params) for d in DTYPES}
        mis = {d: measure(master, arms[d], rl.temperature, rl.replay_ratio) for d in DTYPES}
        toks = {d: [t.segments[0].turns[0].completion_ids for g in arms[d] for t in g.trajectories] for d in DTYPES}
        row = {"version": step, "rollouts_identical": sum(a == b for a, b in zip(*toks.values())) / len(toks["float32"])}
        for d in DTYPES:
            row[f"mismatch_k1_{d}"] = mis[d]["mismatch_kl_k1"]
            row[f"mismatch_k3_{d}"] = mis[d]["mismatch_kl_k3"]
            row[f"mismatch_max_abs_{d}"] = mis[d]["mismatch_max_abs"]
        rows.append(row)
        if step == args.steps:  # the last version's rollouts: measured, not trained
            print(_line(row), flush=True)
            break
        m = trainer.step(arms["bfloat16"])
        row.update(trained_rows=m["trained_rows"], solved_bf16=m["solved_mean"])
        for d in DTYPES:
            pub = stores[d].publish(trainer.version, sampler_weights(master, d))
            version, state = subs[d].poll()
            engines[d].update_weights(state, version)
            engines[d].generate([[tok.eos_id]], SamplingParams(max_tokens=1))  # applied between steps
            row[f"delta_fraction_{d}"] = pub["delta_fraction"]
            row[f"delta_bytes_{d}"] = pub["bytes_written"]
        held, stored = engines["bfloat16"].sampler_weights(), stores["bfloat16"].load(version)
        exact = held.keys() == stored.keys() and all(
            v.dtype == torch.bfloat16 and torch.equal(held[k].view(torch.int16), v.view(torch.int16))
            for k, v in stored.items())
        bit_exact &= exact
        row["bit_exact"] = exact
        changed = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in
                      zip(stored.values(), stores["bfloat16"].load(version - 1).values()))
        row["bf16_values_changed"] = changed / sum(v.numel() for v in stored.values())
        row["step_s"] = time.monotonic() - t
        print(_line(row), flush=True)
    trained, later = rows[:-1], rows[1:]  # deltas of the steps; mismatch at versions 1..steps
    mean = {k: statistics.mean(r[k] for r in trained) for k in trained[0] if k.startswith(("delta", "bf16"))}
    mean.update({k: statistics.mean(r[k] for r in later) for k in later[0] if k.startswith(("mismatch", "rollouts"))})
    out = {"delta_fraction": mean["delta_fraction_bfloat16"], "mismatch_kl_bf16": mean["mismatch_k3_bfloat16"],
           "mismatch_kl_fp32": mean["mismatch_k3_float32"], "bit_exact": bit_exact,
           "delta_fraction_fp32": mean["delta_fraction_float32"],
           "bf16_values_changed": mean["bf16_values_changed"],
           "mismatch_k1_bf16": mean["mismatch_k1_bfloat16"], "mismatch_k1_fp32": mean["mismatch_k1_float32"],
           "mismatch_max_abs_bf16": max(r["mismatch_max_abs_bfloat16"] for r in later),
           "mismatch_max_abs_fp32": max(r["mismatch_max_abs_float32"] for r in later),
           "rollouts_identical": mean["rollouts_identical"], "steps": args.steps,
           "rollouts_per_step": args.groups * args.group_size, "checkpoint": args.checkpoint}
    print(_line(out))


def _line(row: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


if __name__ == "__main__":
    main()
