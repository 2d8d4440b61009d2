"""The orchestrator: which prompt is rolled out next, by whom, and when; the groups' lifecycle.

- **Single epoch.** A prompt is issued once, as one group (G rollouts). A group whose worker died
  is re-queued as the same group (same id, same prompt): it never finished, so it was never
  trained on. A result for a group that is not running under that worker (a late duplicate) is
  dropped. The state is a JSON file rewritten atomically on every change, so all of this holds
  across a crash of the launcher too.
- **Admission bounds staleness.** Groups train in the order they finish, `groups_per_step` at a
  time, so a group started now trains at about version trainer + (groups ahead) // per_step. A
  worker on version v may start it only if that is <= v + max_lag. max_lag = 0 is synchronous RL:
  rollouts of version v only, and the trainer waits for all of them.
- **Upsampling.** Later in training, the next prompt leans toward kinds (category/difficulty)
  whose finished groups took more turns and thinking tokens: a kind is drawn with weight (its
  remaining prompts) x hardness(kind) ** (upsample x progress), then its first remaining prompt.
  The pool never repeats a prompt, so this reorders kinds, never duplicates, and within a kind the
  pool's order holds.

Group states: queued -> running (a worker) -> done (its trajectories on disk) -> handed (to the
trainer) -> trained. A restarted trainer reports what its checkpoint trained; the rest of
"handed" goes back to "done".
"""
from __future__ import annotations

import json
import os
import random
import threading
from dataclasses import asdict, dataclass, field


@dataclass
class Prompt:
    task_id: str
    kind: str


@dataclass
class GroupState:
    id: int
    task_id: str
    kind: str
    status: str = "queued"
    worker: str = ""
    started_version: int = -1
    path: str = ""  # the group's result file (written by the worker before it reports)
    cost: float = 0.0  # mean turns + thinking tokens / 100 of its rollouts (upsampling)


@dataclass
class State:
    remaining: list[Prompt]
    groups: dict[int, GroupState] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)  # done groups in finishing order
    trainer_version: int = 0
    issued: int = 0


