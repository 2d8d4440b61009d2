"""`kiln rl` on Ray, end to end on a tiny real checkpoint: the trainer and the rollout workers as
actors on the session's two-node Ray (tests/conftest.py), groups from sandbox forks, weights
through the store; a worker's process SIGKILLed and the trainer ray.kill-ed mid-run; the roles on
the nodes their resources name, with the weights through s3:// (moto's server on loopback)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from kiln.config import load_config
from kiln.harness.trajectory import Trajectory
from kiln.rl.launcher import RLError, actor_name, prepare_tasks, run_rl
from kiln.rl.store import WeightStore

# Ray's start-up (once per pytest run) lands in whichever test uses it first.
pytestmark = pytest.mark.timeout(600)


def _cfg(tmp_path, *extra, **rl):
    over = {"tasks": 6, "steps": 2, "groups_per_step": 1, "group_size": 2, "workers": 2, "max_lag": 1,
            "timeout_s": 240, "lr": 1e-3, **rl}
    return load_config(None, [f"sandbox.state_dir={tmp_path / 'sb'}", "harness.max_turns=2",
                              "harness.max_turn_tokens=8", *(f"rl.{k}={v}" for k, v in over.items()), *extra])


@pytest.fixture(scope="module")
def rl_dirs(tmp_path_factory):
    """A fresh run dir per call, holding the module's six toy prompts (made once: they take a while)."""
    tasks = prepare_tasks(_cfg(tmp_path_factory.mktemp("made")), tmp_path_factory.mktemp("tasks"), progress=False)

    def make(tmp_path):
        shutil.copytree(tasks, tmp_path / "rl" / "tasks")
        return tmp_path / "rl"
    return make


def _trained(rl_dir):
    state = json.loads((rl_dir / "orchestrator.json").read_text())
    return [g for g in state["groups"].values() if g["status"] == "trained"]


@pytest.mark.parametrize("dtype, speculative, lookup, kv_dtype", [
    ("float32", False, 0, "float32"), pytest.param("bfloat16", False, 0, "float32", marks=pytest.mark.slow),
    ("float32", True, 0, "float32"), ("float32", False, 4, "bfloat16")])
def test_rl_runs_trains_publishes_and_never_repeats_a_prompt(tmp_path, tiny_checkpoint, ray_cluster, rl_dirs, dtype,
                                                            speculative, lookup, kv_dtype):
    rl_dir = rl_dirs(tmp_path)
    cpus = sorted(os.sched_getaffinity(0))  # the trainer and the workers pinned apart (rl/placement.py)
    # (near-greedy with lookup: the untrained model's replies then repeat themselves, which drafts copy)
    s = run_rl(_cfg(tmp_path, f"engine.dtype={dtype}", f"engine.lookup={lookup}", f"engine.kv_dtype={kv_dtype}",
                    trainer_cpus=cpus[:1], worker_cpus=cpus[-1:], speculative=speculative, steps=3,
                    **({"temperature": 0.05} if lookup else {})),
               str(tiny_checkpoint), str(rl_dir), progress=False)
    # with rl.speculative every worker that rolled out drafted with the checkpoint's MTP, with
    # engine.lookup workers drafted where their sequences repeated themselves; without either none did
    steps = [d["steps"] for d in s["drafts"].values()]
    assert steps and (all(steps) if speculative else any(steps) if lookup else not any(steps))
    rows = s["metrics"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(max(r["group_lag"]) <= 1 for r in rows)  # admission bounds staleness
    store = WeightStore(str(rl_dir / "weights"))
    assert store.versions()[-1] == 3
    # what the workers sample with is what is published: the fp32 master, or its bf16 rounding
    assert {t["dtype"] for t in store.manifest(3)["tensors"].values()} == {dtype}
    trained = _trained(rl_dir)
    assert len(trained) == 3 and len({g["task_id"] for g in trained}) == 3
    with open(trained[0]["path"]) as f:  # the driver keeps each group the workers sent back
        traj = Trajectory.load(json.load(f)["trajectories"][0])
    assert traj.turns and traj.turns[0].versions and traj.turns[0].routes  # the sampler's token data
    assert set(traj.rewards) >= {"correctness", "length"}
    assert (rl_dir / "checkpoint" / "model.safetensors").exists()
    assert rows[-1]["delta_fraction"] > 0 and "mismatch_kl_k3" in rows[-1]
    held = [json.loads(p.read_text())["version"] for p in (rl_dir / "weights" / "consumers").glob("*.json")]
    # workers rebuilt and verified a published delta: at max_lag 1 the third step's group waits for
    # version 1 (two steps could finish on version 0 and end the run before a worker's next poll)
    assert max(held) >= 1
    assert s["restarts"] == {"trainer": 0, "worker-0": 0, "worker-1": 0}


def test_speculative_workers_without_a_drafter_are_refused_at_once(tmp_path, tiny_checkpoint):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_checkpoint, bare, ignore=shutil.ignore_patterns("mtp.safetensors"))
    with pytest.raises(RLError, match="has none .no mtp.safetensors.: set rl.speculative=false"):
        run_rl(_cfg(tmp_path, speculative=True), str(bare), str(tmp_path / "rl"), progress=False)
    assert not (tmp_path / "rl").exists()  # refused before any work


