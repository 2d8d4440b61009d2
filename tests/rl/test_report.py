"""The RL section's sentences read trends over quarters of the run, not one noisy step against another."""
from __future__ import annotations

from kiln.rl.report import rl_lines


def _row(step: int, solved: float, mixed: int) -> dict:
    return {"step": step, "reward_mean": solved - 0.5, "solved_mean": solved, "solved_best_of_k": min(1.0, 2 * solved),
            "rollouts": 16, "summarised": step % 2, "lag": {"0": 10}, "delta_fraction": 0.5, "groups_mixed": mixed,
            "mismatch_kl_k3": 1e-7}


def test_rl_lines_compare_the_first_and_last_quarter():
    rows = [_row(i + 1, s, m) for i, (s, m) in enumerate(zip([0.0, 0.5, 0.1, 0.9, 0.2, 0.2, 0.25, 0.75],
                                                               [0, 2, 1, 1, 0, 2, 1, 2]))]
    text = "\n".join(rl_lines(rows, "rl.png", 8))
    assert "Means over the first and the last 2 step(s): reward -0.250 -> +0.000; solved 0.25 -> 0.50 (mean), " \
           "0.50 -> 0.75 (best of 8). 9 of the groups held both a solve and a failure." in text
    assert "4 of 128 rollouts self-summarised at least once." in text
