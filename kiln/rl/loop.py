"""The RL trainer: a Ray actor. Groups in as they finish, one optimizer step per rl.groups_per_step
of them, weights out (the loop that feeds it is the driver's, kiln/rl/launcher.py).

Deliberate deviations from textbook GRPO (RECIPE.md "RL"), and why:
- Advantage = reward - group mean, no division by the group's std (Dr. GRPO): std scaling
  over-weights groups whose rewards barely differ. Switchable (rl.scale_std) for ablations.
- Token terms are summed and divided by a constant, not averaged per sequence: per-sequence
  means favour short wrong answers and long right ones. token_mean / seq_mean by name.
- No clipped surrogate and no reference-KL loss term: KL to the start policy is a k1 estimate
  subtracted from the reward, detached (k1 differentiated as a loss has zero expected gradient);
  off-policyness is kept small by the infrastructure instead: admission bounds the lag, weights
  are swapped mid-rollout, MoE routing is replayed. Truncated importance sampling is optional.
- Asynchronous: samples may come from up to rl.max_lag versions back (the lag is logged).
- Single epoch: no prompt is trained on twice; overlong rollouts are not masked.
- Every generated token of every self-summary segment carries its trajectory's advantage.
"""
from __future__ import annotations

import copy
import gc
import time
from pathlib import Path

import ray

from kiln import cluster


@ray.remote
class Trainer:
    """Loads the start policy (and its frozen copy for the KL term), resumes from `<run dir>/state/`
    on its own node when there is one, and publishes its version to the store if the store lacks it
    (the first start, or a death between saving its state and publishing)."""

    def __init__(self, cfg, start: dict, rl_dir: str):
        from kiln.model.checkpoint import load_checkpoint
        from kiln.pretrain.checkpointing import find_state, read_trainer_state

        from .placement import pin_checked
        from .store import WeightStore
        from .trainer import RLTrainer, sampler_weights

        self.rl, self.run, self.where = cfg.rl, Path(rl_dir), cluster.here()
        self.dtype = cfg.engine.dtype  # what the workers sample with, so what is published
        pin_checked("trainer_cpus", self.rl.trainer_cpus)
        self.ckpt = start["checkpoint"].local()
        model, _ = load_checkpoint(self.ckpt, with_mtp=False)
        ref = copy.deepcopy(model) if self.rl.kl_coef > 0 else None  # the frozen start policy
        state_dir, version, self.trained, self.last = find_state(self.run), 0, [], None
        if state_dir is not None:  # resume: weights, optimizer, version, the groups already trained on
            model, _ = load_checkpoint(state_dir, with_mtp=False)
            st = read_trainer_state(state_dir)
            version, self.trained, self.last = st["version"], st["trained"], st.get("metrics")
        self.model, self.trainer = model, RLTrainer(model, self.rl, ref, version)
        if state_dir is not None:
            self.trainer.opt.load_state_dict(st["opt"])
        self.store = WeightStore(start["store"], anchor_every=self.rl.anchor_every)
        latest = self.store.latest()
        if latest is None or latest < version:
            self.store.publish(version, sampler_weights(model, self.dtype))
        if self.last is not None:  # its state was saved before the publish that sized the delta
            pub = self.store.size(version)
            self.last.update(delta_fraction=pub["delta_fraction"], delta_bytes=pub["bytes_written"])
        # What is loaded by now (torch's and Ray's modules, the model and its frozen copy, the optimizer)
        # lives as long as the trainer: full collections need not walk it. They took 150-190 ms each over
        # ~330k objects, 0.7-1.0 s of an 8-step run of benchmarks/rl_async.py; frozen, under 0.01 s (docs).
        gc.freeze()
        self.began = time.monotonic()

    def ready(self) -> dict:
        """Where it runs, its version, the groups its state holds as trained and that step's metrics."""
        return {**self.where, "version": self.trainer.version, "trained": self.trained, "metrics": self.last}

    def train(self, groups: list, wait_s: float, idle_s: float) -> tuple[dict | None, int]:
        """Add `groups` (rollout.Group) to the coming step, their forward and backward run now; once
        rl.groups_per_step are in, one optimizer step, its state saved, then published. -> the step's
        metrics row (None while the step still waits for groups) and this process's pid (the driver
        notices a restart between calls by it)."""
        from kiln.pretrain.checkpointing import save_state

        from .trainer import sampler_weights

        for g in groups:
            self.trainer.add(g)
        steps = self.trainer.pending
        if len(steps) < self.rl.groups_per_step:
            return None, self.where["pid"]
        m = self.trainer.step()
        self.trained += [g.id for g in steps]
        lags = [self.trainer.version - 1 - g.started_version for g in steps]
        row = {"step": self.trainer.version, **m, "wait_s": wait_s, "idle_s": idle_s,
               "elapsed_s": time.monotonic() - self.began, "group_lag": lags, "groups": [g.id for g in steps],
               "wall": time.time()}
        save_state(self.run, self.model, None, Path(self.ckpt),
                   {"opt": self.trainer.opt.state_dict(), "version": self.trainer.version, "trained": self.trained,
                    "metrics": row})
        pub = self.store.publish(self.trainer.version, sampler_weights(self.model, self.dtype))
        row.update(delta_fraction=pub["delta_fraction"], delta_bytes=pub["bytes_written"])
        self.store.gc()  # what no worker holds and no rebuild needs
        self.last = row
        return row, self.where["pid"]

    def finish(self) -> str:
        """The trained policy as a checkpoint under the run dir of this node; -> its path."""
        from kiln.model.checkpoint import save_checkpoint

        out = self.run / "checkpoint"
        save_checkpoint(self.model, out, tokenizer_dir=self.ckpt)
        return str(out)