@pytest.mark.parametrize("over, error", [
    (["rl.worker_resources={GPU=1}"], r"no node can run the rollout worker \(rl.worker_resources = \{'GPU': 1.0\}\)"),
    # each fits (the two nodes have 2 CPUs each), all together not: a placement group would wait forever
    (["rl.trainer_resources={CPU=2}", "rl.worker_resources={CPU=1.5}"],
     r"the trainer and 2 rollout worker\(s\) need \{'CPU': 5.0\} in all, the cluster has \{'CPU': 4.0\}"),
])
def test_a_role_no_node_can_hold_is_refused_at_once(tmp_path, tiny_checkpoint, ray_cluster, over, error):
    t = time.monotonic()
    with pytest.raises(RLError, match=error):
        run_rl(_cfg(tmp_path, *over), str(tiny_checkpoint), str(tmp_path / "rl"), progress=False)
    assert time.monotonic() - t < 30  # not left pending until rl.timeout_s
    assert not (tmp_path / "rl").exists()  # refused before any task was made


def _pid_of_running_worker(rl_dir) -> int | None:
    """The process of a worker that is rolling out a group, from the orchestrator's state."""
    path = rl_dir / "orchestrator.json"
    if not path.exists():
        return None
    running = [g for g in json.loads(path.read_text())["groups"].values() if g["status"] == "running"]
    return int(running[0]["worker"].rsplit(".", 1)[1]) if running else None


def test_a_trainer_that_hangs_mid_run_is_an_error_naming_it_after_timeout_s(tmp_path, tiny_checkpoint, ray_cluster,
                                                                           rl_dirs):
    """The trainer's process is stopped (SIGSTOP) once it has trained a step. The workers, refused
    new groups, keep answering their version queries; that is no progress, so the run ends with an
    error naming the trainer rl.timeout_s later instead of waiting forever."""
    import ray

    rl_dir = rl_dirs(tmp_path)
    errors: list[BaseException] = []

    def run():
        try:
            run_rl(_cfg(tmp_path, steps=3, timeout_s=20), str(tiny_checkpoint), str(rl_dir), progress=False)
        except BaseException as e:  # noqa: BLE001 - asserted on below
            errors.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline, pid = time.monotonic() + 240, None
    try:
        while pid is None and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.2)
            if (rl_dir / "metrics.jsonl").exists() and (rl_dir / "metrics.jsonl").read_text().strip():
                pid = ray.get(ray.get_actor(actor_name("trainer", rl_dir)).ready.remote(), timeout=60)["pid"]
                os.kill(pid, signal.SIGSTOP)
        assert pid is not None, "the trainer never trained a step"
        t.join(120)  # 20 s without progress, and the actors' stop
        assert not t.is_alive(), "the run kept waiting on a stopped trainer"
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert len(errors) == 1 and isinstance(errors[0], RLError), errors
    assert "no role started, no group finished and no step trained for 20 s" in str(errors[0])
    assert "the trainer on " in str(errors[0]) and "training on groups" in str(errors[0])


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["worker", "trainer"])
def test_a_role_killed_mid_run_is_restarted_and_nothing_is_lost_or_repeated(tmp_path, tiny_checkpoint, victim,
                                                                            ray_cluster, rl_dirs):
    """A worker's process gets SIGKILL while it rolls out a group; the trainer is ray.kill-ed (restart
    allowed) once it has trained a step. The run completes with every prompt trained exactly once."""
    import ray

    rl_dir = rl_dirs(tmp_path)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(run_rl(_cfg(tmp_path, steps=3), str(tiny_checkpoint),
                                                          str(rl_dir), progress=False)))
    t.start()
    deadline, killed = time.monotonic() + 240, None
    while killed is None and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.2)
        if victim == "worker":
            pid = _pid_of_running_worker(rl_dir)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed = pid
        elif (rl_dir / "metrics.jsonl").exists() and (rl_dir / "metrics.jsonl").read_text().strip():
            ray.kill(ray.get_actor(actor_name("trainer", rl_dir)), no_restart=False)
            killed = "trainer"
    t.join(300)
    assert killed, "never found the role to kill"
    assert out, "the run did not finish"
    assert sum(out["restarts"].values()) >= 1 and (victim == "worker" or out["restarts"]["trainer"] >= 1)
    assert [r["step"] for r in out["metrics"]] == [1, 2, 3]
    trained = _trained(rl_dir)
    assert len(trained) == 3 and len({g["task_id"] for g in trained}) == 3  # none twice, none lost
    ids = [i for r in out["metrics"] for i in r["groups"]]
    assert len(ids) == len(set(ids)) == 3


