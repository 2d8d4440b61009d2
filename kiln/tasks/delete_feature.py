"""Feature deletion: remove a public top-level function or class; restoring it is the task.

Removed with it: its imports and `__all__` entries across the package and module-level
re-exports (`name = curry(mod.name)`), so the package still imports. Callers inside other
function bodies are left as they are (they fail only when run); whatever breaks the package's
import or an unrelated test rejects the candidate, checked by one run of the visible suite.

The feature's tests (the test functions that name it) are removed from the visible repository
and their whole original files become the hidden tests; the gold patch restores the source.
Hidden files fail to import without the feature, so validate counts their other tests as
fail-to-pass too; those passed in the visible run, so they are moved to pass-to-pass.
"""
from __future__ import annotations

import ast
import hashlib
import random
from dataclasses import dataclass, field

from .gen import (
    RepoSource,
    discard,
    failing,
    generate,
    module_name,
    publish,
)
from .patch import make_patch
from .pyedit import Edits, parse, references, resolve_from, strip_name
from .record import DEFAULT_TEST_COMMAND, Task
from .validate import validate
from .yields import Yield


@dataclass
class Feature:
    path: str  # the defining module, repository-relative
    name: str
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    units: list = field(default_factory=list)  # multi-unit: the seed and its exclusive helpers (units.Unit)

    @property
    def module(self) -> str:
        return module_name(self.path)

    @property
    def parts(self) -> list[tuple[str, str, ast.stmt]]:
        """(path, name, node) of everything deleted: the seed alone, or the seed and its helpers."""
        return [(u.path, u.name, u.node) for u in self.units] or [(self.path, self.name, self.node)]


def _is_test_class(st: ast.stmt) -> bool:
    """A class pytest collects tests from: `Test*`, or any unittest.TestCase subclass (cachetools'
    `TTLCacheTest(unittest.TestCase, CacheTestMixin)`)."""
    return isinstance(st, ast.ClassDef) and (st.name.startswith("Test") or any(
        isinstance(b, ast.Name) and b.id == "TestCase" or isinstance(b, ast.Attribute) and b.attr == "TestCase"
        for b in st.bases))


def _test_defs(tree: ast.Module):
    """(test id suffix, statement, enclosing class or None) for test functions and methods."""
    for st in tree.body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)) and st.name.startswith("test"):
            yield st.name, st, None
        elif _is_test_class(st):
            for m in st.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test"):
                    yield f"{st.name}::{m.name}", m, st


def _bound_names(st: ast.stmt) -> set[str]:
    """Names a module-level definition or assignment binds."""
    if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {st.name}
    targets = st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, ast.AnnAssign) else []
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _test_helpers(tree: ast.Module, names: set[str]) -> tuple[list[ast.stmt], set[str]]:
    """Module-level helpers of a test file built on the deleted names (a test-only subclass, a
    `Cache = TTLTestCache` alias), transitively: their statements and the names they bind. They go
    with the feature, or the visible file would not import."""
    helpers, found, grow = [], set(), True
    candidates = [st for st in tree.body if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                                            ast.Assign, ast.AnnAssign))
                  and not _is_test_class(st) and not (isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef))
                                                      and st.name.startswith("test"))]
    while grow:
        grow = False
        for st in candidates:
            if st not in helpers and _bound_names(st) and any(references(st, n) for n in names | found):
                helpers.append(st)
                found |= _bound_names(st)
                grow = True
    return helpers, found


