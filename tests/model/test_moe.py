"""The MoE model's own behaviour: packed documents, the balance loss, and its config."""
from __future__ import annotations

import json

import pytest
import torch

from kiln.model import layers
from kiln.model.config import ModelConfig
from kiln.model.moe import MoeBlock, MoeForCausalLM
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module

CFG = ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  intermediate_size=96, mlp_only_layers=[0])


def model(seed: int = 0) -> MoeForCausalLM:
    torch.manual_seed(seed)
    m = MoeForCausalLM(CFG)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    return m.eval()


def _grads(m, loss) -> dict[str, torch.Tensor]:
    m.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.fixture(params=["mask", "spans"])
def packing(request, monkeypatch):
    """Both ways of keeping packed documents apart (model/layers.document_mask picks by row length)."""
    monkeypatch.setattr(layers, "SPANS_FROM", 10**9 if request.param == "mask" else 1)
    return request.param


def test_packed_documents_match_documents_run_alone(packing):
    m = model()
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in (7, 12, 5, 9, 15)]
    rows = [docs[:3], docs[3:]]  # two rows of 24 tokens, split differently
    ids = torch.stack([torch.cat(r) for r in rows])
    doc_ids = torch.stack([torch.cat([torch.full((len(d),), j) for j, d in enumerate(r)]) for r in rows])
    positions = torch.stack([torch.cat([torch.arange(len(d)) for d in r]) for r in rows])
    with torch.no_grad():
        packed = m(ids, positions=positions, doc_ids=doc_ids)
        unmasked = m(ids)
        for row, r in enumerate(rows):
            start = 0
            for d in r:
                alone = m(d[None])[0]
                torch.testing.assert_close(packed[row, start:start + len(d)], alone, rtol=0, atol=1e-5)
                start += len(d)
    # without the mask, later documents see earlier ones: the mask is what made them equal
    assert (unmasked[0, 7:] - packed[0, 7:]).abs().max() > 1e-2
    torch.testing.assert_close(unmasked[0, :7], packed[0, :7], rtol=0, atol=1e-5)


def test_packed_documents_get_the_gradients_of_documents_run_alone(packing):
    """Padding included: it attends nowhere and sends no gradient to the documents."""
    m = model()
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in (9, 1, 6)]
    ids = torch.cat(docs + [torch.zeros(4, dtype=torch.long)])[None]
    doc_ids = torch.cat([torch.full((len(d),), j) for j, d in enumerate(docs)] + [torch.full((4,), -1)])[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs] + [torch.arange(4)])[None]
    packed = _grads(m, m(ids, positions=positions, doc_ids=doc_ids)[0, :16].pow(2).sum())
    alone = _grads(m, sum(m(d[None])[0].pow(2).sum() for d in docs))
    assert packed.keys() == alone.keys()
    for name in packed:
        torch.testing.assert_close(packed[name], alone[name], rtol=1e-3, atol=1e-4)


def test_a_shared_prompt_row_matches_each_sequence_run_whole():
    """A row of [prompt][rest 1][rest 2] with shared_prefix: each rest attends to the prompt as if it
    followed it alone (the RL trainer's tree over a group's rollouts): outputs and gradients."""
    m = model()
    gen = torch.Generator().manual_seed(2)
    prompt, rests = torch.randint(0, CFG.vocab_size, (11,), generator=gen), [
        torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in (6, 9)]
    ids = torch.cat([prompt, *rests])[None]
    doc_ids = torch.cat([torch.full((len(x),), j) for j, x in enumerate([prompt, *rests])])[None]
    positions = torch.cat([torch.arange(11)] + [torch.arange(11, 11 + len(r)) for r in rests])[None]
    tree = m(ids, positions=positions, doc_ids=doc_ids, shared_prefix=True)[0]
    whole = [m(torch.cat([prompt, r])[None])[0] for r in rests]
    torch.testing.assert_close(tree[:11], whole[0][:11], rtol=0, atol=1e-5)
    torch.testing.assert_close(tree[11:17], whole[0][11:], rtol=0, atol=1e-5)
    torch.testing.assert_close(tree[17:], whole[1][11:], rtol=0, atol=1e-5)
    # the prompt's outputs once plus each rest's: the same loss, so the same gradients
    shared = _grads(m, tree[:11].pow(2).sum() + tree[11:].pow(2).sum())
    apart = _grads(m, whole[0].pow(2).sum() + whole[1][11:].pow(2).sum())
    for name in shared:
        torch.testing.assert_close(shared[name], apart[name], rtol=1e-3, atol=1e-4)
    # without shared_prefix the rests see only themselves
    assert (m(ids, positions=positions, doc_ids=doc_ids)[0, 17:] - tree[17:]).abs().max() > 1e-2


