"""A rollout worker process: one engine, weights from the store swapped in mid-rollout, groups
from the orchestrator.

A poller thread watches the weight store; a new version is rebuilt from the delta chain,
verified, and handed to the engine, which applies it between two decoding steps: running
sequences keep their KV cache and go on under the new version (each token records the version
that produced it). A corrupt version is never loaded; the worker keeps decoding with what it has.
"""
from __future__ import annotations

import os
import sys
import threading
import time

POLL_S = 0.1


def worker_main(cfg_path: str, rl_dir: str, worker_id: int, address, authkey: bytes) -> None:
    from kiln.config import load_config
    from kiln.engine import Engine
    from kiln.engine.runner import EngineRunner
    from kiln.model.checkpoint import load_checkpoint
    from kiln.model.tokenizer import load_tokenizer
    from kiln.tasks.record import load_suite

    from .placement import pin
    from .rollout import run_group
    from .rpc import RpcClient
    from .store import WeightStore, WeightSubscriber

    cfg = load_config(cfg_path)
    rl = cfg.rl
    pin(rl.worker_cpus, threads=1)  # one thread each: workers share their cores with each other
    name = f"worker-{worker_id}.{os.getpid()}"  # per incarnation: a restarted worker is a new one
    client = RpcClient(address, authkey, name, rl.timeout_s)
    start = client.call("start_info")
    model, _ = load_checkpoint(start["checkpoint"], with_mtp=False)
    tok = load_tokenizer(start["checkpoint"])
    sub = WeightSubscriber(WeightStore(start["store"], anchor_every=rl.anchor_every), name)
    got, deadline = None, time.monotonic() + rl.timeout_s
    while got is None:  # the trainer publishes version 0 when it starts
        got = sub.poll()
        if got is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no weights appeared in the store {start['store']} within {rl.timeout_s} s")
            time.sleep(POLL_S)
    model.load_state_dict(got[1])
    max_len = min(cfg.model.context, model.config.max_position_embeddings)
    # Prefix reuse: one kept conversation per rollout of a group, as many again for the system
    # prompt that every task's rollouts start with.
    engine = Engine(model, tok, max_batch=rl.group_size, max_len=max_len, version=got[0],
                    prefix_slots=2 * rl.group_size)
    runner = EngineRunner(engine)
    runner.start()
    stop = threading.Event()

    def poll_weights() -> None:
        while not stop.wait(POLL_S):
            try:
                new = sub.poll()
            except Exception as e:  # noqa: BLE001 - corrupt, pruned or unreachable: keep decoding, try again
                print(f"{name}: {type(e).__name__}: {e}; keeping version {engine.version}", file=sys.stderr)
                time.sleep(1.0)
                continue
            if new is not None:
                engine.update_weights(new[1], new[0])

    poller = threading.Thread(target=poll_weights, name="weights", daemon=True)
    poller.start()
    tasks = {t.id: t for t in load_suite(start["tasks"])}
    out = os.path.join(rl_dir, "groups")
    try:
        while True:
            job = client.call("next_job", worker=name, version=engine.version)
            if job is None:
                time.sleep(POLL_S)
                continue
            if job.get("stop"):
                return
            path = run_group(tasks[job["task_id"]], job["group"], cfg, runner, out, seed=cfg.run.seed + job["group"])
            client.call("submit", worker=name, group=job["group"], path=path)
    finally:
        stop.set()
        # Not left to die at exit inside a torch op (which aborts the process: "terminate called").
        poller.join(timeout=30)
        runner.close()
        client.close()
