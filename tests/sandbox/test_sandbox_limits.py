"""Each resource limit, exceeded for real inside a sandbox; the sandbox survives it."""
from __future__ import annotations

import os
import time

import pytest

from kiln.sandbox import SandboxError, create
from kiln.sandbox.service import get_service


def _host_procs_matching(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _cpu_set(cpu_list: str) -> set[int]:
    """/proc's Cpus_allowed_list ("0-3,6") as a set of CPU ids."""
    out = set()
    for part in cpu_list.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def test_wall_timeout_kills_whole_tree_including_daemonised_grandchildren(box):
    t = time.monotonic()
    r = box.exec("sleep 101 & setsid sh -c 'sleep 102' & (nohup sleep 103 >/dev/null 2>&1 &); echo started; sleep 104",
                 timeout_s=1.0)
    assert r.timed_out and r.timeout_kind == "wall"
    assert "started" in r.output
    assert time.monotonic() - t < 5
    time.sleep(0.2)
    assert not _host_procs_matching("sleep 10"), "a process of the timed-out command survived"
    assert box.exec("echo alive").output == "alive\n"


def test_timeout_holds_when_command_closes_its_output(box):
    r = box.exec("exec >&- 2>&- 3>&-; sleep 106", timeout_s=1.0)
    assert r.timed_out and r.duration_s < 5
    assert not _host_procs_matching("sleep 106")


def test_idle_timeout_when_no_output(box):
    r = box.exec("echo start; sleep 30", idle_timeout_s=0.5, timeout_s=20)
    assert r.timed_out and r.timeout_kind == "idle"
    assert r.duration_s < 5
    r = box.exec("for i in 1 2 3 4 5 6; do echo $i; sleep 0.2; done", idle_timeout_s=0.6)
    assert not r.timed_out and r.exit_code == 0  # steady output keeps it alive


def test_exit_code_always_reported(box):
    assert box.exec("exit 7").exit_code == 7
    assert box.exec("kill -9 $$").exit_code == 137
    assert box.exec("false").exit_code == 1


def test_fork_bomb_contained(base, cfg):
    sb = create(base, cfg.model_copy(update={"max_procs": 32}))
    try:
        r = sb.exec("bomb() { bomb | bomb & }; bomb; sleep 1; ls /proc | grep -c '^[0-9]'", timeout_s=2)
        assert r.timed_out or r.exit_code == 0
        time.sleep(0.2)
        r = sb.exec("echo alive")
        assert r.output == "alive\n"
        if sb.cgroups:
            # Tree-wide count: 40 sleepers cannot all start under a limit of 32.
            r = sb.exec("for i in $(seq 40); do sleep 2 & done 2>&1; wait", timeout_s=15)
            assert "Resource temporarily unavailable" in r.output or "retry" in r.output, r.output
    finally:
        sb.close()


def test_memory_hog_contained(base, cfg):
    sb = create(base, cfg.model_copy(update={"memory_mb": 64}))
    try:
        r = sb.exec("python -c 'x = b\"x\" * (512 * 1024 * 1024); print(len(x))'", timeout_s=20)
        assert r.exit_code != 0 and str(512 * 1024 * 1024) not in r.output
        assert sb.exec("echo alive").output == "alive\n"
    finally:
        sb.close()


def test_output_flood_truncated_head_and_tail(box):
    r = box.exec("echo FIRST; yes 0123456789 | head -c 20000000; echo; echo LAST")
    assert r.exit_code == 0
    assert r.output_bytes > 20_000_000
    assert len(r.output) < 4096 + 200  # config keeps 4 KiB plus the elision note
    assert r.output.startswith("FIRST") and r.output.rstrip().endswith("LAST")
    assert f"{r.elided_bytes} bytes elided" in r.output


def test_file_size_limit(box):
    r = box.exec("head -c 20000000 /dev/zero > big")
    assert r.exit_code != 0 and "File size limit exceeded" in r.output
    size = int(box.exec("stat -c %s big").output)
    assert size <= 8 * 1024 * 1024


def test_sparse_files_by_default_with_disk_use_bounded(base, cfg):
    """The default config sets no file-size limit: a test's large sparse file works, while the
    size-capped tmpfs layers (disk_mb, tmp_mb) still bound what is really written."""
    from kiln.config import SandboxConfig
    with create(base, cfg.model_copy(update={"file_size_mb": SandboxConfig().file_size_mb})) as sb:
        r = sb.exec("truncate -s 1G sparse && truncate -s 1G /tmp/sparse && "
                    "python -c \"f = open('seeked', 'wb'); f.seek(2 ** 31); f.write(b'x')\" && "
                    "stat -c %s sparse /tmp/sparse seeked && du -k sparse seeked | cut -f1")
        assert r.exit_code == 0, r.output
        sizes = [int(x) for x in r.output.split()]
        assert sizes[:3] == [2 ** 30, 2 ** 30, 2 ** 31 + 1] and max(sizes[3:]) <= 64  # KiB really used
        r = sb.exec("head -c 40000000 /dev/zero > dense")  # more than the 32 MiB upper layer
        assert r.exit_code != 0 and "No space left on device" in r.output


def test_upper_layer_disk_limit(box):
    # 6 MiB files stay under the 8 MiB file limit; 8 of them exceed the 32 MiB disk limit.
    r = box.exec("for i in $(seq 8); do head -c 6000000 /dev/zero > f$i || exit 1; done")
    assert r.exit_code != 0 and "No space left on device" in r.output
    box.exec("rm -f f*")
    assert box.exec("echo ok > small").exit_code == 0  # space comes back


def test_stdin_is_closed(box):
    r = box.exec("cat; echo done", timeout_s=5)
    assert not r.timed_out and r.output == "done\n"


def test_tmp_is_private_and_limited(box):
    r = box.exec("head -c 40000000 /dev/zero > /tmp/fill", timeout_s=10)
    assert r.exit_code != 0
    assert not os.path.exists("/tmp/fill")


@pytest.mark.parametrize("limit_s", [0.3])
def test_many_timeouts_leave_no_processes(box, limit_s):
    for _ in range(3):
        assert box.exec("sleep 105", timeout_s=limit_s).timed_out
    time.sleep(0.2)
    assert not _host_procs_matching("sleep 105")


def test_cpus_pin_every_process_of_the_sandbox(base, cfg):
    last = max(os.sched_getaffinity(0))
    sb = create(base, cfg.model_copy(update={"cpus": [last]}))
    try:  # a command's child, as pytest's workers would be
        r = sb.exec("sh -c 'grep Cpus_allowed_list /proc/self/status'")
        assert r.exit_code == 0 and r.output.split()[-1] == str(last), r.output
    finally:
        sb.close()
    with pytest.raises(SandboxError, match=r"sandbox.cpus \[9999\].*this machine's CPUs are 0-"):
        create(base, cfg.model_copy(update={"cpus": [9999]}))


def test_the_zygote_works_where_its_sandboxes_run(base, cfg):
    """Creating (mounts, a fork's copy, the keeper's fork) is the sandbox's work: the zygote does it on
    sandbox.cpus, not on its client's CPUs (an RL worker's engine), and on the client's for a sandbox
    without sandbox.cpus, which runs where its starter does."""
    home = os.sched_getaffinity(0)
    if len(home) < 2:
        pytest.skip("needs two CPUs to tell the sandbox's from its client's")
    last = max(home)
    zygote = get_service(base.state_dir).proc.pid
    pinned = create(base, cfg.model_copy(update={"cpus": [last]}))
    try:
        assert os.sched_getaffinity(zygote) == {last}
        fork = pinned.fork()
        fork.close()
        assert os.sched_getaffinity(zygote) == {last}
        free = create(base, cfg)
        try:
            assert os.sched_getaffinity(zygote) == home
            r = free.exec("grep Cpus_allowed_list /proc/self/status")
            assert r.exit_code == 0 and _cpu_set(r.output.split()[-1]) == home, r.output
        finally:
            free.close()
    finally:
        pinned.close()
