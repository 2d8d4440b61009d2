"""Decoding speed, one run, same weights and prompts:

1. kiln's engine against transformers' `generate` (the baseline: the same checkpoint loaded as
   `Qwen3MoeForCausalLM`), greedy, tokens/s at batch 1 and batch 8 (kiln's native C step,
   engine/native.c: at batch 8 one call for all rows, each weight read once);
2. speculative decoding against kiln's own plain decoding at batch 1 (the 8 prompts one after
   another), greedy outputs identical?, mean accepted drafts per step, speedup, all over the same
   prompts: with prompt lookup (engine.lookup's drafts, copied from the sequence itself: what
   agents' engines decode with), and with a self-distilled MTP head, its drafts from the engine's
   default draft vocabulary (the MTP's most frequent training tokens) and from the whole one, and
   the same at the bf16 sampler (part 4's), against its own plain decoding;
3. acceptance of the self-distilled head against a head trained on hard next-token labels for the
   same number of steps from the same initialisation;
4. the bf16 sampler (engine.dtype = "bfloat16": bf16 weight matrices, fp32 activations) against
   the fp32 engine, tokens/s at batch 1 and 8, and how many greedy tokens equal the fp32 engine's.

The model is the tiny preset's shape (`--depth` to change), trained here for a few minutes on the
Python standard library so its distributions are code-like (an untrained model makes acceptance
meaningless). Prompts come from a package held out of training.

    .venv/bin/python benchmarks/decode.py [--depth 4] [--train-steps 300] [--mtp-steps 200]

About 12 minutes on 2 cores (training is most of it); the timed arms of each comparison run in
turn nine times, and each takes its median. Each kiln engine is built once per arm, outside the
timing, as the HF model is loaded once (with no prefix reuse, a call reuses nothing of the last). `--checkpoint DIR` decodes a trained checkpoint
instead (e.g. the committed base, bases/tiny: the tiny preset's shape, trained on code) with its
tokenizer, skipping the training and part 3, and part 2's MTP arms unless the checkpoint has an MTP
module (mtp.safetensors, e.g. a pretraining run's).

Last line: `name=value` pairs including speedup_vs_hf_b1, speedup_vs_hf_b8, greedy_identical,
spec_mean_accepted, spec_speedup, spec_full_vocab_speedup, spec_speedup_bf16, lookup_speedup, selfdistill_acceptance,
hardlabel_acceptance, bf16_speedup_b1, bf16_speedup_b8; `*_rounds` give the middle half of the nine
per-round ratios behind speedup_vs_hf_b1, speedup_vs_hf_b8, spec_speedup and lookup_speedup (each a ratio of medians).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from kiln.config import EngineConfig, ModelSection, project_path
from kiln.engine import Engine, SamplingParams
from kiln.engine.engine import DRAFT_SHARE
from kiln.engine.speculative import SpecStats
from kiln.model import gemm
from kiln.model.checkpoint import load_checkpoint, save_checkpoint
from kiln.model.config import ModelConfig
from kiln.model.moe import MoeForCausalLM
from kiln.model.mtp import MTP, mtp_loss
from kiln.model.tokenizer import (
    iter_corpus,
    list_corpus_files,
    load_tokenizer,
    train_tokenizer,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
HELD_OUT = "email"  # prompts come from this package; it is never trained on
SEQ, BATCH = 256, 8


def corpus_tokens(tok, max_bytes: int) -> torch.Tensor:
    files = [f for f in list_corpus_files([STDLIB]) if f.suffix == ".py" and f"/{HELD_OUT}/" not in str(f)]
    ids: list[int] = []
    for text in iter_corpus(files, max_bytes=max_bytes):
        ids += tok.encode(text) + [tok.endoftext_id]
    return torch.tensor(ids)


def batches(data: torch.Tensor, steps: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
        yield torch.stack([data[s:s + SEQ] for s in starts.tolist()]).to(device)


def set_lr(opt, i: int, steps: int, peak: float = 3e-3) -> None:
    """Step i (0-based) of `steps`: 30 steps of warmup, then a linear decay to a tenth. The MTP heads
    need the decay as much as the model: at a constant lr the drafter's end state is a noisy
    snapshot, and on greedy text (loops, where one wrong draft repeats every cycle) snapshots of
    equal distillation loss ranged from 0.50 to 1.65 drafts accepted a step (docs/architecture.md)."""
    for group in opt.param_groups:
        group["lr"] = peak * min(1.0, (i + 1) / 30) * (0.1 + 0.9 * (1 - i / steps))


@gemm.routed()  # as kiln's trainers step (kiln/model/gemm.py)
def train_model(model, data, steps: int, device: str) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, betas=(0.9, 0.95))
    model.train()
    loss = torch.tensor(0.0)
    for i, x in enumerate(batches(data, steps, seed=1, device=device)):
        set_lr(opt, i, steps)
        out = model.trunk(x[:, :-1])
        logits = model.head(out.hidden)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        (loss + model.config.router_aux_loss_coef * out.aux_loss).backward()
        opt.step()
    model.eval()
    return float(loss.detach())


@gemm.routed()
def train_mtp(model, mtp, data, steps: int, mode: str, device: str) -> float:
    opt = torch.optim.AdamW(mtp.parameters(), lr=3e-3, weight_decay=0.0, betas=(0.9, 0.95))
    mtp.train()
    loss = torch.tensor(0.0)
    for i, x in enumerate(batches(data, steps, seed=2, device=device)):
        set_lr(opt, i, steps)
        with torch.no_grad():
            hidden = model.trunk(x).hidden
            logits = model.head(hidden)
        loss, _ = mtp_loss(logits, mtp(model, hidden, x), x, mode=mode)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    mtp.eval()
    return float(loss.detach())


def timed(*fns, repeats: int = 9) -> list[tuple[float, object, list[float]]]:
    """(median seconds, last output, every round's seconds) of each fn, run in turn `repeats` times:
    interleaved, so a drift in the machine's speed (a VM's swings by a fifth, on a DRAM-bound one
    by 2x, between minutes) hits every arm alike."""
    times, outs = [[] for _ in fns], [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            outs[i] = fn()
            times[i].append(time.perf_counter() - t)
    return [(statistics.median(ts), out, ts) for ts, out in zip(times, outs)]


def spread(base: list[float], new: list[float]) -> str:
    """The middle half of the per-round speedups base / new (a round runs the arms back to back, so
    each ratio is over one state of the machine): how far one run's ratio of medians can be trusted."""
    q = statistics.quantiles([b / n for b, n in zip(base, new)], n=4)
    return f"{q[0]:.2f}-{q[2]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depth", type=int, default=ModelSection().depth)
    ap.add_argument("--vocab", type=int, default=ModelSection().vocab_size)
    ap.add_argument("--train-steps", type=int, default=300, help="main model steps of 8 x 256 tokens")
    ap.add_argument("--mtp-steps", type=int, default=200, help="steps for each MTP head")
    # The preset's drafter depth (model.mtp_depth, 1): on the Zen 5 a depth-2 drafter's first layer
    # alone gave 1.20-1.25x plain where both layers gave 1.04-1.11x (docs: Speculative decoding).
    ap.add_argument("--mtp-depth", type=int, default=ModelSection().mtp_depth or 1)
    ap.add_argument("--tokens", type=int, default=128, help="generated tokens per sequence")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (both engines run there)")
    ap.add_argument("--checkpoint", default=None, help="a trained checkpoint to decode instead of training one")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = args.device
    if args.checkpoint:
        ckpt = project_path(args.checkpoint)
        model, mtp = load_checkpoint(ckpt, device=dev)
        decode(args, load_tokenizer(ckpt), model.eval(), mtp, None, ckpt)
        return
    tmp = Path(tempfile.mkdtemp(prefix="kiln-decode-"))

    t0 = time.time()
    tok = train_tokenizer(list_corpus_files([STDLIB]), tmp / "tok", vocab_size=args.vocab, max_bytes=8_000_000).tokenizer
    data = corpus_tokens(tok, max_bytes=6_000_000)
    cfg = ModelConfig.from_depth(args.depth, vocab_size=tok.vocab_size)
    model = MoeForCausalLM(cfg).to(dev)
    lm_loss = train_model(model, data, args.train_steps, dev)
    mtp_sd = MTP(cfg, args.mtp_depth).to(dev)
    mtp_hl = copy.deepcopy(mtp_sd)  # same initialisation, same data order
    sd_loss = train_mtp(model, mtp_sd, data, args.mtp_steps, "distill", dev)
    hl_loss = train_mtp(model, mtp_hl, data, args.mtp_steps, "hard", dev)
    print(f"setup: {len(data)} training tokens, lm loss {lm_loss:.3f}, mtp distill KL {sd_loss:.3f}, "
          f"hard CE {hl_loss:.3f}, {time.time() - t0:.0f} s", flush=True)
    save_checkpoint(model, tmp / "ckpt")
    decode(args, tok, model, mtp_sd, mtp_hl, tmp / "ckpt")


