"""run_bench end to end on six real tiny tasks: oracle and no-op controls, reports, resume after
SIGKILL, abort on a dead endpoint."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kiln.bench import BenchError, run_bench
from kiln.bench.metrics import first_error_then, pass_at_k, summarize
from kiln.bench.results import read_rows
from kiln.config import Config, HarnessConfig, PolicyConfig
from kiln.tasks.patch import make_patch
from kiln.tasks.record import Task, save_task
from kiln.tasks.validate import validate

# (buggy, fixed, test) per task; {n} names the module
CASES = [
    ("def f(a, b):\n    return a - b\n", "def f(a, b):\n    return a + b\n", "assert f(2, 3) == 5"),
    ("def f(w, h):\n    return w + h\n", "def f(w, h):\n    return w * h\n", "assert f(3, 4) == 12"),
    ("def f(xs):\n    return xs[0]\n", "def f(xs):\n    return xs[-1]\n", "assert f([1, 2, 3]) == 3"),
    ("def f(x):\n    return x < 10\n", "def f(x):\n    return x <= 10\n", "assert f(10)"),
    ("def f(n):\n    return n % 2 == 1\n", "def f(n):\n    return n % 2 == 0\n", "assert f(4) and not f(3)"),
    ("def f(s):\n    return s.upper\n", "def f(s):\n    return s.upper()\n", "assert f('a') == 'A'"),
]
CATEGORIES = ["bugfix", "bugfix", "feature", "refactor", "feature", "bugfix"]
HCFG = HarnessConfig(tools=["read_file", "edit_file", "write_file", "run_shell", "grep", "todo"])


def build_task(root: str, n: int) -> Task:
    buggy, fixed, check = CASES[n]
    src = os.path.join(root, "src", f"r{n}")
    os.makedirs(os.path.join(src, "pkg"))
    open(os.path.join(src, "pkg", "__init__.py"), "w").close()
    pad = "\n\nVERSION = 1\n"
    with open(os.path.join(src, "pkg", f"m{n}.py"), "w") as fh:
        fh.write(buggy + pad)
    tests = (f"from pkg.m{n} import f\n\n\ndef test_f():\n    {check}\n\n\n"
             f"def test_import():\n    import pkg.m{n}\n")
    task = Task(id=f"task-{n}", prompt=f"f in pkg/m{n}.py is wrong; fix it.", category=CATEGORIES[n],
                difficulty=1 + n % 3)
    return save_task(task, os.path.join(root, "suite"), repo_src=src, hidden={f"tests/test_m{n}.py": tests},
                     solution=make_patch(f"pkg/m{n}.py", buggy + pad, fixed + pad))


@pytest.fixture(scope="module")
def config(tcfg):
    return Config(sandbox=tcfg.model_copy(update={"timeout_s": 30, "idle_timeout_s": 20}), harness=HCFG)


@pytest.fixture(scope="module")
def suite(tmp_path_factory, config):
    root = str(tmp_path_factory.mktemp("bsuite"))
    tasks = [build_task(root, n) for n in range(len(CASES))]
    with ThreadPoolExecutor(2) as ex:
        checks = list(ex.map(lambda t: validate(t, config.sandbox), tasks))
    for t, v in zip(tasks, checks):
        assert v.ok, (t.id, v.reason)
        t.fail_to_pass, t.pass_to_pass = v.fail_to_pass, v.pass_to_pass
        with open(os.path.join(t.path, "task.toml"), "w") as fh:
            fh.write(t.to_toml())
    return os.path.join(root, "suite")


def keys(path: str) -> list[tuple[str, int]]:
    return [(r["task_id"], r["pass"]) for r in read_rows(path)]


def check_outputs(out: str, n: int) -> dict:
    assert len(keys(os.path.join(out, "results.jsonl"))) == n == len(set(keys(os.path.join(out, "results.jsonl"))))
    for name in ("report.md", "plots/accuracy_by_category.png", "plots/best_of_k.png",
                 "plots/tokens_vs_accuracy.png"):
        assert os.path.getsize(os.path.join(out, name)) > 1000, name
    with open(os.path.join(out, "plots", "best_of_k.png"), "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out, "summary.json")) as fh:
        return json.load(fh)


def test_oracle_and_noop_controls(suite, config, tmp_path):
    s = run_bench(suite, "oracle", passes=2, workers=2, out_dir=str(tmp_path / "oracle"), config=config, progress=False)
    assert s["correctness_mean"] == 1.0 and s["best_of_k"] == {"1": 1.0, "2": 1.0}
    assert s["n_tasks"] == 6 and s["passes"] == 2 and s["n_rollouts"] == 12 and s["complete"]
    assert set(s["by_category"]) == {"bugfix", "feature", "refactor"} and set(s["by_difficulty"]) == {"1", "2", "3"}
    assert s["axes"]["quality"]["diff_ratio"] == 1.0 and s["axes"]["behaviour"]["tests_before_finish"] == 1.0
    assert s["axes"]["efficiency"]["tool_calls"] > 1 and s["stop_reasons"] == {"finished": 12}
    assert s["after_first_error"] == {"none": {"rollouts": 12, "correctness_mean": 1.0}}
    assert check_outputs(str(tmp_path / "oracle"), 12) == s
    report = (tmp_path / "oracle" / "report.md").read_text()
    assert "## By category" in report and "## By difficulty" in report and "plots/best_of_k.png" in report
    assert "## After the first failed tool call" in report and "| none | 12 | 1.0" in report
    row = read_rows(str(tmp_path / "oracle" / "results.jsonl"))[0]
    traj = json.loads((tmp_path / "oracle" / row["trajectory"]).read_text())
    assert traj["metadata"]["grades"]["correctness"]["resolved"] and traj["rewards"] == {"correctness": 1.0}
    seeds = {r["seed"] for r in read_rows(str(tmp_path / "oracle" / "results.jsonl")) if r["task_id"] == "task-0"}
    assert len(seeds) == 2  # passes differ

    s = run_bench(suite, "noop", passes=2, workers=2, out_dir=str(tmp_path / "noop"), config=config, progress=False)
    assert s["correctness_mean"] == 0.0 and s["best_of_k"] == {"1": 0.0, "2": 0.0}
    assert s["axes"]["efficiency"]["tool_calls"] == 0.0 and s["axes"]["quality"]["lines_changed"] == 0.0
    check_outputs(str(tmp_path / "noop"), 12)
    with pytest.raises(BenchError, match="holds a run of"):  # another policy must not mix into this log
        run_bench(suite, "oracle", passes=2, workers=2, out_dir=str(tmp_path / "noop"), config=config, progress=False)


DRIVER = textwrap.dedent("""
    import sys
    from kiln.bench import run_bench
    from kiln.config import Config, HarnessConfig, SandboxConfig
    cfg = Config(sandbox=SandboxConfig(state_dir=sys.argv[3], memory_mb=512, disk_mb=64, tmp_mb=64),
                 harness=HarnessConfig(tools=["read_file", "edit_file", "write_file", "run_shell", "grep", "todo"]))
    run_bench(sys.argv[1], "noop", passes=2, workers=2, out_dir=sys.argv[2], config=cfg, progress=False)
