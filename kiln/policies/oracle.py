"""The oracle: solves a task from its gold patch through the real tools only.

When the task names a symbol in backticks, it first greps for it (the grep tool, else run_shell),
so a model imitating it learns to find a file before reading it. It then reads the files the
patch touches (paging as a model would), applies each hunk with
edit_file (extending the context until the old text is unique), creates and deletes files,
runs the tests and finishes. A seed varies the order, the plan, the wording and whether it
runs the tests first, so its trajectories are useful SFT data rather than one fixed script.
"""
from __future__ import annotations

import dataclasses
import json
import random
import re

from kiln.harness.format import Call, render_call
from kiln.harness.prompt import summary_request
from kiln.harness.trajectory import TurnRecord
from kiln.tasks.patch import FilePatch, parse_patch
from kiln.tasks.toydata import all_units

from .base import ApproxTokens

_LINE = re.compile(r"^\s*(\d+)\t(.*)$")
_SYMBOL = re.compile(r"`([A-Za-z_][A-Za-z_0-9]*)")  # the leading identifier of a `code span`
_DEF = re.compile(r"^\s*(?:async\s+)?def\s+([A-Za-z_][A-Za-z_0-9]*)")
_MORE = re.compile(r"offset=(\d+)")
_PAGE = 200  # lines per read: stays well inside the observation limit
_SEARCH = ["Let me find where that is defined.", "First, where is it defined?", "Searching the code for it."]
_OPENERS = ["Let me look at the code involved.", "First I'll read the relevant files.",
            "I'll start by reading the code.", "Reading the files this touches."]
_WHERE = ["{symptom}: the cause is in {where}.", "{symptom}. That happens in {where}.",
          "{symptom}, so the change goes in {where}."]
_EDITS = ["Now I'll make the change.", "I see what's needed; editing now.", "Applying the fix.",
          "Here is the change."]
# After a deliberate mistake (`mistakes`): the retry says what the tool's error meant.
_RETRIES = {"identical": ["That changed nothing: old and new were the same. Now with the fix.",
                          "Old and new text were identical; here is the actual change."],
            "missing": ["That text is not in the file. Copying the line exactly as it reads.",
                        "The old text did not match the file; retrying with the exact line."],
            "elsewhere": ["That changed nothing, and `{wrong}` is not where it goes wrong. {lead}",
                          "Nothing to change in `{wrong}`: it is not the cause. {lead}"],
            "other_line": ["That line is already right, so the defect is another one. {lead}",
                           "Nothing to change on that line: it is correct. {lead}"],
            "recalled": ["That text is not in the file, so that is not the defect here. {lead}",
                         "No such line in the file: the defect is another one. {lead}"]}
# A learner's wrong first edits, as the tiny SFT model makes them (docs/architecture.md, "Copying"):
# another line of the right function copied unchanged, or the buggy form of a line in the file (a
# defect the toy generator injects elsewhere, recalled from training; this file does not have it).
_DEFECTS = [(d.old, d.new) for u in all_units() for d in u.defects
            if d.level == 1 and "$" not in d.old + d.new and "\n" not in d.old]
_TESTS = ["Running the tests to check.", "Let me verify with the tests.", "Checking the test suite."]
_DONE = ["Done: {what}.", "I changed {what}; the tests pass.", "Finished. Updated {what}.",
         "The fix is in: {what}."]


