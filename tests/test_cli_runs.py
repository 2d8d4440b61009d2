"""The commands no other test runs, run for real on tiny inputs through the `kiln` app: the task
generators (with --n, and mutate/delete-feature/mine's old --max), the sandbox demo, a bench of the
controls, SFT on a tiny checkpoint, `kiln serve` as a process, and the error lines an unreachable
endpoint gets."""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from typer.testing import CliRunner

from kiln.cli import app
from kiln.tasks.record import load_suite
from tests.pretrain.test_sft import oracle_like
from tests.tasks import test_delete_feature, test_mutate
from tests.tasks.test_mine import CALC, CALC2, TESTS, TESTS2, commit, git

runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result


@pytest.fixture(scope="module")
def state(tmp_path_factory, tcfg):
    return f"sandbox.state_dir={tcfg.state_dir}"


@pytest.fixture(scope="module")
def toy_suite(tmp_path_factory, state):
    out = tmp_path_factory.mktemp("toy")
    result = invoke("tasks", "toy", "--out", out, "--n", 2, "--level", 1, state)
    assert result.exit_code == 0, result.output
    assert "2 kept" in result.stdout
    return out


def closed_port() -> int:
    """A loopback port nothing listens on: bound once by us, then released."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_toy_makes_validated_tasks_and_refuses_a_count_below_one(toy_suite, tmp_path):
    tasks = load_suite(str(toy_suite))
    assert len(tasks) == 2 and {t.difficulty for t in tasks} == {1}
    result = invoke("tasks", "toy", "--out", tmp_path, "--n", 0)
    assert result.exit_code == 2 and "--n" in result.stderr and not list(tmp_path.iterdir())


@pytest.mark.parametrize("policy, score", [("oracle", "1.000"), ("noop", "0.000")])
def test_bench_runs_the_controls(toy_suite, tmp_path, state, policy, score):
    result = invoke("bench", "--suite", toy_suite, "--policy", policy, "--passes", 1, "--out", tmp_path, state)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == f"2 tasks x 1 passes: correctness {score}; report: {tmp_path}/report.md"
    assert json.loads((tmp_path / "summary.json").read_text())["n_rollouts"] == 2


def test_bench_whose_every_rollout_fails_is_an_error(toy_suite, tmp_path, state):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    result = invoke("bench", "--suite", toy_suite, "--policy", "openai", "--passes", 1, "--out", tmp_path,
                    f'policy.base_url="{url}"', "policy.max_retries=0", state)
    assert result.exit_code == 2, result.output
    line = result.stderr.splitlines()[-1]  # after the progress bar's lines
    assert line.startswith(f"error: 2 rollout(s) failed, the last with PolicyError: {url}/chat/completions failed")
    assert line.endswith(f"see {tmp_path}/errors.jsonl (a rerun retries them)")


def test_rl_and_bench_at_a_bad_ray_address_are_error_lines_within_seconds(tiny_checkpoint, toy_suite, tmp_path, state):
    """Nothing listening, and a port that answers but is no Ray head (an HTTP server, as the dashboard's
    port is): an error line each within seconds, where ray.init alone retries for many minutes. In
    subprocesses, since this one may be attached to the session's Ray."""
    import http.server
    import threading

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    # multi-node off: Ray would swap 127.0.0.1 for the host's routable address
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    closed = closed_port()
    cases = [
        (["rl", "--checkpoint", tiny_checkpoint, "--address", f"127.0.0.1:{closed}", f"run.out_dir={tmp_path}"],
         (f"error: cannot start or reach the Ray cluster at '127.0.0.1:{closed}': nothing answers at "
          f"127.0.0.1:{closed} (Connection refused)")),
        (["bench", "--suite", toy_suite, "--policy", "oracle", "--address", f"127.0.0.1:{web.server_port}",
          "--out", tmp_path / "bench", state],
         (f"error: cannot start or reach the Ray cluster at '127.0.0.1:{web.server_port}': "
          f"127.0.0.1:{web.server_port} takes connections but is not a Ray head's GCS")),
    ]
    try:
        for args, error in cases:
            t = time.monotonic()
            r = subprocess.run([sys.executable, "-m", "kiln", *map(str, args)], env=env, capture_output=True, text=True,
                               timeout=120, check=False)
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
            assert r.stderr.splitlines()[-1].startswith(error), r.stderr[-3000:]
            assert time.monotonic() - t < 60  # imports included; the probe itself gives up after 10 s
    finally:
        web.shutdown()


