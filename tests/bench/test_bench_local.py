"""run_bench with the local policy: a kiln checkpoint loaded once, two rollouts decoding on one
shared engine, token data in every trajectory; a missing checkpoint fails before anything runs."""
from __future__ import annotations

import json
import os

import pytest

from kiln.bench import BenchError, run_bench
from kiln.bench.results import read_rows
from kiln.config import Config, HarnessConfig, PolicyConfig
from kiln.tasks.toy import generate_toy


@pytest.fixture(scope="module")
def suite(tmp_path_factory, tcfg):
    out = str(tmp_path_factory.mktemp("lsuite"))
    assert generate_toy(out, 2, level=1, sandbox_cfg=tcfg, progress=False).kept == 2
    return out


def local_config(tcfg, checkpoint) -> Config:
    # Two tools keep the system prompt short; an untrained model's replies are cut at 16 tokens.
    return Config(sandbox=tcfg.model_copy(update={"timeout_s": 30, "idle_timeout_s": 20}),
                  harness=HarnessConfig(tools=["read_file", "run_shell"], max_turns=3, max_turn_tokens=16),
                  policy=PolicyConfig(kind="local", checkpoint=str(checkpoint), temperature=1.0))


def test_two_rollouts_share_one_engine_and_keep_token_data(suite, tcfg, tiny_checkpoint, tmp_path):
    out = str(tmp_path / "bench")
    s = run_bench(suite, "local", passes=1, workers=2, out_dir=out, config=local_config(tcfg, tiny_checkpoint),
                  progress=False)
    rows = read_rows(os.path.join(out, "results.jsonl"))
    assert sorted(r["task_id"] for r in rows) == sorted(os.listdir(suite)) and s["errors"] == 0
    assert {r["policy"] for r in rows} == {"local"}
    assert s["engine"]["max_batch"] == s["engine"]["peak_batch"] == 2  # both rollouts decoded in one batch
    for r in rows:
        with open(os.path.join(out, r["trajectory"])) as f:
            traj = json.load(f)
        turns = [t for seg in traj["segments"] for t in seg["turns"]]
        assert turns and traj["metadata"]["bench"]["policy"] == "local"
        for t in turns:
            assert t["prompt_ids"] and 0 < len(t["completion_ids"]) <= 16
            assert len(t["logprobs"]) == len(t["completion_ids"])
            assert all(lp <= 0 for lp in t["logprobs"])
    with open(os.path.join(out, "bench.json")) as f:  # a resumed run must use the same checkpoint
        assert json.load(f)["checkpoint"] == os.path.abspath(tiny_checkpoint)


def test_engine_lookup_drafts_in_the_local_policy(suite, tcfg, tiny_checkpoint, tmp_path):
    cfg = local_config(tcfg, tiny_checkpoint)  # engine.lookup: 4 by default
    cfg.policy.temperature = 0.0  # an untrained model's greedy replies repeat themselves: drafts to copy
    s = run_bench(suite, "local", passes=1, workers=2, out_dir=str(tmp_path / "bench"), config=cfg, progress=False)
    assert s["errors"] == 0
    drafts = s["engine"]["drafts"]  # the turns' tokens came through prompt-lookup verification steps
    assert drafts["steps"] > 0


def test_the_mtp_drafter_drafts_instead_of_lookup_and_the_kv_cache_takes_its_dtype(tiny_checkpoint):
    import torch

    from kiln.bench.run import start_engine

    for speculative, lookup, kv in ((True, 0, "bfloat16"), (False, 4, "float32")):
        runner = start_engine(str(tiny_checkpoint), 2, speculative=speculative, lookup=4, kv_dtype=kv)
        try:
            assert (runner.engine.mtp is not None) == speculative and runner.engine.lookup == lookup
            caches = [runner.engine.cache] + ([runner.engine.mtp_cache] if speculative else [])
            assert {c.k.dtype for c in caches} == {getattr(torch, kv)}
        finally:
            runner.close()


def test_a_missing_checkpoint_is_a_clear_error(suite, tcfg, tmp_path):
    with pytest.raises(BenchError, match=r"policy.checkpoint .*nowhere.*: no such checkpoint directory"):
        run_bench(suite, "local", out_dir=str(tmp_path / "b1"), config=local_config(tcfg, tmp_path / "nowhere"),
                  progress=False)
    with pytest.raises(BenchError, match=r"set policy.checkpoint=PATH \(or pass --checkpoint PATH"):
        run_bench(suite, "local", out_dir=str(tmp_path / "b2"), config=local_config(tcfg, ""), progress=False)
    assert not os.path.exists(tmp_path / "b1")  # refused before writing anything


def test_the_engine_context_is_model_context_when_the_model_allows_more(tiny_checkpoint, tmp_path):
    # A real model's own context (SmolLM2's 8,192, Gemma 3's 32,768) sized every KV slot: 4.5 GB for
    # the real-base bench's 12 slots. model.context caps it, as it does for RL's workers.
    from kiln.bench.run import start_engine
    from kiln.model.tokenizer import load_tokenizer
    from tests.tiny_model import dense_checkpoint

    llama = dense_checkpoint(tmp_path / "llama", "llama", load_tokenizer(tiny_checkpoint).vocab_size, tiny_checkpoint)
    for context, positions in ((64, 64), (4096, 512), (None, 512)):  # the tiny Llama has 512 positions
        runner = start_engine(str(llama), 2, max_len=context)
        try:
            assert runner.engine.max_len == positions and runner.engine.cache.k.shape[3] == positions
            assert runner.engine.prefix.kv.k.shape[3] == positions
        finally:
            runner.close()
