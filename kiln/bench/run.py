"""`run_bench`: a suite x a policy x several passes, in parallel sandboxes, resumable.

Every rollout is the real harness (the same Agent RL and `kiln agent` run) in a fresh sandbox
of the task's snapshot, graded on all four axes. A finished rollout is one line of
results.jsonl (see results.py); restarting with the same out_dir skips those and redoes only
what never finished. Rollouts that raise (endpoint down, sandbox failure) are logged to
errors.jsonl and retried by the next run; several in a row abort the run.

With `use_ray` (`kiln bench --ray`, bench.ray) each rollout is a Ray task instead of a thread
(on_ray.py): the same rows, the same resume.

The local policy (a kiln checkpoint) loads the checkpoint once: one engine, stepped by one
EngineRunner thread, decodes the turns of every rollout in flight together (continuous batching),
each rollout talking to it through its own LocalPolicy.
"""
from __future__ import annotations

import json
import os
import threading
import time
import traceback
import zlib
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from kiln.grading import grade
from kiln.harness.agent import Agent
from kiln.progress import tqdm
from kiln.sandbox import Snapshot, create
from kiln.tasks.record import Task, load_suite

from .metrics import first_error_then, summarize
from .results import ResultLog, key

POLICIES = ("oracle", "noop", "openai", "local")
MAX_CONSECUTIVE_ERRORS = 5


class BenchError(RuntimeError):
    """The benchmark cannot run (bad policy, mismatched out_dir) or was aborted by errors."""


def make_bench_policy(name: str, task: Task, pass_idx: int, config, runner=None):
    """-> (policy, seed). The seed varies by pass and task, so passes differ; it seeds the oracle's
    choices and the local policy's sampling. `runner`: the shared engine of the local policy."""
    seed = config.policy.seed + 1000 * pass_idx + zlib.crc32(task.id.encode()) % 1000
    if name == "noop":
        from kiln.policies.noop import NoopPolicy
        return NoopPolicy(), seed
    if name == "oracle":
        from kiln.policies.oracle import OraclePolicy
        return OraclePolicy(task.solution, task.test_command, seed=seed, mistakes=config.policy.oracle_mistakes), seed
    if name == "local":
        if runner is None:
            raise ValueError("the local policy in a benchmark decodes on a shared engine: pass its runner")
        from kiln.engine import SamplingParams
        from kiln.policies.local import LocalPolicy
        params = SamplingParams(temperature=config.policy.temperature, seed=seed)
        return LocalPolicy(runner.engine, runner.engine.tok, params, runner=runner,
                           timeout_s=config.policy.timeout_s), seed
    from kiln.policies import make_policy
    return make_policy(config.policy.model_copy(update={"kind": name})), seed


class _Snapshots:
    """One imported snapshot per task, made on first use and removed after its last rollout
    (rollouts run task by task, so only a few repositories are on disk at once)."""

    def __init__(self, state_dir: str, uses: Counter):
        self.state_dir, self.uses = state_dir, dict(uses)
        self.snaps: dict[str, Snapshot] = {}
        self.lock = threading.Lock()
        self.task_locks = {t: threading.Lock() for t in uses}

    def get(self, task: Task) -> Snapshot:
        with self.task_locks[task.id]:
            if task.id not in self.snaps:
                self.snaps[task.id] = Snapshot.from_dir(task.repo_dir, self.state_dir, label=f"bench:{task.id}")
            return self.snaps[task.id]

    def release(self, task: Task) -> None:
        with self.lock:
            self.uses[task.id] -= 1
            snap = self.snaps.pop(task.id, None) if self.uses[task.id] == 0 else None
        if snap is not None:
            snap.drop()

    def close(self) -> None:
        with self.lock:
            snaps, self.snaps = list(self.snaps.values()), {}
        for snap in snaps:
            snap.drop()


def run_rollout(task: Task, pass_idx: int, policy_name: str, config, snapshot: Snapshot, out_dir: str,
                runner=None) -> dict:
    """One graded rollout -> its results row; the trajectory (with every grade) goes to disk."""
    t0 = time.monotonic()
    policy, seed = make_bench_policy(policy_name, task, pass_idx, config, runner)
    path = os.path.join(out_dir, "trajectories", f"{task.id}.p{pass_idx}.json")
    with create(snapshot, task.sandbox_config(config.sandbox)) as sb:
        t1 = time.monotonic()
        traj = Agent(policy, sb, config.harness).run(task.prompt, task_id=task.id, out=path)
        t2 = time.monotonic()
        grades = grade(sb, task, traj)
    t3 = time.monotonic()
    traj.rewards = {"correctness": float(grades["correctness"]["score"])}
    traj.metadata.update(bench={"pass": pass_idx, "seed": seed, "policy": policy_name}, grades=grades)
    traj.save(path)
    correctness = {k: v for k, v in grades["correctness"].items() if k != "log_tail"}  # the log stays in the trajectory
    return {"task_id": task.id, "pass": pass_idx, "category": task.category, "difficulty": task.difficulty,
            "policy": policy_name, "seed": seed, "stop_reason": traj.stop_reason,
            "after_error": first_error_then(traj.tools),
            **grades, "correctness": correctness,
            "timings": {"sandbox_s": t1 - t0, "agent_s": t2 - t1, "grade_s": t3 - t2, "rollout_s": t3 - t0},
            "trajectory": os.path.relpath(path, out_dir), "finished_at": time.time()}


