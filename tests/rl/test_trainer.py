"""The RL trainer step on real engine samples of a tiny MoE: token rows, replayed forward, update."""
from __future__ import annotations

import pytest
import torch

from kiln.config import Config
from kiln.engine import Engine, SamplingParams
from kiln.harness.trajectory import Segment, ToolRecord, Trajectory, TurnRecord
from kiln.model import gemm
from kiln.model.checkpoint import load_checkpoint
from kiln.model.tokenizer import load_tokenizer
from kiln.rl import trainer as trainer_mod
from kiln.rl.batch import BatchError, Sequence, collate, sequences
from kiln.rl.trainer import Group, RLTrainer, target_logp
from tests.threads import one_thread  # noqa: F401


def _turn(c, version_note=None) -> TurnRecord:
    return TurnRecord(text=c.text, prompt_ids=c.prompt_ids, completion_ids=c.token_ids, logprobs=c.logprobs,
                      versions=c.versions, routes=c.routes)


def _traj(engine, prompt, seed, turns=2) -> Trajectory:
    """A multi-turn trajectory whose second prompt extends the first turn's tokens exactly."""
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=seed, stop_token_ids=())
    recs, ids = [], list(prompt)
    for t in range(turns):
        c = engine.generate([ids], params)[0]
        recs.append(_turn(c))
        ids = ids + c.token_ids + [5 + t, 6 + t]  # "tool output" tokens after the reply
    return Trajectory(task_id=f"t{seed}", segments=[Segment(turns=recs)])


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    model, _ = load_checkpoint(tiny_checkpoint, with_mtp=False)
    tok = load_tokenizer(tiny_checkpoint)
    engine = Engine(model, tok, max_batch=4, max_len=256)
    trajs = [_traj(engine, [1, 20 + i, 30, 40], seed=i) for i in range(4)]
    return tiny_checkpoint, trajs


def test_turns_of_a_segment_are_one_sequence_and_targets_are_the_generated_tokens(setup):
    _, trajs = setup
    seqs = sequences(trajs[0], index=3)
    assert len(seqs) == 1  # the second prompt extends the first turn's ids
    s, turns = seqs[0], trajs[0].segments[0].turns
    assert s.ids == turns[1].prompt_ids + turns[1].completion_ids
    gen = [t for i, t in enumerate(s.ids) if s.target[i]]
    assert gen == turns[0].completion_ids + turns[1].completion_ids
    assert [x for i, x in enumerate(s.logp) if s.target[i]] == turns[0].logprobs + turns[1].logprobs
    assert s.traj == 3
    # A prompt that does not extend the chain starts a new sequence.
    broken = Trajectory(segments=[Segment(turns=[turns[0], TurnRecord(
        "x", prompt_ids=[1, 2, 3], completion_ids=[4], logprobs=[-0.5], versions=[0])])])
    assert [len(q.ids) for q in sequences(broken)] == [len(turns[0].prompt_ids) + len(turns[0].completion_ids), 4]
    with pytest.raises(BatchError, match="local policy"):
        sequences(Trajectory(segments=[Segment(turns=[TurnRecord("text only")])]))


def test_replayed_trainer_logprobs_match_the_sampler(setup):
    ckpt, trajs = setup
    model, _ = load_checkpoint(ckpt, with_mtp=False)
    batch = collate([s for i, t in enumerate(trajs) for s in sequences(t, i)])
    with torch.no_grad():
        lp, replaced = target_logp(model, batch, slice(0, len(batch.ids)), 1.0, True, 0.5)
    keep = batch.mask.bool()
    assert keep.sum() == sum(len(tr.completion_ids) for t in trajs for tr in t.turns)
    assert (lp - batch.sampler_logp)[keep].abs().max() < 1e-4
    assert replaced == 0


