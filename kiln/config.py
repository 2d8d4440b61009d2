"""The typed config tree: TOML presets and files plus `dotted.key=value` overrides.

One `Config` flows one way, from the CLI into every stage. Imports no torch. Errors are
`ConfigError`s that name the full dotted key, so a typo on the command line is fixed in one look.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.config_io import ConfigError, apply_override, validate_config

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"  # repo root; fine for editable installs
PROJECT_DIR = CONFIGS_DIR.parent  # also holds bases/: pretrained checkpoints kiln ships


def project_path(path: str) -> Path:
    """`path` as given when it exists (or is absolute), else relative to kiln's project folder:
    `bases/tiny` works from any working directory."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() or not (PROJECT_DIR / p).exists() else PROJECT_DIR / p


class Section(BaseModel):
    # Unknown keys are errors (a misspelt key must never be silently ignored).
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = "tiny"
    out_dir: str = "runs"
    seed: int = 0


class SandboxConfig(Section):
    state_dir: str = ""  # empty = $KILN_STATE_DIR, else /tmp/kiln-sandbox
    workdir: str = "/workspace"  # the workspace path as seen inside the sandbox
    timeout_s: float = Field(120.0, gt=0)  # wall clock per exec
    idle_timeout_s: float = Field(60.0, gt=0)  # no output for this long ends an exec
    memory_mb: int = Field(2048, ge=16)
    max_procs: int = Field(256, ge=8)
    # Largest file size (RLIMIT_FSIZE) a process may set; 0 = no limit, the default. It caps apparent
    # size, not disk use, so a low one only breaks the sparse files tasks make (`truncate -s 1G`); disk
    # use is bounded anyway: every writable place is a size-capped tmpfs (disk_mb, tmp_mb).
    file_size_mb: int = Field(0, ge=0)
    disk_mb: int = Field(1024, ge=1)  # size of the writable upper layer
    tmp_mb: int = Field(512, ge=1)
    output_bytes: int = Field(65536, ge=1024)  # output kept per exec, head + tail
    env_allow: list[str] = ["LANG", "LC_ALL", "TERM", "TZ"]  # caller env vars passed through
    env: dict[str, str] = {}  # fixed extra env vars
    ro_binds: list[str] = []  # extra host paths visible read-only
    # A built task environment (kiln/tasks/env_build.py): its layers' trees, top first, become the
    # sandbox's read-only root instead of the host's system directories and kiln's Python.
    rootfs: list[str] = []
    uid: int = Field(0, ge=0)  # the user commands run as inside (a built environment's USER)
    gid: int = Field(0, ge=0)
    env_cache: str = ""  # built environments; empty = $KILN_ENV_CACHE, else ~/.cache/kiln/envs
    pool_size: int = Field(2, ge=0)  # warm sandboxes kept ready
    fork_pytest: bool = True  # `python -m pytest` runs in a fork with pytest imported (sandbox/pytest_fork.py)
    # CPU ids every sandbox process runs on; [] = those of the process that starts it. The recipe runs
    # environments as their own service, apart from inference: RL's workers may keep their cores for decoding.
    cpus: list[int] = []
    diff_exclude: list[str] = [".git", "__pycache__", ".pytest_cache", "*.pyc"]


ToolName = Literal["read_file", "edit_file", "write_file", "run_shell", "grep", "semantic_search",
                   "web_search", "web_fetch", "todo"]


