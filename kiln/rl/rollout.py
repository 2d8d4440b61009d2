"""One group: G rollouts of one prompt, each in a fork of the same task sandbox, graded, with
their reward axes; the driver writes it to disk (keep_group) before the orchestrator is told it exists.

The G agents run on threads and share the worker's engine (its runner batches their turns), so
a group decodes G sequences at once. The harness, tools and grader are the ones `kiln bench` and
`kiln agent` use (DESIGN.md: same harness everywhere).
"""
from __future__ import annotations

import json
import os
import threading

from kiln.engine import SamplingParams
from kiln.grading import grade
from kiln.harness.agent import Agent
from kiln.harness.trajectory import Trajectory
from kiln.policies.local import LocalPolicy
from kiln.sandbox import Snapshot, create

from .batch import drop_superseded_routes
from .rewards import reward_axes
from .trainer import Group


def task_kind(task) -> str:
    return f"{task.category}/{task.difficulty}"


def run_group(task, group_id: int, cfg, runner, seed: int) -> dict[str, dict]:
    """Roll out `task` cfg.rl.group_size times; -> the group's files as plain data: "<i>.json", each
    rollout's trajectory, and "group.json" naming them (what keep_group writes, what group_from reads).
    Nothing goes to this node's disk: the driver keeps the only copy (Ray ships the data pickled, and
    the JSON round trip this did cost the worker 0.3-0.8 s a group, holding the GIL its engine thread needs)."""
    rl, G = cfg.rl, cfg.rl.group_size
    trajs: list[Trajectory | None] = [None] * G
    rewards: list[dict | None] = [None] * G
    errors: list[BaseException] = []
    snap = Snapshot.from_dir(task.repo_dir, cfg.sandbox.state_dir, label=f"rl:{task.id}")
    try:
        with create(snap, task.sandbox_config(cfg.sandbox)) as base:
            forks = [base.fork() for _ in range(G)]

            def one(i: int) -> None:
                try:
                    params = SamplingParams(temperature=rl.temperature, seed=seed * 1000 + i)
                    policy = LocalPolicy(runner.engine, runner.engine.tok, params, runner=runner, timeout_s=rl.timeout_s)
                    # Graded once it ends (a crashed group is rolled out again, so no per-turn saves).
                    traj = Agent(policy, forks[i], cfg.harness).run(task.prompt, task_id=task.id)
                    drop_superseded_routes(traj)
                    grades = grade(forks[i], task, traj)
                    grades["correctness"].pop("log_tail", None)
                    rewards[i] = reward_axes(grades, rl)
                    traj.rewards = dict(rewards[i])
                    traj.metadata.update(grades=grades, rl={"group": group_id, "seed": seed * 1000 + i})
                    trajs[i] = traj
                except BaseException as e:  # noqa: BLE001 - re-raised below, on the worker's thread
                    errors.append(e)

            threads = [threading.Thread(target=one, args=(i,), name=f"rollout-{i}") for i in range(G)]
            try:
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            finally:
                for f in forks:
                    f.close()
    finally:
        snap.drop()
    if errors:
        raise errors[0]
    cost = sum(t.effort.turns + t.effort.thinking_tokens / 100 for t in trajs) / G
    files = {f"{i}.json": t.to_dict() for i, t in enumerate(trajs)}
    files["group.json"] = {"id": group_id, "task_id": task.id, "kind": task_kind(task), "trajectories": list(files),
                           "rewards": rewards, "cost": cost}
    return files


def keep_group(files: dict[str, dict], out_dir: str, group_id: int) -> str:
    """Write a group a worker returned ({file name: JSON}) under out_dir, group.json last, pointing
    at the trajectories' new paths; -> the path of its group.json."""
    gdir = os.path.join(out_dir, f"{group_id:06d}")
    os.makedirs(gdir, exist_ok=True)
    group = files["group.json"]
    names = [os.path.basename(p) for p in group["trajectories"]]
    # json.dumps, not json.dump: dump encodes in Python (one-shot C encoding is only in dumps), ~5x slower.
    for name in names:
        with open(os.path.join(gdir, name), "w") as f:
            f.write(json.dumps(files[name]))
    path = os.path.join(gdir, "group.json")
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps({**group, "trajectories": [os.path.join(gdir, n) for n in names]}))
    os.replace(path + ".tmp", path)
    return path


def group_from(files: dict[str, dict], started_version: int = -1) -> Group:
    """The Group of the files a worker returned (keep_group's input), without reading them back from disk."""
    g = files["group.json"]
    return Group(g["id"], g["task_id"], g["kind"],
                 [Trajectory.from_dict(files[os.path.basename(p)]) for p in g["trajectories"]], g["rewards"],
                 started_version)


def load_group(path: str, started_version: int = -1) -> Group:
    with open(path) as f:
        d = json.load(f)
    return Group(d["id"], d["task_id"], d["kind"], [Trajectory.load(p) for p in d["trajectories"]], d["rewards"],
                 started_version)
