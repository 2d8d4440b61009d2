"""kiln task -> Harbor task folder. A task imported from Harbor is rebuilt from its provenance (its own
task.toml, Dockerfile, tests and solution, as they were); a kiln-made task gets a folder of its own
(see harbor.py), whose task.toml follows Harbor's current task schema as `harbor tasks init` writes it:

    schema_version = "1.3"          (Harbor 0.17+; `version = "1.0"` is the old spelling)
    [task]        name = "kiln/<task id>" (Harbor's org/name), description, authors, keywords
    [metadata]    difficulty, category, kiln_source
    [verifier]    timeout_sec
    [agent]       timeout_sec
    [environment] build_timeout_sec, cpus, memory_mb, storage_mb (the template's values), and
                  network_mode = "no-network": kiln's tests never download (the build may)

with no empty keys (a key kiln has no value for is left out, as Harbor leaves out None). Its
tests/test.sh writes Harbor's reward file and, as the template's pytest-json-ctrf does, a CTRF
report of every test at /logs/verifier/ctrf.json (written by kiln's own parser: no download)."""
from __future__ import annotations

import inspect
import json
import os
import shlex
import shutil

from kiln.tomlw import toml_key, toml_value

from . import dockerfile, testrun
from .harbor_env import TESTS_DIR, VERIFY
from .patch import apply_patch
from .record import Task