class HarnessConfig(Section):
    # Offered tools. Every schema is part of each prompt (all nine: ~1,650 tokens), so the tiny
    # preset offers the three a 4k-context model needs (grep runs in the shell); configs/small.toml
    # and any API model's config offer all of them.
    tools: list[ToolName] = ["read_file", "edit_file", "run_shell"]
    strict_args: bool = False  # strict: extra or mistyped arguments are errors; lenient: coerced / ignored
    require_read_before_edit: bool = True
    max_turns: int = Field(12, ge=1)
    # A rollout whose last max_repeats turns made the same failing calls (same tools, same arguments)
    # ends with stop reason "looping": the error it keeps getting has not changed what it does.
    max_repeats: int = Field(3, ge=1)
    max_tokens: int = Field(200_000, ge=1)  # generated tokens over the whole rollout
    max_turn_tokens: int = Field(512, ge=1)  # one reply; a cut-off reply is reported to the model
    wall_time_s: float = Field(1800.0, gt=0)
    tool_output_chars: int = Field(16_000, ge=256)  # per observation, head + tail
    read_max_lines: int = Field(400, ge=1)  # read_file default page
    read_max_line_chars: int = Field(2000, ge=16)
    shell_timeout_s: float = Field(60.0, gt=0)  # run_shell default; the model may ask up to shell_max_timeout_s
    shell_max_timeout_s: float = Field(600.0, gt=0)
    grep_max_results: int = Field(100, ge=1)
    # Self-summary: when a segment fills `summary_at` of the model's context window, the agent writes
    # a summary and continues in a fresh context from it. The window is the local policy's own (its
    # engine's); for other policies (an API, the oracle writing SFT data) it is `context_tokens`.
    summary_at: float = Field(0.6, gt=0, le=1)
    context_tokens: int = Field(4096, ge=256)
    max_summaries: int = Field(8, ge=0)
    web_provider: Literal["offline", "http"] = "offline"
    web_corpus: str = "/usr/share/doc/python3-doc/html"  # offline provider: a folder of HTML/text pages
    web_url: str = ""  # http provider: search endpoint
    web_key_env: str = "KILN_WEB_SEARCH_KEY"  # env var holding the http provider's key
    embed_cache: str = ""  # semantic_search index cache; empty = <sandbox state dir>/embed


class PolicyConfig(Section):
    kind: Literal["openai", "oracle", "scripted", "local"] = "openai"
    checkpoint: str = ""  # local: a kiln checkpoint directory (model, MTP drafter, tokenizer)
    # local: draft with the checkpoint's MTP. Off by default: on agent turns on 2 CPU cores it decoded at
    # 0.81-0.91x plain, prefix reuse in both (benchmarks/agent_turns.py), though ~1.3x on long generations (docs).
    speculative: bool = False
    base_url: str = "http://127.0.0.1:8000/v1"  # any OpenAI-compatible chat-completions endpoint
    model: str = "kiln"
    api_key_env: str = "OPENAI_API_KEY"  # the key is read from this env var, never from config
    timeout_s: float = Field(300.0, gt=0)  # per request
    max_retries: int = Field(4, ge=0)  # on connection errors, timeouts, 429 and 5xx, with backoff
    temperature: float = Field(0.2, ge=0)  # near-greedy: how agents are evaluated (the tiny preset measured it)
    native_tools: bool = True  # also send tool schemas in the request's `tools` field
    seed: int = 0  # oracle: seeds the variety of its trajectories
    # oracle: the share of rollouts whose first edit it gets wrong on purpose, then redoes after
    # the tool's error (recovery for SFT to imitate; the wrong turn is never a training target)
    oracle_mistakes: float = Field(0.0, ge=0, le=1)


class EngineConfig(Section):
    """kiln's own decoding engine (kiln/engine/), where `kiln rl` samples and `kiln bench` runs a local policy."""
    # The sampler's weights: bfloat16 rounds the fp32 checkpoint's (the RL trainer publishes them so),
    # activations stay fp32. float32 by measurement: bf16 gave the same RL reward and minutes (docs).
    dtype: Literal["float32", "bfloat16"] = "float32"
    # The KV cache: bfloat16 keeps keys and values rounded (half the bytes a decoding step reads from
    # a long context; attention's arithmetic stays fp32): 1.23-1.30x decoding at 1,500 positions, but
    # no measurable RL gain on the tiny preset, so float32 (docs: "Engine", bf16 KV cache).
    kv_dtype: Literal["float32", "bfloat16"] = "float32"
    # Most prompt-lookup drafts a decoding step (engine/lookup.py: tokens copied from the sequence, fewer
    # after a shorter match, verified exactly, so samples keep their distribution) in RL's workers and
    # the bench's local policy; 0 = off.
    # 4 by measurement: 0.83x the RL minutes of 0 on the tiny preset (docs: "Prompt lookup"). Where an
    # MTP drafter runs (rl.speculative, policy.speculative) it drafts instead.
    lookup: int = Field(4, ge=0, le=15)


