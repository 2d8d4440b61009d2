"""SWE-bench instances <-> kiln task records.

Import: a dataset row plus a local clone of its repository gives a task folder. repo/ is the tree at
`base_commit` with no history; the hidden tests are the test files as `test_patch` leaves them; the
gold change is `patch`; FAIL_TO_PASS / PASS_TO_PASS are pytest node ids: kept as given when they are
(`path::name`), and bare test names, as sympy's rows give them (`test_issue_24062`), mapped to the node
ids of the test functions of that name found by collecting the test files of `test_patch`
(`node_ids`; the given lists are kept in provenance for export). Every other row field goes into
provenance, so export writes the same row back (`test_patch` regenerated as the diff from the
repository's test files to the hidden ones) and import -> export -> import gives the same record.

When kiln's table (swebench_env.py) or the caller's has an install spec for the row's repository and
version, the task gets an environment of its own, built once (Python from the Debian base, the pins,
the repository's install) and kept in provenance["environment"]; its tests then run there, against
the repository's own dependencies, with the workspace at /testbed. Other rows run in kiln's own
environment, where a repository needing older pins fails to import: validation then says so, showing
the conftest and import errors of the run (validate.py).
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile

from .patch import apply_file_patch, gold_stats, make_patch, parse_patch
from .record import DEFAULT_TEST_COMMAND, Task, TaskError, save_task

ROW_FIELDS = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement", "hints_text",
              "created_at", "version", "environment_setup_commit", "FAIL_TO_PASS", "PASS_TO_PASS")
_REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement")
_IN_RECORD = {"instance_id", "patch", "test_patch", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS"}
_BAD_ID = str.maketrans({c: "_" for c in "/\\: "})


def load_rows(path: str) -> list[tuple[int, str]]:
    """(number, JSON text) of each row: a JSONL file's non-blank lines, numbered by line, or a JSON
    array's elements. Rows are parsed one by one, so a malformed line is one bad row."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 text: {e}") from None
    if text.lstrip().startswith("["):
        try:
            rows = [(n, json.dumps(r)) for n, r in enumerate(json.loads(text), 1)]
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}: not a JSON array: {e}") from None
    else:
        rows = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not rows:
        raise TaskError(f"{path}: no rows")
    return rows


def import_swebench(jsonl_path: str, repos_dir: str, out_dir: str, sandbox_cfg=None, validate: bool = False,
                    errors: list | None = None, envs: bool = False, specs: dict | None = None,
                    log=print) -> list[Task]:
    """One task folder per row under `out_dir`. With `validate` (needs `sandbox_cfg`) the gold patch
    must make every FAIL_TO_PASS test pass and keep every PASS_TO_PASS test. With `envs`, a row whose
    repository and version have an install spec (`specs`, a {repo: {version: spec}} table, then
    kiln's) gets its environment built (in sandbox_cfg.env_cache). A bad row raises TaskError, or,
    when an `errors` list is given, is skipped and recorded there as (id, message)."""
    from . import env_base, swebench_env
    tasks = []
    for n, text in load_rows(jsonl_path):
        row = {}
        try:
            row = _parse_row(text)
            spec = swebench_env.spec_for(row.get("repo", ""), row.get("version"), specs) if envs else None
            cache = env_base.cache_dir(sandbox_cfg.env_cache if sandbox_cfg is not None else "") if spec else ""
            task = import_row(row, repos_dir, out_dir, spec=spec, cache=cache, log=log)
            if validate:
                try:
                    _check_gold(task, sandbox_cfg)
                except TaskError:
                    shutil.rmtree(task.path, ignore_errors=True)
                    raise
            tasks.append(task)
        except (ValueError, OSError, subprocess.CalledProcessError) as e:  # TaskError and PatchError are ValueErrors
            msg = f"{jsonl_path}:{n} ({row.get('instance_id', '?')}): {e}"
            if errors is None:
                raise TaskError(msg) from None
            errors.append((row.get("instance_id", ""), msg))
    return tasks


def _parse_row(text: str) -> dict:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskError(f"not JSON: {e}") from None
    if not isinstance(row, dict):
        raise TaskError(f"not a JSON object: {text[:80]}")
    return row