def decode(args, tok, model, mtp_sd, mtp_hl, ckpt: Path) -> None:
    """The timed comparisons (parts 2 and 3 with the MTP heads) and the last line."""
    dev = args.device
    held = [f for f in list_corpus_files([STDLIB / HELD_OUT]) if f.suffix == ".py"]
    prompts = [tok.encode(f.read_text())[:32] for f in held[:BATCH]]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, stop_token_ids=())
    n = args.tokens

    import transformers  # the baseline only

    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(dev).eval()

    def hf_generate(ps):
        with torch.inference_mode():
            return hf.generate(torch.tensor(ps, device=dev), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=tok.pad_id)[:, len(ps[0]):].tolist()

    engines = {}  # built once per arm, outside the timing, as the HF model is loaded once

    def kiln_generate(ps, mtp=None, batch=None, weights=model, dtype=torch.float32, draft_vocab=None, lookup=0):
        key = (id(mtp), batch or len(ps), id(weights), dtype, draft_vocab, lookup)
        if key not in engines:
            engines[key] = Engine(weights, mtp=mtp, max_batch=key[1], max_len=64 + n + 8, weight_dtype=dtype,
                                  draft_vocab=draft_vocab, lookup=lookup)
        engine = engines[key]
        engine.spec_stats = SpecStats(engine.spec_stats.depth)  # this call's drafts only
        outs = engine.generate(ps, greedy)
        return [o.token_ids for o in outs], engine.spec_stats

    r = {}
    for b in (1, 8):
        ps = prompts[:b]
        hf_generate(ps), kiln_generate(ps)  # warm up
        (hf_s, hf_out, hf_ts), (k_s, (k_out, _), k_ts) = timed(lambda ps=ps: hf_generate(ps),
                                                               lambda ps=ps: kiln_generate(ps))
        r[f"hf_tokens_per_s_b{b}"] = b * n / hf_s
        r[f"kiln_tokens_per_s_b{b}"] = b * n / k_s
        r[f"speedup_vs_hf_b{b}"] = hf_s / k_s
        r[f"speedup_vs_hf_b{b}_rounds"] = spread(hf_ts, k_ts)
        r[f"hf_greedy_match_b{b}"] = hf_out == k_out
        print(f"batch {b}: hf {b * n / hf_s:.0f} tok/s, kiln {b * n / k_s:.0f} tok/s, "
              f"x{hf_s / k_s:.2f} (middle half of the rounds {r[f'speedup_vs_hf_b{b}_rounds']}), same tokens as hf: {hf_out == k_out}",
              flush=True)

    rounded = copy.deepcopy(model)  # a bf16 engine rounds its model's weights in place
    for b in (1, 8):
        ps = prompts[:b]
        kiln_generate(ps, weights=rounded, dtype=torch.bfloat16)  # warm up
        (f_s, (f_out, _), _), (b_s, (b_out, _), _) = timed(
            lambda ps=ps: kiln_generate(ps), lambda ps=ps: kiln_generate(ps, weights=rounded, dtype=torch.bfloat16))
        same = sum(len(_common_prefix(x, y)) for x, y in zip(f_out, b_out)) / (b * n)
        r[f"kiln_bf16_tokens_per_s_b{b}"] = b * n / b_s
        r[f"bf16_speedup_b{b}"] = f_s / b_s
        r[f"bf16_greedy_prefix_b{b}"] = same
        print(f"batch {b}: kiln fp32 {b * n / f_s:.0f} tok/s, bf16 {b * n / b_s:.0f} tok/s, x{f_s / b_s:.2f}; "
              f"greedy tokens before the first that differs from fp32's: {same:.1%}", flush=True)

    # Prompt lookup (engine.lookup: the drafter of kiln rl's workers and the bench's local policy), batch 1
    # as part 2: drafts copied from each sequence's own text, verified as the MTP's are; nothing runs to draft.
    most = EngineConfig().lookup  # drafts a step
    kiln_generate(prompts[:1], batch=1, lookup=most)  # warm up
    (lp_s, (lp_out, _), lp_ts), (lk_s, (lk_out, lk_stats), lk_ts) = timed(
        lambda: kiln_generate(prompts, batch=1), lambda: kiln_generate(prompts, batch=1, lookup=most))
    r["lookup_greedy_identical"] = lp_out == lk_out
    r["lookup_mean_accepted"] = lk_stats.mean_accepted
    r["lookup_speedup"] = lp_s / lk_s
    r["lookup_speedup_rounds"] = spread(lp_ts, lk_ts)
    print(f"prompt lookup, batch 1 ({len(prompts)} prompts in turn, up to {most} drafts): x{lp_s / lk_s:.2f} plain "
          f"({lk_stats.mean_accepted:.2f} accepted a step; middle half of the rounds {r['lookup_speedup_rounds']}), "
          f"same tokens: {lp_out == lk_out}", flush=True)

    r.update(depth=model.config.num_hidden_layers, threads=torch.get_num_threads(), tokens=n, device=dev)
    if mtp_sd is None:
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
        return
    # Batch 1: the prompts one after another, so the speed and the acceptance are over the same text.
    kiln_generate(prompts[:1], batch=1), kiln_generate(prompts[:1], mtp_sd, batch=1)  # warm up
    kiln_generate(prompts[:1], mtp_sd, batch=1, draft_vocab=0)
    (plain_s, (all_plain, _), plain_ts), (spec_s, (all_spec, sd_stats), spec_ts), (full_s, (all_full, full_stats), _) = timed(
        lambda: kiln_generate(prompts, batch=1), lambda: kiln_generate(prompts, mtp_sd, batch=1),
        lambda: kiln_generate(prompts, mtp_sd, batch=1, draft_vocab=0))
    _, hl_stats = kiln_generate(prompts, mtp_hl, batch=1, draft_vocab=0) if mtp_hl is not None else (None, None)
    r["greedy_identical"] = all_plain == all_spec == all_full
    drafts = mtp_sd.draft_ids(model.config.vocab_size // DRAFT_SHARE)  # the engine's default
    r["spec_draft_vocab"] = len(drafts) if drafts is not None else model.config.vocab_size
    r["spec_mean_accepted"] = sd_stats.mean_accepted
    r["spec_tokens_per_step"] = 1 + sd_stats.mean_accepted
    r["spec_speedup"] = plain_s / spec_s
    r["spec_speedup_rounds"] = spread(plain_ts, spec_ts)
    r["spec_full_vocab_mean_accepted"] = full_stats.mean_accepted
    r["spec_full_vocab_speedup"] = plain_s / full_s
    print(f"speculative, batch 1 ({len(prompts)} prompts in turn): drafts from {r['spec_draft_vocab']} tokens x{plain_s / spec_s:.2f} "
          f"({sd_stats.mean_accepted:.2f} accepted a step; middle half of the rounds {r['spec_speedup_rounds']}); "
          f"from the whole vocabulary x{plain_s / full_s:.2f} "
          f"({full_stats.mean_accepted:.2f})", flush=True)
    # The same at the bf16 sampler: a verification reads half the bytes (the tiny model's fp32
    # weights, ~35 MB, exceed a 32 MB L3; its bf16 ones fit).
    mtp_bf16, bf16 = copy.deepcopy(mtp_sd), torch.bfloat16  # a bf16 engine rounds its MTP in place too
    kiln_generate(prompts[:1], mtp_bf16, batch=1, weights=rounded, dtype=bf16)  # warm up
    (pb_s, (all_pb, _), _), (sb_s, (all_sb, sb_stats), _) = timed(
        lambda: kiln_generate(prompts, batch=1, weights=rounded, dtype=bf16),
        lambda: kiln_generate(prompts, mtp_bf16, batch=1, weights=rounded, dtype=bf16))
    r["greedy_identical_bf16"] = all_pb == all_sb
    r["spec_mean_accepted_bf16"] = sb_stats.mean_accepted
    r["spec_speedup_bf16"] = pb_s / sb_s
    print(f"speculative at the bf16 sampler, batch 1: x{pb_s / sb_s:.2f} its plain decoding "
          f"({sb_stats.mean_accepted:.2f} accepted a step), same tokens: {all_pb == all_sb}", flush=True)
    r["selfdistill_acceptance"] = sd_stats.acceptance[0]
    r["selfdistill_mean_accepted"] = sd_stats.mean_accepted
    print("acceptance per draft position: self-distilled " + " ".join(f"{a:.3f}" for a in sd_stats.acceptance))
    if hl_stats is not None:
        r["hardlabel_acceptance"], r["hardlabel_mean_accepted"] = hl_stats.acceptance[0], hl_stats.mean_accepted
        print("acceptance per draft position: hard labels " + " ".join(f"{a:.3f}" for a in hl_stats.acceptance))
    r.update(mtp_depth=mtp_sd.depth)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


def _common_prefix(a: list, b: list) -> list:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


if __name__ == "__main__":
    main()
