"""Ten Harbor / Terminal-Bench 1 tasks whose environments need apt packages, imported, validated and
benched the way a user would, with the first build's time and the cached rebuild's.

    .venv/bin/python benchmarks/harbor_apt.py [--keep DIR]

The tasks are written in the tasks' real formats (Harbor: task.toml in the current schema,
instruction.md, environment/Dockerfile, tests/test.sh as `harbor tasks init` writes it with its uv
boilerplate, solution/solve.sh; Terminal-Bench 1: task.yaml, Dockerfile, docker-compose.yaml,
run-tests.sh, solution.sh), each needing a different Debian package: jq, sqlite3, python3-numpy, bc,
libxml2-utils, gawk, python3-yaml, zip/unzip, git (with tmux and asciinema), units; FROM ubuntu:24.04,
ubuntu:22.04, debian:bookworm, debian:trixie-slim and Terminal-Bench's images.

Steps, each through the `kiln` command (a subprocess, as a user runs it):
  1. a fresh environment cache holding only the Debian bases (built first by `kiln env build-base`
     when this machine has none; the base bootstrap is not part of the figures)
  2. `kiln tasks import-harbor DIR/*` (validation on by default): the first build, every layer
  3. the same import again into another folder: the cached rebuild (no layer built)
  4. `kiln bench --policy oracle` and `--policy noop` on the imported suite
The last line is `name=value` pairs: imported, first_build_s, layers_built, cached_rebuild_s,
layers_rebuilt, oracle, noop. Needs the network (the Debian mirror) for step 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

# harbor_apt_tasks.py lies beside this script, whose folder is on sys.path.
from harbor_apt_tasks import write_tasks

from kiln.tasks import env_base


def kiln(*args: str, env: dict) -> tuple[float, str, str]:
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "kiln", *args], check=False, capture_output=True, text=True, env=env)
    if r.returncode:
        print(r.stdout[-3000:], r.stderr[-3000:], sep="\n")
        raise SystemExit(f"kiln {' '.join(args)}: exit {r.returncode}")
    return time.monotonic() - start, r.stdout, r.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", help="Write the tasks, cache and results here (kept) instead of a temporary folder.")
    args = ap.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="kiln-harbor-apt-")
    real = env_base.cache_dir()
    try:
        names = write_tasks(os.path.join(work, "tasks"))
        cache = os.path.join(work, "cache")
        shutil.rmtree(cache, ignore_errors=True)
        os.makedirs(os.path.join(cache, "layers"))
        for suite in ("trixie", "bookworm"):
            base = env_base.ensure_base(real, suite, log=print)  # the machine's, built once
            os.symlink(env_base.layer_tree(real, base)[:-len("/tree")], os.path.join(cache, "layers", base))
        env = dict(os.environ, KILN_ENV_CACHE=cache)
        folders = [os.path.join(work, "tasks", n) for n in names]
        res = {}
        for run in ("first", "cached"):
            out = os.path.join(work, f"suite-{run}")
            shutil.rmtree(out, ignore_errors=True)
            secs, stdout, stderr = kiln("tasks", "import-harbor", *folders, "--out", out, env=env)
            res[run] = (secs, len(re.findall(r"^env: layer \S+ built in", stderr, re.MULTILINE)))
            print(f"== import ({run}): {secs:.1f} s, {res[run][1]} layers built")
            print("\n".join(line for line in stdout.splitlines() if not line.startswith("imported ")))
        suite = os.path.join(work, "suite-first")
        imported = len([d for d in os.listdir(suite) if os.path.isfile(os.path.join(suite, d, "task.toml"))])
        solved = {}
        for policy in ("oracle", "noop"):
            out = os.path.join(work, f"bench-{policy}")
            shutil.rmtree(out, ignore_errors=True)
            kiln("bench", "--suite", suite, "--policy", policy, "--passes", "1", f"bench.out_dir={out}", env=env)
            with open(os.path.join(out, "results.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            solved[policy] = sum(r["correctness"]["resolved"] for r in rows)
            print(f"== bench {policy}: solved {solved[policy]} of {len(rows)}")
        print(f"imported={imported} first_build_s={res['first'][0]:.1f} layers_built={res['first'][1]} "
              f"cached_rebuild_s={res['cached'][0]:.1f} layers_rebuilt={res['cached'][1]} "
              f"oracle={solved['oracle']} noop={solved['noop']}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
