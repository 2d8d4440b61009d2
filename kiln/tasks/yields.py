"""What a generator produced: candidates, kept, and rejections counted by reason."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Yield:
    generator: str
    candidates: int = 0
    kept: int = 0
    rejected: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)  # reason -> the first full message, for diagnosis

    def reject(self, reason: str) -> None:
        # Count by the reason's leading phrase ("flaky tests: [...]" -> "flaky tests"; "no fail-to-pass
        # test; the tests could not run ..." -> "no fail-to-pass test").
        key = reason.split(":")[0].split(";")[0].strip()
        self.rejected[key] += 1
        self.examples.setdefault(key, reason[:300])

    def __str__(self) -> str:
        lines = [f"{self.generator}: {self.candidates} candidates, {self.kept} kept, "
                 f"{sum(self.rejected.values())} rejected"]
        lines += [f"  rejected {n:>4}  {why}" + (f"  (e.g. {self.examples[why]})" if why == "generator error" else "")
                  for why, n in self.rejected.most_common()]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"generator": self.generator, "candidates": self.candidates, "kept": self.kept,
                "rejected": dict(self.rejected), "examples": dict(self.examples)}