def test_few_token_expert_path_matches_the_grouped_path():
    """A forward of one or two tokens (decoding) runs experts token by token; more tokens are
    grouped by expert. Both must give the same result for the same token."""
    m = model(2)
    ids = torch.randint(0, CFG.vocab_size, (4, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        grouped = m(ids)  # 32 tokens
        torch.testing.assert_close(m(ids[:1, :1]), grouped[:1, :1], rtol=0, atol=1e-5)  # 1 token
        torch.testing.assert_close(m(ids[:2, :1]), grouped[:2, :1], rtol=0, atol=1e-5)  # 2 rows of 1
        torch.testing.assert_close(m(ids[3:, :2]), grouped[3:, :2], rtol=0, atol=1e-5)  # 1 row of 2


def test_aux_loss_only_in_training_and_matches_its_definition():
    m = model(1)
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert m.trunk(ids).aux_loss is None

    m.train()
    router_out = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, args, out: router_out.append(out))
             for layer in m.model.layers if isinstance(layer.mlp, MoeBlock)]
    out = m.trunk(ids)
    for h in hooks:
        h.remove()
    assert out.aux_loss is not None and out.aux_loss.ndim == 0
    # Switch balance loss per MoE layer, summed: E * sum_e (share of routed slots) * (mean prob)
    e = CFG.num_experts
    want = sum(e * (torch.bincount(idx.flatten(), minlength=e).float() / idx.numel() * probs.mean(0)).sum()
               for idx, _, probs, _ in router_out)
    assert len(router_out) == len(CFG.moe_layers) == 2
    torch.testing.assert_close(out.aux_loss, want)
    out.aux_loss.backward()  # the balance loss trains the routers
    for i in CFG.moe_layers:
        assert m.model.layers[i].mlp.gate.weight.grad.abs().sum() > 0


def test_dense_only_model_has_no_routes():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, num_experts=0, num_experts_per_tok=1)
    m = MoeForCausalLM(cfg).train()
    out = m.trunk(torch.zeros(1, 4, dtype=torch.long))
    assert out.routes is None and out.aux_loss is None and out.replaced == 0


def test_from_depth_scales_with_depth():
    for depth in range(1, 13):
        cfg = ModelConfig.from_depth(depth, vocab_size=256)
        assert cfg.num_hidden_layers == depth and cfg.hidden_size == 64 * depth
        assert cfg.num_attention_heads * cfg.head_dim == cfg.hidden_size
        assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
        assert cfg.num_key_value_heads <= max(1, cfg.num_attention_heads // 2)
    assert ModelConfig.from_depth(4).num_key_value_heads == 2
    assert ModelConfig.from_depth(2, num_experts=4).num_experts == 4


def test_from_depth_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"depth must be >= 1 \(got 0\)"):
        ModelConfig.from_depth(0)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"):
        ModelConfig.from_depth(4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_experts_per_tok must be in 1..num_experts"):
        ModelConfig.from_depth(2, num_experts_per_tok=9)


def test_hf_config_round_trip():
    cfg = ModelConfig.from_depth(3, vocab_size=512, mlp_only_layers=[0], norm_topk_prob=False,
                                 tie_word_embeddings=True, rope_theta=500000.0, eos_token_id=2, pad_token_id=0)
    d = cfg.to_hf()
    assert d["architectures"] == ["Qwen3MoeForCausalLM"] and d["model_type"] == "qwen3_moe"
    assert d["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert ModelConfig.from_hf(json.loads(json.dumps(d))) == cfg

    from transformers import Qwen3MoeConfig  # what transformers makes of it, and back

    hf = Qwen3MoeConfig(**d)
    assert (hf.num_key_value_heads, hf.mlp_only_layers, hf.norm_topk_prob) == (1, [0], False)
    assert ModelConfig.from_hf(hf.to_dict()) == cfg


def test_from_hf_reads_published_variants_and_rejects_others():
    base = ModelConfig.from_depth(1, vocab_size=128).to_hf()
    old_style = {k: v for k, v in base.items() if k not in ("rope_parameters", "head_dim", "num_experts")}
    old_style.update(rope_theta=1e6, num_local_experts=8)  # v4 keys, no head_dim
    cfg = ModelConfig.from_hf(old_style)
    assert (cfg.rope_theta, cfg.num_experts, cfg.head_dim) == (1e6, 8, 64)
    with pytest.raises(ValueError, match="model_type .gpt2."):
        ModelConfig.from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
