"""Move refactors graded by tests: move a public function or class (with the private helpers only it
uses) out of its module into a new one, keeping the old import path working.

The agent starts from the unchanged repository. The gold change creates the new module (the
imports the moved code needs, copied from the old module, then the code, byte for byte) and
leaves a re-export in the old module. A hidden test file checks the new home (the object is
defined there: its `__module__`) and the old path (`old.name is new.name`); the project's own
tests of the moved code stay visible and are pass-to-pass: the behaviour is kept.

Candidates whose moved code needs a name of the old module that is neither an import nor moved
with it are skipped (the new module would import the old one, which imports it back), and so is
any move after which ruff finds an undefined name in either module. Each task is validated by
execution: the hidden tests fail before the gold change and pass after it, twice, and nothing
that passed breaks.
"""
from __future__ import annotations

import ast
import hashlib
import os
import random
import re

from .gen import RepoSource, discard, generate, module_name, publish
from .patch import make_patch
from .prompts import refactor_prompt
from .pyedit import Edits, parse
from .record import DEFAULT_TEST_COMMAND, Task
from .units import Unit, UnitGraph
from .validate import validate
from .yields import Yield


def snake(name: str) -> str:
    s = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower().strip("_")
    return re.sub(r"_+", "_", s)


def _bound(st) -> list[str]:
    """Names an import statement binds."""
    return [(a.asname or a.name).split(".")[0] for a in st.names if a.name != "*"]


def _loaded(nodes) -> set[str]:
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)}


class Move:
    def __init__(self, seed: Unit, units: list[Unit], new_path: str, new_module: str):
        self.seed, self.units, self.new_path, self.new_module = seed, units, new_path, new_module

    @property
    def path(self) -> str:
        return self.seed.path