class ModelSection(Section):
    """The model's shape (kiln/model/config.py derives the rest from `depth`)."""
    depth: int = Field(4, ge=1)  # layers = depth, width = 64 * depth, heads of 64
    vocab_size: int = Field(8192, ge=265)  # BPE vocabulary: 9 special tokens + 256 bytes at least
    # Longest sequence (RoPE positions, KV cache). 4096: an agent's first prompt (system message with
    # every tool's schema) is ~2,000 tokens, a whole toy-task rollout ~3,500 (what `kiln sft` trains on).
    context: int = Field(4096, ge=16)
    experts: int = Field(8, ge=1)
    top_k: int = Field(2, ge=1)
    mtp_depth: int = Field(1, ge=0)  # MTP layers for speculative decoding; 0 = none
    # One matrix for the input embedding and the output head (HF's tie_word_embeddings): the tiny
    # shape learns to copy from its context within ~250 steps tied and not at all untied (see
    # docs/architecture.md, "Copying").
    tie_embeddings: bool = True


class CorpusConfig(Section):
    """`kiln corpus build` (kiln/pretrain/corpus.py). A weight of 1 takes every document once, a
    fraction a seeded subsample, more than 1 repeats; 0 turns the source off. Weights scale each
    source's natural share, so code dominates: prose is a small part of what is on disk."""
    stdlib_weight: float = Field(1.0, ge=0)  # Python's standard library (.py)
    site_packages_weight: float = Field(1.0, ge=0)  # the installed packages (.py)
    docs_weight: float = Field(1.0, ge=0)  # documentation prose (.md/.rst/.txt, HTML as text): ~5% of tokens
    # Where prose is looked for; "stdlib" and "site-packages" name Python's folders; missing ones are skipped.
    docs_roots: list[str] = ["stdlib", "site-packages", "/usr/share/doc/python3-doc/html"]
    extra: list[str] = []  # your folders of code: one more source, "extra"
    extra_weight: float = Field(1.0, ge=0)
    heldout: str = ""  # the held-out project, never trained on; empty = kiln's own source tree
    max_mb: float = Field(20.0, gt=0)  # text read, over all sources: keeps a tiny build to seconds
    max_file_kb: int = Field(1024, ge=1)  # larger files are dropped as oversized (HTML counts its markup)
    min_file_bytes: int = Field(128, ge=0)  # smaller files are dropped as too short
    near_dup_threshold: float = Field(0.85, gt=0, le=1)  # estimated Jaccard of word 5-gram sets
    shard_tokens: int = Field(16_000_000, ge=1)  # tokens per shard file
    out_dir: str = ""  # empty = <run.out_dir>/<run.name>/corpus


PhaseKind = Literal["bulk", "extension", "sft"]


