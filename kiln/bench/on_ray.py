"""`kiln bench --ray`: every rollout a Ray task, scheduled anywhere in the cluster by
`bench.rollout_resources`.

A task's folder reaches the node that runs it through `cluster.Shipped` (no shared filesystem);
the sandbox is made there from it and graded there. The row and the trajectory come back to the
driver, which writes them exactly as the threaded run does (results.jsonl stays the one source of
truth, so a killed run resumes the same way).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from concurrent.futures import Future

import ray

from kiln import cluster


@ray.remote(max_retries=1)  # a crashed worker process: once more; an exception in the rollout is not retried
def _rollout(shipped: cluster.Shipped, pass_idx: int, policy_name: str, config) -> tuple[dict, dict]:
    from kiln.sandbox import Snapshot
    from kiln.tasks.record import load_task

    from .run import run_rollout

    task = load_task(shipped.local())
    out = tempfile.mkdtemp(prefix="kiln-bench-")
    os.makedirs(os.path.join(out, "trajectories"))
    snap = Snapshot.from_dir(task.repo_dir, config.sandbox.state_dir, label=f"bench:{task.id}")
    try:
        row = run_rollout(task, pass_idx, policy_name, config, snap, out)
        with open(os.path.join(out, row["trajectory"])) as f:
            traj = json.load(f)
        row["node"] = cluster.here()["node_id"]
        return row, traj
    finally:
        snap.drop()
        shutil.rmtree(out, ignore_errors=True)


class _RayFuture(Future):
    """A rollout's Future; cancelling it cancels the Ray task."""

    ref = None

    def cancel(self) -> bool:
        if self.ref is not None and not self.done():
            ray.cancel(self.ref)
        return super().cancel()


class RayRollouts:
    """Submits rollouts as Ray tasks, in the shape of an executor: `submit` gives a Future whose
    result is the row, after the trajectory has been written under out_dir on this node."""

    def __init__(self, policy_name: str, config, out_dir: str):
        self.policy, self.config, self.out_dir = policy_name, config, out_dir
        self.opts = cluster.ray_options(config.bench.rollout_resources)
        self.shipped: dict[str, cluster.Shipped] = {}
        self.refs: list = []

    def submit(self, task, pass_idx: int) -> Future:
        if task.id not in self.shipped:
            self.shipped[task.id] = cluster.Shipped.of(task.path)
        fut = _RayFuture()
        fut.ref = _rollout.options(**self.opts).remote(self.shipped[task.id], pass_idx, self.policy, self.config)
        self.refs.append(fut.ref)
        fut.ref.future().add_done_callback(lambda rf: self._done(fut, rf))
        return fut

    def _done(self, fut: Future, rf: Future) -> None:
        if fut.cancelled():
            return
        try:
            row, traj = rf.result()
            path = os.path.join(self.out_dir, row["trajectory"])
            with open(path + ".tmp", "w") as f:
                json.dump(traj, f)
            os.replace(path + ".tmp", path)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting loop, which logs it as a failed rollout
            fut.set_exception(_unwrap(e))
            return
        fut.set_result(row)

    def shutdown(self, wait: bool = True) -> None:
        """Running rollouts finish (and are kept) before the run ends."""
        if wait and self.refs:
            ray.wait(self.refs, num_returns=len(self.refs), timeout=self.config.sandbox.timeout_s * 4)


def _unwrap(e: BaseException) -> BaseException:
    """A rollout's own exception rather than Ray's wrapper, so errors.jsonl reads as a local run's."""
    from ray.exceptions import RayTaskError

    if isinstance(e, RayTaskError):
        cause = e.as_instanceof_cause()
        return cause if isinstance(cause, BaseException) else e
    return e
