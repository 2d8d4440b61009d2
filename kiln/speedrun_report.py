"""The speedrun's report card: <run dir>/report.md with its plots, from what each stage wrote."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _table(head: list[str], rows: list[list]) -> list[str]:
    def cell(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows] + [""]


def _rows(metrics: str | Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    return list({r["step"]: r for r in rows if r["kind"] == kind}.values())  # a resumed step counts once


def plot_training(pre_metrics: Path, sft_metrics: Path, path: Path) -> Path:
    """training_loss.png: pretraining loss against tokens (log x, phases marked), SFT loss against step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_pre, ax_sft = fig.subplots(1, 2)
    pre = _rows(pre_metrics, "train")
    for phase in dict.fromkeys(r["phase"] for r in pre):
        rows = [r for r in pre if r["phase"] == phase]
        ax_pre.plot([r["tokens_seen"] for r in rows], [r["loss"] for r in rows], label=phase)
    ax_pre.set(xscale="log", xlabel="training tokens seen", ylabel="loss (nats / token)", title="pretraining")
    sft = _rows(sft_metrics, "train")
    ax_sft.plot([r["step"] for r in sft], [r["loss"] for r in sft], color="tab:green")
    ax_sft.set(xlabel="step", ylabel="loss on assistant tokens", title="SFT on oracle trajectories")
    for ax in (ax_pre, ax_sft):
        ax.grid(True, alpha=0.3)
    ax_pre.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_copy(evals: list[dict], path: Path) -> Path | None:
    """copy_probe.png: the probe's second-copy loss against pretraining tokens (base included)."""
    rows = [r for r in evals if r.get("copy")]
    if not rows:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    tokens = [r["tokens_seen"] for r in rows]
    for kind, style in (("random", "o-"), ("code", "s-")):
        ax.plot(tokens, [r["copy"][kind]["second"] for r in rows], style, label=f"{kind} spans, second copy")
        ax.plot(tokens, [r["copy"][kind]["first"] for r in rows], style, alpha=0.3, label=f"{kind} spans, first copy")
    ax.axhline(rows[-1]["copy"]["chance"], color="grey", linestyle=":", label="chance (random spans)")
    ax.set(xscale="log", xlabel="pretraining tokens seen", ylabel="loss (nats / token)",
           title="copy probe: a span, then the same span again")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def paired(a_dir: Path, b_dir: Path) -> dict | None:
    """Per-task mean solved of bench b minus bench a over the tasks both ran: mean difference, its
    standard error over tasks and z = mean / se (the same tasks, so the comparison is paired)."""
    from kiln.bench.metrics import by_task, score, task_se
    from kiln.bench.results import read_rows

    a, b = (by_task(read_rows(str(d / "results.jsonl"))) for d in (a_dir, b_dir))
    diffs = [sum(map(score, b[t])) / len(b[t]) - sum(map(score, a[t])) / len(a[t]) for t in sorted(set(a) & set(b))]
    if len(diffs) < 2:
        return None
    mean, se = sum(diffs) / len(diffs), task_se(diffs)
    return {"tasks": len(diffs), "diff": mean, "se": se, "z": mean / se if se else math.inf * (mean > 0)}


