"""Reward terms that are pure functions of a rollout's counts and logprobs (RECIPE "RL").

The length penalty is the report's concave, increasing C(x) = ((1 + k x)^(1-q) - 1) / (k (1-q)),
which tends to ln(1 + k x) / k as q -> 1; x weighs the rollout's effort counts. The KL to a frozen
reference uses the k1 estimator, log pi - log pi_ref per sampled token, detached and subtracted
from the reward: in the reward it gives the gradient of the reverse KL, while k1 differentiated as
a loss has zero expected gradient (tests/rl/test_rewards.py checks both on a tabular policy).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EFFORT_KINDS = ("thinking_tokens", "tool_call_tokens", "tool_output_tokens", "final_tokens", "tool_calls", "turns")


def concave_penalty(x: float, k: float, q: float) -> float:
    """C(x) for x >= 0, k > 0, q > 0; q == 1 is the logarithmic limit."""
    if x < 0 or k <= 0 or q <= 0:
        raise ValueError(f"C(x) needs x >= 0, k > 0 and q > 0 (got x={x}, k={k}, q={q})")
    if abs(q - 1.0) < 1e-9:
        return math.log1p(k * x) / k
    return ((1.0 + k * x) ** (1.0 - q) - 1.0) / (k * (1.0 - q))


@dataclass(frozen=True)
class LengthPenalty:
    """lambda * C(x), x = sum of weight * count over EFFORT_KINDS (weights by kind name)."""
    lam: float
    k: float
    q: float
    weights: dict[str, float]

    def __post_init__(self):
        unknown = set(self.weights) - set(EFFORT_KINDS)
        if unknown:
            raise ValueError(f"unknown effort kinds {sorted(unknown)}: use {', '.join(EFFORT_KINDS)}")

    def x(self, effort: dict[str, float]) -> float:
        return sum(w * float(effort.get(kind, 0)) for kind, w in self.weights.items())

    def __call__(self, effort: dict[str, float]) -> float:
        return self.lam * concave_penalty(self.x(effort), self.k, self.q)


def k1(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of KL(pi || pi_ref) at the sampled tokens, detached (a reward term)."""
    return (logp - logp_ref).detach()


def reward_axes(grades: dict[str, dict], rl) -> dict[str, float]:
    """A graded rollout's reward, axis by axis (each logged on its own): correctness, minus the
    length penalty on the efficiency counts, minus weight x count of each behaviour term (looked up
    in the behaviour, quality and efficiency axes). `rl`: the config's rl section. The k1 term is
    the trainer's: only it holds the reference model."""
    penalty = LengthPenalty(rl.length_lambda, rl.length_k, rl.length_q, rl.length_weights)
    found = {**grades.get("efficiency", {}), **grades.get("quality", {}), **grades.get("behaviour", {})}
    missing = sorted(set(rl.behaviour_weights) - set(found))
    if missing:
        raise ValueError(f"rl.behaviour_weights names {missing}, which no grading axis reports; "
                         f"use some of {sorted(k for k, v in found.items() if isinstance(v, (int, float)))}")
    axes = {"correctness": float(grades["correctness"]["score"]),
            "length": -penalty(grades.get("efficiency", {}))}
    axes.update({f"behaviour/{k}": -w * float(found[k]) for k, w in rl.behaviour_weights.items()})
    return axes
