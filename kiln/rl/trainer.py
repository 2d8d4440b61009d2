"""One RL optimizer step on finished groups: rewards (k1 included), advantages, the replayed
forward, the policy-gradient loss, Adam, and the step's metrics.

The trainer scores each sampled token under softmax(logits / temperature), the distribution the
sampler drew it from and recorded the logprob of. Only target positions go through the output
head (a rollout is mostly prompt and tool output). A group's rollouts run as one tree, their
shared prompt computed once (_tree_logp); other rows a few at a time, shortest first, each chunk cut
to its longest row (padding to the batch's longest cost ~30% of a step). The gradients accumulate;
each chunk's loss is scaled so the sum equals the loss over the whole batch under every aggregation.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

import torch

from kiln.model.layers import MIN_SHARED

from .batch import Batch, collate, sequences
from .loss import group_advantages, policy_loss, uniform_groups
from .rewards import k1

ROWS_PER_CHUNK = 4
TREE_TOKENS = 16384  # a tree's packed length at most: what ROWS_PER_CHUNK rows of a 4k context hold


@dataclass
class Group:
    """A prompt's G finished rollouts, as the orchestrator hands them to the trainer."""
    id: int
    task_id: str
    kind: str  # what upsampling groups prompts by (the task's category and difficulty)
    trajectories: list  # harness Trajectory objects with token data
    rewards: list[dict[str, float]]  # per rollout: reward axes from rewards.reward_axes
    started_version: int = -1  # the weights version its worker was on when it started (the lag)


def target_logp(model, batch: Batch, rows, temperature: float, replay: bool, replay_ratio: float,
                tree: bool = False):
    """[rows, T-1] logprobs of the targets (0 elsewhere) and the number of replayed experts replaced;
    `rows` is a slice or a tensor of row indices. tree: the rows open with one prompt (a group's
    rollouts, see _chunks), which runs once, each row's rest attending to it."""
    if tree:
        return _tree_logp(model, batch, rows, temperature, replay, replay_ratio)
    full = torch.zeros(batch.mask[rows].shape)
    cols = batch.mask[rows].any(0).nonzero()
    n = int(cols.max()) + 2 if len(cols) else 2  # the chunk's own width: padding past its longest row is skipped
    ids, mask = batch.ids[rows, :n], batch.mask[rows, :n - 1]
    routes = batch.routes[rows, :n] if (replay and batch.routes is not None) else None
    out = model.trunk(ids, routes=routes, replay_ratio=replay_ratio)
    keep = mask.bool()
    h = out.hidden[:, :-1][keep]  # only where a target is scored
    full[:, :n - 1] = torch.zeros(mask.shape).masked_scatter(keep, _logp(model, h, ids[:, 1:][keep], temperature))
    return full, out.replaced


def shared_prompt(batch: Batch, rows: torch.Tensor) -> int:
    """How many leading positions every row of `rows` feeds alike (the same token and replayed
    experts) with no target among them: the prompt a tree computes once."""
    ids, mask = batch.ids[rows], batch.mask[rows].bool()
    same = (ids == ids[:1]).all(0)
    if batch.routes is not None:
        r = batch.routes[rows]
        same &= (r == r[:1]).flatten(2).all(-1).all(0)
    same[:-1] &= ~mask.any(0)  # nor a target: position t's is token t + 1, scored in each row's rest
    return int(same.long().cumprod(0).sum())


def _tree_logp(model, batch: Batch, rows: torch.Tensor, temperature: float, replay: bool, replay_ratio: float):
    """target_logp of rows that share their first shared_prompt() positions, as one packed row: the
    prompt, then each row's rest (layers.Documents, shared). The same logprobs, summed in another
    order, for less work (a group's prompt is ~35% of its tokens)."""
    p, rs = shared_prompt(batch, rows), rows.tolist()
    ends = [int(batch.mask[r].nonzero().max()) + 2 for r in rs]  # each row's length
    parts = [range(p)] + [range(p, n) for n in ends]
    ids = torch.cat([batch.ids[rs[0], :p]] + [batch.ids[r, p:n] for r, n in zip(rs, ends)])
    pos = torch.cat([torch.arange(a.start, a.stop) for a in parts])
    docs = torch.cat([torch.full((len(a),), d) for d, a in enumerate(parts)])
    routes = None
    if replay and batch.routes is not None:
        routes = torch.cat([batch.routes[rs[0], :p]] + [batch.routes[r, p:n] for r, n in zip(rs, ends)])[None]
    out = model.trunk(ids[None], positions=pos[None], doc_ids=docs[None], routes=routes, replay_ratio=replay_ratio,
                      shared_prefix=True)
    hs, targets, keeps, at = [], [], [], p
    for r, n in zip(rs, ends):  # row r's position t (>= p) is packed at at + t - p
        keep = batch.mask[r, p:n - 1].bool()
        hs.append(out.hidden[0, at:at + n - 1 - p][keep])
        targets.append(batch.ids[r, p + 1:n][keep])
        keeps.append(keep)
        at += n - p
    lp = _logp(model, torch.cat(hs), torch.cat(targets), temperature).split([int(k.sum()) for k in keeps])
    full = torch.zeros(batch.mask[rows].shape)
    for i, (keep, n, l) in enumerate(zip(keeps, ends, lp)):
        full[i, p:n - 1] = torch.zeros(keep.shape).masked_scatter(keep, l)
    return full, out.replaced


