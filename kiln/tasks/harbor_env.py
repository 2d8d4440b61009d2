"""Running a Harbor task's own scripts inside a kiln sandbox: path mapping, the verifier runner,
the oracle (solution/solve.sh), and `grade_harbor`.

A Harbor environment has absolute paths kiln's sandbox does not: its root is read-only except the
workspace and /tmp. They map as follows, rewritten in the task's scripts and test files at run time
(the stored files stay as the task wrote them) and also exported as environment variables:

    WORKDIR (e.g. /app)  -> the sandbox workspace (sandbox.workdir: the WORKDIR itself, see sandbox_config)
    /tests               -> <workspace>/.harbor/tests   (the hidden tests; KILN_HARBOR_TESTS, TEST_DIR)
    /logs                -> /tmp/kiln-harbor/logs        (reward.txt / reward.json; KILN_HARBOR_LOGS)
    /solution            -> /tmp/kiln-harbor/solution    (the oracle only)

The runner `.harbor/verify.py` is itself a hidden file, so kiln's `grade_correctness` (test command
`python .harbor/verify.py`) and `grade_harbor` run the very same test.sh: the first reads per-test
outcomes plus a `harbor::reward` pseudo-test from the log, the second reads the reward file.
"""
from __future__ import annotations

import inspect
import json
import re
import sys

from .record import Task, TaskError

HARBOR_DIR = ".harbor"
TESTS_DIR = ".harbor/tests"  # Harbor's tests/ folder, as hidden files
VERIFY = ".harbor/verify.py"
RUN_ROOT = "/tmp/kiln-harbor"
REWARD_ID = "harbor::reward"  # passes when every reward is 1
TEST_COMMAND = f"python {VERIFY}"


def rewrite_paths(text: str, mapping: dict) -> str:
    """Replace each absolute path in `mapping` where it starts a path (never inside a longer name),
    including a shell default such as ${APP_DIR:-/app} or ${APP_DIR:=/app}."""
    keys = sorted(mapping, key=len, reverse=True)
    pat = re.compile(r"(?:(?<![\w.~$/-])|(?<=:-))(" + "|".join(re.escape(k) for k in keys) + r")(?![\w.-])")
    return pat.sub(lambda m: mapping[m.group(1)], text)


def harbor_paths(workdir: str, ws: str) -> dict:
    """The image's paths -> the sandbox's (see the module docstring)."""
    return {workdir: ws, "/tests": f"{ws}/{TESTS_DIR}", "/logs": f"{RUN_ROOT}/logs",
            "/solution": f"{RUN_ROOT}/solution"}


def parse_rewards(txt, js) -> dict:
    """Harbor's reward files: reward.json (named rewards) wins over reward.txt (one float)."""
    try:
        if js is not None:
            data = json.loads(js)
            return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}
        if txt is not None and txt.strip():
            return {"reward": float(txt.strip())}
    except (ValueError, TypeError):
        pass
    return {}


_VERIFY_MAIN = '''

def _read(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def main():
    ws = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tests, root = os.path.join(ws, ".harbor", "tests"), CONFIG["run_root"]
    logs = root + "/logs"
    mapping = {CONFIG["workdir"]: ws, "/tests": tests, "/logs": logs, "/solution": root + "/solution"}
    for sub in ("verifier", "agent"):
        os.makedirs(os.path.join(logs, sub), exist_ok=True)
    for name in ("reward.txt", "reward.json"):
        if os.path.exists(os.path.join(logs, "verifier", name)):
            os.remove(os.path.join(logs, "verifier", name))
    for folder, _, names in os.walk(tests):
        for name in names:
            path = os.path.join(folder, name)
            if os.path.relpath(path, tests) not in CONFIG["files"]:  # planted by the agent, or a stale cache
                os.remove(path)
                continue
            if name.endswith(".sh"):
                os.chmod(path, 0o755)  # hidden files are written 0644; test.sh may run its helpers directly
            try:
                text = open(path, encoding="utf-8").read()
            except UnicodeDecodeError:
                continue
            new = rewrite_paths(text, mapping)
            if new != text:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    # In the image the tests sit outside the working directory: keep the repository's pytest config out.
    if not any(os.path.exists(os.path.join(tests, n)) for n in ("pytest.ini", "pyproject.toml", "tox.ini")):
        with open(os.path.join(tests, "pytest.ini"), "w") as f:
            f.write("[pytest]\\n")
    env = dict(os.environ, **CONFIG["env"], KILN_HARBOR_TESTS=tests, KILN_HARBOR_LOGS=logs, TEST_DIR=tests)
    env["PYTEST_ADDOPTS"] = (env.get("PYTEST_ADDOPTS", "") + " -rA").strip()  # per-test outcomes for kiln
    sys.stdout.flush()
    code = subprocess.call(["bash", os.path.join(tests, "test.sh")], cwd=ws, env=env, stdin=subprocess.DEVNULL)
    rewards = parse_rewards(_read(logs + "/verifier/reward.txt"), _read(logs + "/verifier/reward.json"))
    ok = bool(rewards) and all(v >= 1 for v in rewards.values())
    print("kiln-harbor: test.sh exited %d; rewards %s" % (code, json.dumps(rewards)))
    print(("PASSED " if ok else "FAILED ") + REWARD_ID + ("" if ok else " - rewards %s" % json.dumps(rewards)))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
'''