class PhaseConfig(Section):
    """One phase of continued pretraining. Phases run in order on one model and one optimizer."""
    name: str
    kind: PhaseKind = "bulk"  # bulk: short context; extension: long context; sft: runs under `kiln sft`
    steps: int = Field(ge=1)  # optimizer steps
    seq_len: int = Field(ge=8)  # tokens per packed sequence
    batch_size: int = Field(ge=1)  # sequences per optimizer step
    grad_accum: int = Field(1, ge=1)  # micro-batches per step (batch_size / grad_accum sequences each)
    lr: float = Field(gt=0)  # the phase's peak learning rate
    warmup_steps: int = Field(0, ge=0)  # linear warmup from the phase's first step up to lr
    rope_theta: float | None = Field(None, gt=0)  # RoPE base from this phase on; None = keep the model's
    # Share of each batch's rows that are copy practice ([span][same span], loss on the second copy;
    # kiln/pretrain/copying.py): bulk and extension phases only.
    copy_frac: float = Field(0.0, ge=0, lt=1)
    # sft phases: the MTP distils on every Nth step only. Its distillation needs the trunk's last
    # layer at every position, where the loss alone needs it at the targets: a third of a tiny SFT step.
    mtp_every: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _accum_divides_batch(self):
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of grad_accum ({self.grad_accum})")
        if self.mtp_every > 1 and self.kind != "sft":
            raise ValueError(f"mtp_every is for sft phases (phase {self.name!r} is {self.kind}): pretraining "
                             "cuts the MTP in with pretrain.mtp_start")
        return self


