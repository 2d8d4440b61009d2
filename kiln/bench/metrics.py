"""Benchmark metrics from result rows: mean accuracy over passes, best-of-K, axis means, breakdowns.

Accuracy is averaged per task first (over its passes), then over tasks, so an unfinished run
does not weigh tasks by how many of their passes happened to finish. Best-of-K uses the
unbiased pass@k estimator over each task's n passes (Chen et al. 2021): 1 - C(n-c, k) / C(n, k).
Standard errors are over tasks (the passes of one task are not independent samples):
stdev of the per-task values / sqrt(tasks).
"""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from math import comb

from kiln.grading import AXES


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k passes drawn from n (c of them correct) is correct."""
    if k > n:
        raise ValueError(f"k={k} exceeds the {n} passes run")
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def _numbers(d: dict) -> dict[str, float]:
    return {k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, str)}


def mean_axes(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Axis -> metric -> mean over the rows that report it (keys may be absent, e.g. no gold)."""
    out = {}
    for axis in AXES:
        acc: dict[str, list[float]] = defaultdict(list)
        for r in rows:
            for k, v in _numbers(r.get(axis) or {}).items():
                acc[k].append(v)
        out[axis] = {k: statistics.fmean(v) for k, v in sorted(acc.items())}
    return out


def by_task(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        out[r["task_id"]].append(r)
    return dict(out)


def score(row: dict) -> float:
    return float((row.get("correctness") or {}).get("score", 0.0))


def accuracy(rows: list[dict], passes: int) -> dict:
    """Mean accuracy and best-of-K (K = 1..passes) over the tasks in `rows`."""
    tasks = by_task(rows)
    if not tasks:
        return {"n_tasks": 0, "rollouts": 0, "correctness_mean": 0.0, "correctness_se": 0.0, "best_of_k": {},
                "best_of_k_se": {}}
    means = [statistics.fmean(score(r) for r in rs) for rs in tasks.values()]
    best, best_se = {}, {}
    for k in range(1, passes + 1):
        vals = [pass_at_k(len(rs), sum(score(r) >= 1.0 for r in rs), k) for rs in tasks.values() if len(rs) >= k]
        if vals:
            best[str(k)], best_se[str(k)] = statistics.fmean(vals), task_se(vals)
    return {"n_tasks": len(tasks), "rollouts": len(rows), "correctness_mean": statistics.fmean(means),
            "correctness_se": task_se(means), "best_of_k": best, "best_of_k_se": best_se}


def task_se(values: list[float]) -> float:
    """Standard error of the mean of per-task values (0 for fewer than two tasks)."""
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


def mean_at_k(rows: list[dict], passes: int) -> dict[str, float]:
    """Accuracy over the first K passes actually run: how the average settles as passes are added."""
    out = {}
    for k in range(1, passes + 1):
        sub = [r for r in rows if r["pass"] < k]
        if sub:
            out[str(k)] = accuracy(sub, k)["correctness_mean"]
    return out


def breakdown(rows: list[dict], field: str, passes: int) -> dict[str, dict]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[str(r.get(field))].append(r)
    return {g: accuracy(rs, passes) for g, rs in sorted(groups.items())}


def summarize(rows: list[dict], n_tasks: int, passes: int, **extra) -> dict:
    acc = accuracy(rows, passes)
    eff = defaultdict(list)
    for r in rows:
        for k, v in _numbers(r.get("efficiency") or {}).items():
            eff[k].append(v)
    timings = [r.get("timings", {}).get("rollout_s", 0.0) for r in rows]
    parsed = sum(eff.get("tool_calls", []))  # .get: a defaultdict lookup would add an empty series
    attempted = parsed + sum(eff.get("malformed_calls", []))
    return {
        **extra,
        "n_tasks": n_tasks, "passes": passes, "n_rollouts": len(rows), "n_expected": n_tasks * passes,
        "complete": len(rows) >= n_tasks * passes, "tasks_scored": acc["n_tasks"],
        "correctness_mean": acc["correctness_mean"], "correctness_se": acc["correctness_se"],
        "best_of_k": acc["best_of_k"], "best_of_k_se": acc["best_of_k_se"],
        "mean_at_k": mean_at_k(rows, passes),
        "pass_means": {str(p): statistics.fmean(score(r) for r in rows if r["pass"] == p)
                       for p in sorted({r["pass"] for r in rows})},
        "axes": mean_axes(rows),
        "efficiency_median": {k: statistics.median(v) for k, v in sorted(eff.items())},
        # Of every tool-call block written, the share that parsed (None: no call was attempted).
        "tool_call_parse_rate": parsed / attempted if attempted else None,
        "by_category": breakdown(rows, "category", passes),
        "by_difficulty": breakdown(rows, "difficulty", passes),
        "stop_reasons": dict(Counter(r.get("stop_reason", "") for r in rows).most_common()),
        "rollout_s_mean": statistics.fmean(timings) if timings else 0.0,
        "summarised": summarised(rows),
        "after_first_error": after_first_error(rows),
    }


AFTER_ERROR = ("none", "repeated", "changed", "stopped")  # first_error_then's answers, in report order


def first_error_then(tools: list) -> str:
    """What a rollout did after its first failed tool call (harness ToolRecords): "none" failed,
    "repeated" (the next turn made that call again), "changed" (it did something else) or
    "stopped" (no call after it). On the tiny model the outcome turns on this (docs: "Copying")."""
    failed = next((t for t in tools if not t.ok), None)
    if failed is None:
        return "none"
    after = [t for t in tools if t.turn > failed.turn]
    if not after:
        return "stopped"
    nxt = [(t.name, t.arguments) for t in after if t.turn == after[0].turn]
    return "repeated" if (failed.name, failed.arguments) in nxt else "changed"


def after_first_error(rows: list[dict]) -> dict[str, dict]:
    """{first_error_then: {"rollouts", "correctness_mean"}} over the rows that record it."""
    by: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r.get("after_error"):
            by[r["after_error"]].append(score(r))
    return {k: {"rollouts": len(by[k]), "correctness_mean": statistics.fmean(by[k])} for k in AFTER_ERROR if by[k]}


def summarised(rows: list[dict]) -> dict:
    """Rollouts that self-summarised at least once: how many, and their mean correctness."""
    hit = [r for r in rows if (r.get("efficiency") or {}).get("summaries", 0) > 0]
    return {"rollouts": len(hit), "summaries": sum(r["efficiency"]["summaries"] for r in hit),
            "correctness_mean": statistics.fmean(score(r) for r in hit) if hit else None}
