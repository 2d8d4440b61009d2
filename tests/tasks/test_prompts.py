"""Prompt templates: deterministic picks, variety, terse lengths, and most naming no file."""
from __future__ import annotations

import re
import statistics

from kiln.tasks import prompts as P

PATH = re.compile(r"\b[\w./-]+\.py\b")


def sample_prompts(n: int = 200) -> dict[str, list[str]]:
    out = {"bugfix": [], "feature": [], "refactor": [], "tests": []}
    for i in range(n):
        key = f"task-{i}"
        out["bugfix"].append(P.bug_prompt(key, "boltons", "OrderedMultiDict", "boltons/dictutils.py",
                                          ["tests/test_dictutils.py::test_pop", "tests/test_dictutils.py::test_pop_all[x]",
                                           "tests/test_dictutils.py::TestOMD::test_setdefault"],
                                          "KeyError: 'odd' at 0x7f00deadbeef", multi=True))
        out["feature"].append(P.feature_prompt(key, "boltons", "the `OneToOne` class", "boltons/dictutils.py",
                                               "Implements a one-to-one mapping dictionary.\n\nMore text.", 3,
                                               ["boltons/__init__.py"], "It had 8 methods, among them `unique`."))
        out["refactor"].append(P.refactor_prompt(key, "ManyToMany", "boltons/dictutils.py", "boltons.dictutils",
                                                 "boltons.many_to_many", "boltons/many_to_many.py", 2,
                                                 "A many-to-many mapping."))
        out["tests"].append(P.tests_prompt(key, "cachetools", "cachetools.func", "cachetools/func.py",
                                           ["lru_cache", "ttl_cache", "fifo_cache", "lfu_cache"]))
    return out


def test_picks_are_deterministic_and_varied():
    a, b = sample_prompts(50), sample_prompts(50)
    assert a == b  # the same key, the same prompt (no salted hash, no RNG state)
    for cat, ps in sample_prompts().items():
        assert len(set(ps)) >= 4, cat  # several templates in use
    assert P.pick("x", [1, 2, 3]) == P.pick("x", [1, 2, 3])


def test_prompts_are_terse_and_mostly_name_no_file():
    ps = sample_prompts()
    every = [p for v in ps.values() for p in v]
    assert 250 <= statistics.median(len(p) for p in every) <= 450
    assert sum(not PATH.search(p) for p in every) >= len(every) / 2
    bug = ps["bugfix"]
    assert sum(not PATH.search(p) for p in bug) >= 0.6 * len(bug)  # bugs: mostly the symptom, not the place
    assert all("0x7f" not in p and "`test_pop`" in p and "`TestOMD.test_setdefault`" in p for p in bug)
    assert all("`OneToOne`" in p and "one-to-one mapping" in p for p in ps["feature"])
    assert all("ManyToMany" in p and ("boltons.many_to_many" in p or "boltons/many_to_many.py" in p) for p in ps["refactor"])
    assert all("`lru_cache`" in p for p in ps["tests"])


def test_helpers():
    assert P.first_sentence("Does a thing. And more.\n\nParagraph.") == "Does a thing."
    assert P.clip("a " * 100, 20).endswith("...") and len(P.clip("a " * 100, 20)) <= 20
    assert P.test_names(["t.py::A::test_x[1]", "t.py::A::test_x[2]", "t.py::test_y"]) == ["A.test_x", "test_y"]
    assert P.names(["a", "b", "c", "d", "e"], 3) == "`a`, `b`, `c` and 2 more"
