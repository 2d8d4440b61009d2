"""A rollout worker: a Ray actor with one engine, weights from the store swapped in mid-rollout,
groups from the driver.

A poller thread watches the weight store; a new version is rebuilt from the delta chain,
verified, and handed to the engine, which applies it between two decoding steps: running
sequences keep their KV cache and go on under the new version (each token records the version
that produced it). A corrupt version is never loaded; the worker keeps decoding with what it has.

`rollout` runs in a "rollouts" concurrency group (the driver keeps rl.worker_groups calls in
flight: that many groups at once, their rollouts decoding in the same engine batches); `ready`,
`version` and `close` in a "control" group of their own, so a health check never queues behind a
long rollout. A group's files are returned whole, as data: the driver keeps them (no shared filesystem).
"""
from __future__ import annotations

import gc
import os
import sys
import threading
import time

import ray

from kiln import cluster

POLL_S = 0.1
VERSION_WAIT_S = 1.0  # the longest `version(known)` waits for newer weights before it answers


# Ray fixes concurrency groups at the class: "rollouts" has room for rl.worker_groups' upper bound, and the
# driver never has more than rl.worker_groups rollout calls in flight on one worker.
MAX_GROUPS = 8


@ray.remote(concurrency_groups={"control": 2, "rollouts": MAX_GROUPS})
class RolloutWorker:
    def __init__(self, cfg, start: dict, worker_id: int):
        import torch

        from kiln.engine import Engine
        from kiln.engine.runner import EngineRunner
        from kiln.model.checkpoint import load_checkpoint
        from kiln.model.tokenizer import load_tokenizer
        from kiln.tasks.record import load_suite

        from .placement import pin_checked, widen
        from .store import WeightStore, WeightSubscriber

        self.cfg, rl = cfg, cfg.rl
        pin_checked("worker_cpus", rl.worker_cpus, threads=1)  # one thread each: workers share their cores
        self.where = cluster.here()
        # Per incarnation: a restarted worker is a new consumer of the store and a new owner of groups.
        self.name = f"worker-{worker_id}.{self.where['node_id'][:8]}.{os.getpid()}"
        ckpt = start["checkpoint"].local()
        model, mtp = load_checkpoint(ckpt, with_mtp=rl.speculative)
        tok = load_tokenizer(ckpt)
        self.sub = WeightSubscriber(WeightStore(start["store"], anchor_every=rl.anchor_every), self.name)
        got, deadline = None, time.monotonic() + rl.timeout_s
        while got is None:  # the trainer publishes version 0 when it starts
            got = self.sub.poll()
            if got is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: no weights appeared in the store {start['store']} "
                                       f"within {rl.timeout_s} s")
                time.sleep(POLL_S)
        model.load_state_dict(got[1])
        max_len = min(cfg.model.context, model.config.max_position_embeddings)
        # rl.worker_groups groups at once share the engine's batches. Prefix reuse: one kept conversation
        # per rollout, as many again for the prompts that every task's rollouts start with; a rollout's
        # turns carry on across new weights as a running sequence does (carry_turns, engine/prefix.py).
        rows = rl.group_size * rl.worker_groups
        self.engine = Engine(model, tok, mtp=mtp, max_batch=rows, max_len=max_len, version=got[0],
                             prefix_slots=2 * rows, weight_dtype=getattr(torch, cfg.engine.dtype),  # the store's weights
                             kv_dtype=torch.bfloat16 if cfg.engine.kv_dtype == "bfloat16" else None,
                             carry_turns=True, lookup=0 if mtp is not None else cfg.engine.lookup)
        self.runner = EngineRunner(self.engine)
        self.runner.start()
        if cfg.sandbox.cpus:  # the engine's thread keeps the worker's CPUs; the rest works for the sandboxes
            widen(sorted(set(rl.worker_cpus or os.sched_getaffinity(0)) | set(cfg.sandbox.cpus)), but=self.runner.thread_id)
        self.stop = threading.Event()
        self.poller = threading.Thread(target=self._poll_weights, name="weights", daemon=True)
        self.poller.start()
        self.tasks = {t.id: t for t in load_suite(start["tasks"].local())}
        # What is loaded by now lives as long as the worker (torch's and Ray's modules, the model, the
        # tokenizer, the tasks): full collections need not walk it. They took ~120 ms each over ~350k
        # objects, 0.6 s of a 17 s asynchronous arm, holding the GIL; frozen, 0.03-0.09 s (docs).
        gc.freeze()

    def _poll_weights(self) -> None:
        while not self.stop.wait(POLL_S):
            try:
                new = self.sub.poll()
            except Exception as e:  # noqa: BLE001 - corrupt, pruned or unreachable: keep decoding, try again
                print(f"{self.name}: {type(e).__name__}: {e}; keeping version {self.engine.version}", file=sys.stderr)
                time.sleep(1.0)
                continue
            if new is not None:
                self.engine.update_weights(new[1], new[0])

    @ray.method(concurrency_group="control")
    def ready(self) -> dict:
        return {**self.where, "name": self.name, "version": self.engine.version}

    @ray.method(concurrency_group="control")
    def version(self, known: int | None = None) -> int:
        """The engine's weights version; given the one the caller knows, it answers once newer weights
        are applied (or after VERSION_WAIT_S), so a group held back for lag starts as soon as they are."""
        return self.engine.version if known is None else self.engine.wait_version(known, VERSION_WAIT_S)

    @ray.method(concurrency_group="rollouts")
    def rollout(self, job: dict) -> dict:
        """Roll out one group; -> its files ({name: JSON}) and the version the engine is on now."""
        from .rollout import run_group

        files = run_group(self.tasks[job["task_id"]], job["group"], self.cfg, self.runner,
                          seed=self.cfg.run.seed + job["group"])
        stats = self.engine.spec_stats  # this worker's drafts so far (rl.speculative)
        return {"name": self.name, "version": self.engine.version, "files": files,
                "drafts": {"steps": stats.steps, "accepted": sum(stats.accepted)}}

    @ray.method(concurrency_group="control")
    def close(self) -> None:
        """Stop the poller and the engine, so the process is not killed inside a torch op."""
        self.stop.set()
        self.poller.join(timeout=30)
        self.runner.close()
