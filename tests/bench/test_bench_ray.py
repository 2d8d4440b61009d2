"""`kiln bench` on Ray (kiln/bench/on_ray.py): the oracle gives the threaded run's summary on the
session's two-node Ray (tests/conftest.py); `kiln bench --ray` SIGKILLed mid-run resumes without
redoing a finished rollout; with no address it starts a local Ray of its own, on loopback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kiln.bench import run_bench
from kiln.bench.results import read_rows
from tests.bench.test_bench import config, suite  # noqa: F401 - the six validated tasks, as fixtures

# Ray's start-up (once per pytest run) lands in whichever test uses it first.
pytestmark = pytest.mark.timeout(600)

# What a run's wall clock sets; everything else in the summary comes from the rollouts' grades.
CLOCK = {"wall_s", "rollout_s_mean", "efficiency_median"}


def _scores(summary: dict) -> dict:
    out = {k: v for k, v in summary.items() if k not in CLOCK}
    out["axes"] = {axis: {k: v for k, v in vals.items() if "_s" not in k and "time" not in k}
                   for axis, vals in summary["axes"].items()}
    return out


def test_ray_gives_the_threaded_summary_and_sandboxes_run_on_the_task_nodes(suite, config, tmp_path,  # noqa: F811
                                                                           ray_cluster):
    import ray

    threads = run_bench(suite, "oracle", passes=2, workers=2, out_dir=str(tmp_path / "threads"), config=config,
                        progress=False)
    on_ray = run_bench(suite, "oracle", passes=2, workers=2, out_dir=str(tmp_path / "ray"), config=config,
                       progress=False, use_ray=True)
    assert on_ray["n_rollouts"] == 12 and on_ray["errors"] == 0
    assert _scores(on_ray) == _scores(threads)
    rows = read_rows(str(tmp_path / "ray" / "results.jsonl"))
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert {r["node"] for r in rows} <= alive  # each row says which node ran its rollout
    for r in rows:  # the trajectory came back to the driver's out_dir
        assert (tmp_path / "ray" / r["trajectory"]).is_file()


def _kiln(*args, env):
    return [sys.executable, "-m", "kiln", *map(str, args)], {**os.environ, **env}


def test_a_killed_ray_bench_resumes_without_redoing_finished_rollouts(suite, config, tmp_path,  # noqa: F811
                                                                      ray_cluster):
    out, state = tmp_path / "out", f"sandbox.state_dir={config.sandbox.state_dir}"
    args, env = _kiln("bench", "--suite", suite, "--policy", "noop", "--passes", 2, "--ray", "--out", out, state,
                      env={"RAY_ADDRESS": ray_cluster.address})  # attach to the running Ray
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and len(read_rows(str(out / "results.jsonl"))) < 3 and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    before = read_rows(str(out / "results.jsonl"))
    assert 3 <= len(before) < 12, proc.stderr.read().decode()[-2000:]
    s = run_bench(suite, "noop", passes=2, out_dir=str(out), config=config, progress=False, use_ray=True)
    after = read_rows(str(out / "results.jsonl"))
    assert s["skipped"] == len(before) and s["n_rollouts"] == 12
    assert after[: len(before)] == before  # the finished rows stand, none was run again
    assert len({(r["task_id"], r["pass"]) for r in after}) == len(after) == 12


def test_bench_ray_with_no_address_starts_a_local_ray_on_loopback(suite, config, tmp_path):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    one = tmp_path / "one"
    os.makedirs(one)
    first = min(os.listdir(suite))
    os.symlink(os.path.join(suite, first), one / first)
    r = subprocess.run([sys.executable, "-m", "kiln", "bench", "--suite", one, "--policy", "oracle", "--passes", "1",
                        "--ray", "--out", tmp_path / "out", f"sandbox.state_dir={config.sandbox.state_dir}"],
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ray: local Ray, 1 node(s) at 127.0.0.1," in r.stdout
    assert "1 tasks x 1 passes" in r.stdout
