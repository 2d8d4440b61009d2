"""Top-level units of a Python package and who uses them: the graph behind multi-unit feature
deletion and move refactors.

A unit is a module-level function, class or single-name assignment (`_RE = re.compile(...)`).
A reference is a Name in a unit's code (decorators and base classes included) that resolves to a
unit of the same module or, through `from .x import name`, of another module of the package.
A seed's *exclusive helpers* are the private units it reaches that nothing outside the group
uses: no other unit, no other module-level statement (imports of them aside), transitively. They
can be deleted or moved with the seed without breaking anything else at import.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

from .gen import module_name
from .pyedit import parse, resolve_from


@dataclass(eq=False)
class Unit:
    path: str
    name: str
    node: ast.stmt
    refs: set = field(default_factory=set)  # (path, name) keys of units this one uses

    @property
    def key(self) -> tuple[str, str]:
        return self.path, self.name

    @property
    def kind(self) -> str:
        return "class" if isinstance(self.node, ast.ClassDef) else "assignment" if isinstance(
            self.node, (ast.Assign, ast.AnnAssign)) else "function"

    @property
    def first_line(self) -> int:
        return min([self.node.lineno] + [d.lineno for d in getattr(self.node, "decorator_list", [])])

    @property
    def n_lines(self) -> int:
        return self.node.end_lineno - self.first_line + 1


def _unit_name(st) -> str | None:
    if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return st.name
    if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
        return st.targets[0].id
    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
        return st.target.id
    return None


class UnitGraph:
    def __init__(self, texts: dict[str, bytes], src_files: list[str]):
        self.trees = {}
        for p in src_files:
            try:
                self.trees[p] = parse(texts[p], p)
            except (SyntaxError, ValueError):
                continue
        by_module = {module_name(p): p for p in self.trees}
        self.units: dict[tuple[str, str], Unit] = {}
        self.external: dict[tuple[str, str], int] = {}  # uses from module-level code that is no unit
        scope: dict[str, dict[str, tuple[str, str]]] = {}  # path -> visible name -> unit key
        dup: set = set()
        for p, tree in self.trees.items():
            names = scope.setdefault(p, {})
            for st in tree.body:
                n = _unit_name(st)
                if n is None or n.startswith("__"):
                    continue
                if (p, n) in self.units:
                    dup.add((p, n))
                self.units[(p, n)] = Unit(p, n, st)
                names[n] = (p, n)
        for key in dup:  # defined twice: not one unit
            del self.units[key]
        for p, tree in self.trees.items():
            for st in tree.body:
                if isinstance(st, ast.ImportFrom):
                    target = by_module.get(resolve_from(p, st))
                    for a in st.names:
                        if target and a.name != "*":
                            scope[p].setdefault(a.asname or a.name, (target, a.name))
        for p, tree in self.trees.items():
            for st in tree.body:
                n = _unit_name(st)
                used = {scope[p][x.id] for x in ast.walk(st) if isinstance(x, ast.Name) and x.id in scope[p]}
                used = {k for k in used if k in self.units}
                if n is not None and (p, n) in self.units:
                    self.units[(p, n)].refs = used - {(p, n)}
                elif not isinstance(st, (ast.Import, ast.ImportFrom)):
                    for k in used:
                        self.external[k] = self.external.get(k, 0) + 1
        self.users: dict[tuple[str, str], set] = {k: set() for k in self.units}
        for u in self.units.values():
            for k in u.refs:
                self.users[k].add(u.key)

    def public(self, kinds=("function", "class")) -> list[Unit]:
        return [u for u in self.units.values() if not u.name.startswith("_") and u.kind in kinds]

    def closure(self, seed: Unit, max_units: int = 8) -> list[Unit]:
        """The seed and its exclusive private helpers (in file order), at most `max_units` units."""
        group = {seed.key}
        changed = True
        while changed and len(group) < max_units:
            changed = False
            for k in sorted({r for g in group for r in self.units[g].refs} - group):
                u = self.units[k]
                if (u.name.startswith("_") and not self.external.get(k) and self.users[k] <= group
                        and len(group) < max_units):
                    group.add(k)
                    changed = True
        return sorted((self.units[k] for k in group), key=lambda u: (u.path != seed.path, u.path, u.node.lineno))
