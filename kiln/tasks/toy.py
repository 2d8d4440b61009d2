"""Toy tasks: procedurally generated mini-repositories with one injected defect or removed feature.

Each repository is a package of 2-4 modules (text, list, statistics, number helpers and small
classes; templates in kiln/tasks/toydata/) with a pytest file per module. One unit is the target:

    level 1  a one-line operator / comparison / constant bug            category "bugfix"
    level 2  a logic bug: loop bound, branch, missing case, accumulator  category "bugfix"
    level 3  the body of a function or method is `raise NotImplementedError`; re-implement it
             from its docstring                                          category "feature"

The test file of the target's module is hidden (tests/, copied in at grading); the other modules'
tests stay visible in repo/ and become pass-to-pass. Every candidate is validated by execution.

Seeds. Task k of a run has index j = seed + k and generator seed `toy_seed(j, split)`:
2*j for "train", 2*j + 1 for "eval" - so training and evaluation seeds are disjoint whatever the
seed and n. A task is a pure function of (generator seed, level, TOY_VERSION): same seed, same
bytes. With level=None the level cycles: 1 + j % 3. Rejected candidates are replaced by later
indices. The two splits share templates (not instances): they are i.i.d., not held-out skills.
"""
from __future__ import annotations

import ast
import os
import random
import shutil
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from string import Template

from .patch import gold_stats, make_patch
from .pyedit import parse
from .record import Task, save_task
from .toydata import PACKAGES, THEMES, Unit, all_units
from .validate import Validation, validate
from .yields import Yield

TOY_VERSION = 1  # bump when templates change: a seed then names a different task
SPLITS = ("train", "eval")
UNITS = all_units()
_FIX = ("; fix it.", ". Please fix.", "; can you fix it?", " - fix this.")
_IMPLEMENT = ("Implement `{name}` in `{path}`; its docstring says what it should do.",
              "`{name}` ({path}) is only a stub. Implement it.",
              "Fill in `{name}` so that it does what its docstring says.")


