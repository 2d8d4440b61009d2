"""The config tree: presets, overrides with TOML typing, errors that name the key."""

from typing import Literal

import pytest

from kiln.config import CONFIGS_DIR, Config, ConfigError, Section, load_config
from kiln.config_io import config_to_toml, validate_config


def test_presets_load():
    tiny, small = load_config("tiny"), load_config("small")
    assert tiny.run.name == "tiny" and small.run.name == "small"
    assert small.sandbox.memory_mb == 4096 and small.sandbox.pool_size == 4


def test_every_preset_validates():
    presets = sorted(p.stem for p in CONFIGS_DIR.glob("*.toml"))
    assert {"tiny", "small", "base", "bench", "real-base"} <= set(presets)
    for name in presets:
        assert load_config(name).run.name == name


def test_real_base_preset_fits_a_real_model_on_a_cpu():
    cfg = load_config("real-base")
    assert cfg.model.mtp_depth == 0 and cfg.pretrain.init == ""  # --init names the imported model
    assert [p.kind for p in cfg.pretrain.phases] == ["bulk", "sft"]
    assert cfg.harness.max_turns >= 6 and cfg.harness.max_tokens < Config().harness.max_tokens
    assert (cfg.sft.oracle_level, cfg.bench.passes) == (1, 1)


def test_defaults_are_the_tiny_preset():
    assert load_config() == load_config("tiny") == Config()


def test_file_path_loads(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('[run]\nname = "mine"\nseed = 7\n')
    cfg = load_config(f)
    assert (cfg.run.name, cfg.run.seed) == ("mine", 7)


def test_missing_preset_lists_presets():
    with pytest.raises(ConfigError, match=r"no config file or preset named 'nope'.*small, tiny"):
        load_config("nope")


def test_overrides_apply_with_toml_typing():
    cfg = load_config("tiny", [
        "sandbox.memory_mb=512",
        "sandbox.timeout_s=2.5",
        'sandbox.env_allow=["LANG"]',
        "sandbox.env.PYTHONHASHSEED=0",  # a str-valued dict entry keeps the text
        'run.out_dir="/tmp/out"',
        "run.name=2024",  # a str field keeps the text as typed
        "run.seed=3",
    ])
    assert cfg.sandbox.memory_mb == 512 and cfg.sandbox.timeout_s == 2.5
    assert cfg.sandbox.env_allow == ["LANG"] and cfg.sandbox.env == {"PYTHONHASHSEED": "0"}
    assert (cfg.run.out_dir, cfg.run.name, cfg.run.seed) == ("/tmp/out", "2024", 3)


def test_bare_word_override_is_a_string():
    assert load_config(None, ["run.name=demo"]).run.name == "demo"


def test_misspelt_key_names_key_and_suggests():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["sandbox.memroy_mb=512"])
    msg = str(e.value)
    assert "unknown config key 'sandbox.memroy_mb'" in msg
    assert "did you mean 'sandbox.memory_mb'?" in msg
    assert "allowed:" in msg and "pool_size" in msg


def test_bad_value_names_key():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["sandbox.memory_mb=3"])
    assert str(e.value) == "sandbox.memory_mb: Input should be greater than or equal to 16 (got 3)"


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"^sandbox.env_allow: .*list.*\(got 'LANG'\)"):
        load_config("tiny", ["sandbox.env_allow=LANG"])


def test_unknown_section_rejected(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[sandbx]\nmemory_mb = 512\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'sandbx'; did you mean 'sandbox'\? allowed: run, sandbox"):
        load_config(f)


def test_override_without_equals_shows_form():
    with pytest.raises(ConfigError, match=r"expected dotted.key=value"):
        load_config("tiny", ["sandbox.memory_mb"])


def test_override_into_a_value_is_an_error():
    with pytest.raises(ConfigError, match=r"'run.name' is a value, not a section"):
        load_config("tiny", ["run.name.x=1"])


def test_bad_toml_file_names_file(tmp_path):
    f = tmp_path / "broken.toml"
    f.write_text("[run\n")
    with pytest.raises(ConfigError, match="cannot read config .*broken.toml"):
        load_config(f)


def test_literal_error_lists_allowed_values():
    class Dev(Section):
        device: Literal["cpu", "cuda"] = "cpu"

    with pytest.raises(ConfigError, match=r"^device: Input should be 'cpu' or 'cuda' \(got 'gpu'\)$"):
        validate_config({"device": "gpu"}, Dev)


def test_engine_dtype_is_float32_or_bfloat16():
    assert Config().engine.dtype == "float32" and Config().engine.kv_dtype == "float32"
    assert load_config(None, ["engine.dtype=bfloat16"]).engine.dtype == "bfloat16"
    assert load_config(None, ["engine.kv_dtype=bfloat16"]).engine.kv_dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"^engine.dtype: Input should be 'float32' or 'bfloat16' \(got 'fp16'\)$"):
        load_config(None, ["engine.dtype=fp16"])


def test_engine_lookup_drafts_at_most_15_and_gives_way_to_an_mtp_drafter():
    assert Config().engine.lookup == 4
    assert load_config(None, ["engine.lookup=0"]).engine.lookup == 0
    with pytest.raises(ConfigError, match=r"^engine.lookup: Input should be less than or equal to 15"):
        load_config(None, ["engine.lookup=16"])
    # the MTP drafter drafts where it is on (rl/worker.py, bench/run.py), so both together are valid
    assert load_config(None, ["rl.speculative=true", "policy.speculative=true"]).engine.lookup == 4


def test_assignment_is_validated():
    cfg = Config()
    with pytest.raises(ValueError):
        cfg.sandbox.memory_mb = 1


def test_toml_round_trip(tmp_path):
    cfg = load_config("small", ['sandbox.env={A = "x y", "B.C" = "\\"q\\""}', "run.name=naïve ☃"])
    f = tmp_path / "out.toml"
    f.write_text(config_to_toml(cfg))
    assert load_config(f) == cfg
    assert "[sandbox]" in f.read_text() and "memory_mb = 4096" in f.read_text()


def test_rl_prompts_may_not_repeat_sft_tasks():
    with pytest.raises(ConfigError, match=r"rl.task_seed \(100\) .* overlaps the SFT data's toy tasks .* >= 400"):
        load_config("tiny", ["rl.task_seed=100", "sft.oracle_tasks=400"])
    assert load_config("tiny", ["rl.task_seed=100", "sft.oracle_tasks=0"]).rl.task_seed == 100
