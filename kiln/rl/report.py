"""The RL part of the report card: reward curves, per-axis rewards, the policy-lag histogram."""
from __future__ import annotations

from collections import Counter
from pathlib import Path


def lag_histogram(rows: list[dict]) -> dict[int, int]:
    """Generated tokens by how many versions behind the trained policy they were sampled, over the run."""
    total: Counter = Counter()
    for r in rows:
        total.update({int(k): n for k, n in r.get("lag", {}).items()})
    return dict(sorted(total.items()))


def plot_rl(rows: list[dict], path: Path) -> Path:
    """rl.png: mean reward and best-of-K solved by step; each reward axis; the lag histogram."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4))
    FigureCanvasAgg(fig)
    ax_r, ax_axes, ax_lag = fig.subplots(1, 3)
    steps = [r["step"] for r in rows]
    ax_r.plot(steps, [r["reward_mean"] for r in rows], marker="o", label="mean reward")
    ax_r.plot(steps, [r["solved_mean"] for r in rows], marker="o", label="solved (mean)")
    ax_r.plot(steps, [r["solved_best_of_k"] for r in rows], marker="o", label="solved (best of group)")
    ax_r.set(xlabel="trainer step", title="rewards")
    axes = sorted({k for r in rows for k in r if k.startswith("reward/")})
    for k in axes:
        ax_axes.plot(steps, [r.get(k, 0.0) for r in rows], label=k.removeprefix("reward/"))
    ax_axes.set(xlabel="trainer step", title="reward axes (mean per rollout)")
    hist = lag_histogram(rows)
    ax_lag.bar([str(k) for k in hist], list(hist.values()))
    ax_lag.set(xlabel="versions behind the trained policy", ylabel="generated tokens", title="policy lag")
    for ax in (ax_r, ax_axes):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def rl_lines(rows: list[dict], plot_rel: str, group_size: int) -> list[str]:
    """Markdown lines for report.md."""
    if not rows:
        return ["No RL step finished.", ""]
    last = rows[-1]
    k = max(1, len(rows) // 4)  # one step's 2-3 groups are too few to read a trend from

    def moved(key: str, fmt: str) -> str:
        a, b = (sum(r[key] for r in part) / k for part in (rows[:k], rows[-k:]))
        return f"{a:{fmt}} -> {b:{fmt}}"

    hist = lag_histogram(rows)
    n = sum(hist.values()) or 1
    mixed = [r["groups_mixed"] for r in rows if "groups_mixed" in r]
    return [
        (f"{len(rows)} trainer steps. Means over the first and the last {k} step(s): reward "
         f"{moved('reward_mean', '+.3f')}; solved {moved('solved_mean', '.2f')} (mean), "
         f"{moved('solved_best_of_k', '.2f')} (best of {group_size})."
         + (f" {sum(mixed)} of the groups held both a solve and a failure." if mixed else "")),
        (f"{sum(r.get('summarised', 0) for r in rows)} of {sum(r.get('rollouts', 0) for r in rows)} rollouts "
         "self-summarised at least once."),
        (f"Train/inference mismatch KL (k3) at the last step {last.get('mismatch_kl_k3', float('nan')):.2e}; "
         f"delta per step {sum(r['delta_fraction'] for r in rows) / len(rows):.1%} of the full weights; "
         "policy lag of generated tokens: " + ", ".join(f"{k}: {v / n:.0%}" for k, v in hist.items()) + "."),
        "", f"![rl]({plot_rel})", ""]