def verify_script(workdir: str, env: dict, files: list[str]) -> str:
    """The hidden runner for one task (the mapping code is this module's own, copied in). `files`
    are the test files: any other file under .harbor/tests is removed before test.sh runs."""
    config = {"workdir": workdir, "run_root": RUN_ROOT, "env": {str(k): str(v) for k, v in env.items()},
              "files": sorted(files)}
    return ('"""Written by kiln (kiln/tasks/harbor_env.py): runs this Harbor task\'s tests/test.sh in a kiln\n'
            'sandbox, with the image\'s paths mapped onto the sandbox, and reports the reward."""\n'
            "import json\nimport os\nimport re\nimport subprocess\nimport sys\n\n"
            f"CONFIG = {json.dumps(config)}\nREWARD_ID = {REWARD_ID!r}\n\n\n"
            + inspect.getsource(rewrite_paths) + "\n\n" + inspect.getsource(parse_rewards) + _VERIFY_MAIN)


def sandbox_config(task: Task, cfg):
    """`cfg` for an imported task: the workspace at the task's own WORKDIR (e.g. /app), so the paths in
    its instruction are the agent's paths too (unless that path is the sandbox's own: a system
    directory, /tmp, kiln's Python), and the task's environment variables ([environment.env] of
    task.toml, the Dockerfile's ENV paths) with the WORKDIR mapped. Grading works with either workspace."""
    h = task.provenance.get("harbor")
    if not h:
        return cfg
    workdir, update = h.get("workdir", ""), {}
    if h.get("environment"):  # a root built from the Dockerfile: the image's own paths, its user
        update.update(rootfs=built_root(task, h["environment"], cfg), uid=h["environment"]["uid"],
                      gid=h["environment"]["gid"])
    if workdir and not _sandbox_own(workdir, cfg.model_copy(update=update)):
        update["workdir"] = workdir
    env = {**h.get("image_env", {}), **h.get("task_toml", {}).get("environment", {}).get("env", {})}
    if env:
        mapping = harbor_paths(workdir, update.get("workdir", cfg.workdir))
        update["env"] = {**cfg.env, **{str(k): rewrite_paths(str(v), mapping) for k, v in env.items()}}
    return cfg.model_copy(update=update) if update else cfg


def environment_config(task: Task, env: dict, cfg):
    """`cfg` over a task's built environment (env_build.Environment.to_dict()): its layers as the
    root, its user, its WORKDIR as the workspace and its ENV."""
    return cfg.model_copy(update={"rootfs": built_root(task, env, cfg), "uid": env["uid"], "gid": env["gid"],
                                  "workdir": env["workdir"], "env": {**cfg.env, **env["env"]}})


def built_root(task: Task, env: dict, cfg) -> list[str]:
    """The layer trees of a task's built environment, which must be in this machine's cache."""
    from .env_base import cache_dir, have_layer, layer_tree
    cache = cache_dir(cfg.env_cache)
    missing = [layer for layer in env["layers"] if not have_layer(cache, layer)]
    if missing:
        raise TaskError(f"{task.id}: its environment ({env['image']}) is not built in {cache} (missing layers "
                        f"{', '.join(missing[:3])}); import the task folder again here, or run `kiln env build` on "
                        "its environment/, to build it")
    return [layer_tree(cache, layer) for layer in env["layers"]]


