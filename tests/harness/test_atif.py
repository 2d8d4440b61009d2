"""ATIF export of a real trajectory (scripted policy, real sandbox)."""
from __future__ import annotations

import json

from kiln.config import HarnessConfig
from kiln.harness.agent import Agent
from kiln.harness.atif import SCHEMA_VERSION, to_atif
from kiln.harness.trajectory import Trajectory, TurnRecord
from kiln.policies.scripted import ScriptedPolicy


def call(name: str, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_trajectory_exports_to_atif(hbox):
    policy = ScriptedPolicy([
        TurnRecord(text="<think>Look first.</think>Reading." + call("read_file", path="pkg/calc.py")
                   + call("grep", pattern="def "), prompt_tokens=120, completion_tokens=3, prompt_ids=[1, 2],
                   completion_ids=[7, 8, 9], logprobs=[-0.1, -0.2, -0.3], versions=[4, 4, 5]),
        call("edit_file", path="pkg/calc.py", old_text="return a - b", new_text="return a + b"),
        call("no_such_tool"),
        "Fixed add.",
    ])
    cfg = HarnessConfig(tools=["read_file", "edit_file", "grep", "run_shell"])
    traj = Agent(policy, hbox, cfg).run("Fix add.", task_id="calc-1")
    doc = to_atif(traj, model_name="kiln-tiny")
    assert json.loads(json.dumps(doc)) == doc  # plain JSON
    assert doc == to_atif(Trajectory.from_json(traj.to_json()), model_name="kiln-tiny")  # pure: same input, same output
    assert doc["schema_version"] == SCHEMA_VERSION and doc["session_id"]
    assert doc["agent"]["name"] == "kiln" and doc["agent"]["model_name"] == "kiln-tiny"
    steps = doc["steps"]
    assert [s["step_id"] for s in steps] == list(range(1, len(steps) + 1))
    assert [s["source"] for s in steps] == ["system", "user", "agent", "agent", "agent", "agent"]
    assert steps[1]["message"].endswith("Fix add.") and steps[-1]["message"] == "Fixed add."
    first = steps[2]
    assert first["reasoning_content"] == "Look first." and first["message"] == "Reading."
    assert [c["function_name"] for c in first["tool_calls"]] == ["read_file", "grep"]
    assert first["tool_calls"][0]["arguments"] == {"path": "pkg/calc.py"}
    # every observation is tied to a call of the same step, in order; every call has its result
    for s in steps:
        ids = [c["tool_call_id"] for c in s.get("tool_calls", [])]
        assert [r["source_call_id"] for r in s.get("observation", {}).get("results", [])] == ids
        assert "observation" not in s or s["source"] == "agent"
    assert "return a - b" in first["observation"]["results"][0]["content"]
    assert "Unknown tool" in steps[4]["observation"]["results"][0]["content"]
    assert [r["ok"] for r in steps[4]["extra"]["tool_results"]] == [False]
    m = first["metrics"]
    assert (m["prompt_tokens"], m["completion_tokens"]) == (120, 3)
    assert m["prompt_token_ids"] == [1, 2] and m["completion_token_ids"] == [7, 8, 9]
    assert m["logprobs"] == [-0.1, -0.2, -0.3]
    assert m["extra"]["policy_versions"] == [4, 4, 5] and "logprobs" not in steps[3]["metrics"]
    fm = doc["final_metrics"]
    assert fm["total_steps"] == len(steps) and fm["total_prompt_tokens"] == 120
    assert fm["total_completion_tokens"] == sum(t.completion_tokens for t in traj.turns)
    assert doc["extra"]["task_id"] == "calc-1" and doc["extra"]["stop_reason"] == "finished"
    assert "+    return a + b" in doc["extra"]["diff"]["patch"]


def test_self_summary_segments_are_marked(hbox):
    cfg = HarnessConfig(tools=["run_shell"], context_tokens=512, summary_at=0.5)
    policy = ScriptedPolicy([call("run_shell", command="seq 1 400"), "Summary: printed numbers.", "done"])
    traj = Agent(policy, hbox, cfg).run("Print numbers.")
    assert len(traj.segments) == 2
    steps = to_atif(traj)["steps"]
    later = [s for s in steps if s.get("extra", {}).get("segment") == 1]
    assert [s["source"] for s in later][:2] == ["system", "user"]
    assert sum(1 for s in steps if s["source"] == "agent") == len(traj.turns)
