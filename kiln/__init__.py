"""kiln: train and evaluate coding agents (Composer 2 recipe).

Kept import-light on purpose: sandbox helper processes import `kiln.sandbox` and must start fast,
so nothing here may import torch or pydantic.
"""
import os

# torch's OpenMP threads spin at every barrier by default. On a small machine that also runs
# rollout workers, sandboxes and pytest, the spinning threads fight them for the cores: a training
# step of 4 x 1,024 tokens took 10 s beside a bench instead of 2.8 s passive (1.7 vs 1.8 s with the
# machine idle, docs/architecture.md). Only effective when kiln is imported before torch (the CLI,
# its worker processes, the tests); an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