""")


def test_resume_after_sigkill(suite, config, tmp_path):
    """The no-op control (the cheapest rollout) run in a subprocess, SIGKILLed after 3 results."""
    out = str(tmp_path / "run")
    results = os.path.join(out, "results.jsonl")
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, suite, out, str(tmp_path / "state")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(keys(results)) < 3:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "no results within 60 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    before = read_rows(results)
    assert 3 <= len(before) < 12, "killed too late to test resuming"
    with open(results, "a") as fh:
        fh.write('{"task_id": "task-5", "pass": 1, "corr')  # a write torn by the kill
    s = run_bench(suite, "noop", passes=2, workers=2, out_dir=out, config=config, progress=False)
    after = read_rows(results)
    assert after[:len(before)] == before  # finished rollouts were kept as they were...
    done_before = {(r["task_id"], r["pass"]) for r in before}
    redone = [k for k in keys(results)[len(before):] if k in done_before]
    assert not redone  # ...and not run again
    assert s["skipped"] == len(before) and s["n_rollouts"] == 12 and s["complete"]
    check_outputs(out, 12)
    s = run_bench(suite, "noop", passes=2, workers=2, out_dir=out, config=config, progress=False)
    assert s["skipped"] == 12 and len(keys(results)) == 12  # nothing left to do


def test_dead_endpoint_aborts_the_run(suite, config, tmp_path):
    cfg = config.model_copy(update={"policy": PolicyConfig(base_url="http://127.0.0.1:9/v1", max_retries=0,
                                                           timeout_s=5)})
    out = str(tmp_path / "dead")
    with pytest.raises(BenchError, match="in a row failed"):
        run_bench(suite, "openai", passes=2, workers=1, out_dir=out, config=cfg, progress=False)
    assert keys(os.path.join(out, "results.jsonl")) == []  # failures are not results: a rerun retries them
    with open(os.path.join(out, "errors.jsonl")) as fh:
        errors = [json.loads(line) for line in fh]
    assert 5 <= len(errors) <= 6 and "PolicyError" in errors[0]["error"]  # the rest were cancelled
    # (one more may have started while the fifth failure was being handled)
    with pytest.raises(BenchError, match="unknown policy"):
        run_bench(suite, "gpt", out_dir=out, config=cfg, progress=False)


def test_pass_at_k():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4) and pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(3, 0, 3) == 0.0 and pass_at_k(3, 1, 3) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_summary_of_mixed_rows():
    def row(task, p, ok, cat, **quality):
        return {"task_id": task, "pass": p, "category": cat, "difficulty": 1, "stop_reason": "finished",
                "correctness": {"score": float(ok), "resolved": bool(ok)}, "quality": quality,
                "efficiency": {"generated_tokens": 100 * (p + 1), "tool_calls": 3, "malformed_calls": p},
                "behaviour": {}, "timings": {"rollout_s": 1.0}}
    rows = [row("a", 0, 1, "bugfix", diff_ratio=2.0), row("a", 1, 0, "bugfix"), row("a", 2, 0, "bugfix"),
            row("b", 0, 1, "feature", diff_ratio=1.0), row("b", 1, 1, "feature"), row("b", 2, 1, "feature")]
    s = summarize(rows, n_tasks=3, passes=3)
    assert s["correctness_mean"] == pytest.approx((1 / 3 + 1) / 2) and not s["complete"]
    assert s["best_of_k"] == pytest.approx({"1": (1 / 3 + 1) / 2, "2": (2 / 3 + 1) / 2, "3": 1.0})
    assert s["mean_at_k"]["1"] == 1.0 and s["pass_means"] == {"0": 1.0, "1": 0.5, "2": 0.5}
    assert s["by_category"]["bugfix"]["correctness_mean"] == pytest.approx(1 / 3)
    assert s["axes"]["quality"] == {"diff_ratio": 1.5}  # averaged over the rows that report it
    assert s["efficiency_median"]["generated_tokens"] == 200.0
    assert s["tool_call_parse_rate"] == pytest.approx(18 / (18 + 6))  # every block written, pooled over rollouts
    for r in rows:
        r["efficiency"] = {"tool_calls": 0, "malformed_calls": 0}  # noop: no block written at all
    assert summarize(rows, n_tasks=3, passes=3)["tool_call_parse_rate"] is None


def test_what_follows_the_first_failed_call_is_classified_and_counted():
    from kiln.harness.trajectory import ToolRecord

    def call(turn, args, ok):
        return ToolRecord(turn, f"c{turn}", "edit_file", {"old_text": args}, ok, 0.0, 10)
    assert first_error_then([call(0, "a", True), call(1, "b", True)]) == "none"
    assert first_error_then([call(0, "a", True), call(1, "b", False), call(2, "b", False)]) == "repeated"
    assert first_error_then([call(1, "b", False), call(2, "c", True), call(3, "b", False)]) == "changed"
    assert first_error_then([call(0, "a", True), call(1, "b", False)]) == "stopped"
    # two calls in the turn after: the failed one among them is a repeat
    assert first_error_then([call(1, "b", False), call(2, "c", True), call(2, "b", False)]) == "repeated"
    rows = [{"task_id": t, "pass": 0, "correctness": {"score": ok}, "after_error": a}
            for t, ok, a in [("a", 1.0, "none"), ("b", 0.0, "repeated"), ("c", 1.0, "changed"), ("d", 0.0, "changed")]]
    assert summarize(rows + [{"task_id": "e", "pass": 0, "correctness": {"score": 0.0}}], 5, 1)["after_first_error"] == {
        "none": {"rollouts": 1, "correctness_mean": 1.0}, "repeated": {"rollouts": 1, "correctness_mean": 0.0},
        "changed": {"rollouts": 2, "correctness_mean": 0.5}}  # a row from before the field is left out


def test_standard_errors_are_over_tasks_and_summaries_are_counted():
    def row(task, p, ok, summaries=0):
        return {"task_id": task, "pass": p, "correctness": {"score": float(ok)},
                "efficiency": {"summaries": summaries}}
    # task a always solved, b never: per-task means 1 and 0 -> s.e. = stdev([1, 0]) / sqrt(2) = 0.5
    rows = [row("a", p, 1) for p in range(4)] + [row("b", p, 0, summaries=p % 2) for p in range(4)]
    s = summarize(rows, n_tasks=2, passes=4)
    assert s["correctness_mean"] == 0.5 and abs(s["correctness_se"] - 0.5) < 1e-12
    assert s["best_of_k"]["4"] == 0.5 and abs(s["best_of_k_se"]["4"] - 0.5) < 1e-12
    assert s["summarised"] == {"rollouts": 2, "summaries": 2, "correctness_mean": 0.0}
    assert summarize([], n_tasks=2, passes=4)["correctness_se"] == 0.0