def _check_identity(out_dir: str, suite_dir: str, policy_name: str, config) -> None:
    """A resumed run must be the same suite and policy, or the rows would mix two benchmarks."""
    ident = {"suite": os.path.abspath(suite_dir), "policy": policy_name}
    if policy_name == "local":
        ident["checkpoint"] = os.path.abspath(config.policy.checkpoint)
    elif policy_name not in ("oracle", "noop"):
        ident["model"] = config.policy.model
    path = os.path.join(out_dir, "bench.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old != ident:
            raise BenchError(f"{out_dir} holds a run of {old}, not {ident}: use another out_dir")
        return
    with open(path, "w") as f:
        json.dump(ident, f, indent=2)


def _check_policy(policy_name: str, tasks: list[Task], config) -> None:
    if policy_name not in POLICIES:
        raise BenchError(f"unknown policy {policy_name!r}; use one of {', '.join(POLICIES)}")
    if policy_name == "local":
        ckpt = config.policy.checkpoint
        if not ckpt:
            raise BenchError("the local policy decodes a kiln checkpoint: set policy.checkpoint=PATH "
                             "(or pass --checkpoint PATH to `kiln bench`)")
        if not os.path.isdir(ckpt):
            raise BenchError(f"policy.checkpoint {ckpt!r}: no such checkpoint directory")
    if policy_name == "oracle":
        missing = [t.id for t in tasks if not t.solution]
        if missing:
            raise BenchError(f"the oracle needs a solution.patch; missing in {missing[:5]}")


def run_bench(suite_dir: str, policy_name: str, passes: int = 1, workers: int = 1, out_dir: str = "bench",
              config=None, progress: bool = True, use_ray: bool | None = None) -> dict:
    """Run every task of the suite `passes` times with `policy_name`; write results.jsonl,
    trajectories/, summary.json, report.md and plots under out_dir; return the summary.
    `use_ray` (default: config.bench.ray): rollouts as Ray tasks on `config.ray`'s cluster."""
    from kiln.config import Config
    config = config or Config()
    use_ray = config.bench.ray if use_ray is None else use_ray
    if passes < 1 or workers < 1:
        raise ValueError(f"passes ({passes}) and workers ({workers}) must be >= 1")
    tasks = load_suite(suite_dir)
    _check_policy(policy_name, tasks, config)
    if use_ray and policy_name == "local":
        raise BenchError("the local policy does not run on Ray yet (its one engine batches every rollout in this "
                         "process): run without --ray, or serve the checkpoint (`kiln serve`) and bench the "
                         "openai policy on Ray")
    try:
        os.makedirs(os.path.join(out_dir, "trajectories"), exist_ok=True)
    except OSError as e:  # a path that cannot be a folder: the user's out_dir
        raise BenchError(f"out_dir {out_dir}: {e.strerror or e}") from None
    _check_identity(out_dir, suite_dir, policy_name, config)
    log = ResultLog(os.path.join(out_dir, "results.jsonl"))
    todo = [(t, p) for t in tasks for p in range(passes) if key(t.id, p) not in log.done]  # task-major
    snaps = _Snapshots(config.sandbox.state_dir, Counter(t.id for t, _ in todo))
    wanted = {key(t.id, p) for t in tasks for p in range(passes)}
    skipped = len(wanted & log.done)
    start, errors, consecutive, aborted = time.monotonic(), 0, 0, ""
    try:  # loaded only when there is work: a resumed run with nothing left needs no model
        runner = (start_engine(config.policy.checkpoint, workers, config.policy.speculative, config.model.context,
                               config.engine.dtype, config.engine.lookup, config.engine.kv_dtype)
                  if policy_name == "local" and todo else None)
    except BaseException:
        log.close()
        raise

    def one(task: Task, p: int) -> dict:
        try:
            return run_rollout(task, p, policy_name, config, snaps.get(task), out_dir, runner)
        finally:
            snaps.release(task)

    bar = tqdm(total=len(wanted), initial=skipped, unit="rollout",
               desc=f"bench {policy_name}", disable=not progress, dynamic_ncols=True)
    started_ray = False
    if use_ray and todo:
        from kiln import cluster

        from .on_ray import RayRollouts
        try:
            started_ray = cluster.connect(config.ray, min_cpus=config.bench.rollout_resources.get("CPU", 0))
            cluster.check_fits("bench rollout", "bench.rollout_resources", config.bench.rollout_resources)
        except cluster.ClusterError as e:
            log.close()
            bar.close()  # before the error line, not after it
            raise BenchError(str(e)) from None
        ex = RayRollouts(policy_name, config, out_dir)
        futures = {ex.submit(t, p): (t, p) for t, p in todo}
    else:
        ex = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bench")
        futures = {ex.submit(one, t, p): (t, p) for t, p in todo}
    pending = set(futures)
    try:
        while pending:
            # wait(), not as_completed(): futures cancelled before they start never wake as_completed
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                if fut.cancelled():
                    continue
                t, p = futures[fut]
                try:
                    row = fut.result()
                except Exception as e:
                    errors, consecutive = errors + 1, consecutive + 1
                    _log_error(out_dir, t.id, p, e)
                    if consecutive >= MAX_CONSECUTIVE_ERRORS and not aborted:
                        aborted = f"{consecutive} rollouts in a row failed; last: {type(e).__name__}: {e}"
                        pending = _cancel(pending)  # running ones still finish and are kept
                    continue
                consecutive = 0
                log.append(row)
                bar.update(1)
                bar.set_postfix(acc=f"{sum(r['correctness']['score'] for r in log.rows) / len(log.rows):.3f}")
    except BaseException:
        _cancel(pending)
        raise
    finally:
        ex.shutdown(wait=True)  # rollouts still running finish on the engine before it stops
        if started_ray:
            import ray
            ray.shutdown()
        if runner is not None:
            runner.close()
        bar.close()
        log.close()
        snaps.close()
    rows = [r for r in log.rows if key(r["task_id"], r["pass"]) in wanted]  # a longer run may share the log
    # The local policy's engine: how many sequences it decoded together at most (batching at work),
    # and with a drafter its verification steps and the drafts they accepted.
    engine = {}
    if runner is not None:
        stats = runner.engine.spec_stats
        engine = {"engine": {"max_batch": runner.engine.max_batch, "peak_batch": runner.peak_running,
                             **({"drafts": {"steps": stats.steps, "accepted": sum(stats.accepted)}} if stats.depth else {})}}
    summary = write_outputs(out_dir, rows, len(tasks), passes, suite=os.path.abspath(suite_dir),
                            policy=policy_name, errors=errors, skipped=skipped, wall_s=time.monotonic() - start,
                            **engine)
    if aborted:
        raise BenchError(f"benchmark aborted: {aborted} (see {out_dir}/errors.jsonl; finished rollouts are kept)")
    return summary


def start_engine(checkpoint: str, max_batch: int, speculative: bool = False, max_len: int | None = None,
                 dtype: str = "float32", lookup: int = 0, kv_dtype: str = "float32"):
    """The checkpoint's model and tokenizer in one engine (on the GPU when there is one, with `dtype`
    weights: engine.dtype, and a `kv_dtype` KV cache: engine.kv_dtype), batching
    up to max_batch sequences, on a started EngineRunner; the caller closes it. Speculative: with
    the MTP drafter; lookup: prompt-lookup drafts a step (engine.lookup) where the MTP does not.
    Prefix reuse (2 x max_batch kept sequences, the drafter's cache too), so each turn of a rollout
    prefills only its new tokens. No routes: only RL's router replay reads them.
    max_len (model.context, as RL's workers): the context, when the model's own is longer. Every
    sequence and kept prefix gets a KV cache of that many positions: at SmolLM2's 8,192 the 12
    slots of 4 workers took 4.5 GB, at Gemma 3's 32,768 they would take 14 GB."""
    import torch

    from kiln.engine import Engine
    from kiln.engine.runner import EngineRunner
    from kiln.model.checkpoint import load_checkpoint
    from kiln.model.tokenizer import load_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model, mtp = load_checkpoint(checkpoint, device=device, with_mtp=speculative)
        tok = load_tokenizer(checkpoint)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        raise BenchError(f"policy.checkpoint {checkpoint!r} cannot be loaded: {e}") from None
    context = min(max_len or model.config.max_position_embeddings, model.config.max_position_embeddings)
    runner = EngineRunner(Engine(model, tok, mtp, max_batch=max_batch, max_len=context, capture_routes=False,
                                prefix_slots=2 * max_batch, weight_dtype=getattr(torch, dtype),
                                kv_dtype=torch.bfloat16 if kv_dtype == "bfloat16" else None,
                                lookup=0 if speculative else lookup))
    runner.start()
    return runner


def _cancel(pending: set) -> set:
    """Cancel what has not started; -> the futures still running."""
    return {f for f in pending if not f.cancel()}


def _log_error(out_dir: str, task_id: str, pass_idx: int, e: BaseException) -> None:
    row = {"task_id": task_id, "pass": pass_idx, "error": f"{type(e).__name__}: {e}",
           "traceback": "".join(traceback.format_exception(e)), "at": time.time()}
    with open(os.path.join(out_dir, "errors.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def write_outputs(out_dir: str, rows: list[dict], n_tasks: int, passes: int, **extra) -> dict:
    """summary.json, report.md and the plots, from the rows (all of them, resumed runs included)."""
    from .report import write_report
    summary = summarize(rows, n_tasks, passes, **extra)
    tmp = os.path.join(out_dir, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "summary.json"))
    write_report(out_dir, summary, rows)
    return summary