class Orchestrator:
    def __init__(self, path: str, prompts: list[Prompt] | None, rl, seed: int = 0):
        """`path`: the state file (resumed when it exists; then `prompts` is ignored)."""
        self.path, self.rl, self.seed = path, rl, seed
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        if os.path.exists(path):
            self.s = _load(path)
            for g in self.s.groups.values():  # their workers are gone: run them again
                if g.status == "running":
                    g.status, g.worker = "queued", ""
                elif g.status == "handed":
                    g.status = "done"
        else:
            self.s = State(remaining=list(prompts or []))
        self._save()

    @property
    def needed(self) -> int:
        return self.rl.steps * self.rl.groups_per_step

    # ---- workers -----------------------------------------------------------------------
    def next_job(self, worker: str, version: int) -> dict | None:
        """A group for this worker to roll out with weights `version`, or None (wait and ask again)."""
        with self.lock:
            s = self.s
            active = [g for g in s.groups.values() if g.status in ("running", "done", "handed")]
            trained_at = s.trainer_version + len(active) // self.rl.groups_per_step
            if trained_at - version > self.rl.max_lag:
                return None
            g = next((g for g in s.groups.values() if g.status == "queued"), None)
            if g is None:
                if len(s.groups) >= self.needed or not s.remaining:
                    return None
                p = s.remaining.pop(self._pick())
                g = GroupState(id=s.issued, task_id=p.task_id, kind=p.kind)
                s.groups[g.id], s.issued = g, s.issued + 1
            g.status, g.worker, g.started_version = "running", worker, version
            self._save()
            return {"group": g.id, "task_id": g.task_id, "version": version}

    def next_jobs(self, worker: str, version: int, room: int) -> list[dict]:
        """Up to `room` groups for this worker at once (it has room for that many more), as many as
        admission allows now: handed out one at a time, a worker with room for several got its
        second only on the driver's next pass, up to its 0.5 s poll later."""
        jobs = []
        while len(jobs) < room and (job := self.next_job(worker, version)) is not None:
            jobs.append(job)
        return jobs

    def submit(self, worker: str, group: int, path: str, cost: float) -> bool:
        """A finished group; False (and nothing changes) unless it was running under `worker`."""
        with self.lock:
            g = self.s.groups.get(group)
            if g is None or g.status != "running" or g.worker != worker:
                return False
            g.status, g.path, g.cost = "done", path, cost
            self.s.order.append(g.id)
            self._save()
            self.changed.notify_all()
            return True

    def worker_lost(self, worker: str) -> list[int]:
        """Re-queue the groups a dead worker was running; returns their ids."""
        with self.lock:
            lost = [g for g in self.s.groups.values() if g.status == "running" and g.worker == worker]
            for g in lost:
                g.status, g.worker = "queued", ""
            self._save()
            return [g.id for g in lost]

    # ---- trainer -----------------------------------------------------------------------
    def hello(self, version: int, trained: list[int]) -> None:
        """A (re)started trainer at `version` whose checkpoint holds these groups as trained."""
        with self.lock:
            for g in self.s.groups.values():
                if g.id in trained:
                    g.status = "trained"
                elif g.status == "handed":
                    g.status = "done"
            self.s.trainer_version = version
            self._save()
            self.changed.notify_all()

    def take(self, n: int, timeout: float, least: int | None = None) -> list[dict]:
        """Up to the next n finished groups in finishing order, once at least `least` (default n) are
        done, waiting up to `timeout` s; [] if fewer."""
        least = n if least is None else least
        with self.changed:
            ready = lambda: [i for i in self.s.order if self.s.groups[i].status == "done"]
            self.changed.wait_for(lambda: len(ready()) >= least, timeout)
            ids = ready()[:n]
            if len(ids) < least:
                return []
            for i in ids:
                self.s.groups[i].status = "handed"
            self._save()
            return [asdict(self.s.groups[i]) for i in ids]

    def trained(self, ids: list[int], version: int) -> None:
        with self.lock:
            for i in ids:
                self.s.groups[i].status = "trained"
            self.s.trainer_version = version
            self._save()

    def finished(self) -> bool:
        with self.lock:
            return self.s.trainer_version >= self.rl.steps

    def counts(self) -> dict[str, int]:
        with self.lock:
            out: dict[str, int] = {}
            for g in self.s.groups.values():
                out[g.status] = out.get(g.status, 0) + 1
            return out

    # ---- internals ---------------------------------------------------------------------
    def _pick(self) -> int:
        """Index into the remaining prompts: in order at first; later a kind is drawn with weight
        (its remaining prompts) x hardness ** (upsample x progress) and its first remaining prompt
        taken, so prompts of a kind keep their order (two runs on one pool see the same prompts in
        the same order when no kind is harder than another)."""
        s, rl = self.s, self.rl
        progress = s.trainer_version / max(rl.steps, 1)
        if rl.upsample <= 0 or progress <= 0:
            return 0
        by_kind: dict[str, list[float]] = {}
        for g in s.groups.values():
            if g.status in ("done", "handed", "trained"):
                by_kind.setdefault(g.kind, []).append(g.cost)
        if not by_kind:
            return 0
        mean = sum(sum(v) / len(v) for v in by_kind.values()) / len(by_kind)
        first: dict[str, int] = {}  # kind -> index of its first remaining prompt
        count: dict[str, int] = {}
        for i, p in enumerate(s.remaining):
            first.setdefault(p.kind, i)
            count[p.kind] = count.get(p.kind, 0) + 1
        kinds = list(first)
        hard = {k: (sum(v) / len(v)) / max(mean, 1e-9) for k, v in by_kind.items()}
        w = [count[k] * max(hard.get(k, 1.0), 1e-3) ** (rl.upsample * progress) for k in kinds]
        rng = random.Random(self.seed * 1_000_003 + s.issued)
        return first[rng.choices(kinds, weights=w)[0]]

    def _save(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(self.s), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def _load(path: str) -> State:
    with open(path) as f:
        d = json.load(f)
    return State(remaining=[Prompt(**p) for p in d["remaining"]],
                 groups={int(k): GroupState(**v) for k, v in d["groups"].items()},
                 order=d["order"], trainer_version=d["trainer_version"], issued=d["issued"])