def _logp(model, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """Each target's logprob under softmax(logits / temperature) at its hidden state."""
    logits = model.head(hidden).float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


class RLTrainer:
    def __init__(self, model, rl, ref_model=None, version: int = 0):
        self.model, self.rl, self.ref, self.version = model, rl, ref_model, version
        self.trees = True  # a group's rollouts run as one tree over their prompt (False: padded rows, the old way)
        if not rl.train_embeddings:
            model.model.embed_tokens.weight.requires_grad_(False)
            model.lm_head.weight.requires_grad_(False)  # the same tensor when tied
        self.opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=rl.lr,
                                    betas=tuple(rl.betas))
        if ref_model is not None:
            ref_model.requires_grad_(False).eval()

    def step(self, groups: list[Group]) -> dict:
        """Train on the groups; returns the step's metrics (the version after it included)."""
        t0, rl = time.monotonic(), self.rl
        trajs = [t for g in groups for t in g.trajectories]
        axes = [r for g in groups for r in g.rewards]
        gid = torch.tensor([g.id for g in groups for _ in g.trajectories])
        # By length, so each chunk of rows is about as long as its longest (target_logp trims it).
        seqs = sorted((s for i, t in enumerate(trajs) for s in sequences(t, i)), key=lambda s: len(s.ids))
        batch = collate(seqs)
        n_rows, n_tokens = len(seqs), float(batch.mask.sum())
        row_group = gid[batch.traj] if self.trees else None  # a group's rollouts share its prompt: trees

        kl = torch.zeros(len(trajs))  # summed k1 per rollout, in the reward (detached)
        self.model.train()
        with torch.no_grad():
            if self.ref is not None and rl.kl_coef > 0:
                for rows, tree in _chunks(batch, torch.arange(n_rows), row_group):
                    pol, _ = target_logp(self.model, batch, rows, rl.temperature, True, rl.replay_ratio, tree)
                    ref, _ = target_logp(self.ref, batch, rows, rl.temperature, True, rl.replay_ratio, tree)
                    kl.index_add_(0, batch.traj[rows], (k1(pol, ref) * batch.mask[rows]).sum(1))
        reward = torch.tensor([sum(a.values()) for a in axes]) - rl.kl_coef * kl
        adv = group_advantages(reward, gid, scale_std=rl.scale_std)
        uniform = uniform_groups(torch.tensor([a["correctness"] for a in axes]), gid)
        if rl.mixed_groups_only:  # DAPO's filter: without a solve/fail contrast only the side terms would teach
            adv[uniform] = 0.0
        if rl.positive_only:  # learn from what went better than the group, never push a sample down
            adv = adv.clamp(min=0.0)

        self.opt.zero_grad(set_to_none=True)
        loss_sum, replaced = 0.0, 0
        trainer_lp = torch.zeros_like(batch.mask)
        # Per token: the rollout's advantage, minus the penalty on the turns whose tool call failed.
        token_adv = adv[batch.traj][:, None] - rl.failed_call_penalty * batch.failed
        # A row whose generated tokens all have advantage 0 adds nothing to the gradient under every
        # aggregation: it is not run (with mixed_groups_only or positive_only, most rows of a step).
        trained = ((token_adv != 0) & batch.mask.bool()).any(1)
        for rows, tree in _chunks(batch, trained.nonzero()[:, 0], row_group):
            lp, r = target_logp(self.model, batch, rows, rl.temperature, True, rl.replay_ratio, tree)
            loss = _chunk_loss(lp, token_adv[rows], batch, rows, rl, n_rows, n_tokens)
            loss.backward()
            loss_sum += float(loss.detach())
            replaced += r
            trainer_lp[rows] = lp.detach()
        measured = trained.clone()
        if not trained.any() and n_rows:  # nothing to train: the mismatch is still measured, on the shortest rows
            rows = _chunks(batch, torch.arange(n_rows))[0][0]
            with torch.no_grad():
                trainer_lp[rows] = target_logp(self.model, batch, rows, rl.temperature, True, rl.replay_ratio)[0]
            measured[rows] = True
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), rl.grad_clip or math.inf))
        self.opt.step()
        self.version += 1
        return {"version": self.version, "loss": loss_sum, "grad_norm": grad_norm, "replaced_experts": replaced,
                **mismatch(trainer_lp, batch, measured), **_reward_metrics(groups, reward, kl),
                **_tokens(trajs), "lag": _lag(batch, self.version - 1),
                "groups_mixed": len(groups) - len(set(gid[uniform].tolist())), "train_tokens": int(n_tokens),
                "trained_rows": int(trained.sum()), "step_s": time.monotonic() - t0,
                "tokens_per_s": n_tokens / max(time.monotonic() - t0, 1e-9)}


