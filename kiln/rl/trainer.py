"""One RL optimizer step on finished groups: rewards (k1 included), advantages, the replayed
forward, the policy-gradient loss, Adam, and the step's metrics. Each group's forward and backward
run when it is added (RLTrainer.add, as its rollouts finish); the step applies their sum.

The trainer scores each sampled token under softmax(logits / temperature), the distribution the
sampler drew it from and recorded the logprob of. Only target positions go through the output
head (a rollout is mostly prompt and tool output). A group's rollouts run as one tree, their
shared prompt computed once (_tree_logp); other rows a few at a time, shortest first, each chunk cut
to its longest row (padding to the batch's longest cost ~30% of a step). The gradients accumulate
over chunks and groups, and sum to the gradient of the loss over the whole step under every
aggregation (the step-wide divisors of token_mean and seq_mean are applied once, at the step).
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.model import gemm
from kiln.model.layers import MIN_SHARED

from .batch import Batch, collate, sequences
from .logp import target_logprobs
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
    keep = mask.bool()
    # The last layer and the head run only where a target is scored (RLTrainer.add 1.26x faster on
    # the speedrun's groups, which score ~20% of their positions).
    out = model.trunk(ids, routes=routes, replay_ratio=replay_ratio, at=F.pad(keep, (0, 1)))
    full[:, :n - 1] = torch.zeros(mask.shape).masked_scatter(keep, target_logprobs(model, out.hidden, ids[:, 1:][keep], temperature))
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
    # Row r's position t (>= p) is packed at p + its offset + t - p; the last position of each
    # rest has no target.
    keeps = [batch.mask[r, p:n - 1].bool() for r, n in zip(rs, ends)]
    at = torch.cat([torch.zeros(p, dtype=torch.bool)] + [F.pad(k, (0, 1)) for k in keeps])[None]
    out = model.trunk(ids[None], positions=pos[None], doc_ids=docs[None], routes=routes, replay_ratio=replay_ratio,
                      shared_prefix=True, at=at)
    targets = torch.cat([batch.ids[r, p + 1:n][k] for r, n, k in zip(rs, ends, keeps)])
    lp = target_logprobs(model, out.hidden, targets, temperature).split([int(k.sum()) for k in keeps])
    full = torch.zeros(batch.mask[rows].shape)
    for i, (keep, n, l) in enumerate(zip(keeps, ends, lp)):
        full[i, p:n - 1] = torch.zeros(keep.shape).masked_scatter(keep, l)
    return full, out.replaced


class RLTrainer:
    def __init__(self, model, rl, ref_model=None, version: int = 0):
        self.model, self.rl, self.ref, self.version = model, rl, ref_model, version
        self.acc: dict | None = None  # what add() has accumulated toward the next step
        self.trees = True  # a group's rollouts run as one tree over their prompt (False: padded rows, the old way)
        if not rl.train_embeddings:
            model.model.embed_tokens.weight.requires_grad_(False)
            model.lm_head.weight.requires_grad_(False)  # the same tensor when tied
        self.opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=rl.lr,
                                    betas=tuple(rl.betas))
        if ref_model is not None:
            ref_model.requires_grad_(False).eval()

    @property
    def pending(self) -> list[Group]:
        """The groups added since the last step, in the order they came."""
        return list(self.acc["groups"]) if self.acc else []

    @gemm.routed()
    def add(self, group: Group) -> None:
        """Run one group's forward and backward into the coming step's gradients. Groups arrive as
        their rollouts finish, so a step's compute overlaps the rollouts of its later groups; `step`
        applies what the added groups sum to. Advantages are per group, so nothing here depends on
        the step's other groups: only the batch-wide divisors (token_mean, seq_mean), which `step`
        applies to the summed gradient."""
        t0, rl = time.monotonic(), self.rl
        if not self.acc:
            self.opt.zero_grad(set_to_none=True)
            self.acc = {"groups": [], "reward": [], "kl": [], "d": [], "lag": Counter(), "loss": 0.0, "replaced": 0,
                        "mixed": 0, "rows": 0, "tokens": 0.0, "trained_rows": 0, "seconds": 0.0, "unmeasured": None}
        acc, trajs = self.acc, group.trajectories
        # By length, so each chunk of rows is about as long as its longest (target_logp trims it).
        seqs = sorted((s for i, t in enumerate(trajs) for s in sequences(t, i)), key=lambda s: len(s.ids))
        batch = collate(seqs)
        n_rows = len(seqs)
        one_tree = torch.zeros(n_rows, dtype=torch.long) if self.trees else None  # rollouts share the prompt

        kl = torch.zeros(len(trajs))  # summed k1 per rollout, in the reward (detached)
        self.model.train()
        with torch.no_grad():
            if self.ref is not None and rl.kl_coef > 0:
                for rows, tree in _chunks(batch, torch.arange(n_rows), one_tree):
                    pol, _ = target_logp(self.model, batch, rows, rl.temperature, True, rl.replay_ratio, tree)
                    ref, _ = target_logp(self.ref, batch, rows, rl.temperature, True, rl.replay_ratio, tree)
                    kl.index_add_(0, batch.traj[rows], (k1(pol, ref) * batch.mask[rows]).sum(1))
        reward = torch.tensor([sum(a.values()) for a in group.rewards]) - rl.kl_coef * kl
        gid = torch.zeros(len(trajs), dtype=torch.long)
        adv = group_advantages(reward, gid, scale_std=rl.scale_std)
        uniform = bool(uniform_groups(torch.tensor([a["correctness"] for a in group.rewards]), gid).all())
        if uniform and rl.mixed_groups_only:  # DAPO's filter: without a solve/fail contrast only the side terms would teach
            adv[:] = 0.0
        if rl.positive_only:  # learn from what went better than the group, never push a sample down
            adv = adv.clamp(min=0.0)

        trainer_lp = torch.zeros_like(batch.mask)
        # Per token: the rollout's advantage, minus the penalties on the turns whose tool call failed
        # and on those that repeated a failed call.
        token_adv = (adv[batch.traj][:, None] - rl.failed_call_penalty * batch.failed
                     - rl.repeated_call_penalty * batch.repeated)
        # A row whose generated tokens all have advantage 0 adds nothing to the gradient under every
        # aggregation: it is not run (with mixed_groups_only or positive_only, most rows of a step).
        trained = ((token_adv != 0) & batch.mask.bool()).any(1)
        for rows, tree in _chunks(batch, trained.nonzero()[:, 0], one_tree):
            lp, r = target_logp(self.model, batch, rows, rl.temperature, True, rl.replay_ratio, tree)
            loss = _chunk_loss(lp, token_adv[rows], batch, rows, rl)
            loss.backward()
            acc["loss"] += float(loss.detach())
            acc["replaced"] += r
            trainer_lp[rows] = lp.detach()
        keep = batch.mask.bool() & trained[:, None]
        if keep.any():
            acc["d"].append((trainer_lp - batch.sampler_logp)[keep])
        elif acc["unmeasured"] is None and n_rows:
            acc["unmeasured"] = batch  # a step with nothing to train still measures the mismatch (step)
        acc["groups"].append(group)
        acc["reward"].append(reward)
        acc["kl"].append(kl)
        acc["lag"] += _lag(batch, self.version)
        acc["mixed"] += not uniform
        acc["rows"] += n_rows
        acc["tokens"] += float(batch.mask.sum())
        acc["trained_rows"] += int(trained.sum())
        acc["seconds"] += time.monotonic() - t0

    @gemm.routed()
    def step(self, groups: list[Group] = ()) -> dict:
        """add() each of `groups`, then one optimizer step on every group added since the last; returns
        the step's metrics (the version after it included)."""
        for g in groups:
            self.add(g)
        if not self.acc:
            raise ValueError("an RL step needs at least one group")
        t0, rl, acc = time.monotonic(), self.rl, self.acc
        # add() summed the token terms; token_mean and seq_mean divide by the whole step's count.
        scale = {"token_mean": 1 / max(acc["tokens"], 1.0), "seq_mean": 1 / max(acc["rows"], 1)}.get(rl.aggregation, 1.0)
        if scale != 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        d = torch.cat(acc["d"]) if acc["d"] else None
        if d is None and acc["unmeasured"] is not None:
            # Nothing trained: the mismatch of the shortest row with a sampled token. One row, not a
            # chunk of four: this forward is all such a step computes (2-4 s for four on one core).
            batch = acc["unmeasured"]
            rows = batch.mask.any(1).nonzero()[:1, 0]
            if len(rows):
                with torch.no_grad():
                    lp = target_logp(self.model, batch, rows, rl.temperature, True, rl.replay_ratio)[0]
                d = (lp - batch.sampler_logp[rows])[batch.mask[rows].bool()]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), rl.grad_clip or math.inf))
        self.opt.step()
        self.version += 1
        self.acc = None
        groups = acc["groups"]
        seconds = acc["seconds"] + time.monotonic() - t0
        return {"version": self.version, "loss": acc["loss"] * scale, "grad_norm": grad_norm,
                "replaced_experts": acc["replaced"], **(_mismatch(d) if d is not None and len(d) else {}),
                **_reward_metrics(groups, torch.cat(acc["reward"]), torch.cat(acc["kl"])),
                **_tokens([t for g in groups for t in g.trajectories]), "lag": dict(sorted(acc["lag"].items(), key=lambda kv: int(kv[0]))),
                "groups_mixed": acc["mixed"], "train_tokens": int(acc["tokens"]),
                "trained_rows": acc["trained_rows"], "step_s": seconds,
                "tokens_per_s": acc["tokens"] / max(seconds, 1e-9)}


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