class PretrainConfig(Section):
    """`kiln pretrain` (kiln/pretrain/trainer.py). Each phase runs its own schedule: warmup to its lr,
    then cosine or WSD (warmup-stable-decay) down to min_lr_ratio x lr at its last step, as a phase
    of continued pretraining restarts from the previous one's weights and optimizer moments. The
    tiny phases (continuing bases/tiny) take about 4 minutes on 2 cores (bulk ~3,600 tokens/s,
    extension with MTP ~1,450);
    SFT phases are `kiln sft`'s (agent trajectories, from the pretrained checkpoint; the tiny one
    takes about 11 minutes)."""
    phases: list[PhaseConfig] = [
        # Continued pretraining of the committed base (init): copy practice as the base had it, so
        # copying stays. From scratch, configs/base.toml's 2,700 steps are what copying takes.
        PhaseConfig(name="bulk", kind="bulk", steps=100, seq_len=256, batch_size=16, lr=1e-3, warmup_steps=10,
                    copy_frac=0.25),
        PhaseConfig(name="extension", kind="extension", steps=30, seq_len=1024, batch_size=4, lr=5e-4,
                    warmup_steps=3, rope_theta=40000.0, copy_frac=0.25),
        # One level-1 toy rollout per row (~2,100 tokens, at most ~2,600): ~1.7 s a step on 2 cores,
        # two thirds of an epoch over the oracle's 1,200 rollouts. Many small steps at 2e-3 beat 60 steps of 4 rows
        # at 1e-3 (the tiny run's tool calls parsed 92% of the time against 28%, held-out oracle loss 0.47 against 1.09).
        PhaseConfig(name="sft", kind="sft", steps=800, seq_len=2560, batch_size=2, lr=1e-3, warmup_steps=5,
                    mtp_every=2),
    ]
    schedule: Literal["cosine", "wsd"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # each phase ends at min_lr_ratio x its lr
    decay_frac: float = Field(0.2, ge=0, le=1)  # wsd: the last fraction of a phase's steps decays linearly
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW
    weight_decay: float = Field(0.1, ge=0)  # on matrices only (not norms)
    grad_clip: float = Field(1.0, ge=0)  # max global gradient norm; 0 = no clipping
    # The MTP module (model.mtp_depth layers) is cut in from scratch at this fraction of the bulk
    # phase (the report's mid-run checkpoint) and trains jointly, by self-distillation, from the
    # start of the next phase to the end of the run. Its trunk inputs are detached: it never
    # changes the main model.
    mtp_start: float = Field(0.5, ge=0, le=1)
    # A checkpoint to continue pretraining from (`kiln pretrain --init` overrides it); its tokenizer
    # becomes the run's. Empty = from scratch. Relative paths fall back to kiln's project folder, so
    # "bases/tiny" (the committed tiny base, configs/base.toml) works from anywhere.
    init: str = "bases/tiny"
    # Also write the final model here in bf16 with its pretraining history (history.json): how a
    # base is published for others to continue from (configs/base.toml writes bases/tiny).
    publish: str = ""
    eval_points: int = Field(6, ge=0)  # held-out evaluations, log-spaced over the run (plus each phase's end)
    eval_window: int = Field(256, ge=2)  # context tokens of the rolling window
    eval_stride: int = Field(192, ge=1)  # new tokens scored per window (<= eval_window)
    eval_max_bytes: int = Field(48_000, ge=0)  # held-out text scored (its first N bytes); 0 = all of it
    checkpoint_every: int = Field(50, ge=1)  # steps between resumable states (and at every phase end)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when present (bf16 autocast there)
    seed: int = 0  # data order (windows drawn per (seed, step)) and the MTP's initialisation

    @model_validator(mode="after")
    def _stride_fits_window(self):
        if self.eval_stride > self.eval_window:
            raise ValueError(f"eval_stride ({self.eval_stride}) must be <= eval_window ({self.eval_window})")
        return self


class SftConfig(Section):
    """`kiln sft`'s data; its training settings are pretrain.phases' phases of kind "sft"."""
    oracle_tasks: int = Field(1200, ge=0)  # toy train-split tasks the oracle solves for SFT data; 0 = none
    oracle_level: int = Field(1, ge=0, le=3)  # their level (toy.py); 0 = levels 1-3 in turn
    oracle_seed: int = Field(0, ge=0)  # the first toy task index (train and eval tasks never overlap)
    # policy.oracle_mistakes while collecting SFT data: recovery to imitate (docs/architecture.md, "Copying")
    oracle_mistakes: float = Field(0.5, ge=0, le=1)
    trajectories: list[str] = []  # more trajectory files or folders (e.g. a `kiln bench` out_dir)
    checkpoint: str = ""  # the model to fine-tune; empty = <run dir>/pretrain/checkpoint


class BenchConfig(Section):
    suite: str = ""  # a folder of task folders
    # oracle and noop are controls for any suite; local decodes policy.checkpoint on one shared engine
    policy: Literal["oracle", "noop", "openai", "local"] = "oracle"
    passes: int = Field(3, ge=1)  # best-of-K is reported for K = 1..passes
    workers: int = Field(2, ge=1)  # rollouts in parallel
    out_dir: str = ""  # empty = <run.out_dir>/<run.name>/bench-<policy>
    ray: bool = False  # rollouts as Ray tasks across the cluster (ray.address), each sandbox on its task's node
    rollout_resources: dict[str, float] = {"CPU": 0.5}  # per Ray rollout task: CPU, GPU, memory (bytes), custom


class SpeedrunConfig(Section):
    """`kiln speedrun`'s evaluation of the SFT model (kiln/speedrun.py)."""
    eval_tasks: int = Field(128, ge=1)  # held-out toy tasks (eval split)
    eval_level: int = Field(1, ge=0, le=3)  # 0 = levels 1-3 in turn
    passes: int = Field(4, ge=1)  # mean and best-of-K over K passes


class RLConfig(Section):
    """`kiln rl`: asynchronous RL of the SFT model in the harness (kiln/rl/)."""
    checkpoint: str = ""  # the policy to train; empty = <run dir>/sft/checkpoint
    # Many prompts in small groups: what RL teaches mostly stays with its prompts (docs/architecture.md, "Copying").
    tasks: int = Field(192, ge=1)  # toy train-split prompts; single epoch: each is trained on at most once
    level: int = Field(1, ge=0, le=3)  # their level; 0 = levels 1-3 in turn
    task_seed: int = Field(5000, ge=0)  # the first toy index: past the SFT data's tasks (checked)
    steps: int = Field(48, ge=1)  # trainer steps (one new weight version each)
    group_size: int = Field(4, ge=2)  # G rollouts per prompt, from forks of one task sandbox
    groups_per_step: int = Field(4, ge=1)
    max_lag: int = Field(1, ge=0)  # admission: never start a rollout its step would train > max_lag versions later
    workers: int = Field(2, ge=1)  # rollout worker actors
    # Groups one worker rolls out at once on its one engine (their rollouts share its batches); at most
    # rl/worker.py's MAX_GROUPS. 2 gained nothing on an idle machine (docs/architecture.md, "What an RL group costs").
    worker_groups: int = Field(1, ge=1, le=8)
    # Ray resources per role (kiln/cluster.py): CPU, GPU, memory (bytes) and any custom resource of the
    # cluster's nodes; the defaults fit the trainer and two workers on 2 CPUs.
    trainer_resources: dict[str, float] = {"CPU": 1.0}
    worker_resources: dict[str, float] = {"CPU": 0.5}
    # Ray placement group over the roles' bundles: PACK/STRICT_PACK share nodes, SPREAD/STRICT_SPREAD avoid sharing.
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # CPU pinning (rl/placement.py), on the node each role runs on: CPU ids the trainer / the rollout workers
    # and their sandboxes may use; [] = all. Disjoint sets mirror the recipe's separate training and sampling hardware.
    trainer_cpus: list[int] = []
    worker_cpus: list[int] = []
    temperature: float = Field(0.7, gt=0)  # sampling; the bench evaluates at policy.temperature
    # Workers draft with the start checkpoint's MTP (speculative decoding, prefix reuse kept; RL does
    # not train the drafter, so acceptance may fall as the policy moves; samples stay exact). Off: on
    # agent turns on 2 CPU cores it decoded at 0.81-0.91x plain (benchmarks/agent_turns.py).
    speculative: bool = False
    lr: float = Field(1e-5, gt=0)  # Adam, constant
    # false: the token embedding and the output head (one matrix when tied) stay as SFT left them, every
    # other weight trains. Adam moves every vocabulary row by about lr a step, rows the rollouts never
    # used included (docs/architecture.md, "Copying": -13.3 points trained vs -4.3 frozen, same data).
    train_embeddings: bool = True
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, ge=0)
    aggregation: Literal["constant", "token_mean", "seq_mean"] = "constant"  # Dr. GRPO: constant
    loss_constant: float = Field(1024.0, gt=0)  # "constant": summed token terms / this
    scale_std: bool = False  # divide advantages by the group's std (GRPO) instead of Dr. GRPO's plain centring
    # Zero the advantages of groups whose rollouts all solved or all failed (DAPO's dynamic-sampling
    # filter, without resampling): there the length and behaviour terms alone would set the sign.
    mixed_groups_only: bool = True
    positive_only: bool = False  # clamp advantages at 0: rejection-sampling fine-tuning weighted by the advantage
    # Subtracted from the advantage of every token generated in a turn whose tool call failed: credit
    # for the turn that erred, which a group-centred outcome spreads over the whole rollout. 0 = off
    # (0.5 changed nothing measurable: docs/architecture.md, "Copying").
    failed_call_penalty: float = Field(0.0, ge=0)
    # The same on the turns that repeat a call (same tool, same arguments) that already failed in the
    # rollout: the one choice after an error that almost never solves (docs/architecture.md, "Copying").
    repeated_call_penalty: float = Field(0.0, ge=0)
    tis_cap: float | None = Field(None, gt=0)  # truncated importance sampling with the sampler's logprobs; None = off
    kl_coef: float = Field(0.0, ge=0)  # k1 estimate of KL to the frozen start policy, summed per rollout, in the reward
    replay_ratio: float = Field(0.5, ge=0, le=1)  # router replay's plausibility filter (model/moe.py)
    # Length penalty lambda * C(x), C(x) = ((1 + k x)^(1-q) - 1) / (k (1-q)); x weighs the effort counts.
    length_lambda: float = Field(1e-4, ge=0)
    length_k: float = Field(1e-3, gt=0)
    length_q: float = Field(0.5, gt=0)
    length_weights: dict[str, float] = {"thinking_tokens": 1.0, "tool_call_tokens": 1.0, "tool_output_tokens": 0.1,
                                        "final_tokens": 1.0, "tool_calls": 20.0, "turns": 50.0}
    # Behaviour terms subtracted from the reward: weight x count (grading's behaviour/quality/efficiency axes).
    behaviour_weights: dict[str, float] = {"unfinished_todos": 0.1, "tool_errors": 0.05, "malformed_calls": 0.05,
                                           "reasoning_comments": 0.1, "terminal_only": 0.1}
    upsample: float = Field(1.0, ge=0)  # later prompts lean toward kinds whose groups took more turns/thinking; 0 = off
    store: str = ""  # weight store: a folder or s3://bucket/prefix; empty = <run dir>/rl/weights
    anchor_every: int = Field(10, ge=1)  # a full weight anchor every N versions, deltas between
    timeout_s: float = Field(600.0, gt=0)  # every wait on a role (no progress for this long is an error)


