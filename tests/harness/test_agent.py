"""The real agent loop driven by scripted policies, in a real sandbox."""
from __future__ import annotations

import json
import threading
import time

from kiln.config import HarnessConfig
from kiln.harness.agent import Agent
from kiln.harness.trajectory import Trajectory, TurnRecord
from kiln.policies.scripted import ScriptedPolicy


def call(name: str, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def tool_msgs(messages: list[dict]) -> list[dict]:
    return [m for m in messages if m["role"] == "tool"]


def cfg(**kw) -> HarnessConfig:
    base = dict(tools=["read_file", "edit_file", "write_file", "run_shell", "grep", "todo"])
    return HarnessConfig(**{**base, **kw})


def test_fix_a_bug_end_to_end(hbox, tmp_path):
    policy = ScriptedPolicy([
        "<think>The add test fails; look at calc.</think>" + call("read_file", path="pkg/calc.py"),
        call("edit_file", path="pkg/calc.py", old_text="return a - b", new_text="return a + b"),
        call("run_shell", command="python -m pytest -q"),
        "Fixed add: it subtracted instead of adding.",
    ])
    out = tmp_path / "traj.json"
    traj = Agent(policy, hbox, cfg()).run("The add function is wrong. Fix it.", task_id="t1", out=str(out))
    assert traj.stop_reason == "finished"
    assert traj.diff["files"] == {"pkg/calc.py": "M"}
    assert "+    return a + b" in traj.diff["patch"]
    shell = tool_msgs(traj.messages)[-1]["content"]
    assert "2 passed" in shell and "exit code: 0" in shell
    assert traj.effort.turns == 4 and traj.effort.tool_calls == 3
    assert traj.effort.thinking_tokens > 0 and traj.effort.final_tokens > 0 and traj.effort.tool_output_tokens > 0
    assert [t.ok for t in traj.tools] == [True, True, True]
    # the file on disk is the final state, and it round-trips unchanged
    assert Trajectory.load(str(out)).to_dict() == traj.to_dict()
    # the system prompt lists the tools and the format; the task is the first user message
    system, user = policy.calls[0][0]["content"], policy.calls[0][1]["content"]
    assert '"name": "edit_file"' in system and "<tool_call>" in system
    assert user.endswith("The add function is wrong. Fix it.")


def test_trajectory_saved_after_every_step(hbox, tmp_path):
    out = tmp_path / "t.json"
    seen = []

    def step(messages):
        if out.exists():
            seen.append(len(Trajectory.load(str(out)).turns))
        return call("run_shell", command="true") if len(seen) < 3 else "done"
    Agent(ScriptedPolicy(step), hbox, cfg()).run("go", out=str(out))
    assert seen == [1, 2, 3]


def test_parallel_read_only_calls_run_concurrently(hbox):
    policy = ScriptedPolicy([
        call("read_file", path="pkg/calc.py") + call("grep", pattern="def ") + call("read_file", path="README.md"),
        "done",
    ])
    traj = Agent(policy, hbox, cfg()).run("look around")
    results = tool_msgs(traj.messages)
    assert [m["name"] for m in results] == ["read_file", "grep", "read_file"]  # results in call order
    assert "return a - b" in results[0]["content"] and "tiny calculator" in results[2]["content"]
    assert len({m["tool_call_id"] for m in results}) == 3


def test_parallel_calls_overlap_in_time(hbox):
    from kiln.harness.tools.base import Tool
    active, peak = [0], [0]
    lock = threading.Lock()

    def slow(args, ctx):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.2)
        with lock:
            active[0] -= 1
        return "ok"
    tool = Tool("peek", "read-only probe", {"type": "object", "properties": {}}, slow, read_only=True)
    policy = ScriptedPolicy([call("peek") * 3, "done"])
    Agent(policy, hbox, cfg(), tools={"peek": tool}).run("x")
    assert peak[0] == 3  # all three were running at once


def test_each_malformed_call_kind_teaches_the_model(hbox):
    policy = ScriptedPolicy([
        '<tool_call>{"name": "read_file", "arguments": {"path": "a.py",}}</tool_call>',  # bad JSON
        call("delete_everything", path="/"),  # unknown tool
        call("read_file"),  # missing argument
        call("read_file", path="README.md", colour="red"),  # extra argument (strict)
        call("read_file", path=["README.md"]),  # wrong type
        '<tool_call>{"name": "read_file", "arguments": {"path": "README.md"}}',  # unclosed
        TurnRecord(text="<think>long thought that goes on and on", finish_reason="length"),  # cut off
        "done",
    ])
    traj = Agent(policy, hbox, cfg(strict_args=True)).run("x")
    assert traj.stop_reason == "finished"
    obs = [m["content"] for m in traj.messages if m["role"] in ("tool", "user")][1:]
    assert "invalid JSON" in obs[0] and "Expected exactly" in obs[0]
    assert "Unknown tool 'delete_everything'" in obs[1] and "read_file" in obs[1]
    assert "missing required argument 'path'" in obs[2]
    assert "unknown argument 'colour'" in obs[3]
    assert "argument 'path' must be string" in obs[4]
    assert "no closing </tool_call>" in obs[5]
    assert "cut off" in obs[6]
    assert [t.ok for t in traj.tools] == [False, False, False, False]
    # the bad JSON and the unclosed block never became calls; the other four parsed
    assert (traj.effort.malformed_calls, traj.effort.tool_calls) == (2, 4)