class OraclePolicy(ApproxTokens):
    name = "oracle"

    def __init__(self, patch: str, test_command: str | None = None, seed: int = 0, mistakes: float = 0.0):
        self.files = parse_patch(patch)
        # With probability `mistakes`, the first edit is one a learning model makes (see _edit),
        # then redone after the tool's error: SFT
        # data that shows recovery. That turn is kind "mistake", never a training target. Its own
        # stream, so the rest of a seed's trajectory does not change with the rate.
        self.mistake = mistakes > 0 and random.Random(f"mistake-{seed}").random() < mistakes
        self.retry: tuple[list[Call], str, dict] | None = None  # the edit still to make, why, the retry's words
        self.test_command = test_command
        self.rng = random.Random(seed)
        self.rng.shuffle(self.files)
        self.lines: dict[str, dict[int, str]] = {}  # path -> line number -> text, as read
        self.pending_reads: list[tuple[str, int]] = []
        self.use_todo = self.rng.random() < 0.5
        self.test_first = bool(test_command) and self.rng.random() < 0.3
        self.phase = "start"
        self.task = ""
        self.offered: set[str] = set()

    def _say(self, options: list[str], calls: list[Call], **kw) -> TurnRecord:
        thought = self.rng.choice(options).format(**kw)
        text = thought + "".join("\n" + render_call(c) for c in calls)
        return TurnRecord(text=text)

    def _absorb_reads(self, messages: list[dict]) -> None:
        """Parse the numbered lines of the read_file results since our last turn (none in a segment
        that a self-summary started: they were absorbed when the summary was written)."""
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            return
        last = turns[-1]
        calls = {c["id"]: json.loads(c["function"]["arguments"]) for c in messages[last].get("tool_calls", [])
                 if c["function"]["name"] == "read_file"}
        for m in messages[last + 1:]:
            args = calls.get(m.get("tool_call_id"))
            if args is None:
                continue
            path = args["path"]
            got = self.lines.setdefault(path, {})
            for ln in m["content"].splitlines():
                hit = _LINE.match(ln)
                if hit:
                    got[int(hit.group(1))] = hit.group(2)
            more = _MORE.search(m["content"].splitlines()[-1]) if m["content"] else None
            if more:
                self.pending_reads.append((path, int(more.group(1))))

    def _read(self, path: str, offset: int) -> Call:
        return Call("", "read_file", {"path": path, "offset": offset, "limit": _PAGE})

    def generate(self, messages: list[dict], tools: list[dict], max_tokens: int) -> TurnRecord:
        if messages[-1]["role"] == "user" and messages[-1]["content"] == summary_request():
            return self._summary(messages)
        offered = self.offered = {t["function"]["name"] for t in tools}
        if self.phase == "start":
            self.task = next((m["content"] for m in messages if m["role"] == "user"), "").strip()
        self.use_todo = self.use_todo and "todo" in offered
        if self.phase == "start":
            symbol = _SYMBOL.search(next((m["content"] for m in messages if m["role"] == "user"), "") or "")
            self.phase = "located"
            if symbol and offered & {"grep", "run_shell"}:
                name = symbol.group(1)
                call = (Call("", "grep", {"pattern": name}) if "grep" in offered else
                        Call("", "run_shell", {"command": f"grep -rn -- {name} ."}))
                return self._say(_SEARCH, [call])
        if self.phase == "located":
            self.phase = "read"
            calls = [self._read(f.old_path, 1) for f in self.files if f.old_path and f.new_path]
            if self.use_todo:
                items = [{"content": f"update {f.path}", "status": "pending"} for f in self.files]
                calls.insert(0, Call("", "todo", {"items": items}))
            if self.test_first:
                calls.append(Call("", "run_shell", {"command": self.test_command}))
            if not calls:  # only new files to write: look at the layout first (a reply needs a call)
                calls = [Call("", "run_shell", {"command": "ls -R | head -n 50"})]
            return self._say(_OPENERS, calls)
        if self.phase == "read":
            self._absorb_reads(messages)
            if self.pending_reads:
                calls = [self._read(p, off) for p, off in self.pending_reads]
                self.pending_reads = []
                return self._say(_OPENERS[1:2], calls)
            self.phase = "edit"
            calls = [c for f in self.files for c in self._file_calls(f)]
            where = self._where()
            if not where:
                return self._edit(_EDITS, calls)
            # Restating the task and naming the function (copied from the task or the read) puts
            # what is wrong and where right before the edit, instead of a whole file back.
            lead = self.rng.choice(_WHERE).format(symptom=_symptom(self.task), where=where)
            return self._edit([lead + " " + e for e in _EDITS], calls, lead)
        if self.phase == "retry":
            (calls, kind, kw), self.retry, self.phase = self.retry, None, "edit"
            return self._say(_RETRIES[kind], calls, **kw)
        if self.phase == "edit" and self.test_command:
            self.phase = "test"
            return self._say(_TESTS, [Call("", "run_shell", {"command": self.test_command})])
        if self.use_todo and self.phase != "plan_done":
            self.phase = "plan_done"
            items = [{"content": f"update {f.path}", "status": "done"} for f in self.files]
            return self._say(["Everything on the plan is done."], [Call("", "todo", {"items": items})])
        self.phase = "done"
        return self._say(_DONE, [], what=", ".join(sorted(f.path for f in self.files)))

    def _edit(self, options: list[str], calls: list[Call], lead: str = "") -> TurnRecord:
        """The edit turn, or first a deliberate mistake (see __init__) when one is due: a third an
        unchanged line of another function (a wrong guess of where), a third another line of the
        right function unchanged, a third a line of the file in the buggy form of a defect the
        file lacks (recalled from other tasks); without a function named, the right line unchanged or the
        fixed line as the old text."""
        first = next((c for c in calls if c.name == "edit_file" and c.arguments["old_text"]), None)
        if not (self.mistake and first):
            return self._say(options, calls)
        self.mistake = False
        a = first.arguments
        known = self.lines.get(a["path"], {})
        roll = self.rng.random()
        other = self._elsewhere(known) if lead and roll < 1 / 3 else None
        recalled = self._recalled(known, a["old_text"]) if lead and roll >= 2 / 3 else None
        near = self._nearby(known, a["old_text"]) if lead and roll >= 1 / 3 and not recalled else None
        if recalled or near:  # a defect the file lacks, or another line of the right function unchanged
            kind = "recalled" if recalled else "other_line"
            old_text, new_text = recalled or (near, near)
            self.retry, self.phase = (calls, kind, {"lead": lead}), "retry"
            wrong = dict(a, old_text=old_text, new_text=new_text)
            return dataclasses.replace(self._say(options, [Call("", "edit_file", wrong)]), kind="mistake")
        if other:
            name, line = other
            self.retry, self.phase = (calls, "elsewhere", {"wrong": name, "lead": lead}), "retry"
            options = [self.rng.choice(_WHERE).format(symptom=_symptom(self.task), where=f"`{name}`") + " " + e
                       for e in _EDITS]
            return dataclasses.replace(self._say(options, [Call("", "edit_file", dict(a, old_text=line, new_text=line))]),
                                       kind="mistake")
        kind = "missing" if self.rng.random() < 0.5 and a["new_text"].strip() not in "\n".join(known.values()) \
            else "identical"
        wrong = dict(a, old_text=a["new_text"], new_text=a["old_text"]) if kind == "missing" else dict(
            a, new_text=a["old_text"])
        self.retry, self.phase = (calls, kind, {}), "retry"
        return dataclasses.replace(self._say(options, [Call("", "edit_file", wrong)]), kind="mistake")

    def _recalled(self, known: dict[int, str], old_text: str) -> tuple[str, str] | None:
        """(buggy form, the file's line), each + newline: a line of the file other than old_text's
        with a known defect applied, a form the file does not hold; None when no line has one."""
        text, skip = "\n".join(known[i] for i in sorted(known)), set(old_text.splitlines())
        options = [(line.replace(good, bad, 1), line) for line in known.values() if line not in skip
                   for good, bad in _DEFECTS if good in line]
        options = [(bad + "\n", line + "\n") for bad, line in options if bad.strip() and bad not in text]
        return self.rng.choice(sorted(options)) if options else None

    def _nearby(self, known: dict[int, str], old_text: str) -> str | None:
        """One code line (+ newline) of the function holding `old_text`'s first line, other than
        the lines `old_text` covers; None when there is none."""
        first = old_text.splitlines()[0] if old_text.strip() else None
        at = next((i for i in sorted(known) if known[i] == first), None)
        if at is None:
            return None
        top = next((i for i in range(at, 0, -1) if _DEF.match(known.get(i, ""))), None)
        if top is None:
            return None
        indent, doc, lines = len(known[top]) - len(known[top].lstrip()), False, []
        for i in range(top + 1, max(known) + 1):
            text = known.get(i, "")
            code = text.strip()
            if code and len(text) - len(text.lstrip()) <= indent:
                break
            quotes = code.count('"""') + code.count("'''")
            if doc or quotes:
                doc = doc != (quotes % 2 == 1)
                continue
            if code and not code.startswith(("#", "@", ">>>")) and text not in old_text.splitlines():
                lines.append(text + "\n")
        return self.rng.choice(lines) if lines else None

    def _elsewhere(self, known: dict[int, str]) -> tuple[str, str] | None:
        """(name, one code line + newline) of a function in the file other than the ones edited, or None."""
        right = set(_SYMBOL.findall(self._where()))
        bodies: dict[str, list[str]] = {}
        name, indent = None, 0
        for i in sorted(known):
            text, code = known[i], known[i].strip()
            depth = len(text) - len(text.lstrip())
            if m := _DEF.match(text):
                name, indent = (m.group(1) if m.group(1) not in right else None), depth
            elif code and depth <= indent:  # out of the function's body
                name = None
            elif name and code and not code.startswith(("#", '"', "'", "@")):
                bodies.setdefault(name, []).append(text + "\n")
        if not bodies:
            return None
        name = self.rng.choice(sorted(bodies))
        return name, self.rng.choice(bodies[name])

    def _where(self) -> str:
        """The functions the edits fall in, as `name`s (from the lines read): '' when none is known."""
        names: list[str] = []
        for f in self.files:
            known = self.lines.get(f.old_path or "", {})
            for h in f.hunks:
                at = h.old_start + _trim(h.old_text, h.new_text)[2]
                name = next((m.group(1) for i in range(at, 0, -1) if (m := _DEF.match(known.get(i, "")))), None)
                if name and f"`{name}`" not in names:
                    names.append(f"`{name}`")
        return " and ".join(names)

    def _summary(self, messages: list[dict]) -> TurnRecord:
        """A self-summary that carries what the next segment needs: the files, the exact lines
        still to change (a fresh context has no read results to copy them from), and what is next."""
        if self.phase == "read":
            self._absorb_reads(messages)
        if self.phase == "retry":  # the edit is still to make
            self.phase, self.retry = "read", None
        parts = [f"Task: {self.task}"]
        if self.phase in ("start", "located"):
            parts.append("I searched for where it is defined. Next: read " +
                         ", ".join(f"`{f.path}`" for f in self.files) + ".")
        elif self.phase == "read":
            for f in self.files:
                hunks = "".join(_trim(h.old_text, h.new_text)[0] for h in f.hunks)
                parts.append(f"I read `{f.path}`. The lines to change:\n```\n{hunks}```" if hunks.strip()
                             else f"`{f.path}` is to be written.")
            parts.append("Next: edit them, then run the tests.")
        else:
            parts.append("I edited " + ", ".join(f"`{f.path}`" for f in self.files) + ".")
            parts.append("Next: run the tests, then finish." if self.phase == "edit" else "The tests pass. Next: finish.")
        return TurnRecord(text="\n".join(parts))

    def _file_calls(self, f: FilePatch) -> list[Call]:
        if f.new_path is None:
            return [Call("", "run_shell", {"command": f"rm -- {f.old_path}"})]
        if f.old_path is None:
            content = "".join(h.new_text for h in f.hunks)
            if "write_file" in self.offered:
                return [Call("", "write_file", {"path": f.new_path, "content": content})]
            return [Call("", "edit_file", {"path": f.new_path, "old_text": "", "new_text": content})]
        known = self.lines.get(f.old_path, {})
        text = "".join(known[i] + "\n" for i in sorted(known))
        calls, shift = [], 0
        for h in f.hunks:
            old, new, skipped = _trim(h.old_text, h.new_text)
            old, new, at = _unique(text, old, new, h.old_start - 1 + skipped + shift)
            calls.append(Call("", "edit_file", {"path": f.new_path, "old_text": old, "new_text": new}))
            text = text[:at] + new + text[at + len(old):]
            shift += h.new_text.count("\n") - h.old_text.count("\n")
        return calls


