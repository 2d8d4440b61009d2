"""RL process placement: pinning a role restricts it and everything it starts; bad CPU ids are
refused before any process starts."""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import threading

import pytest

from kiln.config import load_config
from kiln.rl import placement
from kiln.rl.launcher import RLError, run_rl


def _pinned_child(cpus, threads, q):
    n = placement.pin(cpus, threads)
    import torch

    # A process it starts (as a sandbox would be) inherits the mask.
    status = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True, check=True).stdout
    allowed = next(line.split(":")[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
    q.put((n, torch.get_num_threads(), sorted(os.sched_getaffinity(0)), allowed))


def _pinned_after_a_thread(cpus, threads, q):
    # As in a Ray actor, whose pools and Ray's own threads exist before its constructor pins it.
    started, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (started.set(), stop.wait()))
    t.start()
    started.wait()
    placement.pin(cpus, threads)
    q.put(sorted(os.sched_getaffinity(t.native_id)))
    stop.set()
    t.join()


def _widened_but_the_engine(cpus, every, q):
    # As an RL worker: pinned, its engine's thread started, then the rest widened to the sandboxes' CPUs too.
    placement.pin(cpus, 1)
    stop = threading.Event()
    engine = threading.Thread(target=stop.wait)
    engine.start()
    placement.widen(every, but=engine.native_id)
    later = threading.Thread(target=lambda: q.put(sorted(os.sched_getaffinity(0))))
    later.start()
    later.join()
    q.put((sorted(os.sched_getaffinity(engine.native_id)), sorted(os.sched_getaffinity(0))))
    stop.set()
    engine.join()


def _run_pinned(cpus, threads=None, child=_pinned_child):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(cpus, threads, q))
    p.start()
    out = q.get(timeout=60)
    p.join(10)
    assert p.exitcode == 0
    return out


def test_pin_restricts_the_process_its_threads_and_its_children():
    last = max(os.sched_getaffinity(0))
    n, torch_threads, mask, child_mask = _run_pinned([last])
    assert (n, torch_threads, mask, child_mask) == (1, 1, [last], str(last))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning to one CPU of one restricts nothing")
def test_pin_restricts_threads_that_were_already_running():
    last = max(os.sched_getaffinity(0))
    assert _run_pinned([last], child=_pinned_after_a_thread) == [last]


def test_pin_with_no_cpus_keeps_every_cpu_and_sets_the_threads():
    have = sorted(os.sched_getaffinity(0))
    n, torch_threads, mask, _ = _run_pinned([], threads=1)
    assert (n, torch_threads, mask) == (1, 1, have)


def test_check_names_the_bad_cpu_and_what_is_allowed():
    have = sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=r"rl.worker_cpus names CPU\(s\) \[9999\].*" + str(have).replace("[", r"\[")
                       .replace("]", r"\]")):
        placement.check([], [9999])
    with pytest.raises(ValueError, match="trainer_cpus lists a CPU twice"):
        placement.check([have[0], have[0]], [])
    with pytest.raises(ValueError, match=r"sandbox.cpus names CPU\(s\) \[9999\]"):
        placement.check([], [], [9999])
    placement.check([have[0]], [have[-1]])  # a valid split passes


def test_run_rl_refuses_a_bad_placement_before_starting_anything(tmp_path):
    cfg = load_config(None, ["rl.trainer_cpus=[9999]"])
    with pytest.raises(RLError, match="rl.trainer_cpus names CPU"):
        run_rl(cfg, str(tmp_path / "no-checkpoint"), str(tmp_path / "rl"), progress=False)
    assert not (tmp_path / "rl").exists()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU leaves nothing to widen to")
def test_widen_lets_every_thread_but_the_engines_off_its_cpus():
    every = sorted(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_widened_but_the_engine, args=([every[-1]], every, q))
    p.start()
    later, (engine, caller) = q.get(timeout=60), q.get(timeout=60)
    p.join(10)
    assert p.exitcode == 0
    assert (engine, caller, later) == ([every[-1]], every, every)