def sampler_weights(model, dtype: str) -> dict[str, torch.Tensor]:
    """What the trainer publishes: the model's weights as the samplers (engine.dtype) hold them, i.e.
    the fp32 master itself or each tensor rounded to bf16 (a step's bf16 delta is sparse: at RL's lr
    most bf16 values do not change)."""
    to = getattr(torch, dtype)
    return {k: v.detach().to(to) if v.is_floating_point() else v.detach() for k, v in model.state_dict().items()}


def _chunks(batch: Batch, rows: torch.Tensor, group: torch.Tensor | None = None) -> list[tuple[torch.Tensor, bool]]:
    """target_logp's chunks of `rows` (row indices, sorted by length), each with whether it is a tree.
    With `group` (each row's group id), a group's rows that share a prompt of MIN_SHARED or more
    tokens go together, up to TREE_TOKENS packed: a tree. The other rows go in consecutive runs of
    ROWS_PER_CHUNK, each about as long as its longest (target_logp trims it)."""
    keys: dict[tuple, list[int]] = {}
    for i in rows.tolist() if group is not None else []:
        if batch.mask[i].any():  # a row without a target has no length to pack by; it goes with the rest
            keys.setdefault((int(group[i]), *batch.ids[i, :MIN_SHARED].tolist()), []).append(i)
    out, in_tree = [], set()
    for members in (m for m in keys.values() if len(m) > 1):
        p = shared_prompt(batch, torch.tensor(members))
        if p < MIN_SHARED:
            continue
        chunk, size = [], 0
        for i in members:
            n = int(batch.mask[i].nonzero().max()) + 2 - p  # what the row adds to the tree
            if chunk and size + n > TREE_TOKENS:
                out.append((torch.tensor(chunk), len(chunk) > 1))
                chunk, size = [], 0
            size += n + (0 if chunk else p)
            chunk.append(i)
        out.append((torch.tensor(chunk), len(chunk) > 1))
        in_tree.update(members)
    rest = [i for i in rows.tolist() if i not in in_tree]
    return out + [(torch.tensor(rest[i:i + ROWS_PER_CHUNK]), False) for i in range(0, len(rest), ROWS_PER_CHUNK)]


def _chunk_loss(lp, adv, batch: Batch, rows, rl, n_rows: int, n_tokens: float) -> torch.Tensor:
    """This chunk's share of the whole batch's loss under the configured aggregation."""
    mask = batch.mask[rows]
    tis = {"sampler_logp": batch.sampler_logp[rows], "tis_cap": rl.tis_cap} if rl.tis_cap else {}
    if rl.aggregation == "constant":
        return policy_loss(lp, adv, mask, "constant", rl.loss_constant, **tis)
    if rl.aggregation == "token_mean":  # sum over the chunk / tokens of the whole batch
        return policy_loss(lp, adv, mask, "constant", max(n_tokens, 1.0), **tis)
    return policy_loss(lp, adv, mask, "seq_mean", **tis) * (mask.shape[0] / n_rows)


def mismatch(trainer_lp: torch.Tensor, batch: Batch, trained: torch.Tensor) -> dict:
    """Train/inference mismatch on the sampled tokens of the trained rows: KL(sampler || trainer) by
    k1 and k3, the largest logprob gap, and statistics of the ratio pi_trainer / pi_sampler."""
    keep = batch.mask.bool() & trained[:, None]
    if not keep.any():
        return {}
    d = (trainer_lp - batch.sampler_logp)[keep]  # log(pi_train / pi_sampler)
    ratio = d.exp()
    return {"mismatch_kl_k1": float(-d.mean()), "mismatch_kl_k3": float((ratio - 1 - d).mean()),
            "mismatch_max_abs": float(d.abs().max()), "ratio_mean": float(ratio.mean()),
            "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max())}


def _reward_metrics(groups: list[Group], reward: torch.Tensor, kl: torch.Tensor) -> dict:
    axes: dict[str, list[float]] = {}
    for g in groups:
        for a in g.rewards:
            for k, v in a.items():
                axes.setdefault(k, []).append(v)
    best = [max(a["correctness"] for a in g.rewards) for g in groups]  # best-of-K: any rollout solved it
    out = {f"reward/{k}": sum(v) / len(v) for k, v in axes.items()}
    out.update({"reward/kl": -float(kl.mean()), "reward_mean": float(reward.mean()),
                "solved_mean": sum(axes["correctness"]) / len(axes["correctness"]),
                "solved_best_of_k": sum(best) / len(best)})
    return out


def _tokens(trajs) -> dict:
    kinds = ("thinking_tokens", "tool_call_tokens", "tool_output_tokens", "final_tokens")
    return {**{f"tokens/{k}": sum(getattr(t.effort, k) for t in trajs) for k in kinds},
            "rollouts": len(trajs), "summarised": sum(len(t.segments) > 1 for t in trajs)}


def _lag(batch: Batch, trained_at: int) -> dict[str, int]:
    """How many versions behind the trained policy each target token was sampled: {lag: tokens}."""
    v = batch.version[batch.mask.bool()]
    return {str(k): n for k, n in sorted(Counter((trained_at - v).tolist()).items())}
