"""A task's test run in a sandbox: forked from the zygote's imported pytest against bash starting a
fresh `python -m pytest` (the baseline, `sandbox.fork_pytest = false`), measured in the same run.

Each round runs one toy task's tests (level 1, the speedrun's kind: a package, its test files) in a
fresh sandbox per arm, as grading does (`run_tests` with the suite's command), then as an agent types
it (`exec` of the bare command); the arms alternate so that load hits both alike.

    .venv/bin/python benchmarks/pytest_runs.py [--rounds 20] [--tasks 4]

Last line: `name=value` pairs: bash_p50_ms, fork_p50_ms, speedup (bash p50 / fork p50), and the
same for the agent's form.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from kiln.config import SandboxConfig
from kiln.sandbox import Snapshot, create
from kiln.sandbox.service import stop_service
from kiln.tasks.suite import SUITE_TEST_COMMAND
from kiln.tasks.testrun import run_tests
from kiln.tasks.toy import build_candidate, toy_seed, write_candidate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tasks", type=int, default=4, help="distinct toy tasks, used in turn")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        state = os.path.join(tmp, "state")
        snaps = [Snapshot.from_dir(write_candidate(build_candidate(toy_seed(i), 1), os.path.join(tmp, str(i))).repo_dir,
                                   state) for i in range(args.tasks)]
        cfgs = {arm: SandboxConfig(state_dir=state, fork_pytest=arm == "fork") for arm in ("bash", "fork")}
        times: dict[tuple[str, str], list[float]] = {(arm, form): [] for arm in cfgs for form in ("grade", "agent")}
        outcomes: dict[str, list] = {arm: [] for arm in cfgs}
        for r in range(args.rounds + 1):  # round 0 warms the zygote (pytest's import) and the page cache
            for arm, cfg in (cfgs.items() if r % 2 else reversed(cfgs.items())):
                with create(snaps[r % len(snaps)], cfg) as sb:
                    t = time.perf_counter()
                    run = run_tests(sb, SUITE_TEST_COMMAND, 120)
                    graded = time.perf_counter() - t
                    t = time.perf_counter()
                    code = sb.exec(SUITE_TEST_COMMAND).exit_code
                    typed = time.perf_counter() - t
                if r:
                    times[arm, "grade"].append(graded)
                    times[arm, "agent"].append(typed)
                    outcomes[arm].append((run.exit_code, sorted(run.statuses.items()), code))
        stop_service(state)
    same = outcomes["bash"] == outcomes["fork"]
    p50 = {k: statistics.median(v) * 1000 for k, v in times.items()}
    for form in ("grade", "agent"):
        print(f"{form:5}: bash p50 {p50['bash', form]:.0f} ms, fork p50 {p50['fork', form]:.0f} ms "
              f"({p50['bash', form] / p50['fork', form]:.2f}x)")
    print(f"same outcomes in both arms: {same} ({args.rounds} rounds)")
    print(f"bash_p50_ms={p50['bash', 'grade']:.1f} fork_p50_ms={p50['fork', 'grade']:.1f} "
          f"speedup={p50['bash', 'grade'] / p50['fork', 'grade']:.3f} agent_bash_p50_ms={p50['bash', 'agent']:.1f} "
          f"agent_fork_p50_ms={p50['fork', 'agent']:.1f} agent_speedup={p50['bash', 'agent'] / p50['fork', 'agent']:.3f} "
          f"same_outcomes={int(same)}")


if __name__ == "__main__":
    main()