def test_a_chunk_of_short_rows_is_scored_at_its_own_width(setup):
    """The trainer cuts a chunk to its longest row; the short row's logprobs still match the sampler's."""
    ckpt, trajs = setup
    model, _ = load_checkpoint(ckpt, with_mtp=False)
    short = Trajectory(task_id="short", segments=[Segment(turns=trajs[0].segments[0].turns[:1])])
    batch = collate(sequences(short, 0) + [s for i, t in enumerate(trajs) for s in sequences(t, i + 1)])
    assert batch.mask[0].nonzero().max() + 2 < batch.ids.shape[1]  # row 0 is shorter than the batch
    with torch.no_grad():
        lp, _ = target_logp(model, batch, slice(0, 1), 1.0, True, 0.5)
    keep = batch.mask[:1].bool()
    assert lp.shape == keep.shape and (lp[~keep] == 0).all()
    assert (lp - batch.sampler_logp[:1])[keep].abs().max() < 1e-4


@pytest.mark.parametrize("aggregation", ["constant", "token_mean", "seq_mean"])
def test_a_step_moves_logprobs_with_the_advantage_and_logs_the_metrics(setup, aggregation):
    ckpt, trajs = setup
    model, _ = load_checkpoint(ckpt, with_mtp=False)
    rl = Config().rl.model_copy(update={"lr": 3e-3, "aggregation": aggregation, "kl_coef": 0.1,
                                        "temperature": 1.0})  # what _traj sampled at
    ref, _ = load_checkpoint(ckpt, with_mtp=False)
    trainer = RLTrainer(model, rl, ref_model=ref, version=0)
    rewards = [{"correctness": 1.0, "length": -0.1}, {"correctness": 0.0, "length": -0.1},
               {"correctness": 0.0, "length": -0.2}, {"correctness": 0.0, "length": 0.0}]
    groups = [Group(0, "a", "k", trajs[:2], rewards[:2]), Group(1, "b", "k", trajs[2:], rewards[2:])]
    batch = collate([s for i, t in enumerate(trajs) for s in sequences(t, i)])
    rows = slice(0, len(batch.ids))
    with torch.no_grad():
        before, _ = target_logp(model, batch, rows, 1.0, True, 0.5)
    m = trainer.step(groups)
    with torch.no_grad():
        after, _ = target_logp(model, batch, rows, 1.0, True, 0.5)
    gain = ((after - before) * batch.mask).sum(1)  # one row per trajectory here
    assert gain[0] > 0 > gain[1]  # the solved rollout became likelier, its group mate less likely
    assert m["version"] == trainer.version == 1
    assert m["mismatch_kl_k3"] < 1e-6 and m["ratio_min"] > 0.999
    assert m["solved_mean"] == 0.25 and m["solved_best_of_k"] == 0.5
    assert m["reward/kl"] == 0.0  # the reference is the starting policy
    assert m["lag"] == {"0": int(batch.mask.sum())}
    assert m["tokens_per_s"] > 0 and m["grad_norm"] > 0
    assert m["rollouts"] == 4 and m["summarised"] == 0  # one segment each


def test_a_step_computes_its_products_where_gemm_says_and_restores_torchs_setting(setup, monkeypatch):
    """kiln/model/gemm.py: the step's forward and backward run under routed()'s routing, seen from
    inside the model; outside the step torch's own setting is back."""
    ckpt, trajs = setup
    model, _ = load_checkpoint(ckpt, with_mtp=False)
    trainer = RLTrainer(model, Config().rl.model_copy(update={"temperature": 1.0}))
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: seen.append(torch.backends.mkldnn.matmul.fp32_precision))
    before = torch.backends.mkldnn.matmul.fp32_precision
    rewards = [{"correctness": 1.0}, {"correctness": 0.0}]
    for use in ("onednn", "mkl"):
        monkeypatch.setenv("KILN_FP32_GEMM", use)
        seen.clear()
        m = trainer.step([Group(0, "a", "k", trajs[:2], rewards)])
        assert m["grad_norm"] > 0 and seen
        assert set(seen) == {"bf16" if gemm.backend() == "onednn" else "ieee"}
        assert torch.backends.mkldnn.matmul.fp32_precision == before