WORKDIR = "/app"  # kiln-made tasks
DOCKERFILE = f"FROM python:3.11-slim\nRUN pip install --no-cache-dir pytest\nWORKDIR {WORKDIR}\nCOPY repo/ {WORKDIR}/\n"
TEST_SH = f"""#!/bin/bash
# Written by kiln: puts the hidden test files in place, runs the task's test command and writes
# reward 1 when every fail-to-pass test passes and every pass-to-pass test is kept, else 0.
mkdir -p /logs/verifier
cd {WORKDIR}
python3 /tests/kiln_grade.py /tests /logs/verifier/reward.txt
"""
_GRADE_MAIN = '''

def main(tests_dir, reward_path):
    with open(os.path.join(tests_dir, "kiln.json")) as f:
        cfg = json.load(f)
    files = os.path.join(tests_dir, "files")
    for folder, _, names in os.walk(files):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), files)
            os.makedirs(os.path.dirname(rel) or ".", exist_ok=True)
            shutil.copyfile(os.path.join(folder, name), rel)
    start = time.time()
    try:
        r = subprocess.run(cfg["test_command"] + " -v", shell=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=cfg["timeout_s"])
        log = r.stdout.decode("utf-8", "replace")
    except subprocess.TimeoutExpired:
        log = "kiln: the tests timed out"
    sys.stdout.write(log + "\\n")
    st = parse_pytest(log)
    write_ctrf(st, os.path.join(os.path.dirname(reward_path), "ctrf.json"), start, time.time())
    f2p = [st.get(i) in ("PASSED", "XFAIL") for i in cfg["fail_to_pass"]]
    p2p = [st.get(i) in ("PASSED", "XFAIL", "SKIPPED") for i in cfg["pass_to_pass"]]
    ok = bool(f2p) and all(f2p) and all(p2p)
    print("kiln: fail-to-pass %d/%d, pass-to-pass %d/%d" % (sum(f2p), len(f2p), sum(p2p), len(p2p)))
    with open(reward_path, "w") as f:
        f.write("1\\n" if ok else "0\\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''


def write_ctrf(statuses: dict, path: str, start: float, stop: float) -> None:
    """A CTRF test report (what pytest-json-ctrf writes for Harbor): each test's name and status."""
    kind = {"PASSED": "passed", "XFAIL": "passed", "FAILED": "failed", "ERROR": "failed", "XPASS": "failed",
            "SKIPPED": "skipped"}
    tests = [{"name": name, "status": kind.get(st, "other"), "duration": 0, "rawStatus": st.lower()}
             for name, st in statuses.items()]
    summary = {"tests": len(tests), **{k: sum(t["status"] == k for t in tests)
                                       for k in ("passed", "failed", "skipped", "pending", "other")},
               "start": int(start * 1000), "stop": int(stop * 1000)}
    report = {"reportFormat": "CTRF", "specVersion": "0.0.0",
              "results": {"tool": {"name": "pytest"}, "summary": summary, "tests": tests}}
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def grade_script() -> str:
    """tests/kiln_grade.py: kiln's own pytest outcome parser, copied in (the image has no kiln)."""
    return ('"""Written by kiln: grades a kiln task inside its Harbor environment (run by test.sh)."""\n'
            "import json\nimport os\nimport re\nimport shutil\nimport subprocess\nimport sys\nimport time\n\n"
            f"_STATUS = {testrun._STATUS!r}\n_VERBOSE = re.compile({testrun._VERBOSE.pattern!r})\n"
            f"_SUMMARY = re.compile({testrun._SUMMARY.pattern!r})\nERROR = 'ERROR'\n\n\n"
            + inspect.getsource(testrun.parse_pytest) + "\n\n" + inspect.getsource(write_ctrf) + _GRADE_MAIN)


def dump_toml(data: dict) -> str:
    """Top-level keys, then one [table] per dict (deeper dicts inline): reads back equal with tomllib."""
    head = [f"{toml_key(k)} = {toml_value(v)}\n" for k, v in data.items() if not isinstance(v, dict)]
    tables = [f"\n[{toml_key(k)}]\n" + "".join(f"{toml_key(kk)} = {toml_value(vv)}\n" for kk, vv in v.items())
              for k, v in data.items() if isinstance(v, dict)]
    return "".join(head + tables)


def solve_script(task: Task, workdir: str) -> str:
    """solve.sh writing each file of the gold patch as it ends up (python images have no git or patch)."""
    changed: dict[str, str | None] = {}

    def read(rel: str) -> str:
        if rel in changed and changed[rel] is not None:
            return changed[rel]
        with open(os.path.join(task.repo_dir, rel), encoding="utf-8", newline="") as f:
            return f.read()
    apply_patch(task.solution or "", read, changed.__setitem__)
    out = ["#!/bin/bash", "# Written by kiln: applies the gold patch by writing each changed file's new content.",
           "set -e", f"cd {shlex.quote(workdir)}"]
    for rel, text in sorted(changed.items()):
        q = shlex.quote(rel)
        if text is None:
            out.append(f"rm -f -- {q}")
            continue
        if "/" in rel:
            out.append(f"mkdir -p -- {shlex.quote(os.path.dirname(rel))}")
        if text.endswith("\n") and "\nKILN_EOF\n" not in "\n" + text:
            out.append(f"cat > {q} <<'KILN_EOF'\n{text}KILN_EOF")
        else:
            out.append(f"printf '%s' {shlex.quote(text)} > {q}")
    return "\n".join(out) + "\n"


def _write(path: str, data: str | bytes, mode: int = 0o644) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.chmod(path, mode)


def export_harbor(task: Task, out_dir: str) -> str:
    """Write `<out_dir>/<task id>/` as a Harbor task folder (built beside, renamed into place)."""
    final = os.path.join(out_dir, task.id)
    tmp = final + ".part"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    _write(os.path.join(tmp, "instruction.md"), task.prompt)
    hidden = task.hidden_tests()
    h = task.provenance.get("harbor")
    if h:  # imported: rebuild the original folder
        env = os.path.join(tmp, "environment")
        os.makedirs(env)
        dockerfile.reverse(h["copies"], task.repo_dir, env)
        for rel, text in h["environment_files"].items():
            _write(os.path.join(env, rel), text)
        _write(os.path.join(env, "Dockerfile"), h["dockerfile"])
        _write(os.path.join(tmp, "task.toml"), dump_toml(h["task_toml"]))
        original = h.get("original_tests", {})  # a test.sh kiln runs rewritten goes back as written
        for rel, data in hidden.items():
            if rel.startswith(TESTS_DIR + "/"):
                name = rel[len(TESTS_DIR) + 1:]
                mode = 0o755 if rel.endswith(".sh") else 0o644
                _write(os.path.join(tmp, "tests", name), original.get(name, data), mode)
        solution = dict(h["solution_files"])
        if not solution and task.solution:
            solution["solve.sh"] = solve_script(task, h["workdir"])
    else:  # kiln-made
        shutil.copytree(task.repo_dir, os.path.join(tmp, "environment", "repo"), symlinks=True)
        _write(os.path.join(tmp, "environment", "Dockerfile"), DOCKERFILE)
        _write(os.path.join(tmp, "task.toml"), dump_toml(_kiln_toml(task)))
        _write(os.path.join(tmp, "tests", "test.sh"), TEST_SH, 0o755)
        _write(os.path.join(tmp, "tests", "kiln_grade.py"), grade_script())
        _write(os.path.join(tmp, "tests", "kiln.json"), json.dumps(
            {"test_command": task.test_command, "fail_to_pass": task.fail_to_pass,
             "pass_to_pass": task.pass_to_pass, "timeout_s": task.timeout_s}, indent=1) + "\n")
        for rel, data in hidden.items():
            if rel != VERIFY:
                _write(os.path.join(tmp, "tests", "files", rel), data)
        solution = {"solve.sh": solve_script(task, WORKDIR)} if task.solution else {}
    for rel, text in solution.items():
        _write(os.path.join(tmp, "solution", rel), text, 0o755 if rel.endswith(".sh") else 0o644)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final


SCHEMA_VERSION = "1.3"  # Harbor's task.toml schema (harborframework.com/docs/tasks)
ORG = "kiln"  # the org of `[task] name = "org/name"`
# What `harbor tasks init` writes where kiln has no value of its own.
TEMPLATE_ENVIRONMENT = {"build_timeout_sec": 600.0, "cpus": 1, "memory_mb": 2048, "storage_mb": 10240}


def prune(data):
    """`data` without empty values (None, "", [], {}), at every depth: Harbor writes no empty keys."""
    if isinstance(data, dict):
        out = {k: prune(v) for k, v in data.items()}
        return {k: v for k, v in out.items() if v not in (None, "", [], {})}
    if isinstance(data, list):
        return [prune(v) for v in data if v not in (None, "", [], {})]
    return data


def describe(prompt: str) -> str:
    """The prompt's first non-blank line, cut at 200 characters: [task] description."""
    line = next((ln.strip().lstrip("#").strip() for ln in prompt.splitlines() if ln.strip()), "")
    return line if len(line) <= 200 else line[:199].rstrip() + "…"


def _kiln_toml(task: Task) -> dict:
    level = "easy" if task.difficulty <= 1 else "medium" if task.difficulty == 2 else "hard"
    return prune({
        "schema_version": SCHEMA_VERSION,
        "task": {"name": f"{ORG}/{task.id}", "description": describe(task.prompt), "authors": [{"name": "kiln"}],
                 "keywords": ["kiln", task.category]},
        "metadata": {"difficulty": level, "category": task.category,
                     "kiln_source": str(task.provenance.get("source", ""))},
        "verifier": {"timeout_sec": float(task.timeout_s)},
        "agent": {"timeout_sec": 1800.0},
        "environment": {**TEMPLATE_ENVIRONMENT, "network_mode": "no-network"}})