class _Deleter(RepoSource):
    generator = "delete_feature"

    def features(self) -> list[Feature]:
        found: dict[str, list[Feature]] = {}
        for path in self.src_files:
            for st in parse(self.texts[path]).body:
                if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not st.name.startswith("_"):
                    found.setdefault(st.name, []).append(Feature(path, st.name, st))
        # A name defined twice (in one module or in two) cannot be deleted unambiguously.
        out = [fs[0] for fs in found.values() if len(fs) == 1]
        random.Random(self.seed).shuffle(out)
        return out

    def strip_tests(self, f: Feature, also: frozenset[str] = frozenset()) -> tuple[dict[str, bytes], set[str]]:
        """Visible test files without the feature's tests (those naming it or a test helper built on
        it, and the ids in `also`), those helpers and its imports; ids of the removed tests. A test
        class goes whole when its body outside its tests (bases, attributes) names the feature or
        one of its inherited tests is in `also` (then its id `path::Class` stands for its tests: they
        are not all in its body)."""
        edited, removed = {}, set()
        names = {n for _, n, _ in f.parts}
        for path in self.test_files:
            src = self.texts[path]
            tree = parse(src)
            helpers, local = _test_helpers(tree, names)
            used = names | local
            ed, gone, whole = Edits(src), [], []
            for st in tree.body:
                if not _is_test_class(st):
                    continue
                own = {m.name for m in st.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
                outside = [b for b in st.bases] + [s for s in st.body if not isinstance(s, (ast.FunctionDef,
                                                                                          ast.AsyncFunctionDef))]
                inherited = any(i.startswith(f"{path}::{st.name}::") and i.split("::")[2] not in own for i in also)
                if inherited or any(references(s, n) for s in outside for n in used):
                    whole.append(st)
                    tests = {f"{path}::{st.name}::{m}" for m in own if m.startswith("test")}
                    removed |= tests if tests and not inherited else {f"{path}::{st.name}"}
            for suffix, st, cls in _test_defs(tree):
                if cls in whole:
                    continue
                if f"{path}::{suffix}" in also or any(references(st, n) for n in used):
                    gone.append((st, cls))
                    removed.add(f"{path}::{suffix}")
            for st in whole + helpers:
                ed.remove_statement(st)
            for st, cls in gone:
                left = [s for s in cls.body if s not in [g for g, c in gone if c is cls]] if cls else None
                if cls is not None and not any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
                                               and s.name.startswith("test") for s in left):
                    ed.remove_statement(cls)  # a test class with no test left goes whole
                else:
                    ed.remove_statement(st)
            new = ed.result()
            for n in [n for _, n, _ in f.parts]:
                new, _ = strip_name(path, new, n, f.module.split(".")[0], drop_all=False)
            if new != src:
                edited[path] = new
        return edited, removed

    def strip_source(self, f: Feature) -> dict[str, bytes]:
        package = f.module.split(".")[0]
        edited = {}
        for path in self.src_files:
            src = self.texts[path]
            here = [node for p, _, node in f.parts if p == path]
            if here:
                ed = Edits(src)
                for node in here:
                    ed.remove_statement(node)
                src2 = ed.result()
            else:
                src2 = src
            new = src2
            for p, n, _ in f.parts:
                new, _ = strip_name(path, new, n, package, drop_all=p == path)
            if new != src:
                edited[path] = new
        return edited

    def public_name(self, f: Feature) -> str:
        """`pkg.name` when the package's __init__ exports it, else `pkg.module.name`."""
        init = f"{f.path.split('/')[0]}/__init__.py" if "/" in f.path else ""
        if init in self.texts and init != f.path:
            for st in parse(self.texts[init]).body:
                if isinstance(st, ast.ImportFrom) and resolve_from(init, st) == f.module and any(
                        a.name in ("*", f.name) for a in st.names):
                    return f"{f.module.split('.')[0]}.{f.name}"
        return f"{f.module}.{f.name}"

    def prompt(self, f: Feature, source_files: list[str]) -> str:
        doc = (ast.get_docstring(f.node) or "").strip().split("\n\n")[0]
        doc = " ".join(doc.split())
        doc = doc if len(doc) <= 160 else doc[:157] + "..."
        if isinstance(f.node, ast.ClassDef):
            what = f"class `{self.public_name(f)}`"
        else:
            what = f"`{self.public_name(f)}({ast.unparse(f.node.args)})`"
        text = f"Add {what} to `{f.path}`" + (f": {doc}" + ("" if doc[-1] in ".?!" else ".") if doc else ".")
        others = [p for p in source_files if p != f.path]
        if others:
            text += " Also import or export it in " + ", ".join(f"`{p}`" for p in others) + "."
        return text

    def handle(self, f: Feature) -> Task | str:
        tests, removed = self.strip_tests(f)
        if not removed:
            return "no test uses the feature"
        source = self.strip_source(f)
        snap, run = self.screen({**source, **tests})
        task = None
        try:
            fails = failing(run)
            if fails and not run.timed_out and all("::" in i for i in fails) and len(fails) <= self.n_tests // 2:
                # Tests that fail without it use it indirectly (through an internal caller or a
                # helper): they are the feature's tests too. One more run checks the rest pass.
                snap.drop(keep=self.base)
                snap = self.base
                tests, removed = self.strip_tests(f, frozenset(i.split("[")[0] for i in fails))
                snap, run = self.screen({**source, **tests})
                fails = failing(run)
            if run.timed_out:
                return "tests time out without the feature"
            if any("::" not in i for i in fails):
                return "collection breaks without the feature"
            if fails:
                return "other tests fail without the feature"
            gold = "".join(make_patch(p, source[p].decode("utf-8"), self.texts[p].decode("utf-8")) for p in sorted(source))
            digest = hashlib.sha1(f"{f.path}:{f.name}".encode()).hexdigest()[:6]
            prov = {"generator": self.generator, "source": self.source, "file": f.path,
                    "line": f.node.lineno, "name": f"{f.module}.{f.name}",
                    "kind": "class" if isinstance(f.node, ast.ClassDef) else "function",
                    "removed_tests": len(removed), "seed": self.seed}
            if f.units:
                prov["units"] = [f"{module_name(p)}.{n}" for p, n, _ in f.parts]
            task = Task(id=f"{self.name}-feat-{f.name}-{digest}", prompt=self.prompt(f, sorted(source)), category="feature",
                        difficulty=2 if len(f.parts) == 1 else 3, provenance=prov)
            hidden = {p: self.texts[p] for p in sorted({r.split("::")[0] for r in removed})}
            task = self.save(task, {**source, **tests}, hidden, gold)
            v = validate(task, self.cfg, snap, cpu_s=self.screen_cpu, base_run=self.base_run)
            if not v.ok:
                discard(task)
                return v.reason
            own = [i for i in v.fail_to_pass if i.split("[")[0] in removed or i.rsplit("::", 1)[0] in removed]
            if not own:
                discard(task)
                return "feature tests pass without it"
            moved = [i for i in v.fail_to_pass if i not in own and run.passed(i)]
            task.fail_to_pass = sorted(set(v.fail_to_pass) - set(moved))
            task.pass_to_pass = sorted(v.pass_to_pass + moved)
            return publish(task, self.out_dir)
        except BaseException:
            discard(task)
            raise
        finally:
            snap.drop(keep=self.base)


