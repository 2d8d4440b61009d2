"""Each isolation property, checked against real namespaces from inside a sandbox."""
from __future__ import annotations

import os
import socket
import threading

from kiln.sandbox import create


def test_no_network_interfaces_but_loopback_and_no_route(box):
    r = box.exec("python -c 'import socket; print(sorted(n for _, n in socket.if_nameindex()))'; "
                 "tail -n +2 /proc/net/route | wc -l")
    assert r.exit_code == 0, r.output
    names, routes = r.output.split("\n")[:2]
    assert names == "['lo']"
    assert routes.strip() == "0"


def test_host_loopback_service_unreachable(box):
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(srv.accept()), daemon=True).start()
    # Sanity: the host can reach it.
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    r = box.exec(f"python -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), timeout=2)'")
    srv.close()
    assert r.exit_code != 0
    assert "Connection refused" in r.output
    assert len(accepted) == 1  # only the host's own connection arrived


def test_loopback_inside_works(box):
    # A repository's tests may run a local server: the sandbox's own loopback is up.
    r = box.exec("python - <<'PY'\nimport socket\ns = socket.create_server(('127.0.0.1', 0))\n"
                 "c = socket.create_connection(s.getsockname()); print('ok')\nPY")
    assert r.output.strip() == "ok", r.output


def test_host_filesystem_read_only(box, tmp_path):
    for target in ("/usr/kiln-probe", "/etc/kiln-probe", "/bin/kiln-probe"):
        r = box.exec(f"echo x > {target}")
        assert r.exit_code != 0 and "Read-only file system" in r.output, r.output
        assert not os.path.exists(target)
    # root inside owns no privilege over the binds: remounting one writable is refused
    r = box.exec("mount -o remount,rw /usr 2>&1 || mount -o remount,bind,rw /usr 2>&1; touch /usr/kiln-probe")
    assert r.exit_code != 0
    assert not os.path.exists("/usr/kiln-probe")


def test_planted_secret_files_invisible(box):
    home = os.path.expanduser("~")
    planted = [os.path.join(home, ".kiln-test-secret"), "/tmp/kiln-test-secret"]
    for p in planted:
        with open(p, "w") as f:
            f.write("s3cret")
    try:
        r = box.exec("cat " + " ".join(planted))
        assert r.exit_code != 0 and "s3cret" not in r.output
        r = box.exec(f"ls -a {home} /tmp /home; grep -rs s3cret /tmp /workspace")
        assert "kiln-test-secret" not in r.output and "s3cret" not in r.output
    finally:
        for p in planted:
            os.unlink(p)


def test_host_secrets_in_etc_masked(box):
    if not os.path.exists("/etc/shadow"):
        return
    r = box.exec("wc -c < /etc/shadow")
    assert r.output.strip() == "0"


def test_caller_environment_not_inherited(box, base, cfg):
    os.environ["KILN_PLANTED_SECRET"] = "s3cret"
    os.environ["TZ"] = "UTC"  # allow-listed names do pass through
    try:
        sb = create(base, cfg)
        r = sb.exec("env")
        sb.close()
    finally:
        del os.environ["KILN_PLANTED_SECRET"]
        del os.environ["TZ"]
    assert "KILN_PLANTED_SECRET" not in r.output and "s3cret" not in r.output
    assert "TZ=UTC" in r.output


def test_own_pid_namespace_and_no_view_of_other_sandboxes(box, base, cfg):
    other = create(base, cfg)
    try:
        other.spawn("sleep 30 # other-sandbox-marker")
        r = box.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '; echo; ls /proc | grep -c '^[0-9]'")
        assert "other-sandbox-marker" not in r.output
        assert "pytest" not in r.output  # the host's processes are not visible either
        assert int(r.output.strip().split("\n")[-1]) < 10
        # ...and the other sandbox's files are nowhere in this one's filesystem view
        other.write("only-in-other.txt", "x")
        assert "only-in-other.txt" not in box.exec("find / -xdev -name 'only-in-*' 2>/dev/null").output
    finally:
        other.close()


def test_symlink_planted_by_sandbox_cannot_reach_host_files(box):
    with open("/tmp/kiln-host-only", "w") as f:
        f.write("host data")
    try:
        box.exec("ln -s /tmp/kiln-host-only link; ln -s ../../../../tmp/kiln-host-only rel")
        for name in ("link", "rel"):
            try:
                data = box.read_text(name)
            except FileNotFoundError:
                data = ""
            assert "host data" not in data
        assert "host data" not in box.diff().patch
    finally:
        os.unlink("/tmp/kiln-host-only")


def test_python_and_test_packages_usable_read_only(box):
    r = box.exec("python -m pytest -q tests 2>&1 | tail -n 1")
    assert "1 passed" in r.output, r.output
    r = box.exec("python -c 'import pytest, os; p = os.path.dirname(pytest.__file__); open(p + \"/x\", \"w\")'")
    assert r.exit_code != 0 and "Read-only file system" in r.output


def test_a_bind_that_is_a_symlink_reaches_its_target(base, cfg, tmp_path):
    # `.venv -> ../shared/venv -> /elsewhere/venv`: the links are recreated inside and the target
    # bound, so the venv's python (what sandbox PATH names first) is the one that runs, not the next
    # python on PATH.
    real = tmp_path / "elsewhere" / "venv"
    real.mkdir(parents=True)
    (real / "marker.txt").write_text("through the link")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "venv").symlink_to(real)
    link = tmp_path / "project" / ".venv"
    link.parent.mkdir()
    link.symlink_to("../shared/venv")
    sb = create(base, cfg.model_copy(update={"ro_binds": [str(link)]}))
    try:
        assert sb.exec(f"cat {link}/marker.txt").output == "through the link"
        assert "Read-only" in sb.exec(f"touch {link}/new").output
    finally:
        sb.close()


def test_read_only_binds_under_tmp_stay_visible(base, cfg, tmp_path):
    # A virtual environment (or any extra bind) living under the host's /tmp must not be hidden
    # by the sandbox's private /tmp (CI clones the project under /tmp).
    shared = tmp_path / "shared-tool"
    shared.mkdir()
    (shared / "marker.txt").write_text("visible")
    sb = create(base, cfg.model_copy(update={"ro_binds": [str(shared)]}))
    try:
        assert sb.exec(f"cat {shared}/marker.txt").output == "visible"
        assert "Read-only" in sb.exec(f"touch {shared}/new").output
        assert sb.exec("echo x > /tmp/own && cat /tmp/own").output == "x\n"  # /tmp itself stays private
    finally:
        sb.close()
