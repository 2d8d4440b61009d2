"""The speedrun's stages beyond the sandbox demo. Grows as stages land: tokenizer -> corpus ->
pretrain -> sft -> bench of the trained model. Today: the tokenizer, and two held-out suites
(procedural toy tasks and bugs injected into real code, the built-in toolz) benched with the two
control policies, so every run shows the evaluation pipeline's numbers end to end."""
from __future__ import annotations

import os
import tempfile

TOY_TASKS = 6  # two per level
REAL_TASKS = 4  # mutants of toolz: real code, its own test suite
SUITES = ("toy-eval", "toolz-mutate")


def _make_suite(name: str, path: str, cfg):
    if name == "toy-eval":
        from kiln.tasks.toy import generate_toy
        return generate_toy(path, TOY_TASKS, seed=cfg.run.seed, split="eval", sandbox_cfg=cfg.sandbox)
    from kiln.tasks.builtin import materialize_toolz
    from kiln.tasks.mutate import generate_mutants
    with tempfile.TemporaryDirectory(prefix="kiln-toolz-") as work:
        repo = materialize_toolz(os.path.join(work, "repo"))
        return generate_mutants(repo, path, cfg.sandbox, max_tasks=REAL_TASKS, seed=cfg.run.seed, source="builtin:toolz")


TOKENIZER_MB = 8  # of the standard library: enough for a stable 8k vocabulary, seconds on 2 cores


def train_run_tokenizer(cfg, echo=print) -> str:
    """<run dir>/tokenizer, trained on the standard library unless a previous run left one."""
    import sysconfig
    from pathlib import Path

    from kiln.model.tokenizer import list_corpus_files, train_tokenizer

    out = Path(cfg.run.out_dir, cfg.run.name, "tokenizer")
    if (out / "tokenizer.json").exists():
        echo(f"tokenizer: reusing {out}")
        return str(out)
    files = list_corpus_files([Path(sysconfig.get_paths()["stdlib"])])
    r = train_tokenizer(files, out, cfg.model.vocab_size, max_bytes=TOKENIZER_MB * 1_000_000)
    echo(f"tokenizer: vocab {r.tokenizer.vocab_size} from {r.bytes_read / 1e6:.1f} MB of the standard "
         f"library in {r.seconds:.1f} s -> {out}")
    return str(out)


def eval_controls(cfg, echo=print) -> dict:
    from kiln.bench.run import run_bench

    run_dir = os.path.join(cfg.run.out_dir, cfg.run.name)
    out = {}
    for name in SUITES:
        suite = os.path.join(run_dir, f"suite-{name}")
        if not any(os.path.exists(os.path.join(suite, d, "task.toml")) for d in
                   (os.listdir(suite) if os.path.isdir(suite) else [])):
            echo(str(_make_suite(name, suite, cfg)))
        for policy in ("oracle", "noop"):
            bench_dir = os.path.join(run_dir, f"bench-{name}-{policy}")
            s = run_bench(suite, policy, passes=1, workers=2, out_dir=bench_dir, config=cfg)
            echo(f"{name} / {policy}: correctness {s['correctness_mean']:.3f} over {s['n_tasks']} tasks "
                 f"-> {os.path.join(bench_dir, 'report.md')}")
            out[(name, policy)] = s
    return out
