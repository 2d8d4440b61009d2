"""Plumbing shared by the code-derived generators (mutate, delete_feature, mine): source files,
the baseline test run, throw-away snapshot layers, staging, and parallel candidate processing."""
from __future__ import annotations

import os
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

from kiln.grading.correctness import is_test_path
from kiln.sandbox import Snapshot, create

from .patch import gold_stats
from .record import Task, save_task
from .testrun import PASSED, SKIPPED, XFAIL, TestRun, hang_wall, run_tests
from .yields import Yield

SKIP_DIRS = {".git", ".hg", ".venv", "venv", "node_modules", "build", "dist", "__pycache__",
             ".pytest_cache", ".tox", ".eggs"}
_SECTION = re.compile(r"^_{3,} (.+?) _{3,}$", re.M)
_E_LINE = re.compile(r"^E +(.+)$", re.M)


class GeneratorError(RuntimeError):
    """A repository a generator cannot work from (e.g. its own tests do not pass)."""


def python_files(repo: str) -> tuple[list[str], list[str]]:
    """Repository-relative .py files: (source, tests), sorted."""
    src, tests = [], []
    for root, dirs, files in os.walk(repo):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, name), repo).replace(os.sep, "/")
                (tests if is_test_path(rel) else src).append(rel)
    src = [p for p in src if os.path.basename(p) not in ("setup.py", "conftest.py", "noxfile.py")]
    return src, tests


def module_name(path: str) -> str:
    mod = path[:-3].replace("/", ".")
    mod = mod[:-len(".__init__")] if mod.endswith(".__init__") else mod
    return mod[4:] if mod.startswith("src.") else mod


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "repo"


def test_file(test_id: str) -> str:
    return test_id.split("::")[0]


def failing(run: TestRun) -> list[str]:
    return sorted(i for i, s in run.statuses.items() if s not in (PASSED, SKIPPED, XFAIL))


def failure_messages(log: str, ids: list[str]) -> dict[str, str]:
    """Test id -> the first `E   ...` line of its failure section (pytest's summary line is cut
    to the terminal width, so it cannot be used)."""
    sections = {m[1]: m.end() for m in _SECTION.finditer(log)}
    out = {}
    for i in ids:
        at = sections.get(i.split("::", 1)[-1].replace("::", "."))
        e = _E_LINE.search(log, at) if at is not None else None
        if e and not _SECTION.search(log, at, e.start()):
            out[i] = e[1].strip()
    return out


def baseline(snapshot: Snapshot, cfg, test_command: str, timeout_s: float = 600, runs: int = 2) -> TestRun:
    """Run the repository's own tests `runs` times; they must all pass, alike every time, for derived
    tasks to mean anything. Two alike runs let validation take this one for every tree that is the
    base again (validate's `base_run`) instead of running the suite twice per task."""
    got = []
    with create(snapshot, cfg) as sb:
        for _ in range(runs):
            run = run_tests(sb, test_command, timeout_s)
            if run.timed_out:
                raise GeneratorError(f"the repository's tests time out after {timeout_s:.0f}s")
            bad = failing(run)
            if bad or not run.statuses:
                what = f"failing: {bad[:10]}" if bad else "no tests were found"
                raise GeneratorError(f"the repository's own tests must pass before tasks are derived ({what}); "
                                     f"log tail:\n{run.log[-1500:]}")
            got.append(run)
    ids = sorted(set().union(*(r.statuses for r in got)))
    flaky = [i for i in ids if len({r.statuses.get(i) for r in got}) > 1]
    if flaky:
        raise GeneratorError(f"the repository's tests give different outcomes on two runs of the same code: {flaky[:10]}; "
                             "deselect them (pytest's --deselect in the project's addopts) and try again")
    return got[0]