@pytest.mark.parametrize("aggregation", ["constant", "token_mean", "seq_mean"])
def test_groups_added_as_they_finish_make_the_whole_steps_loss_and_gradient(setup, aggregation):
    """The driver hands the trainer each group as its rollouts finish (RLTrainer.add runs its forward
    and backward then); the step's loss and gradient are those of the whole batch at once."""
    from kiln.rl.loss import policy_loss

    ckpt, trajs = setup
    rl = Config().rl.model_copy(update={"aggregation": aggregation, "temperature": 1.0})
    model, _ = load_checkpoint(ckpt, with_mtp=False)
    trainer = RLTrainer(model, rl)
    rewards = [{"correctness": c} for c in (1.0, 0.0, 0.0, 0.5)]
    trainer.add(Group(0, "a", "k", trajs[:2], rewards[:2]))
    assert [g.id for g in trainer.pending] == [0] and trainer.version == 0  # no step yet: weights untouched
    trainer.add(Group(1, "b", "k", trajs[2:], rewards[2:]))
    m = trainer.step()
    assert trainer.pending == [] and m["version"] == 1 and m["rollouts"] == 4

    ref, _ = load_checkpoint(ckpt, with_mtp=False)  # the same loss over the whole batch in one piece
    batch = collate([s for i, t in enumerate(trajs) for s in sequences(t, i)])
    adv = torch.tensor([0.5, -0.5, -0.25, 0.25])[batch.traj]  # reward - its group's mean
    lp, _ = target_logp(ref, batch, slice(0, len(batch.ids)), 1.0, True, rl.replay_ratio)
    loss = policy_loss(lp, adv, batch.mask, aggregation, rl.loss_constant)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters() if p.grad is not None]))
    assert m["loss"] == pytest.approx(float(loss.detach()), rel=1e-4, abs=1e-7)
    assert m["grad_norm"] == pytest.approx(float(norm), rel=1e-4) and m["grad_norm"] > 0
    with pytest.raises(ValueError, match="at least one group"):
        trainer.step()


def test_a_groups_rollouts_train_as_one_tree_over_their_prompt_with_the_same_loss(setup):
    """Rollouts that open with one long prompt run as a tree (the prompt once): each row's logprobs
    are its own run's and the sampler's, and a step's loss and gradient norm are the padded rows'."""
    ckpt, _ = setup
    model, _ = load_checkpoint(ckpt, with_mtp=False)
    engine = Engine(model, load_tokenizer(ckpt), max_batch=4, max_len=256)
    prompt = [1] + [20 + i % 50 for i in range(trainer_mod.MIN_SHARED + 6)]
    trajs = [_traj(engine, prompt, seed=s) for s in range(3)] + [_traj(engine, [1, 2, 3], seed=9)]
    batch = collate([s for i, t in enumerate(trajs) for s in sequences(t, i)])
    group = torch.tensor([0, 0, 0, 1])[batch.traj]
    chunks = trainer_mod._chunks(batch, torch.arange(4), group)
    assert [(c.tolist(), tree) for c, tree in chunks] == [([0, 1, 2], True), ([3], False)]
    # a row without a target (nothing to score) joins no tree, even one of its own group's
    n = len(prompt) + 1
    bare = collate(sequences(trajs[0], 0) + [Sequence(prompt + [5], [False] * n, [0.0] * n, [-1] * n, None, 1, [False] * n, [False] * n)])
    assert [(c.tolist(), tree) for c, tree in trainer_mod._chunks(bare, torch.arange(2), torch.tensor([0, 0]))] == [
        ([0, 1], False)]
    # all but the prompt's last position, which predicts each row's own first generated token
    assert trainer_mod.shared_prompt(batch, torch.arange(3)) == len(prompt) - 1
    with torch.no_grad():
        tree, _ = target_logp(model, batch, torch.arange(3), 1.0, True, 0.5, tree=True)
        alone = torch.cat([target_logp(model, batch, slice(i, i + 1), 1.0, True, 0.5)[0] for i in range(3)])
    keep = batch.mask[:3].bool()
    assert (tree[~keep] == 0).all() and (tree - alone)[keep].abs().max() < 1e-5
    assert (tree - batch.sampler_logp[:3])[keep].abs().max() < 1e-4
    rl = Config().rl.model_copy(update={"temperature": 1.0})
    rewards = [{"correctness": c} for c in (1.0, 0.0, 0.0, 1.0)]
    steps = []
    for trees in (True, False):
        m, _ = load_checkpoint(ckpt, with_mtp=False)
        trainer = RLTrainer(m, rl)
        trainer.trees = trees
        steps.append(trainer.step([Group(0, "a", "k", trajs[:3], rewards[:3]), Group(1, "b", "k", trajs[3:], rewards[3:])]))
    assert steps[0]["loss"] == pytest.approx(steps[1]["loss"], rel=1e-5)
    assert steps[0]["grad_norm"] == pytest.approx(steps[1]["grad_norm"], rel=1e-4) and steps[0]["grad_norm"] > 0


