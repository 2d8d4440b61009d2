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


def write_report(run_dir: Path, cfg, corpus: dict, pre: dict, n_trajs: int, tuned: dict, benches: dict,
                 times: dict[str, float], rl: dict | None = None) -> Path:
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

    evals = _rows(pre["metrics"], "eval")
    lines += ["## Pretraining", "",
              (f"{pre['steps']} steps, {pre['tokens_seen']:,} tokens, {pre['tokens_per_s']} tokens/s; phases "
               f"{', '.join(pre['phases'])}; MTP trained: {pre['mtp']}."), "",
              "Held-out codebase (never trained on), files concatenated in alphabetical order, rolling window:", ""]
    lines += _table(["tokens seen", "phase", "nats / token", "bits / byte"],
                    [[r["tokens_seen"], r.get("phase", ""), r["nll_per_token"], r["bits_per_byte"]] for r in evals])
    fit = pre.get("fit")
    if fit:
        lines += [(f"Fit of held-out loss against ln(tokens): slope {fit['slope']:.4f} nats per e-fold of tokens, "
                   f"R² {fit['r2']:.3f} over {len(evals)} evaluations."), ""]
    if pre.get("plot"):
        lines += [f"![held-out loss]({rel(pre['plot'])})", ""]

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
        rate = s["tool_call_parse_rate"]
        solved = s["correctness_mean"]
        se = math.sqrt(solved * (1 - solved) / s["n_rollouts"]) if s["n_rollouts"] else 0.0
        rows.append([policy, s["n_rollouts"], f"{solved:.3f} ± {se:.3f}", "-" if rate is None else f"{rate:.1%}",
                     ", ".join(f"{k} {v}" for k, v in s["stop_reasons"].items()),
                     f"[report]({rel(run_dir / f'bench-{policy}' / 'report.md')})"])
    lines += _table(["policy", "rollouts", "solved (± s.e.)", "tool calls that parse", "stop reasons", "details"], rows)
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
