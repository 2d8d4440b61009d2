"""SFT data (`kiln sft`): agent trajectories as token sequences with an assistant-token loss mask,
packed into rows whose samples never see each other; a step's rows become trees over their
samples' common prompt (`Packed.trees`).

A sample is one trajectory segment (a self-summary starts a new context, so a new sample), laid
out token for token as the local policy feeds the model at inference (kiln/policies/local.py):
the first prompt is the rendered conversation up to the first reply; each reply is its recorded
completion ids (a local policy's) or the encoded raw text + <|im_end|> (oracle, API policies);
after it come the rest of the turn's closing and the newly rendered messages (tool results, user
messages) and the generation prompt. Re-rendering the parsed replies through the template would
teach a layout the model never writes itself. The loss covers exactly the reply tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.harness.trajectory import Segment, Trajectory
from kiln.model.layers import MIN_SHARED
from kiln.policies.local import _assistant_turn_end
from kiln.pretrain.data import _step_seed


class SftDataError(ValueError):
    """Trajectories that cannot become SFT samples; the message says what to do."""


def segment_tokens(segment: Segment, tokenizer) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of one segment: mask 1 on every token the assistant generated (each
    turn's reply and its end-of-turn token), 0 on system, user, tool and template tokens and on
    a demonstrator's deliberate mistakes (turn kind "mistake": context, never a target)."""
    ids, mask, _ = segment_layout(segment, tokenizer)
    return ids, mask


def segment_layout(segment: Segment, tokenizer) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """segment_tokens, and the [start, end) of each turn's reply in the ids."""
    starts = [i for i, m in enumerate(segment.messages) if m.get("role") == "assistant"]
    if len(starts) != len(segment.turns):
        raise SftDataError(f"a segment has {len(segment.turns)} recorded turns but {len(starts)} assistant "
                           "messages; the trajectory was not written by kiln's harness")
    turn_end = _assistant_turn_end(tokenizer)
    eos_text = tokenizer.decode([tokenizer.eos_id])
    ids: list[int] = []
    mask: list[int] = []
    replies: list[tuple[int, int]] = []
    prev_through = ""  # the conversation through the previous reply, as the template renders it
    prev_ended = False  # the previous reply ended with the end-of-turn token
    for k, (at, turn) in enumerate(zip(starts, segment.turns)):
        text = tokenizer.apply_chat_template(segment.messages[:at], add_generation_prompt=True)
        if k == 0:
            new = tokenizer.encode(text)
        else:
            if not text.startswith(prev_through):
                raise SftDataError("the chat template does not render a conversation as a continuation of its "
                                   "earlier turns; the local policy would restart its prompt here too")
            # As LocalPolicy._continuation: a sampled end-of-turn token already stands for the
            # start of the closing; a reply cut off by max_tokens gets the whole closing.
            closing = turn_end[len(eos_text):] if prev_ended and turn_end.startswith(eos_text) else turn_end
            new = tokenizer.encode(closing + text[len(prev_through):])
        reply = (list(turn.completion_ids) if turn.completion_ids is not None else
                 tokenizer.encode(turn.text) + ([tokenizer.eos_id] if turn.finish_reason == "stop" else []))
        replies.append((len(ids) + len(new), len(ids) + len(new) + len(reply)))
        ids += new + reply
        mask += [0] * len(new) + [0 if turn.kind == "mistake" else 1] * len(reply)
        prev_ended = bool(reply) and reply[-1] == tokenizer.eos_id
        through = tokenizer.apply_chat_template(segment.messages[: at + 1])
        if not (through.startswith(text) and through.endswith(turn_end)):
            raise SftDataError(f"the chat template renders assistant message {at} in an unexpected layout")
        prev_through = through
    return ids, mask, replies