class RepoSource:
    """A repository tasks are derived from: its Python files, a base snapshot, and the timing of
    its (passing) test suite, which sets the screening and task timeouts."""

    def __init__(self, repo: str, out_dir: str, cfg, test_command: str, source: str | None, seed: int,
                 task_timeout: float | None = None):
        self.repo, self.out_dir, self.cfg, self.test_command = os.path.abspath(repo), out_dir, cfg, test_command
        self.source, self.seed = source or self.repo, seed
        os.makedirs(out_dir, exist_ok=True)
        self.staging = staging_dir(out_dir)
        self.src_files, self.test_files = python_files(self.repo)
        self.texts = {p: open(os.path.join(self.repo, p), "rb").read() for p in self.src_files + self.test_files}
        # The base is what save_task copies into repo/ (no .git, no caches), so the tree that is
        # validated is exactly the task's repository.
        clean = os.path.join(self.staging, f"base-{os.getpid()}-{threading.get_ident()}")
        shutil.copytree(self.repo, clean, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache"))
        try:
            self.base = Snapshot.from_dir(clean, cfg.state_dir, label="generator base")
        finally:
            shutil.rmtree(clean, ignore_errors=True)
        try:
            run = baseline(self.base, cfg, test_command)
        except BaseException:
            self.close()
            raise
        self.base_run, self.n_tests, self.t_full = run, len(run.statuses), run.duration_s
        # A fixed `task_timeout` (the frozen suite's) keeps task.toml free of measured times.
        self.task_timeout = task_timeout or max(60.0, 10 * self.t_full)
        # Hangs are found by CPU time: a busy loop is stopped after screen_cpu CPU-seconds whatever
        # the load, so a build on a loaded machine keeps what one on an idle machine keeps, and a
        # hang holds its worker for seconds. A fixed task timeout fixes it too (a measured one would
        # differ by machine). A hang that sleeps is stopped by the wall, at a few times that.
        self.screen_cpu = task_timeout / 10 if task_timeout else max(10.0, 3 * self.t_full)
        self.screen_timeout = hang_wall(self.task_timeout, self.screen_cpu)
        self.project = self.source.split(":", 1)[1] if self.source.startswith("builtin:") else \
            os.path.basename(self.source.rstrip("/"))
        self.name = slug(self.project)

    def screen(self, files: dict[str, bytes], ids: list[str] | None = None) -> tuple[Snapshot, TestRun]:
        """The repository with `files` replaced, frozen as a snapshot (for `validate`; the caller
        drops it), and a test run on it (`ids`: only those test files)."""
        with create(self.base, self.cfg) as sb:
            for path, data in files.items():
                sb.write(path, data)
            snap = sb.snapshot(label="candidate")
            return snap, run_tests(sb, self.test_command, self.screen_timeout, ids, cpu_s=self.screen_cpu)

    def save(self, task: Task, files: dict[str, bytes], hidden: dict[str, bytes], gold: str) -> Task:
        """Write a candidate task into staging: the repository with `files` replaced."""
        task.test_command, task.timeout_s, task.gold = self.test_command, self.task_timeout, gold_stats(gold)
        task = save_task(task, self.staging, repo_src=self.repo, hidden=hidden, solution=gold)
        for path, data in files.items():
            with open(os.path.join(task.repo_dir, path), "wb") as f:
                f.write(data)
        return task

    def close(self) -> None:
        self.base.drop()
        try:
            os.rmdir(self.staging)  # only when empty: a concurrent run may be using it
        except OSError:
            pass


def staging_dir(out_dir: str) -> str:
    path = os.path.join(out_dir, ".staging")
    os.makedirs(path, exist_ok=True)
    return path


def publish(task: Task, out_dir: str, extra_hidden: dict[str, bytes] | None = None) -> Task:
    """Move a validated task from staging into `out_dir`, rewriting its task.toml."""
    for rel, data in (extra_hidden or {}).items():
        dst = os.path.join(task.tests_dir, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(data)
    task.validate()
    with open(os.path.join(task.path, "task.toml"), "w", encoding="utf-8") as f:
        f.write(task.to_toml())
    final = os.path.join(out_dir, task.id)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(task.path, final)
    task.path = os.path.abspath(final)
    return task


def discard(task: Task | None) -> None:
    if task is not None and task.path:
        shutil.rmtree(task.path, ignore_errors=True)


def run_candidates(candidates, handle, y: Yield, workers: int = 2, max_tasks: int | None = None,
                   progress: bool = True, desc: str = "") -> list[Task]:
    """Call `handle(c)` for each candidate on `workers` threads until `max_tasks` are kept.
    `handle` returns a Task (kept) or a rejection reason. Threads suffice: the work is waiting on
    sandboxed test runs. The kept set is the one a sequential run would keep: candidates are
    taken in order, and tasks past the first `max_tasks` (by candidate order) are dropped."""
    it, lock = enumerate(candidates), threading.Lock()
    kept: list[tuple[int, Task]] = []
    bar = None
    if progress:
        from kiln.progress import tqdm
        bar = tqdm(desc=desc or y.generator, unit="task", total=max_tasks, leave=False)

    def worker() -> None:
        while True:
            with lock:
                if max_tasks is not None and len(kept) >= max_tasks:
                    return
                i, c = next(it, (None, None))
                if i is None:
                    return
                y.candidates += 1
            try:
                out = handle(c)
            except Exception as e:  # one odd candidate must not end a long run; it is counted
                out = f"generator error: {type(e).__name__}: {e}"
            with lock:
                if isinstance(out, Task):
                    kept.append((i, out))
                else:
                    y.reject(out)
                if bar is not None:
                    bar.n = min(len(kept), max_tasks or len(kept))
                    bar.set_postfix(cand=y.candidates, rej=sum(y.rejected.values()))

    with ThreadPoolExecutor(max(1, workers)) as pool:
        for f in [pool.submit(worker) for _ in range(max(1, workers))]:
            f.result()
    if bar is not None:
        bar.close()
    kept.sort(key=lambda x: x[0])
    for _, task in kept[max_tasks:] if max_tasks is not None else []:
        discard(task)  # finished after the limit was reached by earlier candidates
        y.candidates -= 1
    tasks = [t for _, t in (kept[:max_tasks] if max_tasks is not None else kept)]
    y.kept = len(tasks)
    return sorted(tasks, key=lambda t: t.id)


def generate(name: str, maker, candidates, handle, workers: int, max_tasks: int | None, progress: bool) -> Yield:
    """A generator's run: `run_candidates` over `candidates()` into a new Yield `name`, then `maker`
    (which holds the staging folder and the base snapshot) closed, whatever happened."""
    y = Yield(name)
    try:
        run_candidates(candidates(), handle, y, workers, max_tasks, progress)
    finally:
        maker.close()
    return y