class RayConfig(Section):
    """Where `kiln rl` and `kiln bench --ray` run (kiln/cluster.py)."""
    address: str = ""  # a cluster to attach to (host:port, or "auto"); empty = $RAY_ADDRESS, else a local Ray
    num_cpus: int = Field(0, ge=0)  # a local Ray's CPUs; 0 = this machine's (at least what the roles ask for)
    object_store_mb: int = Field(256, ge=80)  # a local Ray's shared-memory object store


class Config(Section):
    run: RunConfig = RunConfig()
    sandbox: SandboxConfig = SandboxConfig()
    harness: HarnessConfig = HarnessConfig()
    policy: PolicyConfig = PolicyConfig()
    model: ModelSection = ModelSection()
    engine: EngineConfig = EngineConfig()
    corpus: CorpusConfig = CorpusConfig()
    pretrain: PretrainConfig = PretrainConfig()
    sft: SftConfig = SftConfig()
    bench: BenchConfig = BenchConfig()
    speedrun: SpeedrunConfig = SpeedrunConfig()
    rl: RLConfig = RLConfig()
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _rl_prompts_are_not_sft_tasks(self):
        # Both draw train-split toy tasks by index; an overlap would train RL on tasks SFT has seen.
        s, r = self.sft, self.rl
        if s.oracle_tasks and s.oracle_seed < r.task_seed + r.tasks and r.task_seed < s.oracle_seed + s.oracle_tasks:
            raise ValueError(f"rl.task_seed ({r.task_seed}) + rl.tasks ({r.tasks}) overlaps the SFT data's toy tasks "
                             f"(sft.oracle_seed {s.oracle_seed} + sft.oracle_tasks {s.oracle_tasks}): set rl.task_seed "
                             f">= {s.oracle_seed + s.oracle_tasks}")
        return self


# ---------------------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a TOML file or preset name (`configs/<name>.toml`), then apply overrides.

    `path=None` means the built-in defaults, which are the tiny preset.
    """
    data = _read_toml(resolve_path(path)) if path is not None else {}
    for item in overrides:
        apply_override(data, item, Config)
    return validate_config(data, Config)


def resolve_path(path: str | Path) -> Path:
    """A file path as given, else a preset name from the configs folder."""
    p = Path(path)
    if p.is_file():
        return p
    preset = CONFIGS_DIR / f"{p.name}.toml"
    if p.suffix != ".toml" and len(p.parts) == 1 and preset.is_file():
        return preset
    presets = ", ".join(sorted(f.stem for f in CONFIGS_DIR.glob("*.toml"))) or "none"
    raise ConfigError(f"no config file or preset named '{path}' (presets: {presets})")


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
