"""Bug injection: mutants of a Python repository whose tests pass become bugfix tasks.

Each mutant (kiln/tasks/mutants.py) is screened cheaply first: a sandbox of the repository with
the mutated file runs only the test files that name the mutated function (one full-suite run
when none does). Mutants no test notices, that hang, that break collection or that break too
much are dropped there; the rest are validated in full (`validate`: the whole suite before the
gold patch; after it, the reverse edit, the tree is the base, whose baseline run stands for it).
The failing tests become fail-to-pass. A multi-site bug (2-3 mutants of one unit) is screened with
its sites together first, then each site alone on just the tests that run found failing (see
`handle_group`).

Hidden tests: the test files holding the fail-to-pass tests. They stay visible in repo/ too,
unchanged (as in SWE-bench, where the old tests are visible): an agent may run them, and the
grader resets any test file it edits, so visibility costs nothing and mirrors real bug reports.
"""
from __future__ import annotations

import hashlib
import random
import re

from .gen import (
    RepoSource,
    discard,
    failing,
    failure_messages,
    generate,
    module_name,
    publish,
    test_file,
)
from .mutants import Mutant, find_mutants
from .patch import make_patch
from .prompts import bug_prompt
from .record import DEFAULT_TEST_COMMAND, Task
from .validate import judge, validate
from .yields import Yield

MAX_FAIL_FRACTION = 0.5  # a mutant failing more of the suite than this is a broken build, not a bug


def _interleave(items: list, key, rng: random.Random) -> list:
    """Group by key, shuffle groups and members, then take one from each group in turn."""
    groups: dict = {}
    for it in items:
        groups.setdefault(key(it), []).append(it)
    order = sorted(groups)
    rng.shuffle(order)
    for k in order:
        rng.shuffle(groups[k])
    depth, out = 0, []
    while len(out) < len(items):
        out += [groups[k][depth] for k in order if depth < len(groups[k])]
        depth += 1
    return out


