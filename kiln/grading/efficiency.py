"""Efficiency of a rollout: what it spent, by kind (the quantities the length penalty weighs).

Repeated calls are counted two ways: `repeated_calls` is every call identical (same tool, same
arguments) to an earlier one; `redundant_calls` only those with no edit in between, whose result
could not have changed (re-running the tests after an edit is not waste).
"""
from __future__ import annotations

import json

EDIT_TOOLS = ("edit_file", "write_file")


def _key(name: str, arguments: dict) -> str:
    return name + json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def efficiency(traj) -> dict:
    e = traj.effort
    seen: set[str] = set()
    since_edit: set[str] = set()
    repeated = redundant = 0
    for t in traj.tools:
        k = _key(t.name, t.arguments)
        repeated += k in seen
        redundant += k in since_edit
        seen.add(k)
        since_edit.add(k)
        if t.name in EDIT_TOOLS and t.ok:
            since_edit = set()
    acting_turns = len({t.turn for t in traj.tools})
    return {
        "thinking_tokens": e.thinking_tokens, "tool_call_tokens": e.tool_call_tokens,
        "tool_output_tokens": e.tool_output_tokens, "final_tokens": e.final_tokens,
        "generated_tokens": e.thinking_tokens + e.tool_call_tokens + e.final_tokens,
        "completion_tokens": sum(t.completion_tokens for t in traj.turns),  # as the policy counted them
        "tool_calls": e.tool_calls, "malformed_calls": e.malformed_calls, "turns": e.turns,
        "calls_per_turn": len(traj.tools) / acting_turns if acting_turns else 0.0,  # >1: parallel calls
        "summaries": max(0, len(traj.segments) - 1),
        "wall_s": float(traj.metadata.get("wall_s", 0.0)),
        "tool_s": sum(t.duration_s for t in traj.tools),
        "policy_s": sum(t.duration_s for t in traj.turns),
        "repeated_calls": repeated, "redundant_calls": redundant,
    }
