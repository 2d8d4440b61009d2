"""The edit probe: given everything an oracle's rollout showed before its edit, does the model
write that edit? It says which part of solving a task a model cannot do yet.

Teacher-forced on oracle trajectories of held-out tasks (the model sees exactly the prompt the
oracle's rollout built), at the reply that calls edit_file, top-1 at every token of:
- `old_text`: the text to replace. Finding the place: choosing where the edit starts, then copying
  the file's lines from the read above (with the JSON escapes the call needs).
- `new_text`: the replacement, given the right old text before it.
- `change`: the first token where new differs from old, the fix itself.
A sampled rollout needs all of them at once (and the turns around them), so the fractions of
trajectories whose every token is right bound what the model can solve, and say where it fails.
"""
from __future__ import annotations

import json

import torch

from kiln.harness.trajectory import Trajectory
from kiln.pretrain.sft_data import load_trajectories, segment_layout

_KEYS = ("old_text", "new_text")


def _value_span(text: str, key: str) -> tuple[int, int, str] | None:
    """Character span [start, end) of the JSON string value of `key` in a rendered call, and the value."""
    at = text.find(f'"{key}": "')
    if at < 0:
        return None
    start = at + len(key) + 4  # the opening quote of the value
    value, end = json.JSONDecoder().raw_decode(text, start)
    return start + 1, end - 1, value


def edit_case(traj: Trajectory, tok) -> dict | None:
    """Token positions of one trajectory's first edit: {"ids", "old": (a, b), "new": (a, b), "change": p},
    spans [a, b) in the ids of its first segment. None without an edit_file call that replaces text."""
    seg = traj.segments[0]
    k = next((i for i, t in enumerate(seg.turns) if '"edit_file"' in t.text and t.kind != "mistake"), None)
    if k is None:
        return None
    ids, _, replies = segment_layout(seg, tok)
    s, e = replies[k]
    reply = ids[s:e]
    text = tok.decode(reply)
    ends = []  # character offset after each token of the reply
    for n in range(len(reply)):
        ends.append(len(tok.decode(reply[:n + 1])))
    found = [_value_span(text, key) for key in _KEYS]
    if found[0] is None or found[1] is None or not found[0][2]:  # no old text: a new file, nothing to find
        return None

    def token_at(c: int) -> int:
        return s + next(n for n, x in enumerate(ends) if x > c)

    (oa, ob, _), (na, nb, _) = found
    # the first differing character of the escaped texts (a pure deletion: where the new text ends)
    raw_old, raw_new = text[oa:ob], text[na:nb]
    d = next((i for i, (x, y) in enumerate(zip(raw_old, raw_new)) if x != y), min(len(raw_old), len(raw_new)))
    d = max(0, min(d, len(raw_new) - 1))
    return {"ids": ids[:e], "old": (token_at(oa), token_at(ob - 1) + 1), "new": (token_at(na), token_at(nb - 1) + 1),
            "change": token_at(na + d), "reply": (s, e)}


@torch.inference_mode()
def edit_probe(model, tok, trajectories: list[Trajectory]) -> dict:
    """{"n", "old_text", "new_text", "change", "reply_tokens"}: the fraction of edits whose every
    old-text / new-text token is the model's top-1, whose first changed token is, and the top-1
    accuracy over every token of the edit's reply."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    hits = {"old_text": 0, "new_text": 0, "change": 0}
    reply_right = reply_total = n = 0
    try:
        for traj in trajectories:
            case = edit_case(traj, tok)
            if case is None:
                continue
            x = torch.tensor([case["ids"]], device=device)
            pred = model.head(model.trunk(x[:, :-1]).hidden)[0].argmax(-1).cpu()  # pred[p] predicts ids[p + 1]
            right = torch.cat([torch.tensor([True]), pred == torch.tensor(case["ids"][1:])])  # right[p]: ids[p]
            hits["old_text"] += bool(right[slice(*case["old"])].all())
            hits["new_text"] += bool(right[slice(*case["new"])].all())
            hits["change"] += bool(right[case["change"]])
            a, b = case["reply"]
            reply_right += int(right[a:b].sum())
            reply_total += b - a
            n += 1
    finally:
        model.train(was_training)
    if n == 0:
        raise ValueError("no trajectory has an edit_file call to probe: give oracle rollouts of tasks that edit a file")
    return {"n": n, **{k: v / n for k, v in hits.items()}, "reply_tokens": reply_right / reply_total}


def probe_edits_checkpoint(path, trajectories) -> dict:
    """edit_probe of a checkpoint folder (with its own tokenizer) on trajectory files/folders."""
    from kiln.model.checkpoint import load_checkpoint
    from kiln.model.tokenizer import load_tokenizer

    model, _ = load_checkpoint(path, with_mtp=False)
    return edit_probe(model, load_tokenizer(path), load_trajectories(trajectories))