def test_serve_refuses_a_port_out_of_range(tiny_checkpoint):
    result = invoke("serve", "--checkpoint", tiny_checkpoint, "--port", 70000)
    assert result.exit_code == 2 and "Invalid value for '--port'" in result.stderr


def test_agent_mistakes_are_error_lines(tmp_path, state):
    (tmp_path / "repo").mkdir()
    url = f"http://127.0.0.1:{closed_port()}/v1"
    cases = [
        (["--repo", tmp_path / "nope"], f"error: --repo '{tmp_path / 'nope'}' is not a directory"),
        (["--repo", tmp_path / "repo", "--policy", "oracle", "--patch", tmp_path / "gold.patch"],
         f"error: --patch {tmp_path / 'gold.patch'}: No such file or directory"),
        (["--repo", tmp_path / "repo", "--policy", "openai", f'policy.base_url="{url}"', "policy.max_retries=0"],
         f"error: {url}/chat/completions failed after 1 attempts"),
    ]
    for args, error in cases:
        result = invoke("agent", "--prompt", "fix it", *args, state)
        assert result.exit_code == 2, result.output
        [line] = result.stderr.splitlines()
        assert line.startswith(error)


def test_mutate_counts_with_n(tmp_path, state):
    repo = test_mutate.make_repo(tmp_path / "src")
    result = invoke("tasks", "mutate", "--repo", repo, "--out", tmp_path / "out", "--n", 1, "--seed", 1, state)
    assert result.exit_code == 0, result.output
    [task] = load_suite(str(tmp_path / "out"))
    assert task.category == "bugfix" and task.provenance["generator"] == "mutate"


def test_delete_feature_counts_with_n(tmp_path, state):
    repo = test_delete_feature.make_repo(tmp_path / "src")
    result = invoke("tasks", "delete-feature", "--repo", repo, "--out", tmp_path / "out", "--n", 1, state)
    assert result.exit_code == 0, result.output
    [task] = load_suite(str(tmp_path / "out"))
    assert task.category == "feature" and task.prompt.startswith("Add `mini.")


def test_mine_counts_with_n_and_still_takes_max(tmp_path, state):
    repo = tmp_path / "calc"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit(repo, "Initial calculator", {"calc.py": CALC, "tests/test_calc.py": TESTS})
    commit(repo, "Add mul", {"calc.py": CALC2, "tests/test_calc.py": TESTS2})
    commit(repo, "Add sub", {"calc.py": CALC2 + "\n\ndef sub(a, b):\n    return a - b\n",
                             "tests/test_calc.py": TESTS2.replace("add, mul", "add, mul, sub")
                             + "\n\ndef test_sub():\n    assert sub(3, 2) == 1\n"})
    for flag in ("--n", "--max"):  # --max: the old spelling, kept working but hidden
        out = tmp_path / flag.strip("-")
        result = invoke("tasks", "mine", "--repo", repo, "--out", out, flag, 1, state)
        assert result.exit_code == 0, result.output
        [task] = load_suite(str(out))  # of two minable commits, the newest
        assert task.prompt == "Add sub"
    for cmd in ("mine", "mutate", "delete-feature"):
        shown = invoke("tasks", cmd, "--help").stdout
        assert "--n" in shown and "--max" not in shown


