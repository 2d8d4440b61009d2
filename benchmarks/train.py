"""Training speed, one run, same weights and batches: tokens/s of kiln's pretraining step against
transformers' `Qwen3MoeForCausalLM` (the baseline: the same checkpoint loaded through
`AutoModelForCausalLM`, SDPA attention) on the tiny preset's model.

A step, for both, is what `kiln pretrain` does (kiln/pretrain/trainer.py): forward, next-token
cross-entropy + router_aux_loss_coef x the router balance loss, backward, global gradient-norm
clipping, AdamW (decay on matrices only; betas, weight decay, clip and each size's lr from the
preset's phases). kiln's trunk gets document ids and restarting positions as in the trainer; the
random tokens hold no <|endoftext|>, so that is one causal document, what transformers computes.
transformers computes its own balance loss (`output_router_logits=True`, averaged over layers where
kiln sums), so only the cross-entropies are compared: on the first step, before any update, they
must agree (same weights, same batch). kiln's step computes its fp32 products where kiln's trainer
does (kiln/model/gemm.py: oneDNN where it keeps fp32), transformers' with torch's defaults.

Sizes are the preset's phase shapes: 16 x 256 (bulk) and 4 x 1024 (extension). kiln and
transformers alternate repeat by repeat, so load from other processes falls on both alike; each
figure is the median over repeats of `--steps` timed steps, after `--warmup` untimed ones.

    .venv/bin/python benchmarks/train.py [--steps 5] [--repeats 3] [--device cpu]

About 5 minutes on 2 cores.

Last line: `name=value` pairs including tokens_per_s, hf_tokens_per_s, speedup_vs_hf (the first
size's) and the same per size (`_16x256`, `_4x1024`), loss_diff (first-step cross-entropy).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.config import ModelSection, PretrainConfig
from kiln.model import gemm
from kiln.model.checkpoint import save_checkpoint
from kiln.model.config import ModelConfig
from kiln.model.moe import MoeForCausalLM
from kiln.model.tokenizer import SPECIAL_TOKENS
from kiln.pretrain.data import doc_ids

EOT = 0  # kiln's fixed <|endoftext|> id


def adamw(model: torch.nn.Module, lr: float, p: PretrainConfig) -> torch.optim.AdamW:
    # The trainer's grouping: weight decay on matrices only.
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [q for q in params if q.ndim >= 2], "weight_decay": p.weight_decay},
                              {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0}],
                             lr=lr, betas=tuple(p.betas))


def kiln_loss(model: MoeForCausalLM, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch[:, :-1], batch[:, 1:]
    docs, pos = doc_ids(x, EOT)
    out = model.trunk(x, positions=pos, doc_ids=docs)
    ce = F.cross_entropy(model.head(out.hidden).flatten(0, 1).float(), y.flatten())
    return ce, ce + model.config.router_aux_loss_coef * out.aux_loss


def hf_loss(model, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch[:, :-1], batch[:, 1:]
    out = model(input_ids=x, output_router_logits=True, use_cache=False)
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())
    return ce, ce + model.config.router_aux_loss_coef * out.aux_loss


def step(model, opt, loss_fn, batch, clip: float, autocast) -> float:
    opt.zero_grad(set_to_none=True)
    with autocast:
        ce, total = loss_fn(model, batch)
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return float(ce.detach())


# kiln's trainer steps with its fp32 products where kiln/model/gemm.py sends them; transformers with torch's own.
kiln_step = gemm.routed()(step)


def timed_steps(step_fn, model, opt, loss_fn, batch, n: int, clip: float, autocast, device: str) -> float:
    """Seconds for n steps of step_fn."""
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step_fn(model, opt, loss_fn, batch, clip, autocast)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per size before timing")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast there, as the trainer)")
    args = ap.parse_args()
    import transformers  # the baseline only

    torch.manual_seed(0)
    dev, p = args.device, PretrainConfig()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev == "cuda" else contextlib.nullcontext()
    cfg = ModelConfig.from_section(ModelSection())
    kiln = MoeForCausalLM(cfg)
    ckpt = save_checkpoint(kiln, Path(tempfile.mkdtemp(prefix="kiln-train-")) / "ckpt")
    kiln = kiln.to(dev).train()
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa")
    hf = hf.to(dev).train()
    n_params = sum(q.numel() for q in kiln.parameters())
    print(f"model: tiny preset, {n_params / 1e6:.1f}M parameters, {cfg.num_hidden_layers} layers, "
          f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}; transformers {transformers.__version__} "
          f"({type(hf).__name__}, sdpa); torch {torch.__version__}, {torch.get_num_threads()} threads, {dev}",
          flush=True)

    r: dict = {}
    phases = {(ph.batch_size, ph.seq_len): ph.lr for ph in p.phases if ph.kind != "sft"}
    for i, ((b, t), lr) in enumerate(phases.items()):
        name = f"{b}x{t}"
        # +1: inputs and shifted labels; ids above the special tokens, so no <|endoftext|>
        batch = torch.randint(len(SPECIAL_TOKENS), cfg.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(i))
        batch = batch.to(dev)
        # Fresh optimizers from the same (current) weights: both models take the same first step.
        hf.load_state_dict(kiln.state_dict())
        k_opt, h_opt = adamw(kiln, lr, p), adamw(hf, lr, p)
        k_loss = kiln_step(kiln, k_opt, kiln_loss, batch, p.grad_clip, autocast)
        h_loss = step(hf, h_opt, hf_loss, batch, p.grad_clip, autocast)
        for _ in range(args.warmup - 1):
            kiln_step(kiln, k_opt, kiln_loss, batch, p.grad_clip, autocast)
            step(hf, h_opt, hf_loss, batch, p.grad_clip, autocast)
        k_times, h_times = [], []
        for _ in range(args.repeats):  # alternating: background load hits both
            k_times.append(timed_steps(kiln_step, kiln, k_opt, kiln_loss, batch, args.steps, p.grad_clip, autocast, dev))
            h_times.append(timed_steps(step, hf, h_opt, hf_loss, batch, args.steps, p.grad_clip, autocast, dev))
        tokens = args.steps * b * t
        k_tps, h_tps = tokens / statistics.median(k_times), tokens / statistics.median(h_times)
        r[f"tokens_per_s_{name}"], r[f"hf_tokens_per_s_{name}"] = k_tps, h_tps
        r[f"speedup_vs_hf_{name}"], r[f"loss_diff_{name}"] = k_tps / h_tps, abs(k_loss - h_loss)
        print(f"{name}: kiln {k_tps:.0f} tok/s, transformers {h_tps:.0f} tok/s, x{k_tps / h_tps:.2f}; first-step "
              f"cross-entropy kiln {k_loss:.6f}, transformers {h_loss:.6f} (|diff| {abs(k_loss - h_loss):.2e}); "
              f"step times kiln {[round(s / args.steps, 3) for s in k_times]} s, "
              f"transformers {[round(s / args.steps, 3) for s in h_times]} s", flush=True)
        if i == 0:
            r.update(tokens_per_s=k_tps, hf_tokens_per_s=h_tps, speedup_vs_hf=k_tps / h_tps, loss_diff=abs(k_loss - h_loss))
    r.update(steps=args.steps, repeats=args.repeats, threads=torch.get_num_threads(), device=dev, hf_attn="sdpa")
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