def sample(mutants: list[Mutant], seed: int) -> list[Mutant]:
    """A seeded order that spreads early picks across mutation kinds and, within each kind,
    across functions (and so files). Small functions offer few kinds (often only `return`), so
    spreading by function alone would over-sample those kinds."""
    rng = random.Random(seed)
    by_kind: dict[str, list[Mutant]] = {}
    for m in mutants:
        by_kind.setdefault(m.kind, []).append(m)
    queues = [_interleave(ms, lambda m: (m.path, m.function), rng) for _, ms in sorted(by_kind.items())]
    rng.shuffle(queues)
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def prompt_for(qual: str, f2p: list[str], messages: dict[str, str]) -> str:
    """The symptom, as a bug report would give it: which tests fail and how, in which function."""
    names = [i.split("::", 1)[1] for i in f2p]
    shown = ", ".join(f"`{n}`" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    msg = next((messages[i] for i in f2p if messages.get(i)), "").replace("`", "'")
    msg = re.sub(r" at 0x[0-9a-fA-F]+", "", msg)  # object addresses: noise that differs per run
    msg = msg if len(msg) <= 160 else msg[:157] + "..."
    return (f"`{qual}` misbehaves: {shown} {'fails' if len(names) == 1 else 'fail'}"
            + (f" with `{msg}`" if msg else "") + ".")


class _Mutator(RepoSource):
    def mutants(self) -> list[Mutant]:
        return [m for p in self.src_files for m in find_mutants(p, self.texts[p])]

    def affected(self, m: Mutant) -> list[str] | None:
        """Test files that name the mutated function (or its class); None = the whole suite."""
        words = {w for w in m.function.split(".") if not w.startswith("__")}
        pat = re.compile(rb"\b(" + b"|".join(re.escape(w.encode()) for w in words) + rb")\b") if words else None
        hits = [t for t in self.test_files if pat and pat.search(self.texts[t])]
        return hits if hits and len(hits) < len(self.test_files) else None

    def handle(self, m: Mutant) -> Task | str:
        mutated = m.apply(self.texts[m.path])
        snap, run = self.screen({m.path: mutated}, self.affected(m))
        task = None
        try:
            if run.timed_out:
                return "mutant hangs the tests"
            fails = failing(run)
            if any("::" not in i for i in fails):
                return "mutant breaks test collection"
            if not fails:
                return "mutant survives the tests"
            if len(fails) > MAX_FAIL_FRACTION * self.n_tests:
                return "mutant breaks too many tests"
            msgs = failure_messages(run.log, fails)
            task = self.new_task(m, mutated, fails, msgs)
            v = validate(task, self.cfg, snap, cpu_s=self.screen_cpu, base_run=self.base_run)
            if not v.ok:
                discard(task)
                return v.reason
            task.fail_to_pass, task.pass_to_pass = v.fail_to_pass, v.pass_to_pass
            hidden = {test_file(i) for i in v.fail_to_pass} - set(task.hidden_tests())
            task.prompt = prompt_for(task.provenance["function"], v.fail_to_pass, msgs)
            return publish(task, self.out_dir, {p: self.texts[p] for p in sorted(hidden)})
        except BaseException:
            discard(task)
            raise
        finally:
            snap.drop(keep=self.base)

    def new_task(self, m: Mutant, mutated: bytes, fails: list[str], messages: dict[str, str]) -> Task:
        qual = f"{module_name(m.path)}.{m.function}"
        gold = make_patch(m.path, mutated.decode("utf-8"), self.texts[m.path].decode("utf-8"))
        task = Task(id=f"{self.name}-mut-{m.key}", prompt=prompt_for(qual, fails, messages), category="bugfix",
                    provenance={"generator": "mutate", "source": self.source, "file": m.path, "line": m.line,
                                "function": qual, "mutation": m.kind, "seed": self.seed,
                                "original": m.original.decode("utf-8", "replace"),
                                "mutant": m.replacement.decode("utf-8", "replace")})
        hidden = {p: self.texts[p] for p in sorted({test_file(i) for i in fails})}
        return self.save(task, {m.path: mutated}, hidden, gold)


def generate_mutants(repo: str, out_dir: str, sandbox_cfg, max_tasks: int | None = None, seed: int = 0,
                     workers: int = 2, test_command: str = DEFAULT_TEST_COMMAND, progress: bool = True,
                     source: str | None = None) -> Yield:
    """Write validated bugfix tasks made by mutating `repo` into `out_dir`; `source` names the
    repository in provenance and task ids (default: its path). Raises GeneratorError when the
    repository's own tests do not pass."""
    mut = _Mutator(repo, out_dir, sandbox_cfg, test_command, source, seed)
    return generate("mutate", mut, lambda: sample(mut.mutants(), seed), mut.handle, workers, max_tasks, progress)


# -- multi-site bugs -------------------------------------------------------------------------------

def apply_all(src: bytes, mutants: list[Mutant]) -> bytes:
    """Several non-overlapping mutants of one file, applied together."""
    for m in sorted(mutants, key=lambda m: m.start, reverse=True):
        src = m.apply(src)
    return src


def unit_of(m: Mutant) -> tuple[str, str]:
    """What makes mutants related: the same class (any of its methods) or the same top-level function."""
    return m.path, m.function.split(".")[0]


def mutant_groups(mutants: list[Mutant], seed: int, sizes: tuple[int, ...] = (2, 3)) -> list[list[Mutant]]:
    """Disjoint groups of 2-3 related mutants (one unit, distinct lines, non-overlapping), in the
    seeded sample order: each group is emitted as soon as its unit has collected enough."""
    rng = random.Random(seed * 7919 + 1)
    buckets: dict[tuple[str, str], list[Mutant]] = {}
    want: dict[tuple[str, str], int] = {}
    out = []
    for m in sample(mutants, seed):
        u = unit_of(m)
        b = buckets.setdefault(u, [])
        if u not in want:
            want[u] = rng.choice(sizes)
        if any(x.line == m.line or (m.start < x.end and x.start < m.end) for x in b):
            continue
        b.append(m)
        if len(b) == want[u]:
            out.append(sorted(b, key=lambda x: x.start))
            buckets[u], want[u] = [], rng.choice(sizes)
    return out


class _MultiMutator(_Mutator):
    def named_by_tests(self, m: Mutant) -> bool:
        words = [w for w in m.function.split(".") if not w.startswith("__")]
        pat = re.compile(rb"\b(" + b"|".join(re.escape(w.encode()) for w in words) + rb")\b") if words else None
        return bool(pat) and any(pat.search(self.texts[t]) for t in self.test_files)

    def screen_one(self, m: Mutant, ids: list[str]) -> str | None:
        """Why a single site is unusable (None: some of `ids`, the tests the sites break together,
        catches it on its own)."""
        snap, run = self.screen({m.path: m.apply(self.texts[m.path])}, ids)
        snap.drop(keep=self.base)
        fails = failing(run)
        if run.timed_out:
            return "a site hangs the tests"
        if any("::" not in i for i in fails):
            return "a site breaks test collection"
        if not fails:
            return "a site survives the tests"
        return None

    def handle_group(self, group: list[Mutant]) -> Task | str:
        path = group[0].path
        mutated = apply_all(self.texts[path], group)
        # The sites together run first, on the test files that name their unit, then each site alone
        # on just the tests that run found failing. When those files hold most of the suite, the
        # whole suite costs little more and its run is also the one before the gold patch (the
        # baseline is the one after: the patch restores the base), so validation runs nothing.
        files = {t for m in group for t in (self.affected(m) or self.test_files)}
        share = sum(test_file(i) in files for i in self.base_run.statuses) / max(1, self.n_tests)
        snap, run = self.screen({path: mutated}, sorted(files) if share < 0.5 else None)
        task = None
        try:
            fails = failing(run)
            if run.timed_out or not fails or any("::" not in i for i in fails):
                return "the sites together do not fail cleanly"
            if len(fails) > MAX_FAIL_FRACTION * self.n_tests:
                return "mutant breaks too many tests"
            for m in group:  # every site must matter: a failing test catches each one alone
                why = self.screen_one(m, fails)
                if why:
                    return why
            msgs = failure_messages(run.log, fails)
            unit = f"{module_name(path)}.{group[0].function.split('.')[0]}"
            key = hashlib.sha1(b"".join(f"{m.key}".encode() for m in group)).hexdigest()[:10]
            gold = make_patch(path, mutated.decode("utf-8"), self.texts[path].decode("utf-8"))
            task = Task(id=f"{self.name}-bug{len(group)}-{key}", prompt="-", category="bugfix", difficulty=len(group),
                        provenance={"generator": "mutate_multi", "source": self.source, "file": path, "unit": unit,
                                    "seed": self.seed, "sites": [
                                        {"line": m.line, "function": f"{module_name(path)}.{m.function}",
                                         "mutation": m.kind, "original": m.original.decode("utf-8", "replace"),
                                         "mutant": m.replacement.decode("utf-8", "replace")} for m in group]})
            hidden = {p: self.texts[p] for p in sorted({test_file(i) for i in fails})}
            task = self.save(task, {path: mutated}, hidden, gold)
            v = judge(run, [self.base_run]) if share >= 0.5 else \
                validate(task, self.cfg, snap, cpu_s=self.screen_cpu, base_run=self.base_run)
            if not v.ok:
                discard(task)
                return v.reason
            task.fail_to_pass, task.pass_to_pass = v.fail_to_pass, v.pass_to_pass
            msg = next((msgs[i] for i in v.fail_to_pass if msgs.get(i)), "")
            task.prompt = bug_prompt(task.id, self.project, unit.split(".")[-1], path, v.fail_to_pass, msg, multi=True)
            extra = {test_file(i) for i in v.fail_to_pass} - set(task.hidden_tests())
            return publish(task, self.out_dir, {p: self.texts[p] for p in sorted(extra)})
        except BaseException:
            discard(task)
            raise
        finally:
            snap.drop(keep=self.base)


def generate_multi_mutants(repo: str, out_dir: str, sandbox_cfg, max_tasks: int | None = None, seed: int = 0,
                           workers: int = 2, test_command: str = DEFAULT_TEST_COMMAND, progress: bool = True,
                           source: str | None = None, task_timeout: float | None = None,
                           sizes: tuple[int, ...] = (2, 3)) -> Yield:
    """Write bugfix tasks of 2-3 related mutations each (one class or function): every site is
    caught by some test on its own, and the task's fail-to-pass tests are all the tests the sites
    break together, so every site has to be found and fixed."""
    mut = _MultiMutator(repo, out_dir, sandbox_cfg, test_command, source, seed, task_timeout)
    # Only mutants of code some test file names: the others mostly survive, and one survivor
    # costs its group.
    return generate("mutate_multi", mut,
                    lambda: mutant_groups([m for m in mut.mutants() if mut.named_by_tests(m)], seed, sizes),
                    mut.handle_group, workers, max_tasks, progress)
