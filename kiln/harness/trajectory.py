"""The trajectory record: one JSON document that is both the debug log and the training sample.

Messages are OpenAI chat format. Each segment (a context window; a self-summary starts a new
one) keeps its own per-turn token data, so the trainer never re-tokenises history and can give
every generated token, summaries included, the trajectory's advantage.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

SCHEMA_VERSION = 1


@dataclass
class TurnRecord:
    """One policy call. Token fields are filled by local policies, None otherwise."""
    text: str  # the raw generated text
    finish_reason: str = "stop"  # "stop" | "length"
    kind: str = "action"  # "action" | "summary" | "mistake" (a demonstrator's, made to show recovery)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    duration_s: float = 0.0
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    logprobs: list[float] | None = None
    versions: list[int] | None = None  # policy version that produced each token
    routes: list | None = None  # routed experts per token per MoE layer


@dataclass
class ToolRecord:
    turn: int  # index into the trajectory's turns (all segments, in order)
    call_id: str
    name: str
    arguments: dict
    ok: bool
    duration_s: float
    output_chars: int

    @property
    def call(self) -> tuple[str, str]:
        """What makes two calls the same call: the tool and its arguments."""
        return self.name, json.dumps(self.arguments, sort_keys=True)


@dataclass
class Segment:
    messages: list[dict] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    summary: str | None = None  # the summary that closed this segment


@dataclass
class Effort:
    """The counts the length penalty weighs (RECIPE: thinking, tool calls, outputs, turns), and the
    tool-call blocks that did not parse (a behaviour count)."""
    thinking_tokens: int = 0
    tool_call_tokens: int = 0
    tool_output_tokens: int = 0
    final_tokens: int = 0
    tool_calls: int = 0
    turns: int = 0
    malformed_calls: int = 0


@dataclass
class Trajectory:
    task_id: str = ""
    task: str = ""
    segments: list[Segment] = field(default_factory=list)
    tools: list[ToolRecord] = field(default_factory=list)
    effort: Effort = field(default_factory=Effort)
    diff: dict | None = None  # {"patch", "added", "removed", "files"} of the final sandbox
    rewards: dict[str, float] = field(default_factory=dict)
    stop_reason: str = ""  # finished | max_turns | max_tokens | wall_time | max_summaries | looping | context | error
    unfinished_todos: list[dict] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    @property
    def messages(self) -> list[dict]:
        """Every message of every segment, in order (segments after the first restate the task)."""
        return [m for s in self.segments for m in s.messages]

    @property
    def turns(self) -> list[TurnRecord]:
        return [t for s in self.segments for t in s.turns]

    def version_span(self) -> tuple[int, int] | None:
        versions = [v for t in self.turns for v in (t.versions or [])]
        return (min(versions), max(versions)) if versions else None

    def to_dict(self) -> dict:
        """Plain data for JSON, sharing the record's lists: dataclasses.asdict copies token lists
        element by element, and the agent saves after every turn (that copy was 30% of a bench)."""
        return _plain(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"trajectory schema version {d.get('schema_version')!r} is not {SCHEMA_VERSION}")
        d = dict(d)
        d["segments"] = [Segment(s["messages"], [TurnRecord(**t) for t in s["turns"]], s["summary"])
                         for s in d["segments"]]
        d["tools"] = [ToolRecord(**t) for t in d["tools"]]
        d["effort"] = Effort(**d["effort"])
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Trajectory:
        return cls.from_dict(json.loads(text))

    def save(self, path: str) -> None:
        """Atomic write: a crash mid-save leaves the previous version intact."""
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> Trajectory:
        with open(path) as f:
            return cls.from_json(f.read())


def _plain(x):
    """Dataclasses (and lists of them) as dicts; every other value as it is."""
    if dataclasses.is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, list) and x and dataclasses.is_dataclass(x[0]):
        return [_plain(v) for v in x]
    return x