class _Mover(RepoSource):
    def __init__(self, *args, min_lines: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.min_lines = min_lines
        self.graph = UnitGraph(self.texts, self.src_files)

    def moves(self) -> list[Move]:
        out, taken = [], set(self.src_files) | set(self.test_files)
        for seed in sorted(self.graph.public(), key=lambda u: u.key):
            units = [u for u in self.graph.closure(seed) if u.path == seed.path]
            if sum(u.n_lines for u in units) < self.min_lines:
                continue
            folder = os.path.dirname(seed.path)
            stem = snake(seed.name)
            if os.path.basename(seed.path)[:-3] == stem:
                stem += "_impl"
            new_path = (folder + "/" if folder else "") + stem + ".py"
            if new_path in taken:
                continue
            out.append(Move(seed, units, new_path, module_name(new_path)))
        random.Random(self.seed).shuffle(out)
        return out

    def edit(self, mv: Move) -> tuple[bytes, bytes] | str:
        """(old module after the move, new module), or why the move is skipped."""
        src = self.texts[mv.path]
        tree = parse(src)
        moved = {u.name for u in mv.units}
        needed = _loaded([u.node for u in mv.units]) - moved
        local_units = {u.name for u in self.graph.units.values() if u.path == mv.path} - moved
        if needed & local_units:
            return "moved code uses other code of its module"
        imports, first_unit_line = [], min(u.first_line for u in mv.units)
        last_import = None
        for st in tree.body:
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                if st.lineno < first_unit_line:
                    last_import = st
                if isinstance(st, ast.ImportFrom) and st.module == "__future__":
                    imports.append(ast.get_source_segment(src.decode("utf-8"), st))
                    continue
                names = [a for a in st.names if (a.asname or a.name).split(".")[0] in needed]
                if names:
                    seg = ("import " if isinstance(st, ast.Import) else
                           f"from {'.' * st.level}{st.module or ''} import ")
                    imports.append(seg + ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in names))
        text = src.decode("utf-8")
        lines = text.splitlines(keepends=True)
        body = []
        for u in sorted(mv.units, key=lambda u: u.first_line):
            body.append("".join(lines[u.first_line - 1:u.node.end_lineno]).rstrip("\n") + "\n")
        doc = f'"""{mv.seed.name} (moved here from {module_name(mv.path)})."""\n'
        new = doc + ("\n" + "\n".join(imports) + "\n" if imports else "") + "\n\n" + "\n\n\n".join(body)
        ed = Edits(src)
        for u in mv.units:
            ed.remove_statement(u.node)
        rel = f"from .{mv.new_module.rsplit('.', 1)[-1]} import {mv.seed.name}" if "." in mv.new_module \
            else f"from {mv.new_module} import {mv.seed.name}"
        if "/" not in mv.path:  # a top-level module: the new one is top-level too
            rel = f"from {mv.new_module} import {mv.seed.name}"
        reexport = (rel + "  # noqa: F401 (moved; the old import path is kept)\n").encode()
        if last_import is not None:
            at = ed.pos(last_import.end_lineno + 1, 0) if last_import.end_lineno < len(ed.starts) - 1 else len(src)
            ed.replace(at, at, reexport)
        else:
            at = ed.starts[mv.seed.first_line - 1]
            ed.replace(at, at, reexport + b"\n\n")
        old = ed.result()
        try:
            compile(old, mv.path, "exec", dont_inherit=True)
            compile(new, mv.new_path, "exec", dont_inherit=True)
        except SyntaxError:
            return "the move does not compile"
        from kiln.grading.quality import lint_counts
        counts = lint_counts({"old0": (mv.path, text), "old": (mv.path, old.decode("utf-8")),
                              "new": (mv.new_path, new)})
        if counts["new"]["F821"] or counts["old"]["F821"] > counts["old0"]["F821"]:
            return "the move leaves an undefined name"
        return old, new.encode()

    def hidden_test(self, mv: Move) -> tuple[str, bytes]:
        folder = self.test_folder(mv)
        stem = mv.new_module.rsplit(".", 1)[-1]
        path = (folder + "/" if folder else "") + f"test_{stem}_moved.py"
        old_mod = module_name(mv.path)
        text = f'''"""The move of {mv.seed.name} into {mv.new_module}: its new home, and the old import path kept."""
import importlib


def test_{stem}_is_defined_in_its_new_module():
    new = importlib.import_module("{mv.new_module}")
    assert new.{mv.seed.name}.__module__ == "{mv.new_module}"


def test_{stem}_old_import_path_still_works():
    old = importlib.import_module("{old_mod}")
    new = importlib.import_module("{mv.new_module}")
    assert old.{mv.seed.name} is new.{mv.seed.name}
'''
        return path, text.encode()

    def test_folder(self, mv: Move) -> str:
        """The folder of the first test file that names the moved object (else of any test file)."""
        pat = re.compile(rb"\b" + re.escape(mv.seed.name.encode()) + rb"\b")
        hits = [t for t in self.test_files if pat.search(self.texts[t])] or self.test_files
        return os.path.dirname(hits[0])

    def handle(self, mv: Move) -> Task | str:
        edited = self.edit(mv)
        if isinstance(edited, str):
            return edited
        old, new = edited
        hidden_path, hidden = self.hidden_test(mv)
        if hidden_path in self.texts:
            return "the hidden test's path is taken"
        gold = make_patch(mv.path, self.texts[mv.path].decode("utf-8"), old.decode("utf-8")) + \
            make_patch(mv.new_path, None, new.decode("utf-8"))
        digest = hashlib.sha1(f"{mv.path}:{mv.seed.name}:{mv.new_path}".encode()).hexdigest()[:6]
        old_mod = module_name(mv.path)
        task = Task(id=f"{self.name}-move-{mv.seed.name}-{digest}", prompt=refactor_prompt(
            f"{mv.path}:{mv.seed.name}", mv.seed.name, mv.path, old_mod, mv.new_module, mv.new_path, len(mv.units),
            ast.get_docstring(mv.seed.node) or ""),
            category="refactor", difficulty=2 if len(mv.units) == 1 else 3,
            provenance={"generator": "refactor_move", "source": self.source, "file": mv.path,
                        "name": f"{old_mod}.{mv.seed.name}", "new_file": mv.new_path, "new_module": mv.new_module,
                        "units": [u.name for u in mv.units], "seed": self.seed})
        task = self.save(task, {}, {hidden_path: hidden}, gold)
        try:
            v = validate(task, self.cfg, self.base, runs_after=1, cpu_s=self.screen_cpu, base_run=self.base_run,
                         only=[hidden_path])
            if not v.ok:
                discard(task)
                return v.reason
            if not any(i.startswith(hidden_path + "::") for i in v.fail_to_pass) or any(
                    not i.startswith(hidden_path + "::") for i in v.fail_to_pass):
                discard(task)
                return "fail-to-pass tests other than the move's"
            task.fail_to_pass, task.pass_to_pass = v.fail_to_pass, v.pass_to_pass
            return publish(task, self.out_dir)
        except BaseException:
            discard(task)
            raise


def generate_moves(repo: str, out_dir: str, sandbox_cfg, max_tasks: int | None = None, seed: int = 0,
                   workers: int = 2, test_command: str = DEFAULT_TEST_COMMAND, progress: bool = True,
                   source: str | None = None, task_timeout: float | None = None, min_lines: int = 1) -> Yield:
    """Write validated move-refactor tasks made from `repo` into `out_dir` (moves of at least
    `min_lines` lines). Raises GeneratorError when the repository's own tests do not pass."""
    m = _Mover(repo, out_dir, sandbox_cfg, test_command, source, seed, task_timeout, min_lines=min_lines)
    return generate("refactor_move", m, m.moves, m.handle, workers, max_tasks, progress)
