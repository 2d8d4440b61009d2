"""`kiln rl` end to end on a tiny real checkpoint: trainer and worker processes, the weight store,
groups from sandbox forks; and kill -9 of a worker and of the trainer mid-run."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from kiln.config import load_config
from kiln.harness.trajectory import Trajectory
from kiln.rl.launcher import run_rl
from kiln.rl.store import WeightStore


def _cfg(tmp_path, **rl):
    over = {"tasks": 6, "steps": 2, "groups_per_step": 1, "group_size": 2, "workers": 2, "max_lag": 1,
            "timeout_s": 240, "lr": 1e-3, **rl}
    return load_config(None, [f"sandbox.state_dir={tmp_path / 'sb'}", "harness.max_turns=2",
                              "harness.max_turn_tokens=8", *(f"rl.{k}={v}" for k, v in over.items())])


def _trained(rl_dir):
    state = json.loads((rl_dir / "orchestrator.json").read_text())
    return [g for g in state["groups"].values() if g["status"] == "trained"]


def test_rl_runs_trains_publishes_and_never_repeats_a_prompt(tmp_path, tiny_checkpoint):
    rl_dir = tmp_path / "rl"
    cpus = sorted(os.sched_getaffinity(0))  # the trainer and the workers pinned apart (rl/placement.py)
    s = run_rl(_cfg(tmp_path, trainer_cpus=cpus[:1], worker_cpus=cpus[-1:]), str(tiny_checkpoint), str(rl_dir),
               progress=False)
    rows = s["metrics"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(max(r["group_lag"]) <= 1 for r in rows)  # admission bounds staleness
    assert WeightStore(str(rl_dir / "weights")).versions()[-1] == 2
    trained = _trained(rl_dir)
    assert len(trained) == 2 and len({g["task_id"] for g in trained}) == 2
    with open(trained[0]["path"]) as f:
        traj = Trajectory.load(json.load(f)["trajectories"][0])
    assert traj.turns and traj.turns[0].versions and traj.turns[0].routes  # the sampler's token data
    assert set(traj.rewards) >= {"correctness", "length"}
    assert (rl_dir / "checkpoint" / "model.safetensors").exists()
    assert rows[-1]["delta_fraction"] > 0 and "mismatch_kl_k3" in rows[-1]
    held = [json.loads(p.read_text())["version"] for p in (rl_dir / "weights" / "consumers").glob("*.json")]
    assert max(held) >= 1  # workers rebuilt and verified a published delta


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["worker", "trainer"])
def test_kill_9_mid_run_resumes_and_loses_or_repeats_nothing(tmp_path, tiny_checkpoint, victim):
    rl_dir = tmp_path / "rl"
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(run_rl(_cfg(tmp_path, steps=3), str(tiny_checkpoint),
                                                          str(rl_dir), progress=False)))
    t.start()
    deadline = time.monotonic() + 240
    killed = None
    while killed is None and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.2)
        metrics = rl_dir / "metrics.jsonl"
        ready = (metrics.exists() and metrics.read_text().strip()) if victim == "trainer" else \
            (rl_dir / "orchestrator.json").exists() and '"running"' in (rl_dir / "orchestrator.json").read_text()
        if ready:
            p = next((c for c in mp.active_children() if c.name.startswith(victim)), None)
            if p is not None:
                os.kill(p.pid, signal.SIGKILL)
                killed = p.name
    t.join(300)
    assert killed, "never found the process to kill"
    assert out, "the run did not finish"
    assert out["restarts"][killed] >= 1
    assert [r["step"] for r in out["metrics"]] == [1, 2, 3]
    trained = _trained(rl_dir)
    assert len(trained) == 3 and len({g["task_id"] for g in trained}) == 3  # none twice, none lost