def toy_seed(index: int, split: str = "eval") -> int:
    """The generator seed of task `index` in `split` (train even, eval odd)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    if index < 0:
        raise ValueError("index must be >= 0")
    return 2 * index + (split == "eval")


@dataclass
class Candidate:
    task: Task
    files: dict[str, str]  # the repository the agent sees
    hidden: dict[str, str]  # tests/..., copied in at grading
    solution: str


def bind(unit: Unit, rng: random.Random) -> dict[str, str]:
    names = {k: rng.choice(pool) for k, pool in unit.names.items()}
    if unit.combos:
        names.update(rng.choice(unit.combos))
    return names


def render(text: str, names: dict[str, str]) -> str:
    return Template(text).substitute(names)


def unit_source(unit: Unit, names: dict[str, str]) -> str:
    return render(unit.src, names).strip("\n") + "\n"


def inject(src: str, old: str, new: str) -> str:
    if src.count(old) != 1:
        raise ValueError(f"defect text occurs {src.count(old)} times, not once: {old!r}")
    return src.replace(old, new)


def blank(src: str, target: str) -> str:
    """Replace the body (after the docstring) of function `target` ("f" or "Cls.method") with
    `raise NotImplementedError`."""
    nodes, node = parse(src).body, None
    for part in target.split("."):
        node = next(n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
        nodes = node.body
    body = node.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
    first = body[1] if has_doc else body[0]
    lines = src.splitlines(keepends=True)
    stub = " " * first.col_offset + "raise NotImplementedError\n"
    return "".join(lines[:first.lineno - 1] + [stub] + lines[node.end_lineno:])


def module_text(doc: str, units: list[tuple[Unit, str]]) -> str:
    imports = sorted({line for u, _ in units for line in u.imports})
    head = f'"""{doc}"""\n' + ("\n" + "\n".join(imports) + "\n" if imports else "")
    return head + "".join("\n\n" + src for _, src in units)


def tests_text(pkg: str, mod: str, units: list[tuple[Unit, dict]]) -> str:
    bodies = [render(u.tests, names).strip("\n") + "\n" for u, names in units]
    exports = ", ".join(render(u.export, names) for u, names in units)
    head = ("import pytest\n\n" if any("pytest." in b for b in bodies) else "") + f"from {pkg}.{mod} import {exports}\n"
    return head + "".join("\n\n" + b for b in bodies)


def build_candidate(gen_seed: int, level: int) -> Candidate:
    """The task for (generator seed, level): a pure function of its arguments."""
    if level not in (1, 2, 3):
        raise ValueError(f"level must be 1, 2 or 3, not {level!r}")
    split = SPLITS[gen_seed % 2]
    rng = random.Random(f"kiln-toy/{TOY_VERSION}/{gen_seed}/{level}")
    if level < 3:
        target, defect = rng.choice([(u, d) for u in UNITS for d in u.defects if d.level == level])
    else:
        target, defect = rng.choice([(u, f) for u in UNITS for f in u.features])
    pkg = rng.choice(PACKAGES)
    others = sorted(t for t in THEMES if t != target.theme)
    themes = [target.theme] + rng.sample(others, rng.randint(1, 3))
    modules = {}  # module name -> (theme, [(unit, names)])
    for theme in themes:
        lo, hi = THEMES[theme].per_module
        pool = [u for u in UNITS if u.theme == theme and u is not target]
        chosen = rng.sample(pool, rng.randint(lo, hi) - (theme == target.theme))
        if theme == target.theme:
            chosen.insert(rng.randint(0, len(chosen)), target)
        modules[rng.choice(THEMES[theme].modules)] = (theme, [(u, bind(u, rng)) for u in chosen])

    files = {"README.md": f"# {pkg}\n\nSmall pure-Python helpers.\n\n"
                          + "".join(f"- `{pkg}/{m}.py`: {THEMES[t].doc}\n" for m, (t, _) in sorted(modules.items()))
                          + "\nRun the tests with `python -m pytest`.\n",
             "pyproject.toml": f'[project]\nname = "{pkg}"\nversion = "0.{rng.randint(1, 9)}.0"\n'
                               'requires-python = ">=3.9"\n\n[tool.pytest.ini_options]\ntestpaths = ["tests"]\n',
             f"{pkg}/__init__.py": f'"""{pkg}: small pure-Python helpers."""\n'}
    hidden = {}
    for mod, (theme, units) in sorted(modules.items()):
        srcs = [(u, unit_source(u, names)) for u, names in units]
        files[f"{pkg}/{mod}.py"] = module_text(THEMES[theme].doc, srcs)
        test = tests_text(pkg, mod, units)
        if any(u is target for u, _ in units):
            hidden[f"tests/test_{mod}.py"] = test
            path, tnames = f"{pkg}/{mod}.py", next(n for u, n in units if u is target)
            good = files[path]
            broken = [(u, blank(s, render(defect, tnames)) if level == 3 else
                       inject(s, render(defect.old, tnames), render(defect.new, tnames))) if u is target else (u, s)
                      for u, s in srcs]
            files[path] = module_text(THEMES[theme].doc, broken)
        else:
            files[f"tests/test_{mod}.py"] = test

    if level == 3:
        name = render(defect, tnames)
        prompt = rng.choice(_IMPLEMENT).format(name=name, path=path)
        kind, category = "removed feature", "feature"
    else:
        name = render(target.export, tnames)
        prompt = render(defect.symptom, tnames) + rng.choice(_FIX)
        kind, category = defect.kind, "bugfix"
    solution = make_patch(path, files[path], good)
    task = Task(id=f"toy-L{level}-{gen_seed}", prompt=prompt, category=category, difficulty=level, timeout_s=60.0,
                provenance={"generator": "toy", "version": TOY_VERSION, "seed": gen_seed, "split": split,
                            "level": level, "defect": kind, "unit": target.id, "target": f"{path}::{name}"},
                gold=gold_stats(solution))
    return Candidate(task, files, hidden, solution)


def write_candidate(c: Candidate, out_dir: str) -> Task:
    """Save the task folder (unvalidated: fail_to_pass / pass_to_pass still empty)."""
    task = save_task(c.task, out_dir, hidden=c.hidden, solution=c.solution)
    for rel, text in c.files.items():
        dst = os.path.join(task.repo_dir, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "w", encoding="utf-8") as f:
            f.write(text)
    return task


def _make_one(index: int, level: int, split: str, out_dir: str, staging: str, cfg, runs_after: int) -> str:
    """Build, stage, validate and publish one candidate; returns "" when kept, else the reason."""
    task = write_candidate(build_candidate(toy_seed(index, split), level), staging)
    try:
        v = validate(task, cfg, runs_after=runs_after)  # imports the repo once and drops it afterwards
    except Exception as e:  # a sandbox failure costs this candidate, not the run; it is counted
        v = Validation(False, f"sandbox error ({type(e).__name__}): {e}")
    if not v.ok:
        shutil.rmtree(task.path, ignore_errors=True)
        return v.reason or "rejected"
    task.fail_to_pass, task.pass_to_pass = v.fail_to_pass, v.pass_to_pass
    with open(os.path.join(task.path, "task.toml"), "w", encoding="utf-8") as f:
        f.write(task.to_toml())
    final = os.path.join(out_dir, task.id)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(task.path, final)
    return ""


def generate_toy(out_dir: str, n: int, seed: int = 0, level: int | None = None, split: str = "eval",
                 sandbox_cfg=None, workers: int = 2, progress: bool = True, runs_after: int = 2) -> Yield:
    """Write `n` validated toy tasks to `out_dir` (folders `toy-L{level}-{generator seed}`).

    runs_after: test runs after the gold patch (validate.validate): 2 catches flaky tests; 0 is
    for callers that grade the gold change themselves (SFT data keeps only the oracle's solved
    rollouts).

    `seed` is the first task index; see the module docstring for how indices map to seeds.
    At most 2n + 10 candidates are tried, so a broken sandbox cannot loop forever.
    """
    if level not in (None, 1, 2, 3):
        raise ValueError(f"level must be 1, 2, 3 or None (cycle), not {level!r}")
    toy_seed(seed, split)  # checks split and seed
    if sandbox_cfg is None:
        from kiln.config import SandboxConfig
        sandbox_cfg = SandboxConfig()
    os.makedirs(out_dir, exist_ok=True)
    staging = os.path.join(out_dir, ".toy-staging")  # no task.toml at its top: load_suite skips it
    os.makedirs(staging, exist_ok=True)
    y, index, max_candidates = Yield("toy"), seed, 2 * n + 10
    from kiln.progress import tqdm
    try:
        with ThreadPoolExecutor(max(1, workers)) as pool, \
                tqdm(total=n, desc="toy", unit="task", disable=not progress, leave=False) as bar:
            while y.kept < n and y.candidates < max_candidates:
                # One batch per round; rejected candidates are replaced by the next indices.
                batch = range(index, index + min(n - y.kept, max_candidates - y.candidates))
                index = batch.stop
                futures = [pool.submit(_make_one, j, level or 1 + j % 3, split, out_dir, staging, sandbox_cfg,
                                       runs_after) for j in batch]
                for f in as_completed(futures):
                    y.candidates += 1
                    reason = f.result()
                    if reason:
                        y.reject(reason)
                    else:
                        y.kept += 1
                        bar.update(1)
                    bar.set_postfix(rejected=sum(y.rejected.values()))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return y
