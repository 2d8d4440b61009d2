"""One group: G rollouts of one prompt, each in a fork of the same task sandbox, graded, with
their reward axes; written to disk before anyone is told it exists.

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

from .rewards import reward_axes
from .trainer import Group


def task_kind(task) -> str:
    return f"{task.category}/{task.difficulty}"


def run_group(task, group_id: int, cfg, runner, out_dir: str, seed: int) -> str:
    """Roll out `task` cfg.rl.group_size times; returns the path of the group's JSON file."""
    rl, G = cfg.rl, cfg.rl.group_size
    gdir = os.path.join(out_dir, f"{group_id:06d}")
    os.makedirs(gdir, exist_ok=True)
    paths = [os.path.join(gdir, f"{i}.json") for i in range(G)]
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
                    # Saved once, graded (a crashed group is rolled out again, so no per-turn saves).
                    traj = Agent(policy, forks[i], cfg.harness).run(task.prompt, task_id=task.id)
                    grades = grade(forks[i], task, traj)
                    grades["correctness"].pop("log_tail", None)
                    rewards[i] = reward_axes(grades, rl)
                    traj.rewards = dict(rewards[i])
                    traj.metadata.update(grades=grades, rl={"group": group_id, "seed": seed * 1000 + i})
                    traj.save(paths[i])
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
    trajs = [Trajectory.load(p) for p in paths]
    cost = sum(t.effort.turns + t.effort.thinking_tokens / 100 for t in trajs) / G
    path = os.path.join(gdir, "group.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"id": group_id, "task_id": task.id, "kind": task_kind(task), "trajectories": paths,
                   "rewards": rewards, "cost": cost}, f)
    os.replace(path + ".tmp", path)
    return path


def keep_group(files: dict[str, dict], out_dir: str, group_id: int) -> str:
    """Write a group a worker returned ({file name: JSON}) under out_dir, group.json last, pointing
    at the trajectories' new paths; -> the path of its group.json."""
    gdir = os.path.join(out_dir, f"{group_id:06d}")
    os.makedirs(gdir, exist_ok=True)
    group = files["group.json"]
    names = [os.path.basename(p) for p in group["trajectories"]]
    for name in names:
        with open(os.path.join(gdir, name), "w") as f:
            json.dump(files[name], f)
    path = os.path.join(gdir, "group.json")
    with open(path + ".tmp", "w") as f:
        json.dump({**group, "trajectories": [os.path.join(gdir, n) for n in names]}, f)
    os.replace(path + ".tmp", path)
    return path


def load_group(path: str, started_version: int = -1) -> Group:
    with open(path) as f:
        d = json.load(f)
    return Group(d["id"], d["task_id"], d["kind"], [Trajectory.load(p) for p in d["trajectories"]], d["rewards"],
                 started_version)
