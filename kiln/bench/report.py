"""The benchmark report: report.md (overall, by category, by difficulty, every axis) and PNG plots.

Plots use matplotlib's object API on the Agg canvas (no pyplot global state: safe in threads
and on machines with no display). The plot functions take plain data so kiln/report/ can reuse them.
"""
from __future__ import annotations

import os
import statistics

from .metrics import by_task, score

PLOTS = {"accuracy_by_category": "Accuracy by category", "best_of_k": "Mean and best-of-K against K",
         "tokens_vs_accuracy": "Tokens against accuracy (per task)"}


def _figure(width: float = 6.0, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def plot_accuracy_by_group(groups: dict[str, dict], path: str, title: str = "Accuracy by category") -> str:
    """Bars: mean accuracy per group, best-of-K (largest K run) beside it."""
    fig, ax = _figure()
    names = list(groups) or ["(none)"]
    means = [groups[g]["correctness_mean"] for g in groups] or [0.0]
    best = [max(groups[g]["best_of_k"].items(), key=lambda kv: int(kv[0]))[1] if groups[g]["best_of_k"] else 0.0
            for g in groups] or [0.0]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], means, width=0.4, label="mean over passes")
    ax.bar([x + 0.2 for x in xs], best, width=0.4, label="best-of-K", alpha=0.6)
    ax.set_xticks(list(xs), names, rotation=30 if len(names) > 4 else 0)
    ax.set_ylim(0, 1.25)  # headroom for the legend above the bars
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.legend(loc="upper center", ncol=2)
    return _save(fig, path)


def plot_best_of_k(mean_at_k: dict[str, float], best_of_k: dict[str, float], path: str) -> str:
    fig, ax = _figure()
    for label, series, marker in (("mean (first K passes)", mean_at_k, "o"), ("best-of-K (pass@K)", best_of_k, "s")):
        ks = sorted(int(k) for k in series)
        ax.plot(ks, [series[str(k)] for k in ks], marker=marker, label=label)
    ax.set_xlabel("K (passes)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.25)
    ax.set_title("Mean and best-of-K against K")
    ax.legend(loc="upper center", ncol=2)
    ax.xaxis.get_major_locator().set_params(integer=True)
    return _save(fig, path)


def plot_tokens_vs_accuracy(points: list[tuple[float, float]], path: str) -> str:
    """One point per task: mean generated tokens against the task's mean accuracy."""
    fig, ax = _figure()
    if points:
        ax.scatter([p[0] for p in points], [p[1] for p in points], alpha=0.7)
        if max(p[0] for p in points) > 50 * max(1.0, min(p[0] for p in points)):
            ax.set_xscale("symlog")  # token counts span orders of magnitude across tasks
    ax.set_xlabel("generated tokens per rollout (task mean)")
    ax.set_ylabel("accuracy (task mean over passes)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Tokens against accuracy")
    return _save(fig, path)


def task_points(rows: list[dict]) -> list[tuple[float, float]]:
    pts = []
    for rs in by_task(rows).values():
        tokens = statistics.fmean(float((r.get("efficiency") or {}).get("generated_tokens", 0)) for r in rs)
        pts.append((tokens, statistics.fmean(score(r) for r in rs)))
    return pts


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return out + [""]


def _group_table(groups: dict[str, dict], name: str, passes: int) -> list[str]:
    ks = [str(k) for k in range(1, passes + 1)]
    rows = [[g, d["n_tasks"], d["rollouts"], d["correctness_mean"], *[d["best_of_k"].get(k, "") for k in ks]]
            for g, d in groups.items()]
    return _table([name, "tasks", "rollouts", "mean", *[f"best-of-{k}" for k in ks]], rows)


def render_markdown(summary: dict, plots: dict[str, str]) -> str:
    s = summary
    lines = [f"# Benchmark: {os.path.basename(s.get('suite', '')) or 'suite'} with {s.get('policy', '?')}", ""]
    status = (f"{s['tasks_scored']} of {s['n_tasks']} tasks scored, {s['n_rollouts']} of {s['n_expected']} rollouts "
              f"({s['passes']} passes){'' if s['complete'] else ' - INCOMPLETE'}; "
              f"{s.get('errors', 0)} rollout errors this run; {s.get('skipped', 0)} rollouts resumed from disk.")
    lines += [status, ""]
    lines += ["## Overall", ""]
    overall = [["accuracy (mean over passes)", s["correctness_mean"]]]
    overall += [[f"best-of-{k}", v] for k, v in s["best_of_k"].items()]
    overall += [[f"accuracy of pass {p}", v] for p, v in s["pass_means"].items()]
    if s.get("tool_call_parse_rate") is not None:
        overall += [["tool calls that parse", s["tool_call_parse_rate"]]]
    overall += [["rollout seconds (mean)", s["rollout_s_mean"]]]
    lines += _table(["metric", "value"], overall)
    lines += ["## By category", ""] + _group_table(s["by_category"], "category", s["passes"])
    lines += ["## By difficulty", ""] + _group_table(s["by_difficulty"], "difficulty", s["passes"])
    lines += ["## Axes", "", "Each axis is reported as is, never folded into one score.", ""]
    for axis, metrics in s["axes"].items():
        med = s["efficiency_median"] if axis == "efficiency" else None
        header = ["metric", "mean", "median"] if med else ["metric", "mean"]
        rows = [[k, v, med.get(k, "")] if med else [k, v] for k, v in metrics.items()]
        lines += [f"### {axis.capitalize()}", ""] + _table(header, rows)
    lines += ["## Stop reasons", ""] + _table(["reason", "rollouts"], [[k or "(none)", v] for k, v in s["stop_reasons"].items()])
    if s.get("after_first_error"):
        lines += ["## After the first failed tool call", "",
                  "What the next turn did: none failed, the same call again, something else, or nothing.", ""]
        lines += _table(["then", "rollouts", "solved"], [[k, v["rollouts"], v["correctness_mean"]]
                                                         for k, v in s["after_first_error"].items()])
    lines += ["## Plots", ""] + [f"![{PLOTS[name]}]({rel})" for name, rel in plots.items()] + [""]
    return "\n".join(lines)


def write_report(out_dir: str, summary: dict, rows: list[dict]) -> str:
    """report.md plus plots/*.png under out_dir; returns the report's path."""
    plot_dir = os.path.join(out_dir, "plots")
    os.makedirs(plot_dir, exist_ok=True)
    made = {
        "accuracy_by_category": plot_accuracy_by_group(summary["by_category"], os.path.join(plot_dir, "accuracy_by_category.png")),
        "best_of_k": plot_best_of_k(summary["mean_at_k"], summary["best_of_k"], os.path.join(plot_dir, "best_of_k.png")),
        "tokens_vs_accuracy": plot_tokens_vs_accuracy(task_points(rows), os.path.join(plot_dir, "tokens_vs_accuracy.png")),
    }
    plots = {name: os.path.relpath(p, out_dir) for name, p in made.items()}
    path = os.path.join(out_dir, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_markdown(summary, plots))
    return path
