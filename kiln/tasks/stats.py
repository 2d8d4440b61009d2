"""Suite statistics (prompt length, gold-change size, files changed, categories, projects, levels)
beside the published reference figures, to check how CursorBench-like a suite is (terse prompts,
large changes), and `plot_stats`: their distributions by category as PNGs, with the references'
medians drawn in."""
from __future__ import annotations

import statistics
import os
import re
from collections import Counter

from .patch import gold_stats
from .record import load_suite

# Published medians (Composer 2 report; SWE-bench figures as quoted there): (prompt chars, gold lines).
REFERENCE = {
    "CursorBench (ref)": ("390", "181"),
    "SWE-bench Verified/Multilingual (ref)": ("1,185-3,055", "7-10"),
}
# The same as numbers to draw: name -> (prompt chars, gold lines), a range as (low, high).
REFERENCE_LINES = {"CursorBench": {"prompt_chars": (390,), "gold_lines": (181,)},
                   "SWE-bench": {"prompt_chars": (1185, 3055), "gold_lines": (7, 10)}}


def project_of(t) -> str:
    src = str(t.provenance.get("source", ""))
    return src.split(":", 1)[1] if src.startswith("builtin:") else (src.rstrip("/").rsplit("/", 1)[-1] or "-")


def task_rows(tasks) -> list[dict]:
    """One row per task: category, project, prompt characters, gold lines and files (None: no gold)."""
    rows = []
    for t in tasks:
        g = gold_stats(t.solution) if t.solution else None
        rows.append({"id": t.id, "category": t.category, "project": project_of(t), "prompt_chars": len(t.prompt),
                     "gold_lines": g["lines_added"] + g["lines_removed"] if g else None,
                     "gold_files": len(g["files"]) if g else None,
                     "names_path": bool(_PATH.search(t.prompt))})
    return rows


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


_PATH = re.compile(r"\b[\w./-]+\.py\b")


def suite_stats(path: str) -> dict:
    """Medians and counts over every task under `path` (gold lines = added + removed in solution.patch;
    tasks without a gold patch are left out of that median)."""
    tasks = load_suite(path)
    rows = task_rows(tasks)
    gold = [r["gold_lines"] for r in rows if r["gold_lines"] is not None]
    return {
        "n_tasks": len(tasks),
        "median_prompt_chars": _median([r["prompt_chars"] for r in rows]),
        "median_gold_lines": _median(gold),
        "median_gold_files": _median([r["gold_files"] for r in rows if r["gold_files"] is not None]),
        "prompts_naming_no_file": sum(not r["names_path"] for r in rows) / len(rows) if rows else None,
        "categories": dict(sorted(Counter(t.category for t in tasks).items())),
        "projects": dict(sorted(Counter(r["project"] for r in rows).items())),
        "levels": dict(sorted(Counter(t.difficulty for t in tasks).items())),
    }


def _num(x) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def format_stats(stats_by_suite: dict[str, dict]) -> str:
    """A plain-text table: one row per suite, then the reference rows."""
    head = ("suite", "tasks", "median prompt chars", "median gold lines", "median files", "projects",
            "categories", "levels")
    rows = [head]
    for name, s in stats_by_suite.items():
        cats = ", ".join(f"{k} {v}" for k, v in s.get("categories", {}).items()) or "-"
        levels = " ".join(f"L{k}:{v}" for k, v in s.get("levels", {}).items()) or "-"
        rows.append((name, str(s.get("n_tasks", 0)), _num(s.get("median_prompt_chars")),
                     _num(s.get("median_gold_lines")), _num(s.get("median_gold_files")),
                     str(len(s.get("projects", {}))), cats, levels))
    for name, (prompt, lines) in REFERENCE.items():
        rows.append((name, "-", prompt, lines, "-", "-", "-", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    right = {1, 2, 3, 4, 5}  # numbers align right

    def fmt(r):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(rows[0]), sep, *map(fmt, rows[1:len(stats_by_suite) + 1]), sep,
                      *map(fmt, rows[len(stats_by_suite) + 1:])])



def format_details(path: str) -> str:
    """Per-category medians and counts, per-project counts, and the share of prompts naming no file."""
    rows = task_rows(load_suite(path))
    out = [f"{'category':10} {'tasks':>5} {'prompt chars':>12} {'gold lines':>10} {'files':>5} {'no file named':>13}"]
    for cat in sorted({r["category"] for r in rows}):
        rs = [r for r in rows if r["category"] == cat]
        gl = [r["gold_lines"] for r in rs if r["gold_lines"] is not None]
        gf = [r["gold_files"] for r in rs if r["gold_files"] is not None]
        out.append(f"{cat:10} {len(rs):5} {_num(_median([r['prompt_chars'] for r in rs])):>12} "
                   f"{_num(_median(gl)):>10} {_num(_median(gf)):>5} "
                   f"{sum(not r['names_path'] for r in rs) / len(rs):>12.0%}")
    by_project = Counter(r["project"] for r in rows)
    out.append("projects: " + ", ".join(f"{k} {v}" for k, v in sorted(by_project.items())))
    return "\n".join(out)


def plot_stats(path: str, out_dir: str) -> list[str]:
    """prompt_chars.png, gold_lines.png, gold_files.png in `out_dir`: each a distribution by category
    (log-spaced histograms for the first two), with the CursorBench and SWE-bench medians drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    rows = task_rows(load_suite(path))
    cats = sorted({r["category"] for r in rows})
    os.makedirs(out_dir, exist_ok=True)
    written = []
    styles = {"CursorBench": ("tab:red", "--"), "SWE-bench": ("tab:gray", ":")}
    for key, title, log in (("prompt_chars", "prompt length (characters)", True),
                            ("gold_lines", "gold lines changed (added + removed)", True),
                            ("gold_files", "gold files changed", False)):
        vals = {c: [r[key] for r in rows if r["category"] == c and r[key] is not None] for c in cats}
        allv = [v for vs in vals.values() for v in vs]
        if not allv:
            continue
        fig, ax = plt.subplots(figsize=(8, 4.5))
        if log:
            lo, hi = max(1, min(allv)), max(allv + [3055 if key == "prompt_chars" else 181])
            bins = np.logspace(np.log10(lo), np.log10(hi * 1.05), 30)
            ax.set_xscale("log")
        else:
            bins = np.arange(0.5, max(allv) + 1.5, 1)
        ax.hist([vals[c] for c in cats], bins=bins, stacked=True, label=[f"{c} ({len(vals[c])})" for c in cats])
        med = statistics.median(allv)
        ax.axvline(med, color="black", lw=2, label=f"this suite: median {_num(med)}")
        for name, ref in REFERENCE_LINES.items():
            if key in ref:
                color, ls = styles[name]
                for i, x in enumerate(ref[key]):
                    label = f"{name}: median {'-'.join(f'{v:,}' for v in ref[key])}" if i == 0 else None
                    ax.axvline(x, color=color, ls=ls, lw=1.5, label=label)
        ax.set_xlabel(title)
        ax.set_ylabel("tasks")
        ax.set_title(f"{os.path.basename(os.path.abspath(path))}: {title}, by category")
        ax.legend(fontsize=8, loc="upper right")
        fig.tight_layout()
        dest = os.path.join(out_dir, f"{key}.png")
        fig.savefig(dest, dpi=100)
        plt.close(fig)
        written.append(dest)
    return written
