"""SWE-bench instances <-> kiln task records.

Import: a dataset row plus a local clone of its repository gives a task folder. repo/ is the tree at
`base_commit` with no history; the hidden tests are the test files as `test_patch` leaves them; the
gold change is `patch`; FAIL_TO_PASS / PASS_TO_PASS are kept as given (pytest node ids for pytest
repositories). Every other row field goes into provenance, so export writes the same row back
(`test_patch` regenerated as the diff from the repository's test files to the hidden ones) and
import -> export -> import gives the same record.
"""
from __future__ import annotations

import json
import os
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
                    errors: list | None = None) -> list[Task]:
    """One task folder per row under `out_dir`. With `validate` (needs `sandbox_cfg`) the gold patch
    must make every FAIL_TO_PASS test pass and keep every PASS_TO_PASS test. A bad row raises
    TaskError, or, when an `errors` list is given, is skipped and recorded there as (id, message)."""
    tasks = []
    for n, text in load_rows(jsonl_path):
        row = {}
        try:
            row = _parse_row(text)
            task = import_row(row, repos_dir, out_dir)
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


def import_row(row: dict, repos_dir: str, out_dir: str) -> Task:
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
        tree = os.path.join(tmp, "tree")
        checkout(clone, row["base_commit"], tree)
        hidden = hidden_tests(tree, row["test_patch"])
        task = Task(id=task_id, prompt=row["problem_statement"], category="bugfix",
                    test_command=pytest_command(hidden), fail_to_pass=_ids(row.get("FAIL_TO_PASS", "[]")),
                    pass_to_pass=_ids(row.get("PASS_TO_PASS", "[]")), provenance=prov,
                    gold=gold_stats(row["patch"]))
        return save_task(task, out_dir, repo_src=tree, hidden=hidden, solution=row["patch"])


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


def pytest_command(hidden: dict) -> str:
    """pytest on the test modules of test_patch, as SWE-bench's harness runs them."""
    mods = sorted(p for p in hidden if p.endswith(".py") and os.path.basename(p) not in ("conftest.py", "__init__.py"))
    return " ".join([DEFAULT_TEST_COMMAND, *map(shlex.quote, mods)])


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
    from .validate import validate
    if cfg is None:
        raise TaskError("validate=True needs a sandbox config")
    v = validate(task, cfg)
    if not v.ok:
        raise TaskError(f"does not validate: {v.reason}")
    passing = set(v.fail_to_pass) | set(v.pass_to_pass)
    wrong = [i for i in task.fail_to_pass if i not in v.fail_to_pass]
    wrong += [i for i in task.pass_to_pass if i not in passing]
    if wrong:
        raise TaskError(f"the gold patch does not give the row's outcomes for {wrong[:5]} "
                        f"(fail-to-pass here: {v.fail_to_pass[:5]})")


# -- export ----------------------------------------------------------------------------------------
def export_swebench(task: Task) -> dict:
    """The task as a SWE-bench row (fields in the dataset's order, then any extra ones)."""
    prov = task.provenance
    fields = dict(prov.get("swebench", {}))
    fields.update({k: json.loads(v) for k, v in prov.get("swebench_json", {}).items()})
    raw = prov.get("test_lists_raw", False)
    row = {"instance_id": prov.get("instance_id", task.id), "repo": "", "base_commit": "",
           "patch": task.solution or "", "test_patch": export_test_patch(task),
           "problem_statement": task.prompt, "hints_text": "", "created_at": "", "version": "",
           "environment_setup_commit": "",
           "FAIL_TO_PASS": list(task.fail_to_pass) if raw else json.dumps(task.fail_to_pass),
           "PASS_TO_PASS": list(task.pass_to_pass) if raw else json.dumps(task.pass_to_pass)}
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