def test_sandbox_demo(state):
    result = invoke("sandbox", "demo", state)
    assert result.exit_code == 0, result.output
    assert "1 failed" in result.stdout and "1 passed" in result.stdout and "original still: buggy" in result.stdout
    assert "new sandbox sees the fix: True" in result.stdout


def test_sft_fine_tunes_a_checkpoint_on_given_trajectories(tiny_checkpoint, tmp_path, state):
    trajs = tmp_path / "trajs"
    trajs.mkdir()
    for i in range(2):
        oracle_like(f"Fix the bug in pkg/m{i}.py.", i).save(str(trajs / f"t{i}.json"))
    phases = '[{name="sft", kind="sft", steps=2, seq_len=320, batch_size=2, lr=3e-3, warmup_steps=1}]'
    result = invoke("sft", "--checkpoint", tiny_checkpoint, "--trajectories", trajs, "--oracle-tasks", 0,
                    f"pretrain.phases={phases}", "pretrain.device=cpu", f"run.out_dir={tmp_path}", state)
    assert result.exit_code == 0, result.output
    assert "final loss on assistant tokens: " in result.stdout
    assert result.stdout.splitlines()[-1] == f"checkpoint: {tmp_path}/tiny/sft/checkpoint"
    assert (tmp_path / "tiny" / "sft" / "checkpoint" / "model.safetensors").is_file()
    assert len((tmp_path / "tiny" / "sft" / "metrics.jsonl").read_text().splitlines()) == 2


def _ignore_sigint() -> None:  # what a non-interactive shell does to a job it starts with &
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_serve_answers_on_loopback_and_stops_on_ctrl_c(tiny_checkpoint, sig):
    """The real entry point in its own process: it says where it listens, serves, and Ctrl-C or
    SIGTERM ends it cleanly, also when started in the background (SIGINT inherited as ignored)."""
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", "--checkpoint", str(tiny_checkpoint), "--port", "0",
                             "--model-name", "tiny-test"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_ignore_sigint)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("serving tiny-test at http://127.0.0.1:"), (line, proc.poll())
        url = line.split()[3]
        with urllib.request.urlopen(url + "/models", timeout=30) as r:
            assert [m["id"] for m in json.load(r)["data"]] == ["tiny-test"]
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.strip() == "stopping" and "Traceback" not in err


@pytest.mark.slow  # a trainer and a worker actor
@pytest.mark.timeout(600)  # the first user of the session's Ray pays its start-up
def test_rl_trains_a_checkpoint_through_the_command(tiny_checkpoint, tmp_path, state, ray_cluster):
    """`kiln rl` itself, on the session's Ray: one step of one group of two, the checkpoint."""
    over = {"tasks": 2, "steps": 1, "groups_per_step": 1, "group_size": 2, "workers": 1, "timeout_s": 240}
    result = invoke("rl", "--checkpoint", tiny_checkpoint, f"run.out_dir={tmp_path}", state, "harness.max_turns=2",
                    "harness.max_turn_tokens=8", *(f"rl.{k}={v}" for k, v in over.items()))
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-2].startswith("rl: 1 steps; last reward ")
    # the trainer's node says where it is, when it is not the driver's (both are this machine here)
    assert result.stdout.splitlines()[-1].startswith(f"checkpoint: {tmp_path}/tiny/rl/checkpoint")
    assert len((tmp_path / "tiny" / "rl" / "metrics.jsonl").read_text().splitlines()) == 1
    again = invoke("rl", "--checkpoint", tiny_checkpoint, f"run.out_dir={tmp_path}", state, "harness.max_turns=2",
                   "harness.max_turn_tokens=8", *(f"rl.{k}={v}" for k, v in over.items()))
    assert again.exit_code == 0, again.output  # a finished run resumes: nothing to roll out, the checkpoint again
    assert again.stdout.splitlines()[-2:] == result.stdout.splitlines()[-2:]