def import_row(row: dict, repos_dir: str, out_dir: str, spec=None, cache: str = "", log=print) -> Task:
    """One row -> one task folder. With an install spec (swebench_env.EnvSpec) its environment is
    built in `cache` and the task runs there."""
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        raise TaskError(f"missing field(s) {missing}")
    not_text = [k for k in _REQUIRED if not isinstance(row[k], str)]
    if not_text:
        raise TaskError(f"field(s) {not_text} must be strings")
    clone = find_clone(repos_dir, row["repo"])
    iid = row["instance_id"]
    task_id = iid.translate(_BAD_ID)
    extra = {k: v for k, v in row.items() if k not in _IN_RECORD}
    sw = {k: v for k, v in extra.items() if _toml_safe(v)}
    prov = {"source": "swebench", "swebench": sw}
    as_json = {k: json.dumps(v) for k, v in extra.items() if not _toml_safe(v)}  # None has no TOML spelling
    if as_json:
        prov["swebench_json"] = as_json
    if task_id != iid:
        prov["instance_id"] = iid
    if not isinstance(row.get("FAIL_TO_PASS", "[]"), str):
        prov["test_lists_raw"] = True  # the row held lists, not JSON strings: export the same way
    with tempfile.TemporaryDirectory(prefix="kiln-swebench-") as tmp:
        tree = os.path.join(tmp, "context", "repo")
        checkout(clone, row["base_commit"], tree)
        hidden = hidden_tests(tree, row["test_patch"])
        given = {k: _ids(row.get(k, "[]")) for k in ("FAIL_TO_PASS", "PASS_TO_PASS")}
        mapped = node_ids([*given["FAIL_TO_PASS"], *given["PASS_TO_PASS"]], hidden)
        if mapped:
            prov["test_ids_given"] = given  # export writes the row's own spelling back
        f2p = _dedupe(x for i in given["FAIL_TO_PASS"] for x in mapped.get(i, [i]))
        p2p = _dedupe(x for i in given["PASS_TO_PASS"] for x in mapped.get(i, [i]) if x not in f2p)
        repo_src, command = tree, pytest_command(hidden)
        if spec is not None:
            from . import env_build, swebench_env
            env, text = swebench_env.build(spec, tree, cache, log=log)
            prov["environment"] = {**env.to_dict(), "spec": spec.to_dict(), "dockerfile": text}
            if spec.install:  # what the install left in the repository (egg-info, built files) is the task's too
                repo_src = os.path.join(tmp, "installed")
                env_build.export_workdir(env, cache, repo_src)
            command = pytest_command(hidden, plugins=True)
        task = Task(id=task_id, prompt=row["problem_statement"], category="bugfix", test_command=command,
                    fail_to_pass=f2p, pass_to_pass=p2p, provenance=prov, gold=gold_stats(row["patch"]))
        return save_task(task, out_dir, repo_src=repo_src, hidden=hidden, solution=row["patch"])


def _dedupe(ids) -> list[str]:
    return list(dict.fromkeys(ids))


_PARAM = re.compile(r"^(?P<name>[A-Za-z_]\w*)(?P<param>\[.*\])?$")


