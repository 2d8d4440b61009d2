"""Frozen suites: `kiln tasks build-suite kiln-bench-v1 --out DIR` rebuilds the same task folders,
byte for byte, from the pinned sources (kiln/tasks/sources.py).

A suite is a list of (project, category, quota) with one generator per category, a seed and a
fixed per-task timeout. Everything that goes into a task folder is a function of those and of the
sources' bytes: the generators sample with seeded RNGs, keep the first `quota` candidates in
candidate order that validate (whatever order the parallel validations finish in), and record a
fixed timeout rather than a measured one. Nothing measured at build time (durations, paths of the
build machine) is written.

Layout: DIR/<split>/<task id>/ (split by project: a model can be trained on the `train` projects
and evaluated on the `eval` ones) and DIR/suite.json, the manifest (sources with versions and
sha256 pins, quotas, task ids per split, counts). `kiln bench --suite DIR/eval` runs one split,
`--suite DIR` all of it.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from . import sources as S
from .record import DEFAULT_TEST_COMMAND, Task, load_suite

# A fixed hash seed: str hashing (set and dict-of-set order in assertion messages and parametrize
# ids) is the same in every run, so the failure messages quoted in prompts are too.
SUITE_TEST_COMMAND = "PYTHONHASHSEED=0 " + DEFAULT_TEST_COMMAND

CATEGORY_GENERATORS = {"bugfix": "mutate_multi", "feature": "delete_feature_multi", "refactor": "refactor_move",
                       "tests": "write_tests"}


@dataclass(frozen=True)
class SuiteSpec:
    name: str
    quotas: dict  # project -> {category: number of tasks}
    seed: int = 0
    task_timeout: float = 300.0
    params: dict = field(default_factory=dict)  # category -> generator keyword arguments


KILN_BENCH_V1 = SuiteSpec(
    name="kiln-bench-v1",
    # Quotas are what each project yields (kiln tasks stats on a full build): a category a project
    # cannot fill (too few large units, tests that name too few of a module's functions, moved code
    # tied to the rest of its module) is 0 there rather than a shortfall.
    quotas={
        "toolz": {"bugfix": 5, "feature": 3, "refactor": 5, "tests": 5},
        "boltons": {"bugfix": 6, "feature": 18, "refactor": 21, "tests": 12},
        "cachetools": {"bugfix": 6, "feature": 2, "refactor": 1, "tests": 4},
        "inflection": {"bugfix": 5, "feature": 0, "refactor": 0, "tests": 1},
        "more-itertools": {"bugfix": 6, "feature": 8, "refactor": 20, "tests": 2},
        "parse": {"bugfix": 6, "feature": 0, "refactor": 0, "tests": 3},
        "semver": {"bugfix": 6, "feature": 0, "refactor": 0, "tests": 2},
        "tabulate": {"bugfix": 6, "feature": 1, "refactor": 0, "tests": 0},
    },
    params={"feature": {"min_lines": 80}, "refactor": {"min_lines": 50}, "tests": {"min_lines": 100},
            "bugfix": {}},
)
SUITES = {KILN_BENCH_V1.name: KILN_BENCH_V1}


def _generator(category: str):
    if category == "bugfix":
        from .mutate import generate_multi_mutants
        return generate_multi_mutants
    if category == "feature":
        from .delete_feature import generate_feature_groups
        return generate_feature_groups
    if category == "refactor":
        from .refactor import generate_moves
        return generate_moves
    if category == "tests":
        from .testwrite import generate_test_tasks
        return generate_test_tasks
    raise ValueError(f"no generator for category {category!r}")


def plan(spec: SuiteSpec, projects: list[str] | None = None, cap: int | None = None,
         categories: list[str] | None = None) -> list[tuple[str, str, int]]:
    """(project, category, quota) in build order; `projects`, `categories` and `cap` make a smaller
    build (its task folders are those of the full build: each step depends on nothing but itself)."""
    out = []
    for project, cats in spec.quotas.items():
        if projects and project not in projects:
            continue
        for cat, n in cats.items():
            if categories and cat not in categories:
                continue
            n = min(n, cap) if cap else n
            if n > 0:
                out.append((project, cat, n))
    return out


def build_suite(name: str, out: str, sandbox_cfg, workers: int = 2, projects: list[str] | None = None,
                cap: int | None = None, log=print, categories: list[str] | None = None) -> dict:
    """Build suite `name` into `out` (emptied first). Returns the manifest written to suite.json."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    spec = SUITES[name]
    steps = plan(spec, projects, cap, categories)
    unknown = sorted(set(projects or []) - set(spec.quotas))
    if unknown:
        raise ValueError(f"not projects of {name}: {', '.join(unknown)}; its projects: {', '.join(spec.quotas)}")
    unknown = sorted(set(categories or []) - set(CATEGORY_GENERATORS))
    if unknown:
        raise ValueError(f"not categories of {name}: {', '.join(unknown)}; its categories: "
                         f"{', '.join(CATEGORY_GENERATORS)}")
    missing = {p: S.missing_reason(p) for p, _, _ in steps if S.missing_reason(p)}
    if missing:
        raise S.SourceError("\n".join(missing.values()))
    if os.path.isdir(out):
        for entry in os.listdir(out):
            full = os.path.join(out, entry)
            shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)
    os.makedirs(out, exist_ok=True)
    tasks: dict[str, list[str]] = {"train": [], "eval": []}
    yields = []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kiln-suite-") as work:
        repos = {}
        for project, category, quota in steps:
            if project not in repos:
                repos[project] = S.materialize(project, os.path.join(work, "src", project))
            stage = os.path.join(work, "out", f"{project}-{category}")
            t0 = time.monotonic()
            y = _generator(category)(repos[project], stage, sandbox_cfg, max_tasks=quota, seed=spec.seed,
                                     workers=workers, progress=False, source=f"builtin:{project}",
                                     test_command=SUITE_TEST_COMMAND,
                                     task_timeout=spec.task_timeout, **spec.params.get(category, {}))
            split = S.split_of(project)
            got = load_suite(stage) if y.kept else []
            for t in got:
                t.provenance.update({"suite": spec.name, "split": split})
                _rewrite(t)
                dest = os.path.join(out, split, t.id)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                shutil.move(t.path, dest)
                tasks[split].append(t.id)
            # Candidates tried and rejections are logged, not recorded: with parallel validations a
            # few more candidates may be tried past the quota, so their count is not part of the suite.
            yields.append({"project": project, "category": category, "quota": quota, "kept": y.kept})
            log(f"{project:15} {category:9} {y.kept:3}/{quota:<3} kept of {y.candidates:3} candidates "
                f"({time.monotonic() - t0:.0f}s)" + "".join(f"; {n} {why}" for why, n in y.rejected.most_common(3)))
    manifest = {
        "suite": spec.name, "seed": spec.seed, "task_timeout_s": spec.task_timeout,
        "sources": {p: {"version": S.version(p), "license": S.license_of(p), "split": S.split_of(p),
                        **({"sdist": S.get(p).sdist, "sha256": S.get(p).sha256} if p != "toolz" else
                           {"from": "the installed toolz wheel (a pinned kiln dependency)"})}
                    for p in dict.fromkeys(p for p, _, _ in steps)},
        "generators": CATEGORY_GENERATORS, "params": spec.params,
        "splits": {k: sorted(v) for k, v in tasks.items()},
        "yields": yields,
    }
    with open(os.path.join(out, "suite.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    log(f"{sum(len(v) for v in tasks.values())} tasks into {out} in {time.monotonic() - t_start:.0f}s "
        f"(train {len(tasks['train'])}, eval {len(tasks['eval'])})")
    return manifest


def _rewrite(t: Task) -> None:
    with open(os.path.join(t.path, "task.toml"), "w", encoding="utf-8") as f:
        f.write(t.to_toml())


def tree_digest(path: str) -> dict[str, str]:
    """Relative path -> sha256 of every file under `path` (for byte-identical rebuild checks)."""
    import hashlib
    out = {}
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out
