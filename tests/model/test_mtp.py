"""Multi-token prediction: shapes, what gradients reach, the self-distillation loss, and training."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.model.config import ModelConfig
from kiln.model.moe import MoeForCausalLM
from kiln.model.mtp import MTP, mtp_loss
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module

CFG = ModelConfig.from_depth(2, vocab_size=256)
B, T, V = 3, 24, CFG.vocab_size


def make(depth: int = 2, seed: int = 0) -> tuple[MoeForCausalLM, MTP]:
    torch.manual_seed(seed)
    model = MoeForCausalLM(CFG)
    with torch.no_grad():  # a main model with opinions, so its distribution is worth distilling
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    return model, MTP(CFG, depth=depth)


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_forward_shapes():
    model, mtp = make(depth=2)
    ids = batch()
    hidden = model.trunk(ids).hidden
    out = mtp(model, hidden, ids)
    assert [tuple(x.shape) for x in out] == [(B, T - 1, V), (B, T - 2, V)]
    assert all(torch.isfinite(x).all() for x in out)
    # a sequence too short for the deeper layer stops early instead of failing
    short = ids[:, :2]
    assert [tuple(x.shape) for x in mtp(model, model.trunk(short).hidden, short)] == [(B, 1, V)]


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth must be >= 1"):
        MTP(CFG, depth=0)


def _backward(model, mtp, detach_trunk: bool) -> None:
    ids = batch(1)
    out = model.trunk(ids)
    logits = model.head(out.hidden)
    loss, per_depth = mtp_loss(logits, mtp(model, out.hidden, ids, detach_trunk=detach_trunk), ids)
    assert len(per_depth) == mtp.depth and loss.item() > 0
    loss.backward()


def test_detached_trunk_gets_no_gradient():
    model, mtp = make()
    _backward(model, mtp, detach_trunk=True)
    touched = [n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    assert touched == [], f"training MTP changed the main model: {touched}"
    no_grad = [n for n, p in mtp.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert no_grad == [], f"MTP parameters without gradient: {no_grad}"


def test_undetached_trunk_gets_gradient():
    model, mtp = make()
    _backward(model, mtp, detach_trunk=False)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    assert grads["model.norm.weight"] is None  # MTP heads use their own norm, main logits are detached


def shifted_copy(main: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """MTP logits equal to the main head's at the position predicting the same token."""
    t = main.shape[1]
    return [main[:, k:t].clone() for k in range(1, depth + 1)]


def test_distill_loss_is_zero_on_matching_logits_and_positive_otherwise():
    gen = torch.Generator().manual_seed(0)
    main = 3 * torch.randn(B, T, V, generator=gen)
    ids = batch()
    loss, per = mtp_loss(main, shifted_copy(main, 2), ids)
    assert abs(loss.item()) < 1e-6 and all(abs(x) < 1e-6 for x in per)
    # a constant shift of logits is the same distribution
    loss, _ = mtp_loss(main, [q + 5.0 for q in shifted_copy(main, 2)], ids)
    assert abs(loss.item()) < 1e-5
    for seed in range(3):
        q = [torch.randn(B, T - k, V, generator=gen) for k in (1, 2)]
        loss, per = mtp_loss(main, q, ids)
        assert loss.item() > 0.1 and min(per) > 0
        assert loss.item() == pytest.approx(sum(per) / 2, rel=1e-6)


def test_distill_loss_matches_kl_by_hand():
    gen = torch.Generator().manual_seed(1)
    main = torch.randn(2, 5, 7, generator=gen)
    q = torch.randn(2, 4, 7, generator=gen)  # depth 1: row i against main at i + 1
    ids = torch.zeros(2, 5, dtype=torch.long)
    want = F.kl_div(q.log_softmax(-1), main[:, 1:].log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    loss, _ = mtp_loss(main, [q], ids)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)