def load_trajectories(paths) -> list[Trajectory]:
    """Trajectory JSON files, and every *.json under given folders (e.g. a bench results dir,
    whose trajectories/ it holds), in sorted order so a run always sees the same samples."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():  # a bench results dir keeps them in trajectories/, beside its summary.json
            found = sorted(f for f in p.rglob("*.json") if f.parent.name == "trajectories")
            files += found or sorted(p.glob("*.json"))
        elif p.is_file():
            files.append(p)
        else:
            raise SftDataError(f"no trajectory file or folder at {str(p)!r}")
    out = []
    for f in files:
        try:
            out.append(Trajectory.load(str(f)))
        except (ValueError, KeyError, TypeError) as e:  # JSON errors are ValueErrors
            raise SftDataError(f"{f} is not a kiln trajectory: {e}") from None
    return out


def samples_from(trajectories, tokenizer) -> list[tuple[list[int], list[int]]]:
    """Every segment with at least one reply, as (ids, loss_mask)."""
    return [segment_tokens(s, tokenizer) for t in trajectories for s in t.segments if s.turns]


def collect_oracle_trajectories(cfg, out_dir, n_tasks: int, seed: int = 0, level: int | None = None,
                                progress: bool = True) -> list[Path]:
    """Generate `n_tasks` toy tasks of the train split (of `level`; None: 1-3 in turn), run the oracle on each
    through the real harness in sandboxes (`kiln bench`'s runner: resumable, graded), and return
    the trajectory files of the solved ones. Both steps are skipped when already done."""
    from kiln.bench.run import run_bench
    from kiln.tasks.record import load_suite
    from kiln.tasks.toy import generate_toy

    out_dir = Path(out_dir)
    suite = out_dir / "tasks"
    have = load_suite(str(suite)) if (suite.is_dir() and any(suite.iterdir())) else []
    if len(have) < n_tasks:
        # No test run after the gold patch: the oracle's graded rollout below applies it and runs
        # the tests, and only solved rollouts are kept (one of the four test runs a task cost).
        y = generate_toy(str(suite), n_tasks, seed=seed, level=level, split="train", sandbox_cfg=cfg.sandbox,
                         progress=progress, runs_after=0)
        if y.kept == 0:
            raise SftDataError(f"no toy task could be generated in {suite} (rejected: {dict(y.rejected)})")
    oracle_cfg = cfg.model_copy(deep=True)
    oracle_cfg.policy.oracle_mistakes = cfg.sft.oracle_mistakes
    run_bench(str(suite), "oracle", passes=1, workers=cfg.bench.workers, out_dir=str(out_dir / "rollouts"),
              config=oracle_cfg, progress=progress)
    trajs = sorted((out_dir / "rollouts" / "trajectories").glob("*.json"))
    return [p for p in trajs if Trajectory.load(str(p)).rewards.get("correctness", 0.0) > 0]


@dataclass
class Packed:
    """Rows of seq_len + 1 tokens (inputs and their next-token targets), each [N, seq_len + 1]."""
    ids: torch.Tensor
    mask: torch.Tensor  # 1 where the token is an assistant token (a training target)
    docs: torch.Tensor  # sample index within the row; padding is -1
    pos: torch.Tensor  # positions, restarting at 0 in every sample
    truncated: int = 0  # samples cut to fit a row
    shared: bool = False  # each row is a tree: its first document a prompt its later ones continue

    def __len__(self) -> int:
        return self.ids.shape[0]

    def rows(self, index) -> Packed:
        return Packed(self.ids[index], self.mask[index], self.docs[index], self.pos[index])

    def trees(self, parts: int, margin: int, pad_id: int = 0, min_shared: int = MIN_SHARED) -> Packed:
        """The rows as `parts` trees (one per micro-batch, padded alike): each part's samples as one
        row, their common prompt once, then each sample's rest continuing it (layers.Documents,
        shared). The loss is the same (the prompt carries no target); the step costs less (every
        toy-task trajectory opens with the same ~850-token system message and tool schemas, 40%
        of it). The prompt stops `margin` (the MTP depth) tokens short, so no MTP row that is
        distilled reads a token past it. Rows as they are (trimmed) when a part shares less than
        min_shared tokens or holds one sample."""
        size = math.ceil(len(self) / parts)  # torch.chunk's split, as trainer._step's micro-batches
        chunks = [range(i, min(i + size, len(self))) for i in range(0, len(self), size)]
        trees = [_tree(self._samples(c), margin, min_shared) for c in chunks]
        if any(t is None for t in trees):
            return self.trimmed()
        span = max(len(ids) for ids, _, _, _ in trees)
        out = Packed(torch.full((len(trees), span), pad_id, dtype=torch.long), torch.zeros(len(trees), span, dtype=torch.long),
                     torch.full((len(trees), span), -1, dtype=torch.long), torch.arange(span).repeat(len(trees), 1),
                     self.truncated, shared=True)
        for r, t in enumerate(trees):
            for field, values in zip((out.ids, out.mask, out.docs, out.pos), t):
                field[r, :len(values)] = torch.tensor(values)
        return out

    def _samples(self, rows) -> list[tuple[list[int], list[int]]]:
        """The (ids, mask) of every sample in `rows`, in order."""
        out = []
        for r in rows:
            docs = self.docs[r]
            for d in range(int(docs.max()) + 1):
                at = docs == d
                out.append((self.ids[r][at].tolist(), self.mask[r][at].tolist()))
        return out

    def trimmed(self) -> Packed:
        """Without the trailing columns that are padding in every row. Padding is never a target
        nor attended to, so the loss is the same; the step costs less (an agent sample rarely
        fills its row)."""
        real = (self.docs != -1).any(0).nonzero()
        end = int(real.max()) + 1 if len(real) else self.ids.shape[1]
        return Packed(self.ids[:, :end], self.mask[:, :end], self.docs[:, :end], self.pos[:, :end], self.truncated)


def _tree(samples, margin: int, min_shared: int):
    """(ids, mask, docs, positions) of one tree row over samples [(ids, mask)], or None: the prompt
    is the longest run of tokens every sample opens with in which no position has a target
    (mask 1 on the next token), less `margin`."""
    if len(samples) < 2:
        return None
    first = samples[0][0]
    n = min(len(ids) for ids, _ in samples)
    p = next((i for i in range(n) if any(ids[i] != first[i] or mask[i] for ids, mask in samples)), n)
    p -= 1 + margin  # position p - 1's target is token p
    if p < min_shared:
        return None
    ids, mask, docs, pos = first[:p], [0] * p, [0] * p, list(range(p))
    for d, (s_ids, s_mask) in enumerate(samples, start=1):
        ids += s_ids[p:]
        mask += s_mask[p:]
        docs += [d] * (len(s_ids) - p)
        pos += range(p, len(s_ids))
    return ids, mask, docs, pos


def pack(samples, seq_len: int, pad_id: int = 0) -> Packed:
    """First-fit-decreasing packing of (ids, mask) samples into rows of seq_len + 1 tokens. A
    sample longer than a row keeps its first seq_len + 1 tokens (counted in `truncated`)."""
    span = seq_len + 1
    truncated = sum(len(ids) > span for ids, _ in samples)
    samples = [(ids[:span], mask[:span]) for ids, mask in samples if any(mask[1:span])]
    if not samples:
        raise SftDataError("no SFT sample has an assistant token to learn from")
    rows: list[list[tuple[list[int], list[int]]]] = []
    free: list[int] = []
    for ids, mask in sorted(samples, key=lambda s: -len(s[0])):  # stable: equal lengths keep their order
        i = next((r for r, f in enumerate(free) if f >= len(ids)), None)
        if i is None:
            rows.append([])
            free.append(span)
            i = len(rows) - 1
        rows[i].append((ids, mask))
        free[i] -= len(ids)
    n = len(rows)
    out = Packed(torch.full((n, span), pad_id, dtype=torch.long), torch.zeros(n, span, dtype=torch.long),
                 torch.full((n, span), -1, dtype=torch.long), torch.zeros(n, span, dtype=torch.long), truncated)
    for r, row in enumerate(rows):
        at = 0
        for d, (ids, mask) in enumerate(row):
            sl = slice(at, at + len(ids))
            out.ids[r, sl], out.mask[r, sl] = torch.tensor(ids), torch.tensor(mask)
            out.docs[r, sl], out.pos[r, sl] = d, torch.arange(len(ids))
            at += len(ids)
        out.pos[r, at:] = torch.arange(span - at)  # padding: a document of its own, never a target
    return out


def batch_rows(n_rows: int, step: int, batch_size: int, seed: int) -> list[int]:
    """The rows of optimizer step `step`: epochs of seeded permutations, each drawn from (seed,
    epoch) alone, so a resumed run sees the batches the uninterrupted one would."""
    out = []
    for j in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(j, n_rows)
        g = torch.Generator().manual_seed(_step_seed(seed, epoch))
        out.append(int(torch.randperm(n_rows, generator=g)[i]))
    return out

