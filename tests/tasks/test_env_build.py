"""Task environments built from Dockerfiles without Docker, in real sandboxes: the image table, one
refusal listing every problem, layers built once and shared, RUN/COPY/WORKDIR/ENV/ARG/USER in the
built root, the network there only while building, and a task FROM ubuntu:24.04 that apt-installs
python3-pandas, imported, validated, solved by the oracle and not by noop.

Nothing here downloads: the Debian base and the pandas fixture's layers come from the install step
(`kiln env build-base`, `kiln env build tests/tasks/fixtures/pandas-total` in .ci/run); the other
builds run offline commands on that base, in a cache of this module's own."""
from __future__ import annotations

import http.server
import os
import threading

import pytest

from kiln.bench.run import run_rollout
from kiln.config import Config, HarnessConfig
from kiln.sandbox import Snapshot, create
from kiln.sandbox.service import stop_service
from kiln.tasks import env_base, env_build
from kiln.tasks.env_images import map_image
from kiln.tasks.harbor import REWARD_ID, export_harbor, import_folder, import_harbor
from kiln.tasks.record import TaskError

from .roundtrip import read, record
from .test_harbor import harbor_folder, write

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "pandas-total")


def unavailable(why: str):
    """The install step's cache is missing: a failure in CI (it builds it), a skip elsewhere."""
    why += " (the install step builds it: .ci/run)"
    pytest.fail(why) if os.environ.get("CI") else pytest.skip(why)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache of this module's own over the install step's Debian base (linked, never downloaded)."""
    real, base = env_base.cache_dir(), env_base.base_id(env_base.DEFAULT_SUITE)
    if not env_base.have_layer(real, base):
        unavailable(f"no Debian base in {real}")
    path = tmp_path_factory.mktemp("envs")
    os.makedirs(path / "layers")
    os.symlink(os.path.join(real, "layers", base), path / "layers" / base)
    yield str(path)
    stop_service(str(path))


def run_in(env, cache: str, state_dir: str, repo: str, command: str) -> str:
    from kiln.config import SandboxConfig
    cfg = SandboxConfig(state_dir=state_dir, rootfs=env.trees(cache), workdir=env.workdir, env=env.env,
                        uid=env.uid, gid=env.gid, disk_mb=64, tmp_mb=64)
    snap = Snapshot.from_dir(repo, state_dir)
    try:
        with create(snap, cfg) as sb:
            return sb.exec(command).output
    finally:
        snap.drop()


def test_image_table():
    assert map_image("ubuntu:24.04").suite == "trixie" and map_image("ubuntu:22.04").suite == "bookworm"
    assert map_image("debian:bookworm-slim").suite == map_image("debian:12.5").suite == "bookworm"
    py = map_image("python:3.11-slim")
    assert py.suite == "bookworm" and "python3-pip" in py.packages and py.env["PIP_BREAK_SYSTEM_PACKAGES"] == "1"
    assert map_image("python:3.13-slim-bookworm").suite == "bookworm"  # the release its tag names wins
    assert map_image("python:3.12").suite == "trixie"
    tb = map_image("ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624")
    assert (tb.suite, tb.image) == ("trixie", "ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624")
    assert map_image("ghcr.io/laude-institute/t-bench/python-3-13:20250620").packages
    for image, why in (("python:3.12-alpine", "only Debian-based"), ("node:20", "not one kiln can map"),
                       ("registry.example.com/team/private:1", "a private or other image needs Docker"),
                       ("ubuntu:14.04", "no Debian release close")):
        assert why in map_image(image), image


def test_every_problem_in_one_message(tmp_path):
    other = "s390x" if env_base.host_arch() != "s390x" else "amd64"
    bad = (f"FROM --platform=linux/{other} ubuntu:24.04\nWORKDIR /app\nCOPY --from=builder /out /app/\n"
           "RUN --mount=type=secret,id=token cat /run/secrets/token\nADD https://example.com/data.tar.gz /opt/\n"
           "COPY missing.py /app/\nFROM registry.example.com/team/private:1\n")
    with pytest.raises(TaskError) as e:
        import_harbor(harbor_folder(tmp_path / "many", bad), str(tmp_path / "o"))
    msg = str(e.value)
    assert "6 problems" in msg, msg
    for line, why in ((1, f"another architecture ({other})"), (3, "COPY --from=builder copies from an unknown stage"),
                      (4, "RUN --mount=type=secret,id=token needs Docker"), (5, "ADD of URLs and archives"),
                      (6, "'missing.py' is not in the build context"), (7, "a second FROM (a multi-stage build)")):
        assert f"Dockerfile:{line}: kiln cannot provide" in msg and why in msg, why


def test_layers_built_once_and_shared(cache, tmp_path):
    ctx = write(tmp_path / "ctx", {"run.sh": "#!/bin/sh\necho \"$GREETING from $(pwd)\"\n", "data/x.txt": "x\n"})
    head = ("FROM ubuntu:24.04\nARG WHO=kiln\nENV GREETING=hello\nRUN echo \"$GREETING $WHO\" > /etc/greeting\n"
            "WORKDIR /app\nCOPY --chmod=755 run.sh ./\nCOPY data /srv/data\n")
    a = env_build.parse(head + "RUN ./run.sh > out.txt\n", "A")
    b = env_build.parse(head + "RUN echo b > out.txt\n", "B")

    def built() -> list[str]:
        return sorted(os.listdir(os.path.join(cache, "layers")))

    env_a = env_build.build(a, ctx, cache, log=lambda m: None)
    after_a = built()
    env_b = env_build.build(b, ctx, cache, log=lambda m: None)
    assert env_b.layers[1:] == env_a.layers[1:] and env_b.layers[0] != env_a.layers[0]
    assert len(built()) == len(after_a) + 2  # B's own RUN layer and its lock file
    assert env_build.build(a, ctx, cache, log=print).layers == env_a.layers  # every layer a cache hit
    assert len(built()) == len(after_a) + 2 and env_build.missing(a, ctx, cache) == []

    repo = str(tmp_path / "repo")
    env_build.export_workdir(env_a, cache, repo)
    assert sorted(os.listdir(repo)) == ["out.txt", "run.sh"]  # the final WORKDIR is the task's repo/
    out = run_in(env_a, cache, str(tmp_path / "state"), repo,
                 "pwd; cat /etc/greeting out.txt /srv/data/x.txt; stat -c %a run.sh; echo \"$GREETING/$WHO\"")
    assert out.split("\n")[:6] == ["/app", "hello kiln", "hello from /app", "x", "755", "hello/"], out


def test_build_steps_keep_tmp_and_take_other_owners(cache, tmp_path):
    """As in a Docker build: a file COPY puts in /tmp is there for the next RUN, and a package script
    giving a file to another group (openssh-client's `chgrp _ssh`, brought by `apt-get install git`) does
    not fail, though the build sandbox maps one id (root RUN steps run under fakeroot)."""
    ctx = write(tmp_path / "ctx", {"schema.txt": "rows\n"})
    text = ("FROM debian:trixie\nWORKDIR /app\nCOPY schema.txt /tmp/schema.txt\n"
            "RUN cp /tmp/schema.txt /app/data.txt && rm /tmp/schema.txt\n"
            "RUN groupadd -g 4242 ssh-like && touch /usr/local/bin/agent && chgrp ssh-like /usr/local/bin/agent "
            "&& chown 4243:4242 /usr/local/bin/agent && chmod 2755 /usr/local/bin/agent && echo chgrp-ok > /app/ok.txt\n")
    env = env_build.build(env_build.parse(text, "Dockerfile"), str(ctx), cache, log=lambda m: None)
    repo = str(tmp_path / "repo")
    env_build.export_workdir(env, cache, repo)
    assert sorted(os.listdir(repo)) == ["data.txt", "ok.txt"]
    out = run_in(env, cache, str(tmp_path / "state"), repo, "cat data.txt ok.txt; ls /tmp | wc -l; "
                 "stat -c '%U %a' /usr/local/bin/agent; env | grep -c -i fakeroot")
    assert out.split("\n")[:5] == ["rows", "chgrp-ok", "0", "root 2755", "0"], out  # root's, as the one id there


def test_user_and_network_only_while_building(cache, tmp_path):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"payload")

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    fetch = (f"python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{srv.server_port}/', "
             "timeout=5).read().decode())\"")
    try:
        text = (f"FROM ubuntu:24.04\nRUN {fetch} > /etc/payload\nRUN useradd -m -u 1234 agent\nUSER agent\n"
                "WORKDIR /home/agent/work\nRUN id -un > whoami.txt\n")
        env = env_build.build(env_build.parse(text, "Dockerfile"), str(tmp_path), cache, log=lambda m: None)
        assert (env.uid, env.gid, env.workdir) == (1234, 1234, "/home/agent/work")
        repo = str(tmp_path / "repo")
        env_build.export_workdir(env, cache, repo)
        out = run_in(env, cache, str(tmp_path / "state"), repo,
                     f"cat /etc/payload whoami.txt; id -un; {fetch} 2>&1 | tail -n 1; touch /usr/x 2>&1")
    finally:
        srv.shutdown()
    lines = out.splitlines()
    assert lines[:3] == ["payload", "agent", "agent"], out  # fetched while building; USER honoured
    assert "Connection refused" in lines[3] or "unreachable" in lines[3], out  # no network at run time
    assert "Read-only file system" in lines[4], out

    with pytest.raises(TaskError, match=r"(?s)Dockerfile:3: kiln cannot provide `RUN echo boom >&2; exit 3`: it "
                                        r"failed while building the environment \(exit 3\).*boom"):
        env_build.build(env_build.parse("FROM ubuntu:24.04\nWORKDIR /app\nRUN echo boom >&2; exit 3\n", "Dockerfile"),
                        str(tmp_path), cache, log=lambda m: None)


@pytest.mark.slow  # 25-80 s on 2 busy cores: the oracle, validation and two rollouts each start pandas
def test_apt_package_task_imports_validates_and_only_the_oracle_solves_it(tmp_path, tcfg):
    with open(os.path.join(FIXTURE, "environment", "Dockerfile")) as f:
        recipe = env_build.parse(f.read(), "Dockerfile")
    if env_build.missing(recipe, os.path.join(FIXTURE, "environment"), env_base.cache_dir()):
        unavailable("the pandas fixture's environment is not built")
    task, outcome, _ = import_folder(FIXTURE, str(tmp_path / "k"), tcfg)
    assert outcome == "validated" and task.fail_to_pass == [REWARD_ID]
    assert task.provenance["harbor"]["environment"]["image"] == "ubuntu:24.04"
    assert "+50.0" in task.solution  # solve.sh ran the image's pandas
    cfg = task.sandbox_config(tcfg)
    assert cfg.workdir == "/app" and len(cfg.rootfs) == 3
    config = Config(sandbox=tcfg, harness=HarnessConfig(tools=["read_file", "edit_file", "run_shell"]))
    snap = Snapshot.from_dir(task.repo_dir, tcfg.state_dir)
    try:
        with create(snap, cfg) as sb:
            r = sb.exec("ls; python3 -c 'import pandas; print(pandas.__name__)'; ls /work 2>&1 | head -1")
            assert r.output.splitlines()[:2] == ["sales.csv", "pandas"], r.output  # kiln's tree is not there
        os.makedirs(tmp_path / "bench" / "trajectories")
        rows = {p: run_rollout(task, 0, p, config, snap, str(tmp_path / "bench")) for p in ("oracle", "noop")}
    finally:
        snap.drop()
    assert rows["oracle"]["correctness"]["resolved"] and not rows["noop"]["correctness"]["resolved"], rows

    out = export_harbor(task, str(tmp_path / "exported"))  # the COPY into the WORKDIR comes back from repo/
    assert read(out, "environment", "sales.csv") == read(FIXTURE, "environment", "sales.csv")
    back = import_harbor(out, str(tmp_path / "back"))  # not validated again: that is the import above
    assert back.provenance == task.provenance and record(back)[1::2] == record(task)[1::2]  # tests, repo


def test_gc_removes_half_built_layers_of_dead_builders(tmp_path):
    from kiln.config import SandboxConfig
    from kiln.sandbox.gc import gc
    cfg = SandboxConfig(state_dir=str(tmp_path / "state"), env_cache=str(tmp_path / "envs"))
    layers = tmp_path / "envs" / "layers"
    for name, owner, done in (("dead", "999999999", False), ("alive", str(os.getpid()), False), ("done", "1", True)):
        os.makedirs(layers / name / ("tree" if done else "tree.part"))
        (layers / name / "owner").write_text(owner)
    (layers / ".done.lock").write_text("")
    assert gc(cfg) == 1
    assert sorted(os.listdir(layers)) == [".done.lock", "alive", "done"]
