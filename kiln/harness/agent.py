"""The agent loop: the one agent that RL rollouts, `kiln bench` and `kiln agent` all run.

policy turn -> parse tool calls -> run tools in the sandbox -> observations -> ... until a
reply has no tool call (finished) or a limit (turns, tokens, wall time) is hit. Malformed
replies are interruptions: exceptions carrying the message that teaches the model. When the
context passes the trigger, the model summarises and a new segment starts from the summary.
"""
from __future__ import annotations

import time
import traceback
from concurrent.futures import ThreadPoolExecutor

from .format import FORMAT_SPEC, Call, Reply, openai_tool_calls, parse_reply
from .prompt import render, summary_request
from .tools import build_tools
from .tools.base import ToolContext, ToolError, validate_args
from .tools.todo import unfinished
from .trajectory import Segment, ToolRecord, Trajectory, TurnRecord


class Interrupt(Exception):
    """Ends the current step; its message is appended for the model to read."""

    def __init__(self, text: str):
        super().__init__(text)
        self.message = {"role": "user", "content": text}


class Stop(Exception):
    """A limit was reached; the rollout ends with this reason."""


class ContextFull(Stop):
    """Raised by a policy whose context window cannot hold another reply: the rollout ends with
    stop reason "context" instead of failing."""

    def __init__(self, detail: str = ""):
        super().__init__("context")
        self.detail = detail