def _chunk_loss(lp, adv, batch: Batch, rows, rl) -> torch.Tensor:
    """This chunk's terms under the configured aggregation, before the step-wide divisor: "constant"
    is final; "token_mean" is the chunk's summed terms and "seq_mean" its summed per-row means, which
    RLTrainer.step divides by the step's tokens or rows."""
    mask = batch.mask[rows]
    tis = {"sampler_logp": batch.sampler_logp[rows], "tis_cap": rl.tis_cap} if rl.tis_cap else {}
    if rl.aggregation == "constant":
        return policy_loss(lp, adv, mask, "constant", rl.loss_constant, **tis)
    if rl.aggregation == "token_mean":
        return policy_loss(lp, adv, mask, "constant", 1.0, **tis)
    return policy_loss(lp, adv, mask, "seq_mean", **tis) * mask.shape[0]


def mismatch(trainer_lp: torch.Tensor, batch: Batch, trained: torch.Tensor) -> dict:
    """Train/inference mismatch on the sampled tokens of the trained rows: KL(sampler || trainer) by
    k1 and k3, the largest logprob gap, and statistics of the ratio pi_trainer / pi_sampler."""
    keep = batch.mask.bool() & trained[:, None]
    return _mismatch((trainer_lp - batch.sampler_logp)[keep]) if keep.any() else {}


def _mismatch(d: torch.Tensor) -> dict:
    """mismatch() of the sampled tokens' log(pi_train / pi_sampler)."""
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


def _lag(batch: Batch, trained_at: int) -> Counter:
    """How many versions behind the trained policy each target token was sampled: {lag: tokens}."""
    v = batch.version[batch.mask.bool()]
    return Counter(str(k) for k in (trained_at - v).tolist())
