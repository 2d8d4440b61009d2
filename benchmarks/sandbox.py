"""Sandbox speed on a generated 3,000-file repository, against baselines measured in the same run.

Baselines: a full copy of the repository (`cp -a`, what a naive per-rollout environment
costs) and a bare `subprocess.run("true")` (the floor for running any command).

    .venv/bin/python benchmarks/sandbox.py [--files 3000] [--n 40]

The last line is `name=value` pairs: create_p50_ms, fork_p50_ms, exec_overhead_p50_ms,
copy_speedup (copy p50 / create p50), fork_copy_speedup (copy p50 / fork p50), and more.
create_env: the same sandbox created from a built task environment instead of the host's system
directories: by default the pandas fixture's (tests/tasks/fixtures/pandas-total: the Debian base, an
apt layer of python3-pandas, a COPY; `kiln env build` builds it), with its WORKDIR, ENV and user as a
task gets them (Task.sandbox_config), else the bare Debian base of `kiln env build-base`; --env DIR
names another build context or Harbor task folder, which must be built. Skipped when none is built.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time

from kiln.config import SandboxConfig
from kiln.sandbox import Snapshot, create
from kiln.sandbox.service import stop_service
from kiln.tasks import env_base, env_build

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "tasks", "fixtures", "pandas-total")


def make_repo(root: str, n_files: int, seed: int = 0) -> int:
    """A Python-package-shaped tree of `n_files` files of ~4 KB; returns total bytes."""
    rng = random.Random(seed)
    total = 0
    for i in range(n_files):
        d = os.path.join(root, f"pkg{i % 30}", f"sub{i % 7}")
        os.makedirs(d, exist_ok=True)
        body = "".join(f"def f_{i}_{j}(x):\n    return x * {rng.randint(0, 999)} + {j}\n\n" for j in range(80))
        with open(os.path.join(d, f"mod{i}.py"), "w") as f:
            f.write(body)
        total += len(body)
    return total


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def built_env(cfg: SandboxConfig, folder: str) -> SandboxConfig | None:
    """`cfg` over the environment `folder` describes, when its layers are built, else over the bare
    Debian base, else None (with a line saying why)."""
    cache = env_base.cache_dir()
    context = os.path.join(folder, "environment") if os.path.isdir(os.path.join(folder, "environment")) else folder
    try:
        with open(os.path.join(context, "Dockerfile")) as f:
            recipe = env_build.parse(f.read(), "Dockerfile")
        if not env_build.missing(recipe, context, cache):
            env = env_build.build(recipe, context, cache, log=lambda m: None)  # every layer a cache hit
            print(f"create_env: {env.image} as Debian {env.suite}, {len(env.layers)} layers, WORKDIR {env.workdir}")
            return cfg.model_copy(update={"rootfs": env.trees(cache), "workdir": env.workdir, "env": env.env,
                                          "uid": env.uid, "gid": env.gid})
    except (OSError, ValueError) as e:
        print(f"create_env: {folder}: {e}")
    layer = env_base.base_id(env_base.DEFAULT_SUITE)
    if env_base.have_layer(cache, layer):
        print(f"create_env: {folder} is not built (kiln env build): the bare Debian {env_base.DEFAULT_SUITE} base")
        return cfg.model_copy(update={"rootfs": [env_base.layer_tree(cache, layer)], "workdir": "/app"})
    print(f"no Debian base in {cache} (kiln env build-base): create_env skipped")
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--n", type=int, default=40, help="samples per measurement")
    ap.add_argument("--env", default=FIXTURE, help="a built environment's build context or Harbor task folder")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kiln-bench-")
    cfg = SandboxConfig(state_dir=os.path.join(work, "state"))
    try:
        repo = os.path.join(work, "repo")
        size = make_repo(repo, args.files)
        print(f"repository: {args.files} files, {size / 1e6:.1f} MB")
        base = Snapshot.from_dir(repo, cfg.state_dir)
        create(base, cfg).close()  # starts the per-process sandbox service once

        res: dict[str, list[float]] = {k: [] for k in ("create", "exec", "bare", "fork", "snapshot", "close", "copy")}
        env_cfg = built_env(cfg, args.env)
        if env_cfg is not None:
            res["create_env"] = []
        for i in range(args.n):
            box = None

            def make():
                nonlocal box
                box = create(base, cfg)
            res["create"].append(timed(make))
            res["exec"].append(timed(lambda: box.exec("true")))
            res["bare"].append(timed(lambda: subprocess.run("true")))
            for k in range(10):
                box.write(f"pkg{k}/sub{k % 7}/mod{k}.py", f"# edit {i}\n")
            child = None

            def fork():
                nonlocal child
                child = box.fork()
            res["fork"].append(timed(fork))
            res["snapshot"].append(timed(box.snapshot))
            res["close"].append(timed(child.close))
            box.close()
            if env_cfg is not None:
                def make_env():
                    nonlocal box
                    box = create(base, env_cfg)
                res["create_env"].append(timed(make_env))
                box.close()
            if i % 10 == 9:
                print(f"  {i + 1}/{args.n} samples", flush=True)
        for i in range(min(args.n, 7)):
            dst = os.path.join(work, f"copy{i}")
            res["copy"].append(timed(lambda: subprocess.run(["cp", "-a", repo, dst], check=True)))
            shutil.rmtree(dst)
    finally:
        stop_service(cfg.state_dir)
        shutil.rmtree(work, ignore_errors=True)

    p50 = {k: statistics.median(v) for k, v in res.items()}
    print(f"{'operation':<12}{'p50 ms':>10}{'p95 ms':>10}")
    for k, v in res.items():
        print(f"{k:<12}{p50[k]:>10.2f}{pct(v, 0.95):>10.2f}")
    out = {f"{k}_p50_ms": p50[k] for k in res} | {f"{k}_p95_ms": pct(v, 0.95) for k, v in res.items()}
    out["exec_overhead_p50_ms"] = p50["exec"] - p50["bare"]
    out["copy_speedup"] = p50["copy"] / p50["create"]
    out["fork_copy_speedup"] = p50["copy"] / p50["fork"]
    print(" ".join(f"{k}={v:.2f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
