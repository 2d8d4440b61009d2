"""Terse prompts in a developer's voice for the real-code generators.

CursorBench's prompts are short (a median of 390 characters) and often name no file: the agent
has to find the code. Each generator here fills one of several templates, chosen by a hash of the
task's key (so a rebuild picks the same one), from facts the generator measured: the symbol, a
first docstring line, the failing tests and the first error line. About half the templates name
no path, and the bug templates mostly describe the symptom (which call misbehaves, how), not
where the code is.
"""
from __future__ import annotations

import hashlib
import re


def pick(key: str, options: list):
    """One of `options`, fixed by `key` (sha1, not Python's salted hash)."""
    return options[int(hashlib.sha1(key.encode()).hexdigest(), 16) % len(options)]


def clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 3].rstrip() + "..."


def first_sentence(doc: str, n: int = 140) -> str:
    doc = " ".join((doc or "").strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", doc)
    return clip(m[1] if m else doc, n)


def clean_message(msg: str, n: int = 150) -> str:
    msg = re.sub(r" at 0x[0-9a-fA-F]+", "", msg.replace("`", "'"))
    return clip(msg, n)


def names(items: list[str], n: int = 3) -> str:
    shown = ", ".join(f"`{x}`" for x in items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def test_names(ids: list[str]) -> list[str]:
    """Short names of test ids: `TestCls.test_x` / `test_y` (parameters dropped, deduplicated)."""
    out = []
    for i in ids:
        short = i.split("::", 1)[-1].split("[")[0].replace("::", ".")
        if short not in out:
            out.append(short)
    return out


# -- bugs: symptoms first ------------------------------------------------------------------------

BUG = [
    "Something regressed in {project}: {tests} {fail_verb} now{msg_clause}. {hint} Track it down and fix the "
    "code, not the tests; the rest of the suite has to stay green.",
    "{tests} {fail_verb} after the last round of changes{msg_clause}. I think it's in `{symbol}` but haven't "
    "looked closely. {hint} Please fix it without touching the tests.",
    "Getting wrong results from `{symbol}`{msg_clause}. {hint} {tests} {fail_verb} on this. Can you find what "
    "broke and fix it? Don't edit the tests.",
    "CI is red on {project}: {tests} {fail_verb}{msg_clause}. {hint} Fix the library code so they pass again "
    "and nothing else breaks.",
    "Bug report from a user of {project}: `{symbol}` is misbehaving{msg_clause}. {hint} The failing tests "
    "are {tests}. Make them pass; keep the rest of the suite passing.",
    "There's a regression in `{path}` around `{symbol}`: {tests} {fail_verb}{msg_clause}. {hint} Fix it in "
    "the source.",
]
BUG_CODA = [
    " When you're done, tell me in a sentence what the root cause was.",
    " Run the relevant tests before you call it done.",
    " Keep the fix minimal; no drive-by refactors please.",
    " No need to add new tests, just make the existing ones pass.",
    "",
]
MULTI_HINT = [
    "I suspect more than one thing changed, so don't stop at the first fix.",
    "It looks like several small edits went in together; there may be more than one spot.",
    "Probably a couple of separate mistakes, all in the same area.",
    "Check the neighbouring code too, more than one line is likely off.",
]


def bug_prompt(key: str, project: str, symbol: str, path: str, f2p: list[str], message: str, multi: bool) -> str:
    t = test_names(f2p)
    msg = clean_message(message) if message else ""
    return " ".join((pick(key, BUG) + pick(key + "c", BUG_CODA)).format(
        project=project, symbol=symbol, path=path, tests=names(t, 4), fail_verb="fails" if len(t) == 1 else "fail",
        msg_clause=f" with `{msg}`" if msg else "", hint=pick(key + "h", MULTI_HINT) if multi else "",
    ).split())


# -- features: what to build, rarely where -------------------------------------------------------

FEATURE = [
    "{project} is missing {what}. {doc}{detail} Implement it; the tests for it were lost, so work from the docs "
    "and how the rest of the package is written, and keep the public API consistent with its neighbours.{helpers}",
    "We need {what} back in {project}. {doc}{detail} It should be importable the same way as the other public "
    "names, and behave the way its docstring says, including the edge cases.{helpers}",
    "Please add {what} to `{path}`. {doc}{detail} Hook up any exports too, and follow the style of the code "
    "around it.{helpers}",
    "Implement {what}. {doc}{detail} Follow the conventions of the surrounding code (naming, errors, edge "
    "cases); make it behave the way its name and docs imply.{helpers}",
    "Restore {what} in {project}. {doc}{detail} Look at how similar things are done elsewhere in the repo "
    "to get the details right; hidden tests will exercise it.{helpers}",
]


def feature_prompt(key: str, project: str, what: str, path: str, doc: str, n_units: int, other_files: list[str],
                   detail: str = "") -> str:
    """`detail`: a sentence the generator measured (a signature, a class's public methods)."""
    helpers = ""
    if n_units > 1:
        helpers = " " + pick(key + "u", [
            f"It needs {n_units - 1} private helper{'s' if n_units > 2 else ''} as well, which are gone too.",
            "Its private helpers were removed with it; bring back whatever it needs.",
            "Some internal pieces it relies on are missing as well."])
    if other_files and pick(key + "f", [True, False]):
        helpers += " It should be exported from " + ", ".join(f"`{p}`" for p in other_files[:2]) + "."
    doc = first_sentence(doc, 200)
    if doc and doc[-1] not in ".!?":
        doc += "."
    return " ".join(pick(key, FEATURE).format(project=project, what=what, path=path, doc=doc or "",
                                              detail=" " + detail if detail else "", helpers=helpers).split())


# -- refactors -----------------------------------------------------------------------------------

REFACTOR = [
    "`{old}` is getting too big. Move `{name}`{helpers} into a new module `{new_mod}` ({new_path}). {doc}"
    "Keep `{old_mod}.{name}` importable for existing callers, and don't change behaviour: the existing tests "
    "must pass unchanged.",
    "Split `{name}`{helpers} out of `{old_mod}` into its own module, `{new_mod}`. {doc}It has to be defined "
    "there (not just re-exported), and `from {old_mod} import {name}` must keep working for users who "
    "already import it that way.",
    "Refactor: `{name}` should live in `{new_mod}`{helpers}. {doc}Create the module, move the code with the "
    "imports it needs, and leave a re-export behind so the old import path still works. No behaviour changes.",
    "Please pull `{name}`{helpers} out into `{new_path}`. {doc}Old imports from `{old_mod}` must not break, "
    "nothing else should move, and the test suite must stay green.",
    "I'd like `{name}` in a module of its own so it can be imported without the rest of `{old_mod}`: put it "
    "in `{new_mod}`{helpers}. {doc}Keep the old name working as an alias and don't change what it does.",
]
REFACTOR_CODA = [
    " Update nothing else unless it's needed for the move.",
    " Run the test suite afterwards.",
    " Keep the code itself as it is, just moved.",
    "",
]
REASONS = ["It's unrelated to most of what's around it. ", "We want to reuse it elsewhere. ",
           "That file is hard to navigate. ", "", "It has grown into its own thing. "]


def refactor_prompt(key: str, name: str, old_path: str, old_mod: str, new_mod: str, new_path: str, n_units: int,
                    doc: str = "") -> str:
    helpers = ""
    if n_units > 1:
        helpers = pick(key + "u", [" and the private helpers only it uses", f" (with its {n_units - 1} helper"
                                   f"{'s' if n_units > 2 else ''})", " along with what only it depends on"])
    doc = first_sentence(doc, 150)
    what = (f"For context, `{name}`: {doc[0].lower() + doc[1:]}" if doc else "")
    what = (what if what.endswith((".", "!", "?")) or not what else what + ".") + (" " if what else "")
    return " ".join((pick(key, REFACTOR) + pick(key + "c", REFACTOR_CODA)).format(name=name, old=old_path, old_mod=old_mod, new_mod=new_mod,
                                               new_path=new_path, helpers=helpers,
                                               doc=pick(key + "r", REASONS) + what).split())


# -- test writing --------------------------------------------------------------------------------

TESTS = [
    "`{module}` has almost no test coverage. Write a pytest file for it in a new test file next to the other "
    "tests, covering {names}. Aim for tests that would catch real bugs: edge cases, wrong results, not just "
    "smoke tests. Don't change the library code.",
    "Add tests for `{module}` in {project}: {names} at least. Put them in a new file under the existing tests "
    "folder. They must pass on the current code and should fail if someone breaks the logic. Leave the source "
    "as it is.",
    "We lost the tests for `{module}`. Please write a new test module that exercises {names} thoroughly "
    "(boundaries, error cases, return values). Only add test files; the code itself is fine as it is.",
    "Can you write solid unit tests for `{path}`? New file, pytest style, passing against the current code. "
    "The point is to catch regressions in {names}, so assert on actual results rather than just calling "
    "things.",
    "I want a proper regression net for {names} in `{module}`. Write new pytest tests (a new test file) that "
    "pass today and would fail if the behaviour changed. Don't modify the library.",
]


TESTS_CODA = [
    " Run the new file with pytest before you finish.",
    " Prefer many small focused tests over a few big ones.",
    " Parametrize where it keeps things short.",
    " Check error paths too, not only the happy path.",
]


def tests_prompt(key: str, project: str, module: str, path: str, covered: list[str] | None = None) -> str:
    shown = names(covered or [], 6) if covered else "its public API"
    return " ".join((pick(key, TESTS) + pick(key + "c", TESTS_CODA)).format(
        project=project, module=module, path=path, names=shown).split())
