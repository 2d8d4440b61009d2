"""Route capture and router replay: the trainer reproduces the inference engine's expert choices.

The setting RL has: an engine samples in bf16 and records which experts each token used; the
trainer recomputes the same tokens in fp32. Near-tied router scores flip between the two
precisions, a flipped expert changes that token's output wholesale, and the trainer's
distribution drifts from the one the samples came from. Replaying the recorded routes removes
that source of mismatch, leaving only ordinary rounding.
"""
from __future__ import annotations

import copy

import torch

from kiln.model.config import ModelConfig
from kiln.model.moe import MoeBlock, MoeForCausalLM, plausible_routes
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module

CFG = ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)


def routing_sensitive_model(seed: int = 0) -> MoeForCausalLM:
    """std 0.1 weights: peaked routers whose choices depend on the token (the default 0.02 init
    gives near-uniform routers)."""
    torch.manual_seed(seed)
    model = MoeForCausalLM(CFG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    return model.eval()


def batch(shape=(4, 64), seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B, T, L, k] route tensors -> [B, T, L] bool: the same set of experts (order aside)."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def test_replaying_bf16_routes_brings_the_trainer_closer_to_inference():
    model = routing_sensitive_model()
    engine = copy.deepcopy(model).to(torch.bfloat16)
    ids = batch()
    with torch.no_grad():
        inf = engine.trunk(ids)
        logp_inf = engine.head(inf.hidden).float().log_softmax(-1)
        free = model.trunk(ids)
        logp_free = model.head(free.hidden).log_softmax(-1)
        replay = model.trunk(ids, routes=inf.routes)
        logp_replay = model.head(replay.hidden).log_softmax(-1)

    flipped = int((~same_experts(inf.routes, free.routes)).sum())
    assert flipped > 0, "bf16 and fp32 routed identically: this test would prove nothing"
    assert replay.replaced == 0
    assert torch.equal(replay.routes, inf.routes)

    def kl(p, q):  # KL(inference || trainer), mean over tokens
        return float((p.exp() * (p - q)).sum(-1).mean())

    def max_gap(q):  # on the sequence's own next tokens, as on sampled tokens in RL
        tgt = ids[:, 1:, None]
        return float((logp_inf[:, :-1].gather(-1, tgt) - q[:, :-1].gather(-1, tgt)).abs().max())

    kl_free, kl_replay = kl(logp_inf, logp_free), kl(logp_inf, logp_replay)
    gap_free, gap_replay = max_gap(logp_free), max_gap(logp_replay)
    print(f"{flipped}/{inf.routes[..., 0].numel()} token-layers routed differently; "
          f"KL {kl_free:.2e} -> {kl_replay:.2e} with replay; max logprob gap {gap_free:.3f} -> {gap_replay:.3f}")
    assert kl_replay < 0.25 * kl_free
    assert gap_replay < 0.5 * gap_free


def test_router_gets_gradients_under_replay():
    model = routing_sensitive_model()
    ids = batch(seed=1)
    with torch.no_grad():
        routes = copy.deepcopy(model).to(torch.bfloat16).trunk(ids).routes
    logits = model.head(model.trunk(ids, routes=routes).hidden)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    for i in CFG.moe_layers:
        grad = model.model.layers[i].mlp.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0, f"layer {i}: router has no gradient under replay"


def test_replaying_own_routes_reproduces_the_forward():
    model = routing_sensitive_model(seed=2)
    ids = batch(seed=2)
    with torch.no_grad():
        free = model.trunk(ids)
        replay = model.trunk(ids, routes=free.routes)
    assert replay.replaced == 0
    assert torch.equal(replay.routes, free.routes)
    torch.testing.assert_close(model.head(replay.hidden), model.head(free.hidden), rtol=0, atol=1e-6)


def test_unrecorded_routes_mean_live_routing():
    model = routing_sensitive_model(seed=3)
    ids = batch((2, 16), seed=3)
    with torch.no_grad():
        free = model.trunk(ids)
        blank = model.trunk(ids, routes=torch.full_like(free.routes, -1))
    assert blank.replaced == 0
    assert torch.equal(blank.routes, free.routes)
    assert torch.equal(blank.hidden, free.hidden)


def test_captured_routes_are_what_the_experts_ran():
    model = routing_sensitive_model(seed=4)
    ids = batch((3, 20), seed=4)
    seen: list[torch.Tensor] = []
    hooks = [layer.mlp.experts.register_forward_hook(lambda mod, args, out: seen.append(args[1].clone()))
             for layer in model.model.layers if isinstance(layer.mlp, MoeBlock)]
    k, n_moe = CFG.num_experts_per_tok, len(CFG.moe_layers)
    with torch.no_grad():
        free = model.trunk(ids)
        # replay arbitrary first experts: many are implausible and get swapped for live choices,
        # and the captured routes must show what was actually run, not what was asked for
        bogus = free.routes.clone()
        bogus[..., 0] = (free.routes[..., 1] + 1) % CFG.num_experts
        replayed = model.trunk(ids, routes=bogus)
    for h in hooks:
        h.remove()

    assert free.routes.shape == (3, 20, n_moe, k)
    assert replayed.routes.shape == (3, 20, n_moe, k)
    assert len(seen) == 2 * n_moe
    for m in range(n_moe):
        assert torch.equal(free.routes[:, :, m].reshape(-1, k), seen[m])
        assert torch.equal(replayed.routes[:, :, m].reshape(-1, k), seen[n_moe + m])
    used = replayed.routes
    assert (used.sort(-1).values.diff(dim=-1) != 0).all(), "an expert used twice by one token"
    kept = used == bogus
    assert int((~kept).sum()) == replayed.replaced > 0  # every change is a counted swap


# plausible_routes on hand-made rows. Live probabilities over 5 experts, top-2; ratio 0.5, so a
# replayed expert needs probability >= 0.5 * 0.3 = 0.15 to stand.
PROBS = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])


