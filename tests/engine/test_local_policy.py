"""The local policy on a real tiny checkpoint: token-in/token-out across turns, fresh conversations,
config wiring, and the real agent loop running on it."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kiln.config import ConfigError, HarnessConfig, PolicyConfig
from kiln.engine import Engine, SamplingParams
from kiln.engine.runner import EngineRunner
from kiln.harness.agent import Agent
from kiln.model.checkpoint import load_checkpoint
from kiln.model.tokenizer import load_tokenizer
from kiln.policies import make_policy
from kiln.policies.local import LocalPolicy
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module

EOS, TURN_END = 2, "<|im_end|>\n"  # kiln's end-of-turn token and what the template closes a turn with
SYSTEM = {"role": "system", "content": "You are a coding agent. Tools: run_shell."}
TASK = {"role": "user", "content": "List the files, then fix the bug."}


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


def render(tok, messages, gen=True):
    return tok.apply_chat_template(messages, add_generation_prompt=gen)


def ending_policy(tiny_checkpoint, tok) -> LocalPolicy:
    """A greedy policy whose replies end with the end-of-turn token after a few tokens: the
    untrained model almost never samples it, so its output row is made a copy (slightly scaled)
    of the token greedy decoding picks fourth."""
    model, _ = load_checkpoint(tiny_checkpoint)
    greedy = SamplingParams(temperature=0)
    first = Engine(model, tok).generate([tok.encode(render(tok, [SYSTEM, TASK]))], SamplingParams(temperature=0, max_tokens=4))
    with torch.no_grad():
        model.lm_head.weight[EOS] = 1.01 * model.lm_head.weight[first[0].token_ids[-1]]
    return LocalPolicy(Engine(model, tok), tok, greedy)


def check_turn(rec, tok) -> None:
    n = len(rec.completion_ids)
    assert rec.prompt_tokens == len(rec.prompt_ids) and rec.completion_tokens == n > 0
    assert len(rec.logprobs) == len(rec.versions) == n and set(rec.versions) == {0}
    assert len(rec.routes) == len(rec.prompt_ids) + n
    stopped = rec.completion_ids[-1] in (tok.eos_id, tok.endoftext_id)
    assert rec.finish_reason == ("stop" if stopped else "length")
    assert rec.text == tok.decode(rec.completion_ids[:-1] if stopped else rec.completion_ids)  # no stop token


@pytest.mark.parametrize("ending", ["cut off by max_tokens", "end-of-turn token"])
def test_each_turn_extends_the_previous_tokens_exactly(tiny_checkpoint, tok, ending):
    if ending == "end-of-turn token":
        policy = ending_policy(tiny_checkpoint, tok)
    else:
        policy = LocalPolicy.from_checkpoint(tiny_checkpoint, SamplingParams(temperature=1.0, seed=3))
    messages = [SYSTEM, TASK]
    t1 = policy.generate(messages, [{"type": "function"}], 12)
    assert t1.prompt_ids == tok.encode(render(tok, messages))  # the first turn: the rendered conversation
    check_turn(t1, tok)
    assert (t1.completion_ids[-1] == EOS) == (ending == "end-of-turn token")

    messages = messages + [
        {"role": "assistant", "content": t1.text},
        {"role": "tool", "tool_call_id": "call_0_0", "name": "run_shell", "content": "a.py\nb.py"},
        {"role": "tool", "tool_call_id": "call_0_1", "name": "run_shell", "content": "exit code: 1"},
    ]
    t2 = policy.generate(messages, [], 12)
    check_turn(t2, tok)
    head = t1.prompt_ids + t1.completion_ids
    # the sampled end-of-turn token stands for the closing's start; a cut-off reply gets it all
    closing = "\n" if t1.completion_ids[-1] == EOS else TURN_END
    appended = render(tok, messages)[len(render(tok, messages[:3], gen=False)):]  # the tool messages + prompt
    assert appended.startswith("<|im_start|>user\n<tool_response>") and appended.endswith("<|im_start|>assistant\n")
    assert t2.prompt_ids == head + tok.encode(closing + appended)
    assert tok.decode(t2.prompt_ids) == render(tok, messages)

    messages = messages + [{"role": "assistant", "content": t2.text}, {"role": "user", "content": "Go on."}]
    t3 = policy.generate(messages, [], 12)
    assert t3.prompt_ids[: len(t2.prompt_ids) + len(t2.completion_ids)] == t2.prompt_ids + t2.completion_ids
    assert tok.decode(t3.prompt_ids) == render(tok, messages)


def test_the_prompt_keeps_the_sampled_tokens_when_the_harness_reformats_the_reply(tiny_checkpoint, tok):
    policy = LocalPolicy.from_checkpoint(tiny_checkpoint, SamplingParams(temperature=1.0, seed=4))
    t1 = policy.generate([SYSTEM, TASK], [], 10)
    # the harness stores a parsed reply; the template renders it its own way
    reply = {"role": "assistant", "content": "", "reasoning_content": t1.text}
    messages = [SYSTEM, TASK, reply, {"role": "user", "content": "Use a tool."}]
    t2 = policy.generate(messages, [], 10)
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.completion_ids)] == t1.prompt_ids + t1.completion_ids
    assert tok.decode(t2.prompt_ids) != render(tok, messages)  # what the model saw, not the re-rendering
    assert tok.decode(t2.prompt_ids).endswith("<|im_start|>user\nUse a tool.<|im_end|>\n<|im_start|>assistant\n")


def test_a_new_conversation_starts_fresh(tiny_checkpoint, tok):
    policy = LocalPolicy.from_checkpoint(tiny_checkpoint, SamplingParams(temperature=1.0, seed=5), speculative=False)
    t1 = policy.generate([SYSTEM, TASK], [], 8)
    reply = {"role": "assistant", "content": t1.text}
    cases = [
        [SYSTEM, {"role": "user", "content": "Another task."}],  # a new conversation
        [SYSTEM, {"role": "user", "content": "Resume from this summary: ..."}],  # a self-summary's new segment
        [SYSTEM, {"role": "user", "content": "Edited task."}, reply, {"role": "user", "content": "Go on."}],
        [SYSTEM, TASK, reply],  # nothing new after the reply
    ]
    for messages in cases:
        policy.generate([SYSTEM, TASK], [], 8)  # the conversation each case departs from
        rec = policy.generate(messages, [], 8)
        assert rec.prompt_ids == tok.encode(render(tok, messages))


def test_make_policy_builds_the_local_policy(tiny_checkpoint, tok):
    policy = make_policy(PolicyConfig(kind="local", checkpoint=str(tiny_checkpoint), temperature=0.5))
    assert isinstance(policy, LocalPolicy) and policy.name == "local"
    assert policy.params.temperature == 0.5 and policy.engine.mtp is None  # policy.speculative is off by default
    assert policy.engine.prefix is not None  # each turn reuses the last
    drafting = make_policy(PolicyConfig(kind="local", checkpoint=str(tiny_checkpoint), speculative=True))
    assert drafting.engine.mtp is not None and drafting.engine.prefix is not None  # the checkpoint's drafter, reuse kept
    assert policy.count_tokens("def f(x):\n    return x") == len(tok.encode("def f(x):\n    return x"))
    with pytest.raises(ConfigError, match=r"policy.checkpoint is empty.*set policy.checkpoint=PATH"):
        make_policy(PolicyConfig(kind="local"))


def test_the_agent_loop_runs_on_the_local_policy(tiny_checkpoint, tok, calc_box):
    policy = LocalPolicy.from_checkpoint(tiny_checkpoint, SamplingParams(temperature=1.0, seed=0))
    cfg = HarnessConfig(tools=["read_file", "run_shell"], max_turns=3, max_turn_tokens=24,
                        summary_at=1.0)  # the tiny test model's window is smaller than the prompts: one segment
    traj = Agent(policy, calc_box, cfg).run("Fix add in calc.py.")
    turns = traj.turns
    assert traj.stop_reason in ("finished", "max_turns") and len(turns) >= 2  # garbage replies are observations
    assert traj.metadata["errors"] == []
    for prev, rec in zip([None] + turns, turns):
        check_turn(rec, tok)
        assert tok.decode(rec.prompt_ids).startswith(render(tok, traj.segments[0].messages[:2], gen=False))
        if prev is not None:  # one segment: every turn extends the previous one's tokens
            assert rec.prompt_ids[: len(prev.prompt_ids) + len(prev.completion_ids)] == prev.prompt_ids + prev.completion_ids
    # the tool schemas come from the harness's system message only: the template adds no tools block
    assert tok.decode(turns[0].prompt_ids) == render(tok, traj.segments[0].messages[:2])


def test_policies_sharing_a_runner_batch_their_turns(tiny_checkpoint, tok):
    """Two conversations on two threads through one engine: the runner decodes them together and
    each gets exactly what it gets alone (seeded sampling is per request)."""
    model, _ = load_checkpoint(tiny_checkpoint, with_mtp=False)
    engine = Engine(model, tok, max_batch=4, max_len=1024)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (11, 12)]
    chats = [[{"role": "system", "content": "sys"}, {"role": "user", "content": f"task {i}"}] for i in range(2)]
    alone = [LocalPolicy(engine, tok, p).generate(c, [], 40) for p, c in zip(params, chats)]
    runner = EngineRunner(engine)
    shared = [LocalPolicy(engine, tok, p, runner=runner) for p in params]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(policy.generate, chat, [], 40) for policy, chat in zip(shared, chats)]
        # Both turns queued before the runner's first step: they share its batches however fast the
        # first would finish alone (a faster engine had it done before the second was submitted).
        deadline = time.monotonic() + 30
        while engine.waiting.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        runner.start()
        try:
            together = [f.result() for f in futures]
        finally:
            runner.close()
    assert runner.peak_running == 2
    assert [r.completion_ids for r in together] == [r.completion_ids for r in alone]


def test_a_full_context_ends_the_rollout_with_stop_reason_context(tiny_checkpoint, tok, calc_box):
    """The engine's context holds the first prompt and a reply but not the next prompt: the rollout
    stops with "context" instead of failing on the engine's refusal."""
    model, _ = load_checkpoint(tiny_checkpoint, with_mtp=False)
    cfg = HarnessConfig(tools=["read_file", "run_shell"], max_turns=5, max_turn_tokens=16)
    probe = Agent(LocalPolicy(Engine(model, tok), tok, SamplingParams(seed=0)), calc_box, cfg)
    first = probe.run("Fix add in calc.py.").turns[0].prompt_tokens
    engine = Engine(model, tok, max_len=first + 24)  # room for one 16-token reply, not for the next prompt
    traj = Agent(LocalPolicy(engine, tok, SamplingParams(seed=0)), calc_box, cfg).run("Fix add in calc.py.")
    assert traj.stop_reason == "context" and len(traj.turns) == 1
    assert traj.metadata["errors"] == []