@pytest.mark.parametrize("mixed_only", [False, True])
def test_mixed_groups_only_leaves_a_group_without_a_solve_untrained(setup, mixed_only):
    """Two failed rollouts that differ only in length: the length term trains them unless filtered."""
    ckpt, trajs = setup
    model, _ = load_checkpoint(ckpt, with_mtp=False)
    rl = Config().rl.model_copy(update={"lr": 3e-3, "temperature": 1.0, "mixed_groups_only": mixed_only})
    trainer = RLTrainer(model, rl, version=0)
    before = [p.detach().clone() for p in model.parameters()]
    m = trainer.step([Group(0, "a", "k", trajs[:2], [{"correctness": 0.0, "length": -0.1},
                                                     {"correctness": 0.0, "length": -0.3}])])
    moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert moved is not mixed_only
    assert m["groups_mixed"] == 0
    assert m["trained_rows"] == (0 if mixed_only else 2)  # rows whose advantage is 0 are not run
    assert m["mismatch_kl_k3"] < 1e-6  # measured on rows it did not train, too


@pytest.mark.parametrize("positive_only", [False, True])
def test_positive_only_drops_the_failed_rollouts_from_the_loss(setup, positive_only):
    ckpt, trajs = setup
    model, _ = load_checkpoint(ckpt, with_mtp=False)
    rl = Config().rl.model_copy(update={"temperature": 1.0, "positive_only": positive_only})
    m = RLTrainer(model, rl, version=0).step([Group(0, "a", "k", trajs[:2], [{"correctness": 1.0},
                                                                            {"correctness": 0.0}])])
    n = [sum(len(tr.completion_ids) for tr in t.turns) for t in trajs[:2]]  # generated tokens per rollout
    # Dr. GRPO: -sum(A * ratio) / constant with ratio 1 at the sampled weights; A = +0.5 and -0.5
    want = (-0.5 * n[0] + (0 if positive_only else 0.5 * n[1])) / rl.loss_constant
    assert m["loss"] == pytest.approx(want, rel=1e-5)
    assert m["trained_rows"] == (1 if positive_only else 2)


