"""`kiln sft`: trajectory segments as the exact tokens the model sees at inference, the assistant-token
loss mask, packing without attention across samples, training (loss falls, MTP kept, resume), and
oracle trajectories collected through the real harness.

Models are real: the tiny checkpoint (tests/tiny_model.py; untrained, vocab 512) and its tokenizer.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.config import HarnessConfig, load_config
from kiln.config_io import ConfigError
from kiln.engine import Engine, SamplingParams
from kiln.harness.agent import Agent
from kiln.harness.format import Call, openai_tool_calls, parse_reply, render_call
from kiln.harness.trajectory import Segment, Trajectory, TurnRecord
from kiln.model.checkpoint import load_checkpoint
from kiln.model.tokenizer import load_tokenizer
from kiln.policies.local import LocalPolicy
from kiln.pretrain import trainer
from kiln.pretrain.sft import sft
from kiln.pretrain.sft_data import (
    SftDataError,
    batch_rows,
    collect_oracle_trajectories,
    load_trajectories,
    pack,
    segment_tokens,
)
from kiln.pretrain.trainer import PretrainError, Run
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.tiny_model import (
    dense_checkpoint,
    tiny_model,
)

SYSTEM = {"role": "system", "content": "You are a coding agent. Tools: read_file, edit_file, run_shell."}


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


def oracle_like(task: str, seed: int) -> Trajectory:
    """A trajectory as the harness records an oracle-style policy: raw reply texts in the turns,
    parsed replies (content + tool_calls) in the messages, tool results between them."""
    path = f"pkg/m{seed}.py"
    replies = [("Reading the file.", [Call("", "read_file", {"path": path})]),
               ("Applying the fix.", [Call("", "edit_file", {"path": path, "old_text": "a - b", "new_text": "a + b"}),
                                      Call("", "run_shell", {"command": "pytest -q"})]),
               (f"Done: fixed {path}.", [])]
    messages = [SYSTEM, {"role": "user", "content": task}]
    turns = []
    for k, (thought, calls) in enumerate(replies):
        text = thought + "".join("\n" + render_call(c) for c in calls)
        turns.append(TurnRecord(text=text))
        reply = parse_reply(text, id_prefix=f"call_{k}_")
        msg = {"role": "assistant", "content": reply.content}
        if reply.calls:
            msg["tool_calls"] = openai_tool_calls(reply.calls)
        messages.append(msg)
        messages += [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": f"ok {c.name} {seed}"}
                     for c in reply.calls]
    return Trajectory(task_id=f"t{seed}", task=task, segments=[Segment(messages, turns)], stop_reason="finished")


def runs_of(ids, mask) -> list[list[int]]:
    """The maximal runs of masked tokens."""
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out, cur = out + [cur], []
    return out + ([cur] if cur else [])


def test_segment_tokens_render_the_conversation_and_mask_only_replies(tok):
    traj = oracle_like("Fix add in pkg/m1.py.", 1)
    seg = traj.segments[0]
    ids, mask = segment_tokens(seg, tok)
    assert len(ids) == len(mask)
    # the replies, exactly: each turn's raw text and its end-of-turn token, nothing else
    assert runs_of(ids, mask) == [tok.encode(t.text) + [tok.eos_id] for t in seg.turns]
    # the rest is the rendered conversation (the template lays tool calls out as the model writes them)
    assert tok.decode(ids) + "\n" == tok.apply_chat_template(seg.messages)  # the sample ends at <|im_end|>
    assert ids[:len(tok.encode(tok.apply_chat_template(seg.messages[:2], add_generation_prompt=True)))] == \
        tok.encode(tok.apply_chat_template(seg.messages[:2], add_generation_prompt=True))
    bad = Segment(seg.messages, seg.turns[:2])
    with pytest.raises(SftDataError, match="2 recorded turns but 3 assistant messages"):
        segment_tokens(bad, tok)


def check_like_inference(seg: Segment, tok) -> None:
    ids, mask = segment_tokens(seg, tok)
    last = seg.turns[-1]
    assert ids == last.prompt_ids + last.completion_ids  # token for token what the model saw and sampled
    masked = [i for i, m in enumerate(mask) if m]
    expected = []
    for t in seg.turns:  # every turn's prompt extends the previous ids; its completion follows it
        assert ids[:len(t.prompt_ids)] == t.prompt_ids
        expected += range(len(t.prompt_ids), len(t.prompt_ids) + len(t.completion_ids))
    assert masked == expected


def test_segment_tokens_reproduce_the_local_policys_tokens(tiny_checkpoint, tok, calc_box):
    # A real agent rollout: replies cut off by max_tokens, each one reported back as a user message.
    policy = LocalPolicy.from_checkpoint(tiny_checkpoint, SamplingParams(temperature=1.0, seed=0))
    cfg = HarnessConfig(tools=["read_file", "run_shell"], max_turns=3, max_turn_tokens=24, summary_at=1.0)  # one segment
    traj = Agent(policy, calc_box, cfg).run(
        "Fix add in calc.py.")
    assert len(traj.segments) == 1 and len(traj.turns) >= 2
    check_like_inference(traj.segments[0], tok)
    # A reply ended by the end-of-turn token (the closing after it is only "\n"): the tiny model
    # samples it once its output row copies (slightly scaled) the token greedy decoding picks fourth.
    model, _ = load_checkpoint(tiny_checkpoint)
    first = Engine(model, tok).generate([tok.encode(tok.apply_chat_template(
        [SYSTEM, {"role": "user", "content": "hi"}], add_generation_prompt=True))], SamplingParams(temperature=0, max_tokens=4))
    with torch.no_grad():
        model.lm_head.weight[tok.eos_id] = 1.01 * model.lm_head.weight[first[0].token_ids[-1]]
    policy = LocalPolicy(Engine(model, tok), tok, SamplingParams(temperature=0))
    seg = Segment([SYSTEM, {"role": "user", "content": "hi"}])
    for k in range(2):
        rec = policy.generate(seg.messages, [], 12)
        assert k > 0 or rec.completion_ids[-1] == tok.eos_id  # the next prompt continues after it
        seg.turns.append(rec)
        seg.messages += [{"role": "assistant", "content": rec.text},
                         {"role": "tool", "tool_call_id": f"c{k}", "name": "run_shell", "content": "exit code: 0"}]
    seg.messages.pop()  # the segment ends with the last reply
    check_like_inference(seg, tok)


def test_packed_samples_never_see_each_other():
    model, _ = tiny_model(seed=1)
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(9, 500, (n,), generator=g).tolist(), [0] * 3 + [1] * (n - 3)) for n in (11, 7, 5)]
    packed = pack(samples, seq_len=15)  # rows of 16: [11, 5] and [7]
    assert len(packed) == 2 and packed.truncated == 0
    with torch.no_grad():
        logits = model.head(model.trunk(packed.ids, positions=packed.pos, doc_ids=packed.docs).hidden)
        for ids, mask in samples:
            alone = model.head(model.trunk(torch.tensor([ids])).hidden)[0]
            hits = [(r, c) for r in range(2) for c in range(16 - len(ids) + 1)
                    if packed.ids[r, c:c + len(ids)].tolist() == ids]
            (r, c), = hits
            assert torch.allclose(logits[r, c:c + len(ids)], alone, atol=1e-4)
            assert packed.mask[r, c:c + len(ids)].tolist() == mask
    assert packed.mask[packed.docs == -1].sum() == 0  # padding is never a target
    # trimmed: a batch loses only the columns that are padding in all its rows, and no logit changes
    one = packed.rows([1])  # the row holding the 7-token sample
    short = one.trimmed()
    assert short.ids.shape == (1, 7) and torch.equal(short.ids, one.ids[:, :7]) and short.mask.sum() == one.mask.sum()
    assert packed.trimmed().ids.shape == packed.ids.shape  # row 0 is full
    with torch.no_grad():
        cut = model.head(model.trunk(short.ids, positions=short.pos, doc_ids=short.docs).hidden)
    assert torch.allclose(cut, logits[1:2, :7], atol=1e-5)
    # batches: a seeded permutation per epoch, so every row comes once per epoch, the same on resume
    order = [batch_rows(5, step, 2, seed=3) for step in range(5)]
    assert sorted(order[0] + order[1] + order[2][:1]) == list(range(5)) and order == [batch_rows(5, s, 2, seed=3) for s in range(5)]
    assert order != [batch_rows(5, s, 2, seed=4) for s in range(5)]
    with pytest.raises(SftDataError, match="no SFT sample has an assistant token"):
        pack([([5, 6, 7], [0, 0, 0])], seq_len=8)


def test_the_loss_counts_assistant_tokens_only():
    model, _ = tiny_model(seed=2)
    p = load_config(None, []).pretrain
    run = Run(model.train(), None, trainer._adamw(model, p), None)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(9, 500, (2, 13), generator=g)
    docs, pos = torch.zeros_like(ids), torch.arange(13).expand(2, 13)
    mask = torch.zeros_like(ids)
    mask[:, 4:9] = 1  # last token (index 12) is not a target

    def loss(ids, mask, accum=1):  # lr 0: the model does not move
        return trainer._step(run, (ids, docs, pos, mask), 0.0, False, 1.0, accum, torch.device("cpu"),
                             torch.autocast("cpu", enabled=False))["loss"]

    base = loss(ids, mask)
    changed = ids.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 500  # a masked-out token that is no later token's input
    assert loss(changed, mask) == base
    mask2 = mask.clone()
    mask2[:, 12] = 1
    assert loss(changed, mask2) != loss(ids, mask2)
    with torch.no_grad():  # the mean cross-entropy over the targets, however the batch is split
        logits = model.head(model.trunk(ids[:, :-1]).hidden)
        want = F.cross_entropy(logits[mask[:, 1:] == 1], ids[:, 1:][mask[:, 1:] == 1])
    assert base == pytest.approx(float(want), rel=1e-5) and loss(ids, mask, accum=2) == pytest.approx(base, rel=1e-5)


def test_trees_compute_the_rows_loss_and_gradients_with_the_prompt_once():
    """An SFT step's samples as trees over their common prompt (what `kiln sft` runs): the same
    loss, MTP loss and gradients as the rows as they are, from fewer tokens."""
    model, mtp = tiny_model(seed=3)  # MTP depth 2: the prompt must stop 2 more tokens short
    model.config.router_aux_loss_coef = 0.0  # the balance loss is over the tokens computed: the prompt once
    p = load_config(None, []).pretrain
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(9, 500, (80,), generator=g).tolist()
    samples = []
    for n in (40, 25, 33, 12, 9):  # each sample: the prompt, then replies (targets) and tool output
        rest = torch.randint(9, 500, (n,), generator=g).tolist()
        samples.append((prompt + rest, [0] * 80 + [1] * (n // 2) + [0] * (n - n // 2 - 2) + [1, 1]))
    packed = pack(samples, seq_len=200)  # four rows, one holding two samples
    assert len(packed) == 4 and int((packed.docs == 1).any(1).sum()) == 1
    rows = packed.rows([0, 1, 2, 3])
    flat, trees = rows.trimmed(), rows.trees(parts=2, margin=mtp.depth)
    assert trees.shared and not flat.shared and trees.ids.shape[0] == 2
    assert trees.ids.numel() < 0.75 * flat.ids.numel()
    assert trees.mask.sum() == flat.mask.sum()
    # the prompt: 80 tokens less the one whose target is the first reply token, less the MTP depth
    assert all((t.docs == 0).sum() == 80 - 1 - mtp.depth for t in (trees.rows([0]), trees.rows([1])))
    assert [int(trees.pos[r][trees.docs[r] == d][0]) for r, d in ((0, 1), (0, 2), (1, 1), (1, 2), (1, 3))] == [77] * 5

    def step(b):
        run = Run(copy.deepcopy(model).train(), copy.deepcopy(mtp).train(), None, None)
        run.opt, run.mtp_opt = trainer._adamw(run.model, p), trainer._adamw(run.mtp, p)
        row = trainer._step(run, (b.ids, b.docs, b.pos, b.mask, b.shared), 0.0, True, 1.0, 2, torch.device("cpu"),
                            torch.autocast("cpu", enabled=False))
        return row, [q.grad for q in list(run.model.parameters()) + list(run.mtp.parameters())]

    (want, want_g), (got, got_g) = step(flat), step(trees)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["mtp_loss"] == pytest.approx(want["mtp_loss"], rel=1e-5)
    assert all((a is None) == (b is None) for a, b in zip(want_g, got_g))
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(want_g, got_g) if a is not None)
    # a prompt shorter than min_shared, or a part with one sample: the rows as they are
    assert not rows.trees(parts=2, margin=2, min_shared=100).shared
    assert not rows.trees(parts=4, margin=2).shared


def sft_cfg(tmp: Path, *overrides: str):
    phases = '[{name="sft", kind="sft", steps=8, seq_len=320, batch_size=2, lr=3e-3, warmup_steps=1}]'
    return load_config(None, [f"pretrain.phases={phases}", "pretrain.device=cpu", "pretrain.checkpoint_every=3",
                              "model.mtp_depth=1", f"sandbox.state_dir={tmp}", *overrides])


@pytest.fixture(scope="module")
def trajs(tmp_path_factory):
    d = tmp_path_factory.mktemp("trajs")
    for i in range(4):
        oracle_like(f"Fix the bug in pkg/m{i}.py.", i).save(str(d / f"t{i}.json"))
    return d


@pytest.fixture(scope="module")
def straight(tiny_checkpoint, trajs, tmp_path_factory):
    run = tmp_path_factory.mktemp("sft")
    return run, sft(sft_cfg(run), tiny_checkpoint, [str(trajs)], run, progress=False)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_sft_lowers_the_assistant_loss_and_keeps_the_mtp(straight):
    run, summary = straight
    losses = [r["loss"] for r in _rows(run)]
    assert len(losses) == 8 and summary["steps"] == 8
    assert losses[-1] < 0.6 * losses[0]  # four short trajectories, eight steps: memorised fast
    assert all(r["mtp_loss"] is not None for r in _rows(run))  # the checkpoint's MTP keeps training
    _, mtp = load_checkpoint(run / "checkpoint")
    assert mtp is not None and (run / "checkpoint" / "tokenizer.json").is_file()


def test_the_mtp_can_distil_on_every_other_step_only(straight, tiny_checkpoint, trajs, tmp_path):
    """mtp_every=2: the MTP trains on steps 1, 3, 5, ... of the phase and the main model trains as
    on every step (its last layer then runs at the targets alone: equal to float rounding)."""
    phases = '[{name="sft", kind="sft", steps=8, seq_len=320, batch_size=2, lr=3e-3, warmup_steps=1, mtp_every=2}]'
    sft(sft_cfg(tmp_path, f"pretrain.phases={phases}"), tiny_checkpoint, [str(trajs)], tmp_path, progress=False)
    rows, every = _rows(tmp_path), _rows(straight[0])
    assert [r["mtp_loss"] is not None for r in rows] == [True, False] * 4
    assert rows[0]["mtp_loss"] == pytest.approx(every[0]["mtp_loss"], rel=1e-5)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in every], rel=1e-4)
    with pytest.raises(ConfigError, match="mtp_every is for sft phases.*pretrain.mtp_start"):
        load_config(None, ['pretrain.phases=[{name="b", steps=2, seq_len=16, batch_size=2, lr=1e-3, mtp_every=2}]'])


def test_sft_resumes_bit_identically(straight, tiny_checkpoint, trajs, tmp_path, monkeypatch):
    class Killed(Exception):
        pass

    real, calls = trainer._step, [0]

    def step(*a, **kw):
        calls[0] += 1
        if calls[0] == 5:
            raise Killed
        return real(*a, **kw)

    monkeypatch.setattr(trainer, "_step", step)
    with pytest.raises(Killed):  # killed during step 5: the state saved is step 3's
        sft(sft_cfg(tmp_path), tiny_checkpoint, [str(trajs)], tmp_path, progress=False)
    monkeypatch.setattr(trainer, "_step", real)
    sft(sft_cfg(tmp_path), tiny_checkpoint, [str(trajs)], tmp_path, progress=False)
    keys = ("loss", "mtp_loss", "grad_norm", "lr", "tokens_seen")
    assert [[r[k] for k in keys] for r in _rows(tmp_path)] == [[r[k] for k in keys] for r in _rows(straight[0])]


def test_sft_errors_say_what_to_do(tiny_checkpoint, trajs, tmp_path):
    cfg = sft_cfg(tmp_path)
    with pytest.raises(PretrainError, match="no checkpoint at .*run `kiln pretrain` first"):
        sft(cfg, tmp_path / "nope", [str(trajs)], tmp_path / "a")
    with pytest.raises(PretrainError, match="no trajectories.*--oracle-tasks"):
        sft(cfg, tiny_checkpoint, [], tmp_path / "a")
    with pytest.raises(SftDataError, match="no trajectory file or folder"):
        load_trajectories([str(tmp_path / "missing")])
    with pytest.raises(PretrainError, match='no phase of kind "sft"'):
        sft(load_config(None, ['pretrain.phases=[{name="b", steps=1, seq_len=8, batch_size=1, lr=1e-3}]']),
            tiny_checkpoint, [str(trajs)], tmp_path / "a")


def test_oracle_trajectories_parse(tcfg, tok, tmp_path):
    cfg = load_config(None, ["bench.workers=2"]).model_copy(update={"sandbox": tcfg})
    paths = collect_oracle_trajectories(cfg, tmp_path, n_tasks=2, seed=0, progress=False)
    assert len(paths) == 2
    for traj in load_trajectories(paths):
        turns = traj.turns
        assert traj.stop_reason == "finished" and len(turns) >= 3
        for k, t in enumerate(turns):
            reply = parse_reply(t.text)
            assert reply.errors == [] and bool(reply.calls) == (k < len(turns) - 1)
        _, mask = segment_tokens(traj.segments[0], tok)
        assert sum(mask) == sum(len(tok.encode(t.text)) + 1 for t in turns if t.kind != "mistake")  # never trained on


def test_sft_on_a_dense_family_checkpoint(tiny_checkpoint, trajs, tmp_path):
    init = dense_checkpoint(tmp_path / "llama", "llama", load_tokenizer(tiny_checkpoint).vocab_size, tiny_checkpoint)
    summary = sft(sft_cfg(tmp_path / "run", "model.mtp_depth=0"), init, [str(trajs)], tmp_path / "run", progress=False)
    losses = [r["loss"] for r in _rows(tmp_path / "run")]
    assert summary["steps"] == 8 and losses[-1] < 0.8 * losses[0]
    model, _ = load_checkpoint(tmp_path / "run" / "checkpoint")
    assert model.config.model_type == "llama" and (tmp_path / "run" / "checkpoint" / "tokenizer.json").is_file()
