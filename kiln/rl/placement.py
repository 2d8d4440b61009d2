"""Where the RL roles run on their node: the trainer and the rollout workers on disjoint CPU sets.

The recipe trains and samples on separate hardware, so synchronous RL leaves one side idle while
the other works and asynchrony reclaims it. Processes that share every core of one machine hide
that: the OS hands an idle role's cores to the busy one. rl.trainer_cpus / rl.worker_cpus pin
each role (every thread it has, and every thread and sandbox it starts); empty means all CPUs.
Ray's CPU resource (rl.trainer_resources) only counts; this is what keeps roles off each other's
cores. Each actor pins itself, so the ids are those of the node it runs on. sandbox.cpus moves
the workers' sandboxes elsewhere (the recipe's environments are a service apart from inference),
and with them every thread of a worker but its engine's (`widen`).
"""
from __future__ import annotations

import os


def check(trainer_cpus: list[int], worker_cpus: list[int], sandbox_cpus: list[int] = ()) -> None:
    """Raise ValueError naming what is wrong with the placement, before any process starts."""
    have = sorted(os.sched_getaffinity(0))
    for key, cpus in (("rl.trainer_cpus", trainer_cpus), ("rl.worker_cpus", worker_cpus),
                      ("sandbox.cpus", sandbox_cpus)):
        missing = sorted(set(cpus) - set(have))
        if missing:
            raise ValueError(f"{key} names CPU(s) {missing}, but this process may run on {have}: "
                             f"use ids from that list, or [] for all of them")
        if len(set(cpus)) != len(cpus):
            raise ValueError(f"{key} lists a CPU twice: {list(cpus)}")


def pin_checked(key: str, cpus: list[int], threads: int | None = None) -> int:
    """`pin`, after checking the ids against this node's CPUs (the error names the node)."""
    try:
        check(cpus if key == "trainer_cpus" else [], cpus if key == "worker_cpus" else [])
    except ValueError as e:
        raise ValueError(f"{e} (on {os.uname().nodename})") from None
    return pin(cpus, threads)


def pin(cpus: list[int], threads: int | None = None) -> int:
    """Restrict this process (and what it starts) to `cpus` (empty: leave it); set torch's
    intra-op threads to `threads`, or to the number of CPUs it may use. Returns that number."""
    import torch

    if cpus:
        _pin_threads(cpus)
    n = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n


def widen(cpus: list[int], but: int) -> None:
    """Let every thread of this process but the one with OS id `but` run on `cpus` (and what they
    start from now on). An RL worker keeps its engine's thread on rl.worker_cpus and lets the rest
    work beside its sandboxes: the rollouts' harness (replies parsed, observations tokenized, tools
    called), Ray's threads, the weights poller."""
    _pin_threads(cpus, but)


def _pin_threads(cpus: list[int], but: int | None = None) -> None:
    """Set the mask of every thread of this process (but `but`), not only the caller's: Linux keeps
    one per thread, and a Ray actor pins itself from its constructor, after Ray's own threads exist
    (in a profiled run they did little: the roles' CPU off their sets was start-up, before pinning).
    Threads started later inherit their starter's mask; repeat until no new one appeared."""
    done: set[str] = {str(but)}
    while todo := set(os.listdir("/proc/self/task")) - done:
        for tid in todo:
            try:
                os.sched_setaffinity(int(tid), cpus)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        done |= todo