@pytest.mark.parametrize("penalty", [0.0, 0.5])
def test_failed_call_penalty_pushes_down_only_the_turn_whose_call_failed(setup, penalty):
    """Two rollouts with equal rewards (advantage 0): only the penalty on trajectory 0's failed second
    turn can train, and it makes exactly that turn's tokens less likely."""
    ckpt, trajs = setup
    model, _ = load_checkpoint(ckpt, with_mtp=False)
    failed = Trajectory(task_id="f", segments=trajs[0].segments, tools=[
        ToolRecord(0, "c0", "read_file", {}, True, 0.1, 10), ToolRecord(1, "c1", "edit_file", {}, False, 0.1, 10)])
    turns = failed.segments[0].turns
    seq = sequences(failed)[0]
    assert [x for x, f in zip(seq.ids, seq.failed) if f] == turns[1].completion_ids
    rl = Config().rl.model_copy(update={"lr": 3e-3, "temperature": 1.0, "failed_call_penalty": penalty})
    batch = collate(sequences(failed, 0) + sequences(trajs[1], 1))
    with torch.no_grad():
        before, _ = target_logp(model, batch, slice(0, 2), 1.0, True, 0.5)
    m = RLTrainer(model, rl, version=0).step([Group(0, "a", "k", [failed, trajs[1]],
                                                    [{"correctness": 0.0}, {"correctness": 0.0}])])
    # Dr. GRPO: -sum(A * ratio) / constant, A = -penalty on the failed turn's tokens, 0 elsewhere
    assert m["loss"] == pytest.approx(penalty * len(turns[1].completion_ids) / rl.loss_constant, rel=1e-5)
    assert m["trained_rows"] == (1 if penalty else 0)
    with torch.no_grad():
        after, _ = target_logp(model, batch, slice(0, 2), 1.0, True, 0.5)
    moved = float(((after - before) * batch.failed[:2]).sum())
    assert (moved < 0) if penalty else (moved == 0)


def test_repeated_call_penalty_pushes_down_only_the_repeat_of_a_failed_call(setup):
    """A call made again after it failed is marked (not the first failure, not a repeat of a call that
    worked), and with advantage 0 only its penalty trains: those tokens become less likely."""
    ckpt, trajs = setup
    tools = [ToolRecord(0, "c0", "edit_file", {"path": "a", "old_text": "x"}, False, 0.1, 10),
             ToolRecord(0, "c1", "read_file", {"path": "a"}, True, 0.1, 10),
             ToolRecord(1, "c2", "read_file", {"path": "a"}, True, 0.1, 10),
             ToolRecord(1, "c3", "edit_file", {"old_text": "x", "path": "a"}, False, 0.1, 10)]
    looped = Trajectory(task_id="r", segments=trajs[0].segments, tools=tools)
    turns = looped.segments[0].turns
    seq = sequences(looped)[0]
    assert [x for x, r in zip(seq.ids, seq.repeated) if r] == turns[1].completion_ids
    worked = Trajectory(task_id="w", segments=trajs[0].segments, tools=[tools[1], tools[2]])
    assert not any(sequences(worked)[0].repeated)
    model, _ = load_checkpoint(ckpt, with_mtp=False)
    rl = Config().rl.model_copy(update={"lr": 3e-3, "temperature": 1.0, "repeated_call_penalty": 0.5})
    batch = collate(sequences(looped, 0) + sequences(trajs[1], 1))
    with torch.no_grad():
        before, _ = target_logp(model, batch, slice(0, 2), 1.0, True, 0.5)
    m = RLTrainer(model, rl, version=0).step([Group(0, "a", "k", [looped, trajs[1]],
                                                    [{"correctness": 0.0}, {"correctness": 0.0}])])
    assert m["loss"] == pytest.approx(0.5 * len(turns[1].completion_ids) / rl.loss_constant, rel=1e-5)
    assert m["trained_rows"] == 1
    with torch.no_grad():
        after, _ = target_logp(model, batch, slice(0, 2), 1.0, True, 0.5)
    assert float(((after - before) * batch.repeated[:2]).sum()) < 0