class Agent:
    def __init__(self, policy, sandbox, config, tools: dict | None = None, services: dict | None = None,
                 on_message=None):
        self.policy, self.cfg = policy, config
        self.on_message = on_message or (lambda message: None)  # live display (`kiln agent`)
        self.tools = tools if tools is not None else build_tools(config)
        self.schemas = [t.schema() for t in self.tools.values()]
        self.ctx = ToolContext(sandbox=sandbox, config=config, services=services if services is not None else {})
        self.traj = Trajectory()

    def run(self, task: str, task_id: str = "", recent_files=(), past_messages=(), out: str | None = None) -> Trajectory:
        self.traj = Trajectory(task_id=task_id, task=task, metadata={"policy": self.policy.name, "errors": []})
        self.ctx.touched[:] = list(recent_files)
        self._new_segment(render("task", task=task, recent_files=list(recent_files), past_messages=list(past_messages)))
        self.start = time.monotonic()
        while not self.traj.stop_reason:
            try:
                self._check_limits()
                # Before acting, not after the reply: a cut-off or malformed reply interrupts the
                # step, and its long text must still lead to a summary rather than a full context.
                self._maybe_summarise()
                reply = self._act()
                self._observe(reply.calls)
                self._check_reply(reply)
            except Interrupt as e:
                self._append(e.message)
            except Stop as e:
                self.traj.stop_reason = str(e)
            if out:
                self.traj.save(out)
        self._finish(out)
        return self.traj

    # -- one step ------------------------------------------------------------------------------
    @property
    def segment(self) -> Segment:
        return self.traj.segments[-1]

    def _append(self, message: dict) -> None:
        self.segment.messages.append(message)
        self.on_message(message)

    def _new_segment(self, user_text: str) -> None:
        system = render("system", workdir=self.ctx.sandbox.cfg.workdir, tools=self.schemas, format_spec=FORMAT_SPEC)
        self.traj.segments.append(Segment(messages=[{"role": "system", "content": system}]))
        self._append({"role": "user", "content": user_text})

    def _generate(self, kind: str) -> TurnRecord:
        t = time.monotonic()
        rec = self.policy.generate(self.segment.messages, self.schemas, self.cfg.max_turn_tokens)
        rec.duration_s = time.monotonic() - t
        if rec.kind != "mistake":  # a demonstrator's deliberate mistake stays marked (SFT masks it)
            rec.kind = kind
        if not rec.completion_tokens:
            rec.completion_tokens = self.policy.count_tokens(rec.text)
        self.segment.turns.append(rec)
        self.traj.effort.turns += 1
        return rec

    def _act(self) -> Reply:
        rec = self._generate("action")
        reply = parse_reply(rec.text, id_prefix=f"call_{len(self.traj.turns) - 1}_")
        reply.finish_reason = rec.finish_reason
        msg = {"role": "assistant", "content": reply.content}
        if reply.thinking:
            msg["reasoning_content"] = reply.thinking
        if reply.calls:
            msg["tool_calls"] = openai_tool_calls(reply.calls)
        self._append(msg)
        count, effort = self.policy.count_tokens, self.traj.effort
        effort.thinking_tokens += count(reply.thinking)
        effort.tool_call_tokens += count(reply.tool_text)
        effort.tool_calls += len(reply.calls)
        effort.malformed_calls += len(reply.errors)
        if not reply.calls:
            effort.final_tokens += count(reply.content)
        return reply

    def _check_reply(self, reply: Reply) -> None:
        problems = list(reply.errors)
        if reply.finish_reason == "length":
            problems.append(f"Your reply was cut off at the limit of {self.cfg.max_turn_tokens} tokens. "
                            "Think less and act in smaller steps: one short reply per few tool calls.")
        if problems:
            raise Interrupt("\n\n".join(problems))
        if not reply.calls:
            raise Stop("finished")

    def _observe(self, calls: list[Call]) -> None:
        """Run the calls in order; a run of consecutive read-only calls runs concurrently."""
        results, i = [], 0
        while i < len(calls):
            j = i
            while j < len(calls) and self._read_only(calls[j]):
                j += 1
            if j - i > 1:
                with ThreadPoolExecutor(max_workers=min(8, j - i)) as ex:
                    results += list(ex.map(self._call, calls[i:j]))
            else:
                j = max(j, i + 1)
                results += [self._call(c) for c in calls[i:j]]
            i = j
        turn = len(self.traj.turns) - 1
        for call, (text, ok, took) in zip(calls, results):
            self._append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text})
            self.traj.tools.append(ToolRecord(turn, call.id, call.name, call.arguments, ok, took, len(text)))
            self.traj.effort.tool_output_tokens += self.policy.count_tokens(text)
        self._check_looping()

    def _check_looping(self) -> None:
        """Stop when each of the last max_repeats turns made the same calls, and they all failed."""
        n, by_turn = self.cfg.max_repeats, {}
        for t in self.traj.tools:
            by_turn.setdefault(t.turn, []).append(t)
        last = list(by_turn.values())[-n:]
        calls = {tuple(sorted(t.call for t in ts)) for ts in last}
        if len(last) == n and len(calls) == 1 and not any(t.ok for ts in last for t in ts):
            raise Stop("looping")

    def _read_only(self, call: Call) -> bool:
        tool = self.tools.get(call.name)
        return bool(tool and tool.read_only)

    def _call(self, call: Call) -> tuple[str, bool, float]:
        t = time.monotonic()
        tool = self.tools.get(call.name)
        try:
            if tool is None:
                raise ToolError(f"Unknown tool '{call.name}'. Available tools: {', '.join(self.tools)}.")
            text, ok = tool.run(validate_args(tool, call.arguments, self.cfg.strict_args), self.ctx), True
        except ToolError as e:
            text, ok = str(e), False
        except Exception as e:  # a tool bug must not end the rollout; the model sees it, the log keeps it
            text, ok = f"{call.name} failed with an internal error: {type(e).__name__}: {e}", False
            self.traj.metadata["errors"].append(traceback.format_exc())
        return text, ok, time.monotonic() - t

    # -- limits and self-summary ---------------------------------------------------------------
    def _check_limits(self) -> None:
        if self.traj.effort.turns >= self.cfg.max_turns:
            raise Stop("max_turns")
        if sum(t.completion_tokens for t in self.traj.turns) >= self.cfg.max_tokens:
            raise Stop("max_tokens")
        if time.monotonic() - self.start >= self.cfg.wall_time_s:
            raise Stop("wall_time")

    def context_tokens(self) -> int:
        """The current segment's size in the policy's tokens (+4 per message for the markup)."""
        return sum(self.policy.count_tokens(m.get("content") or "") + 4 for m in self.segment.messages)

    def summary_trigger(self) -> int:
        """The segment size (tokens) at which the agent summarises: a fraction of the context window
        (the policy's own when it has one, e.g. a local model's, else harness.context_tokens)."""
        window = getattr(self.policy, "context_window", None) or self.cfg.context_tokens
        return int(self.cfg.summary_at * window)

    def _maybe_summarise(self) -> None:
        if not self.segment.turns or self.context_tokens() < self.summary_trigger():  # acted in it first
            return
        if len(self.traj.segments) - 1 >= self.cfg.max_summaries:
            raise Stop("max_summaries")
        self._append({"role": "user", "content": summary_request()})
        rec = self._generate("summary")
        summary = parse_reply(rec.text).content or rec.text.strip()
        self._append({"role": "assistant", "content": summary})
        self.segment.summary = summary
        self._new_segment(render("resume", task=self.traj.task, summary=summary, n_summaries=len(self.traj.segments),
                                 todos=self.ctx.todos, recent_files=self.ctx.touched[-10:]))

    def _finish(self, out: str | None) -> None:
        d = self.ctx.sandbox.diff()
        self.traj.diff = {"patch": d.patch, "added": d.added, "removed": d.removed, "files": d.files}
        self.traj.unfinished_todos = unfinished(self.ctx)
        self.traj.metadata["wall_s"] = time.monotonic() - self.start
        if out:
            self.traj.save(out)
