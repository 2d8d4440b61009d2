"""The orchestrator: single epoch across crashes, admission by lag, re-queueing, upsampling."""
from __future__ import annotations

from kiln.config import Config
from kiln.rl.orchestrator import Orchestrator, Prompt


def _rl(**kw):
    return Config().rl.model_copy(update={"steps": 3, "groups_per_step": 2, "max_lag": 0, "upsample": 0.0, **kw})


def _prompts(n=10, kinds=("easy",)):
    return [Prompt(f"t{i}", kinds[i % len(kinds)]) for i in range(n)]


def _drain(o, workers=("w",), version=0):
    """Start and finish every group admission allows now; returns their ids."""
    out = []
    for w in workers * 4:
        job = o.next_job(w, version)
        if job is None:
            continue
        assert o.submit(w, job["group"], f"/g/{job['group']}", cost=1.0)
        out.append(job["group"])
    return out


def test_max_lag_zero_is_synchronous_and_a_step_unlocks_the_next_version(tmp_path):
    o = Orchestrator(str(tmp_path / "o.json"), _prompts(), _rl())
    assert _drain(o) == [0, 1]  # one step's worth, then admission says wait
    assert o.next_job("w", 0) is None
    assert o.take(3, timeout=0.1) == []  # fewer done than asked
    # least=1: what is done so far (the driver hands each group to the trainer as it is done).
    assert [g["id"] for g in o.take(2, timeout=0.1, least=1)] == [0, 1]
    assert o.take(1, timeout=0.1, least=1) == []  # both are with the trainer now
    assert o.counts() == {"handed": 2}
    assert o.next_job("w", 0) is None  # still version 0: the next groups would train at version 1
    o.trained([0, 1], version=1)
    assert o.next_job("w", 0) is None  # a worker still on version 0 may not start
    assert o.next_job("w", 1)["group"] == 2


def test_max_lag_one_lets_workers_run_a_step_ahead(tmp_path):
    o = Orchestrator(str(tmp_path / "o.json"), _prompts(), _rl(max_lag=1))
    assert _drain(o, workers=("a", "b")) == [0, 1, 2, 3]
    assert o.next_job("a", 0) is None


def test_a_worker_with_room_for_several_groups_gets_what_admission_allows_at_once(tmp_path):
    o = Orchestrator(str(tmp_path / "o.json"), _prompts(), _rl(max_lag=1))  # 2 groups a step: 4 may run
    assert o.next_jobs("a", 0, room=0) == []
    assert [j["group"] for j in o.next_jobs("a", 0, room=3)] == [0, 1, 2]  # its room, not one
    assert [j["group"] for j in o.next_jobs("b", 0, room=3)] == [3]  # then admission's bound
    assert o.next_jobs("b", 0, room=3) == []
    assert o.counts() == {"running": 4}


def test_single_epoch_holds_across_a_crash_and_lost_workers(tmp_path):
    path = str(tmp_path / "o.json")
    o = Orchestrator(path, _prompts(), _rl(max_lag=2))
    j0, j1 = o.next_job("a", 0), o.next_job("b", 0)
    assert o.worker_lost("a") == [j0["group"]]  # a died: its group goes back to the queue
    assert not o.submit("a", j0["group"], "/late", 1.0)  # a late result from the dead worker is dropped
    j2 = o.next_job("c", 0)
    assert (j2["group"], j2["task_id"]) == (j0["group"], j0["task_id"])  # the same group, the same prompt
    assert o.submit("c", j2["group"], "/g0", 1.0) and o.submit("b", j1["group"], "/g1", 1.0)
    assert len(o.take(2, timeout=0.1)) == 2
    j3 = o.next_job("c", 0)
    # The launcher dies here: one group is running, two are with the trainer, none trained.
    o2 = Orchestrator(path, None, _rl(max_lag=2))
    assert o2.counts() == {"done": 2, "queued": 1}
    o2.hello(version=1, trained=[j0["group"]])  # the trainer's checkpoint had trained one of them
    assert [g["id"] for g in o2.take(1, timeout=0.1)] == [j1["group"]]
    seen = [j0["task_id"], j1["task_id"]]
    j4 = o2.next_job("d", 1)
    assert j4["group"] == j3["group"] and j4["task_id"] == j3["task_id"]
    seen.append(j4["task_id"])
    o2.submit("d", j4["group"], "/g", 1.0)
    for _ in range(3):
        j = o2.next_job("d", 1)
        if j:
            seen.append(j["task_id"])
            o2.submit("d", j["group"], "/g", 1.0)
    assert len(seen) == len(set(seen)) == 6  # steps x groups_per_step prompts, none twice
    assert o2.next_job("d", 3) is None  # nothing beyond what the run needs


def test_upsampling_leans_toward_kinds_that_took_longer(tmp_path):
    rl = _rl(steps=20, groups_per_step=1, max_lag=50, upsample=4.0)
    o = Orchestrator(str(tmp_path / "o.json"), _prompts(200, kinds=("easy", "hard")), rl)
    for cost in (1.0, 9.0):  # one finished group of each kind: hard took 9x the turns
        j = o.next_job("w", 0)
        o.submit("w", j["group"], "/g", cost)
    o.trained([0, 1], version=10)  # half-way: upsampling is on
    kinds = [o.next_job("w", 10)["task_id"] for _ in range(10)]
    hard = sum(int(t[1:]) % 2 for t in kinds)
    assert hard >= 9


def test_upsampling_keeps_each_kinds_prompts_in_the_pools_order(tmp_path):
    """A kind is drawn, then its first remaining prompt: with one kind (nothing to lean toward) the
    pool's order holds whatever the progress, so runs of one pool (the two arms of
    benchmarks/rl_async.py) see the same prompts in the same order; with two, each kind's own order."""
    rl = _rl(steps=20, groups_per_step=1, max_lag=50, upsample=4.0)
    for kinds in (("easy",), ("easy", "hard")):
        o = Orchestrator(str(tmp_path / f"{len(kinds)}.json"), _prompts(200, kinds=kinds), rl)
        for cost in (1.0, 9.0):
            j = o.next_job("w", 0)
            o.submit("w", j["group"], "/g", cost)
        o.trained([0, 1], version=10)  # half-way: upsampling is on
        ids = [int(o.next_job("w", 10)["task_id"][1:]) for _ in range(12)]
        for parity in {i % len(kinds) for i in ids}:
            mine = [i for i in ids if i % len(kinds) == parity]
            assert mine == list(range(mine[0], mine[-1] + 1, len(kinds)))  # ascending, none skipped
        if len(kinds) == 1:
            assert ids == list(range(2, 14))