def test_hard_mode_is_cross_entropy_on_true_tokens():
    gen = torch.Generator().manual_seed(2)
    ids = torch.tensor([[5, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]])
    q1, q2 = torch.randn(2, 5, 10, generator=gen), torch.randn(2, 4, 10, generator=gen)
    main = torch.randn(2, 6, 10, generator=gen)  # unused in hard mode
    # depth k row i predicts token i + k + 1; rows whose target falls off the end are dropped
    ce1 = sum(-q1[b, i].log_softmax(-1)[ids[b, i + 2]] for b in range(2) for i in range(4)) / 8
    ce2 = sum(-q2[b, i].log_softmax(-1)[ids[b, i + 3]] for b in range(2) for i in range(3)) / 6
    loss, per = mtp_loss(main, [q1, q2], ids, mode="hard")
    assert per == pytest.approx([ce1.item(), ce2.item()], rel=1e-5)
    assert loss.item() == pytest.approx((ce1.item() + ce2.item()) / 2, rel=1e-5)
    with pytest.raises(ValueError, match="mode must be"):
        mtp_loss(main, [q1], ids, mode="soft")


def test_doc_boundaries_exclude_cross_document_positions():
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    gen = torch.Generator().manual_seed(3)
    main = torch.randn(1, 8, 16, generator=gen)

    # distill, depth 1: row i reads token i+1; rows 2 and 6 straddle a boundary
    q = shifted_copy(main, 1)[0]
    crossing = [2, 6]
    q[:, crossing] = 100 * torch.randn(1, 2, 16, generator=gen)
    assert mtp_loss(main, [q], ids)[0].item() > 10
    assert mtp_loss(main, [q], ids, doc_ids=doc_ids)[0].item() < 1e-6

    # hard, depth 1: row i predicts token i+2 (rows 0..5); rows 1, 2 and 5 cross a boundary
    q = torch.full((1, 7, 16), -50.0)
    for i in range(6):
        q[0, i, ids[0, i + 2]] = 50.0  # confidently right...
    for i in (1, 2, 5):
        q[0, i] = -q[0, i]  # ...except across documents
    assert mtp_loss(main, [q], ids, mode="hard")[0].item() > 10
    assert mtp_loss(main, [q], ids, doc_ids=doc_ids, mode="hard")[0].item() < 1e-6


def test_mtp_forward_respects_documents():
    """Packed documents: MTP outputs for a document do not depend on the other documents."""
    model, mtp = make()
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, V, (1, 10), generator=gen), torch.randint(0, V, (1, 14), generator=gen)
    packed = torch.cat((a, b), 1)
    doc_ids = torch.tensor([[0] * 10 + [1] * 14])
    positions = torch.cat((torch.arange(10), torch.arange(14)))[None]
    with torch.no_grad():
        hidden = model.trunk(packed, positions=positions, doc_ids=doc_ids).hidden
        out = mtp(model, hidden, packed, positions=positions, doc_ids=doc_ids)
        alone = mtp(model, model.trunk(b).hidden, b)
    for k in (1, 2):  # rows of the second document, whose inputs all lie in it
        torch.testing.assert_close(out[k - 1][:, 10:24 - k], alone[k - 1], rtol=0, atol=1e-4)


