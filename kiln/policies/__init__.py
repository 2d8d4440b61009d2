"""Policies: what the harness asks for the next turn (scripted, oracle, OpenAI-compatible, local)."""
from __future__ import annotations


def make_policy(cfg, patch: str | None = None, test_command: str | None = None):
    """The policy `cfg.kind` names (cfg: kiln.config.PolicyConfig). The oracle needs the gold patch;
    the local policy, a checkpoint."""
    if cfg.kind == "openai":
        from .openai import OpenAIPolicy
        return OpenAIPolicy(cfg)
    if cfg.kind == "oracle":
        if not patch:
            raise ValueError("the oracle policy solves a task from its gold patch: pass one (--patch FILE)")
        from .oracle import OraclePolicy
        return OraclePolicy(patch, test_command, seed=cfg.seed)
    if cfg.kind == "local":
        if not cfg.checkpoint:
            from kiln.config import ConfigError
            raise ConfigError("policy.checkpoint is empty: the local policy decodes a kiln checkpoint "
                              "directory; set policy.checkpoint=PATH")
        from kiln.engine import SamplingParams

        from .local import LocalPolicy
        return LocalPolicy.from_checkpoint(cfg.checkpoint, SamplingParams(temperature=cfg.temperature),
                                           speculative=cfg.speculative)
    raise ValueError(f"policy kind {cfg.kind!r} cannot be built from the command line "
                     "(scripted policies are made in code); use openai, oracle or local")
