"""The oracle policy solves tasks through the real tools alone."""
from __future__ import annotations

import re

import pytest

from kiln.config import HarnessConfig
from kiln.harness.agent import Agent
from kiln.policies.oracle import OraclePolicy
from kiln.sandbox import Snapshot, create

from .oracle_repos import make_repos


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    return make_repos(str(tmp_path_factory.mktemp("oracle")), 20)


def test_oracle_solves_20_of_20(repos, hstate, scfg):
    cfg = HarnessConfig(tools=["read_file", "edit_file", "write_file", "run_shell", "grep", "todo"])
    solved, plans, openers = 0, set(), set()
    for i, r in enumerate(repos):
        base = Snapshot.from_dir(r["path"], hstate)
        with create(base, scfg) as sb:
            assert sb.exec(r["test"]).exit_code != 0  # the task starts failing
            traj = Agent(OraclePolicy(r["patch"], r["test"], seed=i), sb, cfg).run(r["prompt"])
            assert traj.stop_reason == "finished", traj.messages[-3:]
            assert all(t.name in cfg.tools for t in traj.tools)
            assert traj.unfinished_todos == []
            solved += sb.exec(r["test"]).exit_code == 0
            plans.add(any(t.name == "todo" for t in traj.tools))
            openers.add(traj.turns[0].text.split("\n")[0])
    assert solved == 20
    assert plans == {True, False} and len(openers) > 1  # seeded variety, not one fixed script


def test_oracle_finds_the_file_before_reading_it_and_edits_only_changed_lines(scfg, tmp_path):
    """Under the tiny preset's three tools: a grep in the shell for the symbol the task names, a
    read of a path that grep printed, then the task restated with the function to change and an
    edit of the one changed line."""
    from kiln.bench.run import run_bench
    from kiln.config import Config
    from kiln.harness.trajectory import Trajectory
    from kiln.tasks.toy import generate_toy

    generate_toy(str(tmp_path / "suite"), 2, seed=0, level=1, split="train", sandbox_cfg=scfg, progress=False)
    cfg = Config(sandbox=scfg, harness=HarnessConfig(tools=["read_file", "edit_file", "run_shell"]))
    s = run_bench(str(tmp_path / "suite"), "oracle", out_dir=str(tmp_path / "out"), config=cfg, progress=False)
    assert s["correctness_mean"] == 1.0 and s["tool_call_parse_rate"] == 1.0
    for f in sorted((tmp_path / "out" / "trajectories").glob("*.json")):
        traj = Trajectory.load(str(f))
        symbol = traj.task.split("`")[1].split("(")[0].split(".")[0]
        first, second = traj.tools[0], traj.tools[1]
        assert (first.name, first.arguments) == ("run_shell", {"command": f"grep -rn -- {symbol} ."})
        grep_out = next(m["content"] for m in traj.messages if m.get("tool_call_id") == first.call_id)
        assert second.name == "read_file" and f"./{second.arguments['path']}:" in grep_out
        edits = [t.arguments for t in traj.tools if t.name == "edit_file"]
        old, new = edits[0]["old_text"].splitlines(), edits[0]["new_text"].splitlines()
        # one line changed; context only where that line alone is not unique in the file
        assert len(edits) == 1 and len(old) == len(new) and sum(a != b for a, b in zip(old, new)) == 1
        assert len(old) == 1 or old[0] == new[0] or old[-1] == new[-1]
        # the edit's turn restates the task and names the function the file shows above the line
        read = next(m["content"] for m in traj.messages if m.get("tool_call_id") == second.call_id)
        above = read[:read.index(old[0])].splitlines()
        name = [m.group(1) for ln in above if (m := re.match(r"\s*\d+\t\s*def (\w+)", ln))][-1]
        edit_turn = next(t for t in traj.turns if "edit_file" in t.text)
        assert f"`{name}`" in edit_turn.text.split("\n")[0] and f"`{traj.task.split('`')[1]}`" in edit_turn.text


def test_oracle_pages_through_a_file_longer_than_one_read(scfg, tmp_path):
    """The bug is past the first page, so the oracle follows the tool's offset hint, page by
    page, and still makes the one-line edit."""
    from kiln.tasks.patch import make_patch

    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "pkg" / "__init__.py").write_text("")
    body = "".join(f"VALUE_{k} = {k}\n" for k in range(450))
    buggy, fixed = body + "LIMIT = 9\n", body + "LIMIT = 10\n"
    (repo / "pkg" / "big.py").write_text(buggy)
    (repo / "tests" / "test_big.py").write_text("from pkg.big import LIMIT\n\ndef test_limit():\n    assert LIMIT == 10\n")
    cfg = HarnessConfig(tools=["read_file", "edit_file", "run_shell"])
    test = "python -m pytest -q -p no:hypothesispytest"
    with create(Snapshot.from_dir(str(repo), scfg.state_dir), scfg) as sb:
        traj = Agent(OraclePolicy(make_patch("pkg/big.py", buggy, fixed), test, seed=0), sb, cfg).run(
            "tests/test_big.py fails; fix it.")
        assert sb.exec(test).exit_code == 0
    offsets = [t.arguments["offset"] for t in traj.tools if t.name == "read_file"]
    assert offsets == [1, 201, 401]