def _sandbox_own(path: str, cfg) -> bool:
    """Whether a workspace mounted at `path` would cover or sit inside a directory the sandbox needs."""
    from kiln.sandbox.rootfs import SYSTEM_DIRS, bind_paths
    if cfg.rootfs:  # a built root is the task's own: only the sandbox's private mounts are taken
        own = ["/tmp", "/dev", "/proc", *bind_paths(list(cfg.ro_binds), [], system=False)]
    else:
        own = [*SYSTEM_DIRS, "/tmp", "/dev", "/proc", *bind_paths(list(cfg.ro_binds), [sys.prefix, sys.base_prefix])]
    return path == "/" or any(path == p or path.startswith(p + "/") or p.startswith(path + "/") for p in own)


def run_solution(repo_dir: str, files: dict[str, bytes], task: Task, cfg, timeout_s: float, env: dict) -> str:
    """Run solution/solve.sh (the oracle) on the repository, in the task's sandbox with [solution.env];
    its change is the gold patch."""
    from kiln.sandbox import Snapshot, create
    cfg = sandbox_config(task, cfg)
    snap = Snapshot.from_dir(repo_dir, cfg.state_dir)
    try:
        with create(snap, cfg) as sb:
            ws = sb.cfg.workdir
            mapping = harbor_paths(task.provenance["harbor"]["workdir"], ws)
            for rel, data in files.items():
                try:
                    data = rewrite_paths(data.decode("utf-8"), mapping).encode()
                except UnicodeDecodeError:
                    pass
                sb.write(f"{RUN_ROOT}/solution/{rel}", data)
            env = {str(k): rewrite_paths(str(v), mapping) for k, v in env.items()}
            r = sb.exec(f"bash {RUN_ROOT}/solution/solve.sh", timeout_s=timeout_s, idle_timeout_s=timeout_s, cwd=ws,
                        env=env)
            if r.exit_code or r.timed_out:
                how = "timed out" if r.timed_out else f"exit {r.exit_code}"
                raise TaskError(f"solution/solve.sh failed in kiln's sandbox ({how}); output tail:\n{r.output[-1500:]}")
            patch = sb.diff().patch
    finally:
        snap.drop()
    if "Binary files" in patch:
        raise TaskError("solution/solve.sh changes binary files, which a kiln gold patch cannot carry")
    if not patch:
        raise TaskError("solution/solve.sh changes nothing in the working directory")
    return patch


def grade_harbor(sandbox, task: Task) -> dict:
    """Harbor's verdict: tests/test.sh run in a fork of the agent's final sandbox (the tests are put
    there only now), then the reward it wrote. Resolved means every reward is 1. Test files the agent
    edited are reset first, as in `grade_correctness`, so the two graders see the same files."""
    from kiln.grading.correctness import reset_edited_tests

    from .validate import write_hidden_tests
    if VERIFY not in task.hidden_tests():
        raise TaskError(f"{task.id}: not a Harbor task (no {VERIFY}); export_harbor it and import that folder")
    fork = sandbox.fork()
    try:
        reset = reset_edited_tests(fork, task, fork.diff().files)
        write_hidden_tests(fork, task)
        r = fork.exec(f"mkdir -p {RUN_ROOT} && {TEST_COMMAND} > {RUN_ROOT}/verify.log 2>&1",
                      timeout_s=task.timeout_s, idle_timeout_s=task.timeout_s, cwd=fork.cfg.workdir)
        got = {}
        for name in ("verify.log", "logs/verifier/reward.txt", "logs/verifier/reward.json"):
            try:
                got[name] = fork.read_text(f"{RUN_ROOT}/{name}")
            except OSError:
                got[name] = None
    finally:
        fork.close()
    rewards = parse_rewards(got["logs/verifier/reward.txt"], got["logs/verifier/reward.json"])
    resolved = bool(rewards) and not r.timed_out and all(v >= 1 for v in rewards.values())
    score = sum(rewards.values()) / len(rewards) if rewards else 0.0
    return {"resolved": resolved, "score": score, "reward": rewards.get("reward", score), "rewards": rewards,
            "timed_out": r.timed_out, "exit_code": r.exit_code, "reset_tests": reset,
            "log_tail": (got["verify.log"] or r.output)[-2000:]}