@pytest.mark.slow
def test_a_worker_whose_node_is_removed_mid_run_is_placed_again_and_nothing_is_lost_or_repeated(
        tmp_path, tiny_checkpoint, ray_cluster, rl_dirs, capsys):
    """The worker runs on a node of its own (the custom resource doomed_node); that node is removed,
    all its processes SIGKILLed, while the worker rolls out a group, and a node with the same resource
    joins. Ray places the worker's bundle there and restarts it; the driver re-queues the group and
    says which role was lost on which node."""
    rl_dir = rl_dirs(tmp_path)
    small = {"num_cpus": 1, "resources": {"doomed_node": 1}, "object_store_memory": 80 << 20}
    doomed, spare = ray_cluster.add_node(**small), None
    out: dict = {}
    cfg = _cfg(tmp_path, "rl.trainer_resources={CPU=1, trainer_node=1}", "rl.worker_resources={CPU=0.5, doomed_node=1}",
               workers=1, steps=2)
    t = threading.Thread(target=lambda: out.update(run_rl(cfg, str(tiny_checkpoint), str(rl_dir), progress=False)))
    try:
        t.start()
        deadline, removed = time.monotonic() + 240, False
        while not removed and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.2)
            if _pid_of_running_worker(rl_dir) is not None:
                ray_cluster.remove_node(doomed, allow_graceful=False)
                removed = True
        assert removed, "never saw the worker roll out a group"
        spare = ray_cluster.add_node(**small)
        t.join(300)
    finally:
        if spare is not None:
            ray_cluster.remove_node(spare)
    assert out, "the run did not finish"
    assert out["restarts"] == {"trainer": 0, "worker-0": 1}
    assert out["nodes"]["worker-0"] == spare.node_id  # its bundle went to the node that joined
    assert [r["step"] for r in out["metrics"]] == [1, 2]
    trained = _trained(rl_dir)
    assert len(trained) == 2 and len({g["task_id"] for g in trained}) == 2  # none twice, none lost
    ids = [i for r in out["metrics"] for i in r["groups"]]
    assert len(ids) == len(set(ids)) == 2
    lost = [ln for ln in capsys.readouterr().out.splitlines() if "re-queued groups" in ln]
    assert len(lost) == 1 and "worker-0 on node " in lost[0] and f"({doomed.node_id[:8]}" in lost[0], lost


@pytest.fixture(scope="module")
def s3_store(s3_endpoint):
    """The variables every role needs to reach moto's server (they go to the actors through the
    job's runtime_env, as a cluster's nodes would have them set)."""
    return {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1"}


def test_roles_run_on_the_nodes_their_resources_name_and_weights_travel_through_s3(
        tmp_path, tiny_checkpoint, ray_cluster, s3_store, monkeypatch, rl_dirs):
    import ray

    rl_dir = rl_dirs(tmp_path)
    for k, v in s3_store.items():
        monkeypatch.setenv(k, v)
    ray.shutdown()  # the same cluster, with the S3 variables in every actor's environment
    ray.init(address=ray_cluster.address, runtime_env={"env_vars": s3_store})
    try:
        s = run_rl(_cfg(tmp_path, "rl.trainer_resources={CPU=1, trainer_node=1}",
                        "rl.worker_resources={CPU=0.5, rollout_node=1}", steps=1, store="s3://kiln/multi-node"),
                   str(tiny_checkpoint), str(rl_dir), progress=False)
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    finally:
        ray.shutdown()
        ray.init(address=ray_cluster.address)
    assert [r["step"] for r in s["metrics"]] == [1]
    assert "trainer_node" in nodes[s["nodes"]["trainer"]]
    assert all("rollout_node" in nodes[s["nodes"][w]] for w in ("worker-0", "worker-1"))
    assert s["nodes"]["trainer"] != s["nodes"]["worker-0"]
    store = WeightStore("s3://kiln/multi-node")
    assert store.versions()[-1] == 1 and not (rl_dir / "weights").exists()
    held = [json.loads(store.backend.get(k))["version"] for k in store.backend.list("consumers/")]
    assert len(held) == 2  # both workers took their weights from S3
    assert any(Path(os.environ["KILN_SHIP_CACHE"]).iterdir())  # the task suite and checkpoint went by Ray