def test_a_step_on_a_dense_family_scores_like_its_sampler_and_learns(tiny_checkpoint, tmp_path):
    """`kiln rl` from a Llama checkpoint: no routes are recorded or replayed, the trainer's
    logprobs are the engine's, and a step moves them with the advantage."""
    from tests.tiny_model import dense_checkpoint

    ckpt = dense_checkpoint(tmp_path / "llama", "llama", load_tokenizer(tiny_checkpoint).vocab_size, tiny_checkpoint)
    model, _ = load_checkpoint(ckpt)
    engine = Engine(model, load_tokenizer(ckpt), max_batch=4, max_len=256)
    trajs = [_traj(engine, [1, 20 + i, 30, 40], seed=i) for i in range(4)]
    batch = collate([s for i, t in enumerate(trajs) for s in sequences(t, i)])
    assert batch.routes is None
    rows = slice(0, len(batch.ids))
    with torch.no_grad():
        before, replaced = target_logp(model, batch, rows, 1.0, True, 0.5)
    keep = batch.mask.bool()
    assert (before - batch.sampler_logp)[keep].abs().max() < 1e-4 and replaced == 0
    rl = Config().rl.model_copy(update={"lr": 3e-3, "temperature": 1.0})
    rewards = [{"correctness": 1.0}, {"correctness": 0.0}, {"correctness": 0.0}, {"correctness": 1.0}]
    RLTrainer(model, rl).step([Group(0, "a", "k", trajs[:2], rewards[:2]), Group(1, "b", "k", trajs[2:], rewards[2:])])
    with torch.no_grad():
        after, _ = target_logp(model, batch, rows, 1.0, True, 0.5)
    gain = ((after - before) * batch.mask).sum(1)
    assert gain[0] > 0 > gain[1] and gain[3] > 0 > gain[2]


@pytest.mark.parametrize("train_embeddings", [True, False])
def test_train_embeddings_false_keeps_the_embedding_and_head_and_still_learns(setup, train_embeddings):
    ckpt, trajs = setup
    model, _ = load_checkpoint(ckpt, with_mtp=False)
    rl = Config().rl.model_copy(update={"lr": 3e-3, "temperature": 1.0, "train_embeddings": train_embeddings})
    trainer = RLTrainer(model, rl, version=0)
    vocab = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = collate([s for i, t in enumerate(trajs[:2]) for s in sequences(t, i)])
    with torch.no_grad():
        lp0, _ = target_logp(model, batch, slice(0, 2), 1.0, True, 0.5)
    trainer.step([Group(0, "a", "k", trajs[:2], [{"correctness": 1.0}, {"correctness": 0.0}])])
    with torch.no_grad():
        lp1, _ = target_logp(model, batch, slice(0, 2), 1.0, True, 0.5)
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    kept_vocab = {n for n, p in model.named_parameters() if id(p) in vocab} - moved
    assert bool(kept_vocab) is not train_embeddings  # frozen: the embedding (and untied head) bit for bit
    assert any("layers" in n for n in moved)  # every other weight still trains
    assert all(id(p) not in vocab for g in trainer.opt.param_groups for p in g["params"]) is not train_embeddings
    assert ((lp1 - lp0) * batch.mask[:2]).sum(1)[0] > 0  # the solved rollout became likelier either way