def test_oracle_self_summarises_and_still_solves(repos, hstate, scfg):
    """A small context (summaries at 1,200 tokens; the system prompt alone is ~870) makes the agent
    ask for a summary mid-task: the oracle's summary says what is done and what is next (the lines
    still to change, when it has read but not edited), and it finishes from the fresh segment."""
    cfg = HarnessConfig(tools=["read_file", "edit_file", "run_shell"], context_tokens=2400, summary_at=0.5)
    summarised = 0
    for i, r in enumerate(repos[:6]):
        base = Snapshot.from_dir(r["path"], hstate)
        with create(base, scfg) as sb:
            traj = Agent(OraclePolicy(r["patch"], r["test"], seed=i), sb, cfg).run(r["prompt"])
            assert traj.stop_reason == "finished", traj.messages[-3:]
            assert sb.exec(r["test"]).exit_code == 0
            summarised += len(traj.segments) > 1
            for seg in traj.segments[:-1]:
                assert seg.turns[-1].kind == "summary" and seg.summary.startswith("Task: ")
                assert r["prompt"] in seg.summary
    assert summarised >= 3


def test_oracle_mistakes_are_recovered_and_never_trained_on(scfg, tmp_path):
    """policy.oracle_mistakes=1: the first edit is wrong on purpose, as a learner's are (a line of
    another function left unchanged, another line of the right function unchanged, or that line in
    a buggy form the file lacks), the tool refuses it, the next turn makes the right edit (naming
    the right function after a wrong one; never the mistaken line again) and the task is solved;
    SFT's loss mask leaves out exactly the mistaken turn."""
    from kiln.bench.run import run_bench
    from kiln.config import Config, PolicyConfig
    from kiln.harness.trajectory import Trajectory
    from kiln.model.tokenizer import load_tokenizer
    from kiln.pretrain.sft_data import segment_layout
    from kiln.tasks.toy import generate_toy

    n = 6
    generate_toy(str(tmp_path / "suite"), n, seed=0, level=1, split="train", sandbox_cfg=scfg, progress=False)
    cfg = Config(sandbox=scfg, harness=HarnessConfig(tools=["read_file", "edit_file", "run_shell"]),
                 policy=PolicyConfig(oracle_mistakes=1.0))
    s = run_bench(str(tmp_path / "suite"), "oracle", out_dir=str(tmp_path / "out"), config=cfg, progress=False)
    assert s["correctness_mean"] == 1.0
    assert s["after_first_error"] == {"changed": {"rollouts": n, "correctness_mean": 1.0}}  # the retry is another edit
    tok = load_tokenizer("bases/tiny")
    kinds_seen = set()
    for f in sorted((tmp_path / "out" / "trajectories").glob("*.json")):
        traj = Trajectory.load(str(f))
        kinds = [t.kind for t in traj.turns]
        assert kinds.count("mistake") == 1
        k = kinds.index("mistake")
        edits = [t for t in traj.tools if t.name == "edit_file"]
        assert [e.turn for e in edits] == [k, k + 1] and [e.ok for e in edits] == [False, True]
        error = next(m["content"] for m in traj.messages if m.get("tool_call_id") == edits[0].call_id)
        wrong, right = edits[0].arguments, edits[1].arguments
        retry = traj.turns[k + 1].text
        named = re.findall(r"`(\w+)`", retry)
        if "identical" in error and ("is not where it goes wrong" in retry or "is not the cause" in retry):
            kinds_seen.add("elsewhere")  # names the wrong function, then the right one
            assert named[0] in traj.turns[k].text and named[0] != named[-1], retry
        elif "identical" in error and ("already right" in retry or "on that line" in retry):
            kinds_seen.add("other_line")  # another line of the function the retry names
            assert wrong["old_text"] not in right["old_text"] and named[-1] in traj.turns[k].text, retry
        elif "was not found" in error and ("not in the file" in retry or "No such line" in retry):
            kinds_seen.add("recalled")  # a form of another line: the retry's old text is the file's
            assert wrong["old_text"] != right["old_text"] and wrong["new_text"] not in right["old_text"]
        else:
            kinds_seen.add(error)
        _, mask, replies = segment_layout(traj.segments[0], tok)
        for i, (a, b) in enumerate(replies):
            assert set(mask[a:b]) == ({0} if i == k else {1})
        assert sum(mask) == sum(b - a for i, (a, b) in enumerate(replies) if i != k)
    assert kinds_seen == {"elsewhere", "other_line", "recalled"}, kinds_seen  # every kind, each answered by the tool