def _symptom(task: str) -> str:
    """The task's first clause: what is wrong, without the request ("; fix it.")."""
    first = task.strip().splitlines()[0] if task.strip() else ""
    cut = min((i for i in (first.find("; "), first.find(" - "), first.find(". ")) if i > 0), default=len(first))
    return first[:cut].rstrip(".?! ")[:200]


def _trim(old: str, new: str) -> tuple[str, str, int]:
    """Drop the hunk's unchanged context lines (an edit as a person writes it: just the changed
    lines), keeping a line on each side when the other side would be empty. Returns old, new and
    how many leading lines were dropped."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    lead = 0
    while lead < min(len(a), len(b)) - 1 and a[lead] == b[lead]:
        lead += 1
    tail = 0
    while tail < min(len(a), len(b)) - lead - 1 and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    return "".join(a[lead:len(a) - tail]), "".join(b[lead:len(b) - tail]), lead


def _unique(text: str, old: str, new: str, line: int) -> tuple[str, str, int]:
    """Pick the occurrence of `old` nearest to 0-based `line`, then grow it (and `new`) by whole
    lines of context until it is unique. Returns old, new and the occurrence's offset."""
    starts = [m.start() for m in re.finditer(re.escape(old), text)] if old else []
    if not starts:
        return old, new, 0  # edit_file will say it does not match; the model-facing path
    at = min(starts, key=lambda i: abs(text.count("\n", 0, i) - line))
    end = at + len(old)
    while text.count(text[at:end]) > 1:
        if at > 0:
            prev = text.rfind("\n", 0, at - 1) + 1
            new, at = text[prev:at] + new, prev
        elif end < len(text):
            nxt = text.find("\n", end)
            nxt = len(text) if nxt == -1 else nxt + 1
            new, end = new + text[end:nxt], nxt
        else:
            break
    return text[at:end], new, at
