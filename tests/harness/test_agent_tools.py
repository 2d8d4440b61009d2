"""Every tool, on its success path and an error path, through the real loop."""
from __future__ import annotations

from typing import get_args

import pytest

from kiln.config import HarnessConfig, ToolName
from kiln.harness.agent import Agent
from kiln.policies.scripted import ScriptedPolicy

from .test_agent import call

# (tool call, expected in a success observation) and (bad call, expected in the error observation)
CASES = {
    "read_file": (call("read_file", path="pkg/calc.py"), "return a - b",
                  call("read_file", path="nope.py"), "does not exist"),
    "edit_file": (call("read_file", path="pkg/calc.py") + call("edit_file", path="pkg/calc.py", old_text="a - b",
                                                               new_text="a + b"), "Replaced 1 occurrence",
                  call("read_file", path="pkg/calc.py") + call("edit_file", path="pkg/calc.py", old_text="a / b",
                                                               new_text="x"), "not found"),
    "write_file": (call("write_file", path="new/a.txt", content="hi\n"), "Created new/a.txt",
                   call("write_file", path="/usr/x.txt", content="hi"), "read-only"),
    "run_shell": (call("run_shell", command="echo hello"), "hello",
                  call("run_shell", command="  "), "empty"),
    "grep": (call("grep", pattern="def add"), "pkg/calc.py:1:def add",
             call("grep", pattern="(unclosed"), "regular expression"),
    "todo": (call("todo", items=[{"content": "fix", "status": "pending"}]), "[ ] fix",
             call("todo", items=[{"content": "fix", "status": "someday"}]), "status"),
    "semantic_search": (call("semantic_search", query="add two numbers"), "pkg/calc.py",
                        call("semantic_search", query="   "), "query"),
    "web_search": (call("web_search", query="calculator addition"), "calc",
                   call("web_search", query=""), "query"),
    "web_fetch": (call("web_fetch", url="calc.html"), "Adds two numbers",
                  call("web_fetch", url="missing.html"), "missing.html"),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("web")
    (root / "calc.html").write_text("<html><title>calc module</title><body>Adds two numbers: calculator "
                                    "addition with add(a, b).</body></html>")
    (root / "other.html").write_text("<html><title>other</title><body>Unrelated text about files.</body></html>")
    return root


@pytest.mark.parametrize("tool", sorted(CASES))
def test_tool_success_and_error_through_the_loop(tool, hbox, corpus, tmp_path):
    good, good_text, bad, bad_text = CASES[tool]
    cfg = HarnessConfig(tools=list(get_args(ToolName)), web_corpus=str(corpus), embed_cache=str(tmp_path / "embed"))
    traj = Agent(ScriptedPolicy([good, bad, "done"]), hbox, cfg).run(f"exercise {tool}")
    assert traj.stop_reason == "finished"
    recs = [r for r in traj.tools if r.name == tool]
    obs = {m["tool_call_id"]: m["content"] for m in traj.messages if m["role"] == "tool"}
    ok, err = recs[0], recs[-1]
    assert ok.ok and good_text in obs[ok.call_id], obs[ok.call_id]
    assert not err.ok and bad_text.lower() in obs[err.call_id].lower(), obs[err.call_id]
    assert obs[err.call_id].startswith(f"{tool}:") or tool in obs[err.call_id]
