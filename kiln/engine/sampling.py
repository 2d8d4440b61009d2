"""Sampling parameters and the per-row sampling step.

Reported logprobs are log softmax(logits / T) of the chosen token, without top-k/top-p truncation
(T = 1 for greedy): the policy's own probability of the token, which is what the RL trainer
recomputes and compares. Sampling itself draws from the truncated distribution.
Each request has its own generator, so a seeded request samples the same tokens whatever else
shares its batch. Where the native step runs, untruncated rows (no top-k, no top-p) take native.c's
sampler instead (`NativeSampler`): the same rule, one pass over the row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 256
    stop: tuple[str, ...] = ()  # strings that end the completion (not included in its text)
    stop_token_ids: tuple[int, ...] | None = None  # None: the tokenizer's end-of-turn tokens
    seed: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (got {self.top_k})")
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1 (got {self.max_tokens})")
        if problems:
            raise ValueError("; ".join(problems))
        self.stop = tuple(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return g


def untruncated(p: SamplingParams) -> bool:
    """Drawn from all of softmax(logits / T) (or greedy): the rows native.c's sampler takes."""
    return p.top_k == 0 and p.top_p == 1.0


def uniform(gen: torch.Generator) -> float:
    """One draw in [0, 1) from a request's generator."""
    return float(torch.rand((), generator=gen))


def policy_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) in fp32; T = 0 (greedy) reports the T = 1 distribution."""
    x = logits.float()  # T = 1 skips the division (exact anyway): it is a step's Python time
    return torch.log_softmax(x if temperature in (0, 1) else x / temperature, dim=-1)


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy row draws from: temperature, then top-k, then top-p."""
    scaled = logits.float() / p.temperature
    if p.top_k and p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One index of a 1-D distribution (not necessarily normalised) by inverting its CDF with one
    uniform number: torch.multinomial draws a random number per entry, 8,192 per token here, and
    was a third of the decoding thread's time. right=True never lands on a zero-probability entry."""
    cdf = probs.float().cumsum(-1)
    u = torch.rand(1, generator=gen) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), cdf.shape[-1] - 1)


def argmax(logits: torch.Tensor) -> list:
    """The index of the largest logit along the last dimension, as (nested) ints; the first on
    ties and NaN as largest, as torch's. Through numpy: torch's reduction took ~15 us a row of
    8,192 here, numpy's ~1, and greedy decoding takes one (speculative: several) a token."""
    if logits.device.type != "cpu":
        return logits.argmax(-1).tolist()
    return logits.detach().float().numpy().argmax(-1).tolist()


def sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    if p.greedy:
        return argmax(logits)
    return draw(sampling_probs(logits, p), gen)