def test_a_bf16_sampler_holds_the_published_bf16_weights_bit_for_bit_and_their_deltas_are_sparse(setup, tmp_path):
    """engine.dtype = bfloat16: the trainer keeps its fp32 master and publishes it rounded to bf16; a
    worker's engine rebuilds each version from the deltas and samples with exactly those bits."""
    from kiln.rl.store import WeightStore, WeightSubscriber
    from kiln.rl.trainer import sampler_weights

    ckpt, trajs = setup
    model, _ = load_checkpoint(ckpt, with_mtp=False)
    trainer = RLTrainer(model, Config().rl.model_copy(update={"temperature": 1.0}), version=0)  # RL's lr, 1e-5
    store = WeightStore(str(tmp_path / "weights"))
    store.publish(0, sampler_weights(model, "bfloat16"))
    sub = WeightSubscriber(store, "worker")
    sampler, _ = load_checkpoint(ckpt, with_mtp=False)
    sampler.load_state_dict(sub.poll()[1])  # as a worker starts
    engine = Engine(sampler, max_batch=1, max_len=64, weight_dtype=torch.bfloat16)
    rewards = [{"correctness": 1.0}, {"correctness": 0.0}, {"correctness": 0.0}, {"correctness": 1.0}]
    for _ in range(2):
        trainer.step([Group(0, "a", "k", trajs[:2], rewards[:2]), Group(1, "b", "k", trajs[2:], rewards[2:])])
        assert next(model.parameters()).dtype == torch.float32  # the master
        pub = store.publish(trainer.version, sampler_weights(model, "bfloat16"))
        assert pub["kind"] == "delta" and pub["delta_fraction"] <= 0.10
        version, state = sub.poll()
        engine.update_weights(state, version)
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1))  # applied between steps
        held, stored = engine.sampler_weights(), store.load(version)
        assert held.keys() == stored.keys()
        for k, v in stored.items():
            assert v.dtype == held[k].dtype == torch.bfloat16
            assert torch.equal(held[k].view(torch.int16), v.view(torch.int16)), k


def test_a_group_the_driver_hands_on_from_memory_batches_as_its_copy_on_disk_does(setup, tmp_path):
    """run_group's files as a worker returns them, built into the trainer's Group directly (group_from)
    and through the driver's copy on disk (keep_group, then load_group): the same rows, bit for bit."""
    import copy
    from dataclasses import fields

    from kiln.rl.rollout import group_from, keep_group, load_group

    trajs = copy.deepcopy(setup[1])  # the fixture's are shared with the other tests
    trajs[1].tools = [ToolRecord(turn=0, call_id="c0", name="bash", arguments={"cmd": "ls"}, ok=False,
                                 duration_s=0.1, output_chars=3)]  # a failed call: the `failed` rows differ
    files = {f"{i}.json": t.to_dict() for i, t in enumerate(trajs)}
    files["group.json"] = {"id": 7, "task_id": "t", "kind": "toy/1", "trajectories": list(files),
                           "rewards": [{"correctness": float(i % 2)} for i in range(len(trajs))], "cost": 2.0}
    direct = group_from(files, started_version=3)
    disk = load_group(keep_group(files, str(tmp_path), 7), started_version=3)
    assert (direct.id, direct.kind, direct.rewards, direct.started_version) == (7, "toy/1", disk.rewards, 3)
    a, b = ([s for i, t in enumerate(g.trajectories) for s in sequences(t, i)] for g in (direct, disk))
    a, b = collate(a), collate(b)
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert (x is None and y is None) or torch.equal(x, y), f.name
    assert a.routes is not None and a.failed.any()


def test_a_rollout_keeps_only_the_routes_its_sequences_replay(setup):
    """drop_superseded_routes: the routes of a turn its next turn continues go, those of a chain's last
    turn stay, and the trainer's rows are bit for bit what they were with every turn's routes."""
    import copy

    from kiln.rl.batch import drop_superseded_routes

    a, b = copy.deepcopy(setup[1][:2])
    # one segment: a's two chained turns, then b's first turn, which does not continue them (a new row)
    traj = Trajectory(task_id="t", segments=[Segment(turns=[*a.turns, b.turns[0]]), Segment(turns=[b.turns[1]])])
    before = collate(sequences(copy.deepcopy(traj)))
    drop_superseded_routes(traj)
    assert [t.routes is None for s in traj.segments for t in s.turns] == [True, False, False, False]
    after = collate(sequences(traj))
    assert before.ids.shape[0] == 3
    for name in ("ids", "mask", "sampler_logp", "version", "routes"):
        assert torch.equal(getattr(before, name), getattr(after, name)), name