def collect(hidden: dict[str, bytes]) -> dict[str, list[str]]:
    """Test name -> the pytest node ids of that name in the test files (pytest's default collection:
    `test*` functions of test_*.py / *_test.py modules, and `test*` methods of `Test*` classes)."""
    from .pyedit import parse
    found: dict[str, list[str]] = {}
    for path in sorted(hidden):
        base = os.path.basename(path)
        if not (base.endswith(".py") and (base.startswith("test_") or base.endswith("_test.py"))):
            continue
        try:
            tree = parse(hidden[path].decode("utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                found.setdefault(node.name, []).append(f"{path}::{node.name}")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                for m in node.body:
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test"):
                        found.setdefault(m.name, []).append(f"{path}::{node.name}::{m.name}")
    return found


def node_ids(ids: list[str], hidden: dict[str, bytes]) -> dict[str, list[str]]:
    """Bare test names among `ids` (no `::`, as sympy's rows give them) -> their node ids, found by
    collecting the test files of test_patch; a name in several files maps to each. Ids that are
    already node ids are not in the result. A bare name no test file defines is a TaskError."""
    bare = [i for i in ids if "::" not in i]
    if not bare:
        return {}
    found, out, unknown = collect(hidden), {}, []
    for i in bare:
        m = _PARAM.match(i)
        hits = found.get(m["name"], []) if m else []
        if not hits:
            unknown.append(i)
        out[i] = [h + (m["param"] or "") for h in hits]
    if unknown:
        files = sorted(p for p in hidden if p.endswith(".py"))
        raise TaskError(f"test name(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''} name no test function in "
                        f"the test files of test_patch ({', '.join(files) or 'none'}), so kiln cannot map them to "
                        "pytest node ids")
    return out


def find_clone(repos_dir: str, repo: str) -> str:
    owner, _, name = repo.rpartition("/")
    tried = [os.path.join(repos_dir, f"{owner}__{name}"), os.path.join(repos_dir, name)]
    for path in tried:
        if os.path.isdir(path):
            return path
    raise TaskError(f"no local clone of {repo!r}: looked for {tried}")


def _git(clone: str, *args: str, env: dict | None = None) -> bytes:
    git_dir = subprocess.run(["git", "-C", clone, "rev-parse", "--absolute-git-dir"], check=True,
                             capture_output=True, text=True).stdout.strip()
    r = subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, env=env, check=False)
    if r.returncode:
        raise TaskError(f"git {' '.join(args[:3])} in {clone}: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout


def checkout(clone: str, commit: str, dest: str) -> None:
    """The tree at `commit`, without history. Not `git archive`: that honours export-ignore and
    export-subst attributes, so its tree can differ from the checkout SWE-bench grades in. A
    throw-away index keeps the clone's own index and HEAD untouched; bare clones work too."""
    os.makedirs(dest)
    env = {**os.environ, "GIT_INDEX_FILE": os.path.join(os.path.dirname(dest), "kiln-index")}
    _git(clone, f"--work-tree={dest}", "read-tree", commit, env=env)
    _git(clone, f"--work-tree={dest}", "checkout-index", "--all", env=env)


def hidden_tests(tree: str, test_patch: str) -> dict[str, bytes]:
    """Each file of `test_patch` applied to its version in `tree` (the new content of each test file)."""
    if "Binary files" in test_patch or "GIT binary patch" in test_patch:
        raise TaskError("test_patch holds binary files, which kiln's hidden tests cannot be built from a text diff")
    out = {}
    for fp in parse_patch(test_patch):
        if fp.new_path is None:
            raise TaskError(f"test_patch deletes {fp.old_path}; hidden tests can only add or change files")
        base = ""
        if fp.old_path is not None:
            with open(os.path.join(tree, fp.old_path), encoding="utf-8", newline="") as f:  # keep CRLF
                base = f.read()
        out[fp.new_path] = apply_file_patch(base, fp).encode()
    if not out:
        raise TaskError("test_patch changes no file")
    return out


def pytest_command(hidden: dict, plugins: bool = False) -> str:
    """pytest on the test modules of test_patch, as SWE-bench's harness runs them. In kiln's own
    environment its plugins stay off; in the task's own (`plugins`) they are the repository's."""
    mods = sorted(p for p in hidden if p.endswith(".py") and os.path.basename(p) not in ("conftest.py", "__init__.py"))
    base = DEFAULT_TEST_COMMAND.removeprefix("PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 ") if plugins else DEFAULT_TEST_COMMAND
    return " ".join([base, *map(shlex.quote, mods)])


def _ids(value) -> list[str]:
    ids = json.loads(value) if isinstance(value, str) else value
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise TaskError(f"FAIL_TO_PASS / PASS_TO_PASS must be lists of test ids, got {value!r}"[:300])
    return ids


def _toml_safe(v) -> bool:
    if isinstance(v, (str, int, float, bool)):
        return True
    if isinstance(v, list):
        return all(_toml_safe(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _toml_safe(x) for k, x in v.items())
    return False


def _check_gold(task: Task, cfg) -> None:
    from .validate import validate, with_cause
    if cfg is None:
        raise TaskError("validate=True needs a sandbox config")
    v = validate(task, cfg)
    if not v.ok:
        raise TaskError(f"does not validate: {v.reason}")
    passing = set(v.fail_to_pass) | set(v.pass_to_pass)
    wrong = [i for i in task.fail_to_pass if i not in v.fail_to_pass]
    wrong += [i for i in task.pass_to_pass if i not in passing]
    if wrong:
        raise TaskError(with_cause(f"the gold patch does not give the row's outcomes for {wrong[:5]} "
                                   f"(fail-to-pass here: {v.fail_to_pass[:5]})", v.problems))


# -- export ----------------------------------------------------------------------------------------
def export_swebench(task: Task) -> dict:
    """The task as a SWE-bench row (fields in the dataset's order, then any extra ones)."""
    prov = task.provenance
    fields = dict(prov.get("swebench", {}))
    fields.update({k: json.loads(v) for k, v in prov.get("swebench_json", {}).items()})
    raw = prov.get("test_lists_raw", False)
    given = prov.get("test_ids_given", {})
    f2p, p2p = given.get("FAIL_TO_PASS", task.fail_to_pass), given.get("PASS_TO_PASS", task.pass_to_pass)
    row = {"instance_id": prov.get("instance_id", task.id), "repo": "", "base_commit": "",
           "patch": task.solution or "", "test_patch": export_test_patch(task),
           "problem_statement": task.prompt, "hints_text": "", "created_at": "", "version": "",
           "environment_setup_commit": "",
           "FAIL_TO_PASS": list(f2p) if raw else json.dumps(f2p),
           "PASS_TO_PASS": list(p2p) if raw else json.dumps(p2p)}
    row.update(fields)
    return {k: row[k] for k in (*ROW_FIELDS, *[k for k in row if k not in ROW_FIELDS])}


def export_test_patch(task: Task) -> str:
    """A git-style diff taking the repository's test files to the hidden ones."""
    chunks = []
    for rel, data in sorted(task.hidden_tests().items()):
        base_path = os.path.join(task.repo_dir, rel)
        try:
            new, old = data.decode("utf-8"), None
            if os.path.isfile(base_path):
                with open(base_path, encoding="utf-8", newline="") as f:
                    old = f.read()
        except UnicodeDecodeError:
            raise TaskError(f"{task.id}: hidden test {rel} is not text; a test_patch cannot carry it") from None
        body = make_patch(rel, old, new)
        if body:
            chunks.append(f"diff --git a/{rel} b/{rel}\n" + ("new file mode 100644\n" if old is None else "") + body)
    return "".join(chunks)


def prediction_row(task_id: str, model_name: str, model_patch: str) -> dict:
    """One line of a SWE-bench predictions file."""
    return {"instance_id": task_id, "model_name_or_path": model_name, "model_patch": model_patch}


def write_rows(rows: list[dict], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
