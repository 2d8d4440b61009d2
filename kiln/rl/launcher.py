"""`kiln rl`: one launcher starts the trainer and N rollout workers as processes from one config,
owns the orchestrator, and keeps the run going.

- A worker that dies (crash, kill -9) has its running groups re-queued and is restarted.
- A trainer that dies is restarted; it resumes from its last state (weights, optimizer, version,
  groups trained), and the groups it had taken but not trained go back to the queue.
- Everything is on disk under `<run dir>/rl/`: `orchestrator.json` (prompts left, every group's
  state), `groups/` (trajectories), `state/` (the trainer), `weights/` (the store), so running
  `kiln rl` again after the launcher itself died picks up where it stopped.
- No wait is unbounded: no progress (a group finished or a step trained) for rl.timeout_s aborts
  the run with an error naming what was waiting.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import time
from pathlib import Path

from kiln.config import config_to_toml

from . import placement
from .orchestrator import Orchestrator, Prompt
from .rpc import RpcServer
from .store import WeightStore

MAX_RESTARTS = 5  # per process: more means something is broken, not unlucky


class RLError(RuntimeError):
    """The run cannot start or cannot go on."""


def prepare_tasks(cfg, rl_dir: Path, progress: bool = True) -> Path:
    """rl.tasks toy prompts of the train split, after the SFT data's (kept apart by task_seed)."""
    from kiln.tasks.record import load_suite
    from kiln.tasks.toy import generate_toy

    suite = rl_dir / "tasks"
    have = load_suite(str(suite)) if suite.is_dir() and any(suite.iterdir()) else []
    if len(have) < cfg.rl.tasks:
        y = generate_toy(str(suite), cfg.rl.tasks, seed=cfg.rl.task_seed, level=cfg.rl.level or None, split="train",
                         sandbox_cfg=cfg.sandbox, progress=progress)
        if y.kept == 0:
            raise RLError(f"no toy task could be generated in {suite} (rejected: {dict(y.rejected)})")
    return suite


def run_rl(cfg, checkpoint: str, rl_dir: str, progress: bool = True) -> dict:
    """Train the policy at `checkpoint` with asynchronous RL; returns a summary (metrics rows, final checkpoint)."""
    from kiln.tasks.record import load_suite

    from .loop import trainer_main
    from .rollout import task_kind
    from .worker import worker_main

    rl, run = cfg.rl, Path(rl_dir)
    try:
        placement.check(rl.trainer_cpus, rl.worker_cpus)
    except ValueError as e:
        raise RLError(str(e)) from None
    if not (Path(checkpoint) / "config.json").is_file():
        raise RLError(f"no checkpoint at {checkpoint!r}: run `kiln sft` first, or set rl.checkpoint=DIR")
    run.mkdir(parents=True, exist_ok=True)
    suite = prepare_tasks(cfg, run, progress)
    tasks = load_suite(str(suite))[: rl.tasks]
    if len(tasks) < rl.steps * rl.groups_per_step:
        raise RLError(f"{rl.steps} steps x {rl.groups_per_step} groups need {rl.steps * rl.groups_per_step} "
                      f"prompts (single epoch) but there are {len(tasks)}: raise rl.tasks")
    cfg_path = run / "config.toml"
    cfg_path.write_text(config_to_toml(cfg))
    orch = Orchestrator(str(run / "orchestrator.json"), [Prompt(t.id, task_kind(t)) for t in tasks], rl, cfg.run.seed)
    start = {"checkpoint": str(Path(checkpoint).resolve()), "store": rl.store or str(run / "weights"),
             "tasks": str(suite)}
    last_progress = [time.monotonic()]

    def submit(worker: str, group: int, path: str) -> bool:
        with open(path) as f:
            cost = json.load(f)["cost"]
        ok = orch.submit(worker, group, path, cost)
        last_progress[0] = time.monotonic()
        return ok

    def trained(ids: list[int], version: int) -> None:
        orch.trained(ids, version)
        last_progress[0] = time.monotonic()

    def next_job(worker: str, version: int):
        return {"stop": True} if orch.finished() else orch.next_job(worker, version)

    handlers = {"start_info": lambda: start, "next_job": next_job, "submit": submit, "trained": trained,
                "hello": orch.hello, "take": lambda n, wait: orch.take(n, wait)}
    authkey = secrets.token_bytes(16)
    server = RpcServer(handlers, authkey, on_disconnect=lambda who: who.startswith("worker") and orch.worker_lost(who))
    server.start()
    ctx = mp.get_context("spawn")  # a clean interpreter: no inherited threads, locks or sandboxes
    args = (str(cfg_path), str(run))

    def spawn(name: str):
        if name == "trainer":
            p = ctx.Process(target=trainer_main, args=(*args, server.address, authkey), name=name)
        else:
            p = ctx.Process(target=worker_main, args=(*args, int(name.split("-")[1]), server.address, authkey),
                            name=name)
        p.start()
        return p

    procs = {n: spawn(n) for n in ["trainer"] + [f"worker-{i}" for i in range(rl.workers)]}
    restarts = dict.fromkeys(procs, 0)
    try:
        while not (orch.finished() and procs["trainer"].exitcode == 0):
            time.sleep(0.5)
            for name, p in list(procs.items()):
                if p.exitcode is None or (name == "trainer" and p.exitcode == 0):
                    continue
                if name.startswith("worker") and orch.finished():
                    continue
                restarts[name] += 1
                if restarts[name] > MAX_RESTARTS:
                    raise RLError(f"{name} died {MAX_RESTARTS + 1} times (last exit code {p.exitcode}); "
                                  f"see its traceback above")
                if name.startswith("worker"):
                    lost = orch.worker_lost(f"{name}.{p.pid}")
                    WeightStore(start["store"]).forget(f"{name}.{p.pid}")  # its marker would pin old versions
                    print(f"rl: {name} exited with {p.exitcode}; re-queued groups {lost}; restarting", flush=True)
                else:
                    print(f"rl: the trainer exited with {p.exitcode}; restarting it from its last state", flush=True)
                procs[name] = spawn(name)
                last_progress[0] = time.monotonic()
            if time.monotonic() - last_progress[0] > rl.timeout_s:
                raise RLError(f"no group finished and no step trained for {rl.timeout_s:.0f} s "
                              f"(groups: {orch.counts()}); raise rl.timeout_s if rollouts are just slow")
    finally:
        deadline = time.monotonic() + 30
        for p in procs.values():
            p.join(max(0.1, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(5)
        server.close()
    from kiln.pretrain.checkpointing import MetricsLog
    return {"metrics": MetricsLog(run / "metrics.jsonl").rows(), "checkpoint": str(run / "checkpoint"),
            "groups": orch.counts(), "restarts": restarts}


def rl_dir_of(cfg) -> str:
    return os.path.join(cfg.run.out_dir, cfg.run.name, "rl")
