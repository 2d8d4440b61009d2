"""The RL loop: the trainer process. Groups in, one optimizer step, weights out.

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
import time
from pathlib import Path


def trainer_main(cfg_path: str, rl_dir: str, address, authkey: bytes) -> None:
    from kiln.config import load_config
    from kiln.model.checkpoint import load_checkpoint, save_checkpoint
    from kiln.pretrain.checkpointing import (
        MetricsLog,
        find_state,
        read_trainer_state,
        save_state,
    )

    from .placement import pin
    from .rollout import load_group
    from .rpc import RpcClient
    from .store import WeightStore
    from .trainer import RLTrainer

    cfg = load_config(cfg_path)
    rl, run = cfg.rl, Path(rl_dir)
    pin(rl.trainer_cpus)
    client = RpcClient(address, authkey, "trainer", rl.timeout_s)
    start = client.call("start_info")
    model, _ = load_checkpoint(start["checkpoint"], with_mtp=False)
    ref = copy.deepcopy(model) if rl.kl_coef > 0 else None  # the frozen start policy
    state_dir, version, trained = find_state(run), 0, []
    if state_dir is not None:  # resume: weights, optimizer, version, the groups already trained on
        model, _ = load_checkpoint(state_dir, with_mtp=False)
        st = read_trainer_state(state_dir)
        version, trained = st["version"], st["trained"]
    trainer = RLTrainer(model, rl, ref, version)
    if state_dir is not None:
        trainer.opt.load_state_dict(st["opt"])
    store = WeightStore(start["store"], anchor_every=rl.anchor_every)
    latest = store.latest()
    if latest is None or latest < version:  # the first start, or killed between its state and its publish
        store.publish(version, model.state_dict())
    client.call("hello", version=version, trained=trained)
    metrics = MetricsLog(run / "metrics.jsonl")
    metrics.truncate(version)
    idle, began = 0.0, time.monotonic()
    while trainer.version < rl.steps:
        t0, groups = time.monotonic(), []
        while not groups:  # the orchestrator answers [] after its own short wait
            groups = client.call("take", n=rl.groups_per_step, wait=5.0)
            if not groups and time.monotonic() - t0 > rl.timeout_s:
                raise TimeoutError(f"no finished groups for {rl.timeout_s} s: are the rollout workers alive?")
        wait = time.monotonic() - t0
        idle += wait
        m = trainer.step([load_group(g["path"]) for g in groups])
        trained += [g["id"] for g in groups]
        save_state(run, model, None, Path(start["checkpoint"]),
                   {"opt": trainer.opt.state_dict(), "version": trainer.version, "trained": trained})
        pub = store.publish(trainer.version, {k: v.detach() for k, v in model.state_dict().items()})
        client.call("trained", ids=[g["id"] for g in groups], version=trainer.version)
        store.gc()  # what no worker holds and no rebuild needs
        lags = [trainer.version - 1 - g["started_version"] for g in groups]
        metrics.append({"step": trainer.version, **m, "wait_s": wait, "idle_s": idle,
                        "elapsed_s": time.monotonic() - began, "group_lag": lags,
                        "delta_fraction": pub["delta_fraction"], "delta_bytes": pub["bytes_written"],
                        "groups": [g["id"] for g in groups], "wall": time.time()})
        print(f"rl step {trainer.version}/{rl.steps}: reward {m['reward_mean']:+.3f} solved {m['solved_mean']:.2f} "
              f"best-of-{rl.group_size} {m['solved_best_of_k']:.2f} mismatch_kl {m.get('mismatch_kl_k3', 0):.2e} "
              f"lag {lags} waited {wait:.1f}s", flush=True)
    save_checkpoint(model, run / "checkpoint", tokenizer_dir=start["checkpoint"])
    client.close()