def write_report(run_dir: Path, cfg, corpus: dict, pre: dict, n_trajs: int, tuned: dict, benches: dict,
                 times: dict[str, float], rl: dict | None = None, probes: dict | None = None,
                 edits: dict | None = None) -> Path:
    from kiln.bench.metrics import AFTER_ERROR
    from kiln.pretrain.corpus import describe_corpus
    from kiln.rl.report import plot_rl, rl_lines

    run_dir = Path(run_dir)
    plot = plot_training(Path(pre["metrics"]), Path(tuned["metrics"]), run_dir / "training_loss.png")

    def rel(p) -> str:  # links that survive moving the run dir
        return os.path.relpath(p, run_dir)

    lines = [f"# kiln speedrun: {cfg.run.name}", "",
             (f"Every stage on one config (`{cfg.run.name}`): {sum(times.values()) / 60:.1f} minutes of stage time on "
              "this machine, summed over the invocations that built this run directory (a stage a previous "
              "invocation finished is reused, and adds only its check)."), ""]
    lines += ["## Stages", ""] + _table(["stage", "seconds"], [[k, round(v, 1)] for k, v in times.items()] +
                                        [["total", round(sum(times.values()), 1)]])
    lines += ["## Corpus", "", "```", describe_corpus(corpus), "```", ""]

    evals = pre.get("evals") or _rows(pre["metrics"], "eval")
    base = (f" It continues the base `{cfg.pretrain.init}`, pretrained on {pre['base_tokens']:,} tokens "
            "(configs/base.toml); the table and the fit cover the base's evaluations and this run's, with this "
            "run's tokens counted on top of the base's.") if pre.get("base_tokens") else ""
    lines += ["## Pretraining", "",
              (f"{pre['steps']} steps, {pre['tokens_seen']:,} tokens, {pre['tokens_per_s']} tokens/s; phases "
               f"{', '.join(pre['phases'])}; MTP trained: {pre['mtp']}.{base}"), "",
              "Held-out codebase (never trained on), files concatenated in alphabetical order, rolling window:", ""]
    lines += _table(["tokens seen", "phase", "nats / token", "bits / byte"],
                    [[r["tokens_seen"], r.get("phase", ""), r["nll_per_token"], r["bits_per_byte"]] for r in evals])
    fit = pre.get("fit")
    if fit:
        lines += [(f"Fit of held-out loss against ln(tokens): slope {fit['slope']:.4f} nats per e-fold of tokens, "
                   f"R² {fit['r2']:.3f} over {len(evals)} evaluations."), ""]
    if pre.get("plot"):
        lines += [f"![held-out loss]({rel(pre['plot'])})", ""]
    lines += _copy_lines(probes, plot_copy(evals, run_dir / "copy_probe.png"), rel)

    lines += ["## SFT", "",
              (f"{n_trajs} oracle trajectories (toy train split, level {cfg.sft.oracle_level or '1-3'}); "
               f"{tuned['steps']} steps; final loss on assistant tokens {tuned['final_loss']:.4f}."), "",
              f"![training loss]({rel(plot)})", ""]

    if rl is not None:
        lines += ["## RL", "", (f"`kiln rl`: groups of {cfg.rl.group_size} rollouts per toy prompt (train split, "
                                f"level {cfg.rl.level or '1-3'}), {cfg.rl.groups_per_step} groups a step, "
                                f"{cfg.rl.workers} rollout workers, max lag {cfg.rl.max_lag}."), ""]
        lines += rl_lines(rl["metrics"], rel(plot_rl(rl["metrics"], run_dir / "rl.png")) if rl["metrics"] else "",
                          cfg.rl.group_size)

    lines += ["## Evaluation on held-out toy tasks", "",
              (f"{cfg.speedrun.eval_tasks} task(s) of the eval split (level {cfg.speedrun.eval_level or '1-3'}), "
               f"{cfg.speedrun.passes} pass(es). `local` is the SFT model; `oracle` and `noop` are the controls "
               "(the gold patch through the same tools, and doing nothing); `rl` is the model after RL."), ""]
    rows = []
    for policy, s in benches.items():
        rate, k = s["tool_call_parse_rate"], str(s["passes"])
        best = f"{s['best_of_k'][k]:.3f} ± {s['best_of_k_se'][k]:.3f} (of {k})" if k in s["best_of_k"] else "-"
        summ = s.get("summarised") or {}
        rows.append([policy, f"{s['tasks_scored']} x {s['passes']}", f"{s['correctness_mean']:.3f} ± {s['correctness_se']:.3f}",
                     best, "-" if rate is None else f"{rate:.1%}",
                     f"{summ.get('rollouts', 0)}" + (f" (solved {summ['correctness_mean']:.2f})" if summ.get("rollouts") else ""),
                     ", ".join(f"{k} {v}" for k, v in s["stop_reasons"].items()),
                     f"[report]({rel(run_dir / f'bench-{policy}' / 'report.md')})"])
    lines += _table(["policy", "tasks x passes", "solved (± s.e.)", "best-of-K (± s.e.)", "tool calls that parse",
                     "rollouts that self-summarised", "stop reasons", "details"], rows)
    lines += ["Standard errors are over tasks (a task's passes are not independent).", ""]
    errs = {p: s["after_first_error"] for p, s in benches.items() if p in ("local", "rl") and s.get("after_first_error")}
    if errs:
        lines += [("After a rollout's first failed tool call, what its next turn did (rollouts, and the share "
                   "solved): no call failed, the same call again, another, or none."), ""]
        kinds = [k for k in AFTER_ERROR if any(k in e for e in errs.values())]
        lines += _table(["model", *[{"none": "no call failed"}.get(k, k) for k in kinds]],
                        [[p, *[f"{e[k]['rollouts']} ({e[k]['correctness_mean']:.0%})" if k in e else "-" for k in kinds]]
                         for p, e in errs.items()])
    if "local" in benches:
        sft = benches["local"]
        lines += [f"The SFT model solves {sft['correctness_mean']:.1%} of its {sft['n_rollouts']} rollouts on tasks it "
                  "never saw in training.", ""]
    if edits:
        lines += [("The edit probe (`kiln probe edits`), teacher-forced on the oracle's rollouts of these tasks: the "
                   "share of edits whose every old-text token (finding the place), every new-text token (given the "
                   "right old text) and first changed token (the fix) is the model's top-1."), ""]
        lines += _table(["model", "edits", "old text", "new text", "first change", "all reply tokens"],
                        [[m, r["n"], f"{r['old_text']:.1%}", f"{r['new_text']:.1%}", f"{r['change']:.1%}",
                          f"{r['reply_tokens']:.1%}"] for m, r in edits.items()])
    if "rl" in benches and "local" in benches:
        lines += _verdict(benches["local"], benches["rl"], paired(run_dir / "bench-local", run_dir / "bench-rl"))
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _copy_lines(probes: dict | None, plot: Path | None, rel) -> list[str]:
    lines = ["## Copying from context", "",
             ("The copy probe (`kiln probe copy`): mean loss in nats on the second copy of a 32-token span against "
              "the first, for random full-vocabulary spans (only the context predicts them) and held-out code. "
              "A model that copies scores near 0 on the second copy."), ""]
    if probes:
        chance = next(iter(probes.values()))["chance"]
        lines += [f"Chance on random spans: {chance:.2f} nats.", ""]
        lines += _table(["model", "random: first", "random: second", "code: first", "code: second"],
                        [[m, r["random"]["first"], r["random"]["second"], r["code"]["first"], r["code"]["second"]]
                         for m, r in probes.items()])
    if probes and "pretrained" in probes:
        r = probes["pretrained"]["random"]
        lines += [(f"The pretrained model predicts the second copy of a random span at {r['second']:.2f} nats, the "
                   f"first at {r['first']:.2f}: " + ("it copies from its context." if r["second"] <= 1.0 else
                                                     "it does not copy reliably yet (a copying model is under 1 nat).")), ""]
    if plot:
        lines += [f"![copy probe]({rel(plot)})", ""]
    return lines


def _verdict(sft: dict, rl: dict, pair: dict | None) -> list[str]:
    """What the evaluation shows about RL, in words."""
    k = str(rl["passes"])
    lines = [f"**RL against SFT.** Solved {sft['correctness_mean']:.3f} -> {rl['correctness_mean']:.3f}"
             + (f"; best-of-{k} {sft['best_of_k'].get(k, 0):.3f} -> {rl['best_of_k'].get(k, 0):.3f}" if k in rl["best_of_k"] else "")
             + "."]
    if pair:
        sig = ("more than two standard errors: RL measurably improved the agent" if pair["z"] > 2 else
               "within two standard errors: this run does not show that RL improved the agent" if pair["z"] > -2 else
               "more than two standard errors below: RL made the agent worse")
        lines[0] += (f" Paired over {pair['tasks']} tasks, the difference is {pair['diff']:+.3f} ± {pair['se']:.3f} "
                     f"(z = {pair['z']:.2f}), {sig}.")
    return lines + [""]
