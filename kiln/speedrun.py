"""`kiln speedrun`: every stage end to end on one config, into one run directory with report.md.

tokenizer -> corpus -> pretrain (bulk + extension, MTP cut in mid-bulk) -> SFT data (the oracle on
toy train-split tasks) -> SFT -> bench of the SFT model on held-out toy tasks, beside the oracle
and noop controls on the same suite -> RL of the SFT model (`kiln rl`) -> the same bench of the
RL model. Each stage resumes or skips what a previous run finished, so
an interrupted speedrun continues where it stopped; stage wall times go into the report.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

TOKENIZER_MB = 8  # of the standard library: enough for a stable 8k vocabulary, seconds on 2 cores
CONTROLS = ("oracle", "noop")  # the ceiling and the floor of every suite


def train_run_tokenizer(cfg, echo=print) -> str:
    """<run dir>/tokenizer: the base's when pretraining continues one (pretrain.init), else trained
    on the standard library, unless a previous run left one."""
    import sysconfig

    from kiln.config import project_path
    from kiln.model.checkpoint import copy_tokenizer
    from kiln.model.tokenizer import list_corpus_files, train_tokenizer

    out = Path(cfg.run.out_dir, cfg.run.name, "tokenizer")
    if (out / "tokenizer.json").exists():
        echo(f"tokenizer: reusing {out}")
        return str(out)
    if cfg.pretrain.init:
        base = project_path(cfg.pretrain.init)
        if not (base / "tokenizer.json").is_file():
            raise FileNotFoundError(f"pretrain.init {cfg.pretrain.init!r}: no tokenizer.json in {base} (a kiln "
                                    "checkpoint folder holds one)")
        copy_tokenizer(base, out)
        echo(f"tokenizer: the base's ({base}) -> {out}")
        return str(out)
    files = list_corpus_files([Path(sysconfig.get_paths()["stdlib"])])
    r = train_tokenizer(files, out, cfg.model.vocab_size, max_bytes=TOKENIZER_MB * 1_000_000)
    echo(f"tokenizer: vocab {r.tokenizer.vocab_size} from {r.bytes_read / 1e6:.1f} MB of the standard "
         f"library in {r.seconds:.1f} s -> {out}")
    return str(out)


def build_run_corpus(cfg, tokenizer_dir: str, echo=print) -> dict:
    """The corpus (corpus.out_dir, else <run dir>/corpus) unless a finished build is there."""
    from kiln.model.tokenizer import load_tokenizer
    from kiln.pretrain.corpus import build_corpus, corpus_dir

    out = corpus_dir(cfg)
    if (out / "meta.json").exists():
        echo(f"corpus: reusing {out}")
        return json.loads((out / "meta.json").read_text())
    return build_corpus(cfg.corpus, load_tokenizer(Path(tokenizer_dir)), out, cfg.run.seed,
                        tokenizer_path=tokenizer_dir)


def eval_suite(cfg, path: str, echo=print) -> str:
    """The held-out suite: speedrun.eval_tasks toy tasks of the eval split (disjoint from SFT's)."""
    from kiln.tasks.record import load_suite
    from kiln.tasks.toy import generate_toy

    s = cfg.speedrun
    if not (os.path.isdir(path) and len(load_suite(path)) >= s.eval_tasks):
        y = generate_toy(path, s.eval_tasks, seed=cfg.run.seed, level=s.eval_level or None, split="eval",
                         sandbox_cfg=cfg.sandbox)
        echo(str(y))
    return path


def bench_one(cfg, suite: str, label: str, policy: str, run_dir: Path, checkpoint: str = "", echo=print,
              passes: int | None = None) -> dict:
    """One policy on `suite` into <run dir>/bench-<label> (speedrun.passes passes unless given); its summary."""
    from kiln.bench.run import run_bench

    local = cfg.model_copy(deep=True)
    local.policy.checkpoint = checkpoint
    bench_dir = run_dir / f"bench-{label}"
    s = run_bench(suite, policy, passes=passes or cfg.speedrun.passes, workers=cfg.bench.workers,
                  out_dir=str(bench_dir), config=local)
    rate = s["tool_call_parse_rate"]
    echo(f"bench {label}: correctness {s['correctness_mean']:.3f} over {s['n_rollouts']} rollouts, tool calls "
         f"parsed {'-' if rate is None else f'{rate:.1%}'} -> {bench_dir / 'report.md'}")
    return s


def bench_all(cfg, suite: str, checkpoint: str, run_dir: Path, echo=print) -> dict:
    """The SFT model (policy local) and the controls on `suite` (one pass each: they are
    deterministic in outcome); {label: summary}."""
    return {p: bench_one(cfg, suite, p, p, run_dir, checkpoint if p == "local" else "", echo,
                         passes=None if p == "local" else 1)
            for p in ("local", *CONTROLS)}


def _probes(path: Path, checkpoints: dict[str, str], probe, describe, echo) -> dict:
    """{label: probe(checkpoint)}, kept in `path` so a resumed speedrun does not redo them."""
    done = json.loads(path.read_text()) if path.exists() else {}
    for label, ckpt in checkpoints.items():
        if label not in done:
            done[label] = probe(ckpt)
            echo(f"{path.stem.replace('_', ' ')} {label}: {describe(done[label])}")
            path.write_text(json.dumps(done, indent=1) + "\n")
    return done


def copy_probes(run_dir: Path, corpus: str, checkpoints: dict[str, str], echo=print) -> dict:
    """The copy probe (kiln/pretrain/copying.py) of each model, code spans from the corpus's
    held-out text, in <run dir>/copy_probe.json."""
    from kiln.pretrain.copying import probe_checkpoint

    heldout = (Path(corpus) / "heldout.txt").read_text(encoding="utf-8")
    return _probes(run_dir / "copy_probe.json", checkpoints, lambda c: probe_checkpoint(c, heldout),
                   lambda r: (f"second copy {r['random']['second']:.2f} nats on random spans (first "
                              f"{r['random']['first']:.2f}), {r['code']['second']:.2f} on held-out code (first "
                              f"{r['code']['first']:.2f})"), echo)


def edit_probes(run_dir: Path, checkpoints: dict[str, str], echo=print) -> dict:
    """The edit probe (kiln/pretrain/edit_probe.py) of each model on the oracle control's rollouts
    of the held-out suite (bench-oracle), in <run dir>/edit_probe.json."""
    from kiln.pretrain.edit_probe import probe_edits_checkpoint

    oracle = str(run_dir / "bench-oracle")
    return _probes(run_dir / "edit_probe.json", checkpoints, lambda c: probe_edits_checkpoint(c, [oracle]),
                   lambda r: (f"old text {r['old_text']:.1%}, new text {r['new_text']:.1%}, first change "
                              f"{r['change']:.1%} top-1 over {r['n']} edits"), echo)


def speedrun(cfg, echo=print) -> Path:
    """Run (or resume) every stage; returns the path of report.md."""
    from kiln.pretrain.corpus import corpus_dir
    from kiln.pretrain.sft import sft
    from kiln.pretrain.sft_data import collect_oracle_trajectories
    from kiln.pretrain.trainer import pretrain
    from kiln.rl.launcher import run_rl
    from kiln.speedrun_report import write_report

    run_dir = Path(cfg.run.out_dir, cfg.run.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Seconds per stage, summed over every invocation that worked on this run dir: a resumed
    # stage's cost is what all its pieces took, and a reused one adds only the check.
    times_path = run_dir / "stage_seconds.json"
    times: dict[str, float] = json.loads(times_path.read_text()) if times_path.exists() else {}

    def stage(name: str, fn):
        echo(f"== {name}")
        t = time.monotonic()
        try:
            return fn()
        finally:
            times[name] = times.get(name, 0.0) + time.monotonic() - t
            times_path.write_text(json.dumps(times, indent=1) + "\n")

    tokenizer = stage("tokenizer", lambda: train_run_tokenizer(cfg, echo))
    corpus = stage("corpus", lambda: build_run_corpus(cfg, tokenizer, echo))
    pre = stage("pretrain", lambda: pretrain(cfg, corpus_dir(cfg), tokenizer, run_dir / "pretrain"))
    trajs = stage("sft data", lambda: collect_oracle_trajectories(
        cfg, run_dir / "sft-data", cfg.sft.oracle_tasks, cfg.sft.oracle_seed, level=cfg.sft.oracle_level or None))
    tuned = stage("sft", lambda: sft(cfg, pre["checkpoint"], [str(p) for p in trajs], run_dir / "sft"))
    suite = stage("eval suite", lambda: eval_suite(cfg, str(run_dir / "suite-eval"), echo))
    benches = stage("bench", lambda: bench_all(cfg, suite, tuned["checkpoint"], run_dir, echo))
    rl = stage("rl", lambda: run_rl(cfg, tuned["checkpoint"], str(run_dir / "rl")))
    benches["rl"] = stage("bench rl", lambda: bench_one(cfg, suite, "rl", "local", run_dir, rl["checkpoint"], echo))
    probes = stage("copy probes", lambda: copy_probes(run_dir, str(corpus_dir(cfg)), {
        "pretrained": pre["checkpoint"], "sft": tuned["checkpoint"], "rl": rl["checkpoint"]}, echo))
    edits = stage("edit probes", lambda: edit_probes(run_dir, {"sft": tuned["checkpoint"], "rl": rl["checkpoint"]}, echo))
    report = write_report(run_dir, cfg, corpus, pre, len(trajs), tuned, benches, times, rl, probes, edits)
    echo(f"speedrun: {sum(times.values()) / 60:.1f} min of stages -> {report}")
    return report