def generate_feature_deletions(repo: str, out_dir: str, sandbox_cfg, max_tasks: int | None = None, seed: int = 0,
                               workers: int = 2, test_command: str = DEFAULT_TEST_COMMAND, progress: bool = True,
                               source: str | None = None) -> Yield:
    """Write validated feature tasks made by deleting public functions and classes of `repo`
    into `out_dir`. Raises GeneratorError when the repository's own tests do not pass."""
    d = _Deleter(repo, out_dir, sandbox_cfg, test_command, source, seed)
    return generate("delete_feature", d, d.features, d.handle, workers, max_tasks, progress)


class _GroupDeleter(_Deleter):
    """Multi-unit deletion: a public function or class with the private helpers only it uses, in its
    own module or (imported) in others, deleted together; kept when it spans `min_lines`."""
    generator = "delete_feature_multi"

    def __init__(self, *args, min_lines: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.min_lines = min_lines

    def features(self) -> list[Feature]:
        from .units import UnitGraph
        g = UnitGraph(self.texts, self.src_files)
        names: dict[str, int] = {}
        for u in g.units.values():
            names[u.name] = names.get(u.name, 0) + 1
        out = []
        for seed in sorted(g.public(), key=lambda u: u.key):
            if names[seed.name] > 1:
                continue  # defined in two modules: not one feature
            group = g.closure(seed)
            if sum(u.n_lines for u in group) >= self.min_lines:
                out.append(Feature(seed.path, seed.name, seed.node, group))
        random.Random(self.seed).shuffle(out)
        return out

    def prompt(self, f: Feature, source_files: list[str]) -> str:
        from .prompts import feature_prompt
        if isinstance(f.node, ast.ClassDef):
            what = f"the `{f.name}` class"
        else:
            what = f"`{self.public_name(f)}()`"
        key = f"{f.path}:{f.name}"
        if isinstance(f.node, ast.ClassDef):
            methods = [m.name for m in f.node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                       and (not m.name.startswith("_") or m.name in ("__init__", "__iter__", "__getitem__",
                                                                      "__contains__", "__len__", "__call__"))]
            methods = list(dict.fromkeys(methods))  # a property's getter and setter share a name
            detail = (f"It had {len(methods)} methods, among them " + ", ".join(f"`{m}`" for m in methods[:5]) + "."
                      if methods else "")
        else:
            detail = f"The signature was `{f.name}({ast.unparse(f.node.args)})`."
            detail = detail if len(detail) <= 140 else ""
        return feature_prompt(key, self.project, what, f.path, ast.get_docstring(f.node) or "", len(f.parts),
                              [p for p in source_files if p != f.path], detail)


def generate_feature_groups(repo: str, out_dir: str, sandbox_cfg, max_tasks: int | None = None, seed: int = 0,
                            workers: int = 2, test_command: str = DEFAULT_TEST_COMMAND, progress: bool = True,
                            source: str | None = None, task_timeout: float | None = None,
                            min_lines: int = 1) -> Yield:
    """Multi-unit feature tasks: a public function or class deleted with its exclusive private
    helpers (across modules when they are imported), its tests hidden; only groups of at least
    `min_lines` source lines are tried."""
    d = _GroupDeleter(repo, out_dir, sandbox_cfg, test_command, source, seed, task_timeout, min_lines=min_lines)
    return generate("delete_feature_multi", d, d.features, d.handle, workers, max_tasks, progress)