def check(replay_rows: list[list[int]], expected: list[list[int]], expected_replaced: int):
    probs = PROBS.expand(len(replay_rows), -1)
    top_w, top_i = torch.topk(probs, 2, dim=-1)
    replay = torch.tensor(replay_rows)
    idx, replaced = plausible_routes(replay, probs, top_w, top_i, ratio=0.5)
    assert idx.tolist() == expected
    assert replaced == expected_replaced
    assert replay.tolist() == replay_rows, "the caller's routes were modified"
    for row in idx.tolist():
        assert len(set(row)) == len(row), f"duplicate expert in {row}"


def test_plausible_rows_are_kept_as_replayed():
    check([[2, 1], [1, 0], [0, 2]], [[2, 1], [1, 0], [0, 2]], 0)


def test_implausible_expert_is_swapped_for_best_unused_live_choice():
    # 3 (0.06) is below 0.15: replaced by the live best, expert 0
    check([[2, 3]], [[2, 0]], 1)
    # 4 is implausible and the live best (0) is already kept: the next live choice, 1
    check([[0, 4]], [[0, 1]], 1)
    # both implausible: the live top-2
    check([[3, 4]], [[0, 1]], 2)
    # a mix of rows: only the bad entries change, and the count is over the whole batch
    check([[2, 1], [4, 2], [3, 4], [1, 0]], [[2, 1], [0, 2], [0, 1], [1, 0]], 3)


def test_unrecorded_entries_take_live_choices_uncounted():
    check([[-1, 2]], [[0, 2]], 0)
    check([[-1, -1]], [[0, 1]], 0)
    check([[0, -1]], [[0, 1]], 0)
    check([[-1, 3], [1, 2]], [[0, 1], [1, 2]], 1)  # 3 is implausible (counted), -1 is not


def test_score_exactly_at_the_threshold_is_plausible():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    top_w, top_i = torch.topk(probs, 2, dim=-1)
    idx, replaced = plausible_routes(torch.tensor([[0, 2]]), probs, top_w, top_i, ratio=0.5)
    assert idx.tolist() == [[0, 2]] and replaced == 0
    idx, replaced = plausible_routes(torch.tensor([[0, 2]]), probs, top_w, top_i, ratio=0.51)
    assert idx.tolist() == [[0, 1]] and replaced == 1