def test_lenient_mode_coerces_and_ignores(hbox):
    policy = ScriptedPolicy([call("read_file", path="README.md", limit="1", colour="red"), "done"])
    traj = Agent(policy, hbox, cfg(strict_args=False)).run("x")
    assert traj.tools[0].ok
    assert "# calc" in tool_msgs(traj.messages)[0]["content"]


def test_limits_end_the_rollout(hbox):
    loop = ScriptedPolicy(lambda m: call("run_shell", command="true"))
    assert Agent(loop, hbox, cfg(max_turns=3)).run("x").stop_reason == "max_turns"
    big = ScriptedPolicy(lambda m: TurnRecord(text=call("run_shell", command="true"), completion_tokens=400))
    traj = Agent(big, hbox, cfg(max_tokens=1000)).run("x")
    assert traj.stop_reason == "max_tokens" and traj.effort.turns == 3
    slow = ScriptedPolicy(lambda m: call("run_shell", command="sleep 0.2"))
    assert Agent(slow, hbox, cfg(wall_time_s=0.5)).run("x").stop_reason == "wall_time"


def test_self_summary_chains_segments(hbox):
    filler = "x " * 200

    def step(messages):
        last = messages[-1]["content"]
        if "Your context is nearly full" in last:
            return f"SUMMARY: read calc, plan to fix add. {len(messages)}"
        return call("todo", items=[{"content": "fix add", "status": "in_progress"}]) + call(
            "run_shell", command=f"echo {filler}")
    policy = ScriptedPolicy(step)
    c = cfg(context_tokens=1000, summary_at=0.6, max_summaries=2, max_turns=30)  # summarise at 600 tokens
    traj = Agent(policy, hbox, c).run("Fix add.")
    assert traj.stop_reason == "max_summaries"
    assert len(traj.segments) == 3
    for seg in traj.segments[:-1]:
        assert seg.summary.startswith("SUMMARY:")
        assert seg.turns[-1].kind == "summary"  # the summary's tokens stay with its segment
        assert all(t.completion_tokens > 0 for t in seg.turns)
    resume = traj.segments[1].messages[1]["content"]
    assert "Fix add." in resume and "SUMMARY:" in resume and "fix add" in resume  # task + summary + to-dos
    assert "1 summary so far" in resume and "2 summaries so far" in traj.segments[2].messages[1]["content"]
    assert traj.unfinished_todos == [{"content": "fix add", "status": "in_progress"}]


def test_replies_cut_off_at_the_turn_limit_still_lead_to_a_summary(hbox):
    """A model repeating itself until max_turn_tokens is interrupted every turn; its context must
    still pass through a summary instead of filling up (found in the tiny SFT model's rollouts)."""
    def step(messages):
        if "Your context is nearly full" in messages[-1]["content"]:
            return "SUMMARY: nothing fixed yet."
        return TurnRecord(text="It is not where it goes wrong. " * 20, completion_tokens=150, finish_reason="length")
    c = cfg(tools=["run_shell"], context_tokens=3000, summary_at=0.6, max_summaries=1, max_turns=30)
    traj = Agent(ScriptedPolicy(step), hbox, c).run("Fix add.")
    assert traj.stop_reason == "max_summaries" and len(traj.segments) == 2
    assert len(traj.segments[0].turns) > 3  # it acted (and was cut off) several times before summarising
    assert traj.segments[0].summary == "SUMMARY: nothing fixed yet."
    assert "cut off" in traj.segments[0].messages[-3]["content"]  # the interrupt came right before the request


def test_trajectory_json_round_trip_keeps_token_data(hbox):
    rec = TurnRecord(text=call("run_shell", command="echo hi"), prompt_ids=[1, 2, 3], completion_ids=[4, 5],
                     logprobs=[-0.125, -2.5e-7], versions=[3, 4], routes=[[[0, 1]], [[2, 3]]])
    traj = Agent(ScriptedPolicy([rec, "bye"]), hbox, cfg()).run("x")
    back = Trajectory.from_json(traj.to_json())
    assert back == traj and back.turns[0].logprobs == [-0.125, -2.5e-7]
    assert back.version_span() == (3, 4)


def test_summary_trigger_is_a_fraction_of_the_policys_context(hbox):
    policy = ScriptedPolicy(["done"])
    c = cfg(context_tokens=100_000, summary_at=0.5)
    assert Agent(policy, hbox, c).summary_trigger() == 50_000  # a policy without a window: the config's
    policy.context_window = 4096  # a local model's engine: its own window wins
    assert Agent(policy, hbox, c).summary_trigger() == 2048


def test_a_rollout_repeating_one_failing_call_stops_as_looping(hbox):
    bad = call("read_file", path="no/such/file.py")
    traj = Agent(ScriptedPolicy([bad] * 10), hbox, cfg(max_repeats=3)).run("Read it.")
    assert traj.stop_reason == "looping" and len(traj.tools) == 3 and not any(t.ok for t in traj.tools)
    # a call that succeeds, a different failing one, or repeats within one turn are not a loop
    once = Agent(ScriptedPolicy([bad + bad + bad, "done"]), hbox, cfg(max_repeats=3)).run("Read it.")
    assert once.stop_reason == "finished" and len(once.tools) == 3
    ok = call("run_shell", command="echo hi")
    mixed = [bad, bad, ok, bad, bad, call("read_file", path="other.py"), bad, "done"]
    traj = Agent(ScriptedPolicy(mixed), hbox, cfg(max_repeats=3)).run("Read it.")
    assert traj.stop_reason == "finished"
