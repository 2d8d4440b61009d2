"""The causal language model every family shares: HF's `model.` prefix (embeddings, decoder
layers, final norm) and `lm_head`, with one `trunk` / `head` interface, so the engine, the
trainers and checkpoint I/O never branch on the family.

A family (moe.py, qwen3.py, llama.py, gemma3.py) subclasses `CausalLM` and says how to build a
decoder layer, which norm it uses, and whether embeddings are scaled.
"""
from __future__ import annotations

import torch
from torch import nn

from kiln.model.layers import (
    RMSNorm,
    TrunkOutput,
    attention_mask,
    init_weights,
    inv_frequencies,
    rope_tables,
)

DEFAULT_REPLAY_RATIO = 0.5


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, cfg, layers: list[nn.Module], norm: nn.Module):
        super().__init__()
        # Built on the meta device (load_checkpoint: the checkpoint supplies the values), its own init
        # is skipped (_weight): normal_ there imports torch._dynamo, ~0.9 s of every start-up.
        meta = torch.empty(0).is_meta
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size) if meta else None)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.config = cfg
        self._inv_freq: dict = {}  # not buffers: they must stay fp32 under .to(bf16)

    def inv_freq(self, device: torch.device, local: bool = False) -> torch.Tensor:
        """RoPE inverse frequencies: the global ones, or (local=True) sliding-window layers' own
        base where the family has one (Gemma 3)."""
        key = (device, local)
        if key not in self._inv_freq:
            cfg = self.config
            inv = (inv_frequencies(cfg.head_dim, cfg.rope_local_base_freq) if local
                   else inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
            self._inv_freq[key] = inv.to(device)
        return self._inv_freq[key]


class CausalLM(nn.Module):
    norm_class: type[nn.Module] = RMSNorm
    local_rope = False  # sliding-window layers use rope_local_base_freq (Gemma 3)

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        layers = [self.make_layer(cfg, i, cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)]
        self.model = Backbone(cfg, layers, self.norm_class(cfg.hidden_size, cfg.rms_norm_eps))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        init_weights(self, cfg.initializer_range)

    @staticmethod
    def make_layer(cfg, index: int, moe: bool) -> nn.Module:
        """Decoder layer `index`; its forward is (x, rope, mask, cache, replay, ratio) ->
        (x, expert ids or None, aux loss or None, replaced)."""
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def trunk(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache=None,
              routes: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
              replay_ratio: float = DEFAULT_REPLAY_RATIO, shared_prefix: bool = False,
              at: torch.Tensor | None = None) -> TrunkOutput:
        """input_ids [B, T]; positions [B, T] (default 0..T-1; required with a cache); routes
        [B, T, n_moe_layers, k] to replay (MoE families only); doc_ids [B, T] keep packed
        documents from attending to each other (pass positions that restart per document).
        shared_prefix: each row's first document is a prompt its later documents all continue
        (layers.Documents; their positions continue the prompt's). at ([B, T] bool, no cache):
        the hidden states at those positions only, [M, D] in row-major order, and routes None:
        the last layer runs its queries and MLP there alone (a training forward whose loss reads
        a fraction of the positions: SFT's and RL's targets)."""
        b, t = input_ids.shape
        if routes is not None and not self.config.moe_layers:
            raise ValueError(f"router replay is for mixture-of-experts models only; this "
                             f"{self.config.model_type!r} model has no routed layers (pass routes=None)")
        if positions is None:
            if cache is not None:
                raise ValueError("positions are required when decoding with a cache")
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        x = self.embed(input_ids)
        ropes, masks = {}, {}
        used, aux, replaced, m = [], None, 0, 0
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            window = layer.self_attn.window
            local = self.local_rope and window is not None
            if local not in ropes:
                ropes[local] = rope_tables(self.model.inv_freq(x.device, local), positions, x.dtype)
            if cache is None and window not in masks:
                masks[window] = attention_mask(t, doc_ids, window, x.device, shared_prefix)
            replay = None
            if routes is not None and getattr(layer.mlp, "routed", False):
                replay = routes[:, :, m]
            if at is not None and i == last:
                x, idx, a, r = _layer_at(layer, x, ropes[local], masks.get(window), at, replay, replay_ratio)
            else:
                x, idx, a, r = layer(x, ropes[local], masks.get(window), cache, replay, replay_ratio)
            if idx is not None:
                used.append(idx)
                m += 1
                replaced += r
                aux = a if aux is None else (aux if a is None else aux + a)
        return TrunkOutput(x, torch.stack(used, dim=2) if used and at is None else None, aux, replaced)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model.norm(hidden))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, input_ids: torch.Tensor, **kw) -> torch.Tensor:
        return self.head(self.trunk(input_ids, **kw).hidden)

    def set_rope_theta(self, theta: float) -> None:
        """Long-context extension: a larger RoPE base, as continued pretraining's second phase."""
        self.config.rope_theta = theta
        self.model._inv_freq = {}


def _layer_at(layer, x, rope, mask, at, replay, ratio):
    """A decoder layer's forward at the positions `at` only (trunk(at=)): queries and MLP there
    alone where the layer has full attention and forward_at, else the whole layer, then selected."""
    if hasattr(layer, "forward_at") and layer.self_attn.window is None:
        return layer.forward_at(x, rope, mask, at, replay, ratio)
    x, idx, a, r = layer(x, rope, mask, None, replay, ratio)
    return x[at], None if idx is None else idx[at], a, r