def test_self_distillation_training_reduces_the_loss():
    model, mtp = make(depth=2, seed=5)
    ids = batch(5)
    with torch.no_grad():
        out = model.trunk(ids)
        hidden, logits = out.hidden, model.head(out.hidden)
    opt = torch.optim.Adam(mtp.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, _ = mtp_loss(logits, mtp(model, hidden, ids), ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"self-distillation: {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < 0.25 * losses[0]


def test_kept_positions_equal_the_full_loss_restricted_to_them():
    """SFT runs the heads only at its targets: same KL per position as the full path, averaged
    over the kept positions that stay inside their document."""
    model, mtp = make()
    ids, docs = batch(5), torch.tensor([[0] * 10 + [1] * 14] * B)
    keep = torch.rand(B, T, generator=torch.Generator().manual_seed(6)) < 0.4
    with torch.no_grad():
        hidden = model.trunk(ids, doc_ids=docs).hidden
        full_main, full_q = model.head(hidden), mtp(model, hidden, ids, doc_ids=docs)
        kept_main, kept_q = model.head(hidden[keep]), mtp(model, hidden, ids, doc_ids=docs, keep=keep)
        _, per = mtp_loss(kept_main, kept_q, ids, docs, keep=keep)
    for k, q in enumerate(full_q, start=1):
        n = T - k
        kl = (F.kl_div(q.log_softmax(-1), full_main[:, k:].log_softmax(-1), log_target=True, reduction="none")
              .sum(-1))
        at = keep[:, k:] & (docs[:, :n] == docs[:, k:])
        assert kept_q[k - 1].shape[0] == int(keep[:, k:].sum())
        assert per[k - 1] == pytest.approx(kl[at].mean().item(), rel=1e-4)
    with pytest.raises(ValueError, match="needs mode 'distill'"):
        mtp_loss(kept_main, kept_q, ids, docs, mode="hard", keep=keep)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("docs", ["none", "mask", "tree"])
def test_the_last_layer_at_kept_rows_equals_the_full_layer_there(depth, docs):
    """With keep, the last MTP layer runs its queries and MLP at the kept rows only: the same
    logits and the same gradients as running it everywhere and then selecting them, whether
    attention is causal, a packed-documents mask or a shared-prompt tree (SFT's steps)."""
    model, mtp = make(depth=depth, seed=3)
    ids = batch(7)
    doc_ids = {"none": None, "mask": torch.tensor([[0] * 10 + [1] * 14] * B),
               "tree": torch.tensor([[0] * 8 + [1] * 9 + [2] * 7] * B)}[docs]
    shared = docs == "tree"
    pos = None if doc_ids is None else torch.cat([torch.arange(17), torch.arange(8, 15)]).expand(B, T) if shared \
        else torch.cat([torch.arange(10), torch.arange(14)]).expand(B, T)
    keep = torch.rand(B, T, generator=torch.Generator().manual_seed(8)) < 0.3
    hidden = model.trunk(ids, positions=pos, doc_ids=doc_ids, shared_prefix=shared).hidden.detach()
    weight = torch.randn(B * T, V, generator=torch.Generator().manual_seed(9))
    grads = []
    for rows in (None, keep):
        mtp.zero_grad()
        q = mtp(model, hidden, ids, pos, doc_ids, keep=rows, shared=shared)
        last = q[-1] if rows is not None else q[-1][keep[:, depth:]]
        (last * weight[:len(last)]).sum().backward()
        grads.append([p.grad.clone() for p in mtp.parameters() if p.grad is not None])
        if rows is None:
            full = last.detach()
    assert last.shape == full.shape and len(last) == int(keep[:, depth:].sum()) > 0
    assert torch.allclose(last.detach(), full, atol=1e-5)
    assert len(grads[0]) == len(grads[1]) and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(*grads))


def test_training_counts_tokens_and_the_drafter_takes_the_most_frequent(tmp_path):
    """Training forwards count their input tokens (evaluation forwards do not); draft_ids(k) are
    the k most counted (ties to the lower id); the counts survive a checkpoint, and a checkpoint
    from before them loads with none, so the drafter keeps the whole vocabulary."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from kiln.model.checkpoint import load_checkpoint, save_checkpoint

    model, mtp = make()
    ids = torch.tensor([[5, 5, 5, 9, 9, 2, 7, 7]])
    hidden = model.trunk(ids).hidden
    mtp.eval()(model, hidden, ids)
    assert not mtp.token_counts.any() and mtp.draft_ids(3) is None
    mtp.train()(model, hidden, ids)
    mtp(model, hidden[:, 5:], ids[:, 5:])
    assert mtp.token_counts[[5, 9, 2, 7]].tolist() == [3, 2, 2, 4] and int(mtp.token_counts.sum()) == 11
    assert mtp.draft_ids(3).tolist() == [2, 5, 7]  # 9 and 2 tie at 2: 2 is the lower id
    assert mtp.draft_ids(0) is None and mtp.draft_ids(V) is None
    save_checkpoint(model, tmp_path / "ckpt", mtp=mtp, dtype=torch.bfloat16)
    _, loaded = load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(loaded.token_counts, mtp.token_counts) and loaded.token_counts.dtype == torch.int64
    path = tmp_path / "ckpt" / "mtp.safetensors"
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
    old = {k: v for k, v in load_file(str(path)).items() if k != "token_counts"}
    save_file(old, str(path), metadata=meta)
    _, loaded = load_checkpoint(tmp_path / "ckpt")
    assert not loaded.token_counts.any() and loaded.draft_ids(3) is None
