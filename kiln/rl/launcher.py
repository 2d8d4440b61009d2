"""`kiln rl`: the driver. It owns the orchestrator, runs the trainer and N rollout workers as Ray
actors (a local Ray by default, a cluster by `ray.address` / `$RAY_ADDRESS`), and feeds them:
prompts to idle workers, each finished group to the trainer as it finishes.

- Roles get `rl.trainer_resources` / `rl.worker_resources` (CPUs, GPUs, custom resources) in one
  placement group of strategy `rl.placement`: PACK/STRICT_PACK keep them together, SPREAD/
  STRICT_SPREAD apart.
- Only small things travel through Ray: jobs, a group's JSON files (kept by the driver under
  `groups/`), the groups handed to the trainer, metrics rows. Weights go through the weight store
  (a folder, or `s3://` across nodes); the store, not Ray's object store, is their source of truth.
- A worker that dies (ray.kill, its process killed, its node gone) is restarted by Ray
  (`max_restarts`) and its running groups are re-queued; a Python error in a rollout re-queues
  that group. A trainer that dies is restarted by Ray and resumes from `state/` (weights,
  optimizer, version, groups trained); the groups it had taken but not trained go back to the
  queue. A trainer step that raises restarts it the same way (its memory is not trusted).
- Everything the run needs to resume is on the driver's disk under `<run dir>/rl/`:
  `orchestrator.json`, `groups/`, `metrics.jsonl`; the trainer keeps `state/` and `checkpoint/`
  under the same path on its node. Running `kiln rl` again after the driver died picks up there.
- No wait is unbounded: no progress (a role started, a group finished, a step trained) for
  rl.timeout_s is an error naming every role still awaited and its node.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from kiln import cluster
from kiln.config_io import config_to_toml

from . import placement
from .orchestrator import Orchestrator, Prompt
from .store import WeightStore

MAX_RESTARTS = 5  # per role: more means something is broken, not unlucky
POLL_S = 0.5


class RLError(RuntimeError):
    """The run cannot start or cannot go on."""


def prepare_tasks(cfg, rl_dir: Path, progress: bool = True) -> Path:
    """rl.tasks toy prompts of the train split, after the SFT data's (kept apart by task_seed)."""
    from kiln.tasks.record import load_suite
    from kiln.tasks.toy import generate_toy

    suite = rl_dir / "tasks"
    have = load_suite(str(suite)) if suite.is_dir() and any(suite.iterdir()) else []
    if len(have) < cfg.rl.tasks:
        y = generate_toy(str(suite), cfg.rl.tasks, seed=cfg.rl.task_seed, level=cfg.rl.level or None, split="train",
                         sandbox_cfg=cfg.sandbox, progress=progress)
        if y.kept == 0:
            raise RLError(f"no toy task could be generated in {suite} (rejected: {dict(y.rejected)})")
    return suite


def run_rl(cfg, checkpoint: str, rl_dir: str, progress: bool = True) -> dict:
    """Train the policy at `checkpoint` with asynchronous RL; returns a summary (metrics rows, final
    checkpoint, group counts, restarts per role, each worker's speculative steps and drafts accepted)."""
    from kiln.tasks.record import load_suite

    from .rollout import task_kind

    rl, run = cfg.rl, Path(rl_dir).resolve()
    if not (cfg.ray.address or os.environ.get("RAY_ADDRESS")):  # one machine: its CPU ids, checked up front
        try:
            placement.check(rl.trainer_cpus, rl.worker_cpus, cfg.sandbox.cpus)
        except ValueError as e:
            raise RLError(str(e)) from None
    if not (Path(checkpoint) / "config.json").is_file():
        raise RLError(f"no checkpoint at {checkpoint!r}: run `kiln sft` first, or set rl.checkpoint=DIR")
    if rl.speculative and not (Path(checkpoint) / "mtp.safetensors").is_file():
        raise RLError(f"rl.speculative drafts with the checkpoint's MTP module, and {checkpoint!r} has none "
                      "(no mtp.safetensors): set rl.speculative=false, or start from a checkpoint that has one")
    need_cpus = rl.trainer_resources.get("CPU", 0) + rl.workers * rl.worker_resources.get("CPU", 0)
    try:
        started = cluster.connect(cfg.ray, min_cpus=need_cpus)
    except cluster.ClusterError as e:
        raise RLError(str(e)) from None
    try:
        # What no node can hold is refused before any work (Ray would leave it pending).
        cluster.check_fits("trainer", "rl.trainer_resources", rl.trainer_resources)
        cluster.check_fits("rollout worker", "rl.worker_resources", rl.worker_resources, rl.workers)
        cluster.check_total([("trainer", rl.trainer_resources, 1), ("rollout worker", rl.worker_resources, rl.workers)],
                            "lower rl.trainer_resources, rl.worker_resources or rl.workers, or add nodes")
        run.mkdir(parents=True, exist_ok=True)
        suite = prepare_tasks(cfg, run, progress)
        tasks = load_suite(str(suite))[: rl.tasks]
        if len(tasks) < rl.steps * rl.groups_per_step:
            raise RLError(f"{rl.steps} steps x {rl.groups_per_step} groups need {rl.steps * rl.groups_per_step} "
                          f"prompts (single epoch) but there are {len(tasks)}: raise rl.tasks")
        (run / "config.toml").write_text(config_to_toml(cfg))
        orch = Orchestrator(str(run / "orchestrator.json"), [Prompt(t.id, task_kind(t)) for t in tasks], rl,
                            cfg.run.seed)
        return Driver(cfg, orch, run, Path(checkpoint).resolve(), suite.resolve()).run()
    except cluster.ClusterError as e:
        raise RLError(str(e)) from None
    finally:
        if started:
            import ray

            ray.shutdown()


class Driver:
    """One run's actors and the loop that feeds them (see the module doc)."""

    def __init__(self, cfg, orch: Orchestrator, run: Path, checkpoint: Path, suite: Path):
        import ray
        from ray.util.placement_group import placement_group

        from .loop import Trainer
        from .worker import RolloutWorker

        self.ray, self.cfg, self.rl, self.orch, self.dir = ray, cfg, cfg.rl, orch, run
        rl = self.rl
        self.store_url = rl.store or str(run / "weights")
        if "://" not in self.store_url:
            self.store_url = str(Path(self.store_url).resolve())
            if len(cluster.alive_nodes()) > 1:
                print(f"rl: warning: the weight store {self.store_url} is a folder: every node must see it at "
                      f"that path (a shared filesystem); set rl.store=s3://bucket/prefix otherwise", flush=True)
        bundles = [_bundle("rl.trainer_resources", rl.trainer_resources)]
        bundles += [_bundle("rl.worker_resources", rl.worker_resources)] * rl.workers
        self.pg = placement_group(bundles, strategy=rl.placement)
        if not self.pg.wait(timeout_seconds=rl.timeout_s):
            ray.util.remove_placement_group(self.pg)
            raise RLError(f"Ray could not place the roles within {rl.timeout_s:.0f} s: placement group "
                          f"{rl.placement} of {bundles} (trainer first, then each worker) on nodes "
                          f"{[cluster.describe(n) + ' ' + cluster._fmt(n['Resources']) for n in cluster.alive_nodes()]}")
        # Held for the run: a restarted actor gets these again, shipped folders included.
        # The MTP drafter travels only when the workers draft with it (rl.speculative).
        self.start = start = {"checkpoint": cluster.Shipped.of(str(checkpoint),
                                                               skip=() if rl.speculative else ("mtp.safetensors",)),
                              "store": self.store_url, "tasks": cluster.Shipped.of(str(suite))}
        self.trainer = Trainer.options(**self._opts(0, rl.trainer_resources, "trainer")).remote(cfg, start, str(run))
        self.workers = [RolloutWorker.options(**self._opts(i + 1, rl.worker_resources, f"worker-{i}")).remote(
            cfg, start, i) for i in range(rl.workers)]
        self.roles = ["trainer"] + [f"worker-{i}" for i in range(rl.workers)]
        self.info: dict[str, dict | None] = dict.fromkeys(self.roles)  # ready() of each role's live incarnation
        self.restarts = dict.fromkeys(self.roles, 0)
        self.version = dict.fromkeys(self.roles[1:], 0)
        self.drafts = {}  # per worker, its engine's speculative steps and drafts accepted so far
        self.calls: dict = {}  # ObjectRef -> (role, kind, payload, since)
        self.metrics = _metrics(run)
        self.idle, self.idle_since = 0.0, None
        self.handed, self.step_wait = [], 0.0  # the groups the trainer holds toward its next step, its wait for them
        self.fresh: dict[int, dict] = {}  # finished groups' files as their worker returned them, until handed on
        self.ready_at = dict.fromkeys(self.roles, 0.0)  # roles to ask ready() (started, or restarting) and when

    def _opts(self, bundle: int, resources: dict, role: str) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # Named for the dashboard (and for tests that inject faults): the role and the run dir.
        return {**cluster.ray_options(resources), "max_restarts": MAX_RESTARTS, "max_task_retries": 0,
                "name": actor_name(role, self.dir),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)}

    def _actor(self, role: str):
        return self.trainer if role == "trainer" else self.workers[int(role.split("-")[1])]

    def _call(self, role: str, kind: str, *args, payload=None) -> None:
        ref = getattr(self._actor(role), kind).remote(*args)
        self.calls[ref] = (role, kind, payload, time.monotonic())

    def _busy(self, role: str, kind: str) -> bool:
        return self._in_flight(role, kind) > 0

    def _in_flight(self, role: str, kind: str) -> int:
        return sum(r == role and k == kind for r, k, _, _ in self.calls.values())

    def run(self) -> dict:
        self.progress = time.monotonic()
        try:
            while not (self.orch.finished() and not self._busy("trainer", "train")):
                self._dispatch()
                if self.calls:
                    done, _ = self.ray.wait(list(self.calls), num_returns=1, timeout=POLL_S)
                    for ref in done:
                        self._collect(ref, *self.calls.pop(ref))
                else:  # every role idle: workers held back by admission, the trainer short of groups
                    time.sleep(POLL_S)
                if time.monotonic() - self.progress > self.rl.timeout_s:
                    raise RLError(f"no role started, no group finished and no step trained for "
                                  f"{self.rl.timeout_s:.0f} s; waiting on {self._waiting()} (groups: "
                                  f"{self.orch.counts()}); raise rl.timeout_s if rollouts are just slow")
            checkpoint = self._get(self.trainer.finish.remote(), "trainer", "saving the checkpoint")
            at = self.info["trainer"] and self.info["trainer"]["node_id"]
            # Written on the trainer's node: say which when it is not this one.
            elsewhere = at and at != self.ray.get_runtime_context().get_node_id() and cluster.node_of(at)
        finally:
            self._stop()
        steps = sum(d["steps"] for d in self.drafts.values())
        if steps:
            print(f"rl: speculative decoding accepted {sum(d['accepted'] for d in self.drafts.values()) / steps:.2f} "
                  f"drafts a step over {steps} steps", flush=True)
        return {"metrics": self.metrics.rows(), "checkpoint": checkpoint, "checkpoint_node": elsewhere or None,
                "groups": self.orch.counts(), "restarts": self.restarts, "drafts": self.drafts,
                "nodes": {r: i and i["node_id"] for r, i in self.info.items()}}

    def _dispatch(self) -> None:
        rl, now = self.rl, time.monotonic()
        for role, at in list(self.ready_at.items()):
            if now >= at:
                del self.ready_at[role]
                self._call(role, "ready")
        for role in self.roles[1:]:
            room = rl.worker_groups - self._in_flight(role, "rollout")
            if self.info[role] is None or room <= 0 or self.orch.finished():
                continue
            jobs = self.orch.next_jobs(self.info[role]["name"], self.version[role], room)
            for job in jobs:
                self._call(role, "rollout", job, payload={**job, "worker": self.info[role]["name"]})
            if not jobs and not self._busy(role, "version"):
                # Refused for lag: the worker answers once its poller has applied newer weights (or
                # after a second), so the group it may then start is dispatched within milliseconds.
                self._call(role, "version", self.version[role])
        if self.info["trainer"] is not None and not self._busy("trainer", "train") and not self.orch.finished():
            # Each group as soon as it is done: the trainer runs its forward and backward while the
            # step's other groups are still rolling out, and steps once it holds groups_per_step.
            groups = self.orch.take(rl.groups_per_step - len(self.handed), 0, least=1)
            if groups:
                wait = now - (self.idle_since or now)
                self.idle += wait
                self.step_wait += wait
                self.handed += [g["id"] for g in groups]
                self._call("trainer", "train", [self._group(g) for g in groups], self.step_wait, self.idle,
                           payload=list(self.handed))
            elif self.idle_since is None:
                self.idle_since = now

    def _group(self, g: dict):
        """A taken group for the trainer: from the files its worker returned, or, when this driver did
        not receive them (it resumed, or the group went back to the queue), from its copy on disk.
        Reading the copy back cost 0.17-0.85 s a group, while the trainer waited for it."""
        from .rollout import group_from, load_group

        files = self.fresh.pop(g["id"], None)
        return group_from(files, g["started_version"]) if files else load_group(g["path"], g["started_version"])

    def _collect(self, ref, role: str, kind: str, payload, since: float) -> None:
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        try:
            value = self.ray.get(ref, timeout=self.rl.timeout_s)
        except RayActorError as e:  # died: Ray restarts it (max_restarts); ready() answers when it is back
            if e.actor_init_failed:  # its start raised: the same arguments would raise again
                raise RLError(f"the {role} could not start: {_first_line(e)}") from None
            if kind == "ready":  # still restarting (not counted), or died again while starting (counted)
                if not isinstance(e, ActorUnavailableError):
                    self._count(role, "its node", f"died again while restarting ({_first_line(e)})")
                self.ready_at[role] = time.monotonic() + 1.0
            elif self.info[role] is not None:  # the first sign of this death; later ones add nothing
                self._lost(role, f"died ({_first_line(e)})", restart=False)
            return
        except RayTaskError as e:
            if self.info[role] is not None:
                self._lost(role, f"raised {_first_line(e)}", restart=role == "trainer")
            return
        if kind != "version":  # a worker's version answer, every second while it is refused, is no progress
            self.progress = time.monotonic()
        if kind == "ready":
            self.info[role] = value
            where = cluster.node_of(value["node_id"])
            if role == "trainer":
                self._trainer_back(value, where)
            else:
                self.version[role] = value["version"]
                print(f"rl: {role} ready on {where} ({value['name']}, weights version {value['version']})", flush=True)
        elif kind == "version":
            self.version[role] = value
        elif kind == "rollout":
            from .rollout import keep_group

            self.version[role] = value["version"]
            self.drafts[role] = value["drafts"]
            if value["name"] != payload["worker"]:  # it died while idle and this call found its next incarnation
                self._restarted(role, payload["worker"], {**self.info[role], "name": value["name"]})
            path = keep_group(value["files"], str(self.dir / "groups"), payload["group"])
            self.fresh[payload["group"]] = value["files"]
            self.orch.submit(payload["worker"], payload["group"], path, value["files"]["group.json"]["cost"])
        elif kind == "train":
            value, pid = value
            if pid != self.info[role]["pid"]:  # it died while idle; its next incarnation resumed from state/
                self._restarted(role, f"pid {self.info[role]['pid']}", {**self.info[role], "pid": pid})
            self.idle_since = time.monotonic()
            if value is None:  # the groups are in; the step waits for more
                return
            self.metrics.append(value)
            self.orch.trained(payload, value["step"])
            self.handed, self.step_wait = [], 0.0
            print(f"rl step {value['step']}/{self.rl.steps}: reward {value['reward_mean']:+.3f} solved "
                  f"{value['solved_mean']:.2f} best-of-{self.rl.group_size} {value['solved_best_of_k']:.2f} "
                  f"mismatch_kl {value.get('mismatch_kl_k3', 0):.2e} lag {value['group_lag']} "
                  f"waited {value['wait_s']:.1f}s", flush=True)

    def _trainer_back(self, info: dict, where: str) -> None:
        """A (re)started trainer: its state says which groups are trained; the rest it held go back."""
        v = info["version"]
        self.orch.hello(v, info["trained"])
        self.metrics.truncate(v)
        self.handed, self.step_wait = [], 0.0  # what it held toward its next step went back with hello()
        if info["metrics"] and not any(r["step"] == v for r in self.metrics.rows()):
            self.metrics.append(info["metrics"])  # it saved this step, then died before returning it
        self.idle_since = time.monotonic()
        print(f"rl: trainer ready on {where} at version {v}", flush=True)

    def _restarted(self, role: str, old: str, info: dict) -> None:
        """A restart noticed only by a later answer (the role died between calls)."""
        self.restarts[role] += 1
        self.info[role] = info
        if role != "trainer":
            self.orch.worker_lost(old)
            WeightStore(self.store_url).forget(old)
        print(f"rl: the {role} ({old}) was restarted between calls", flush=True)

    def _count(self, role: str, where: str, why: str) -> None:
        self.restarts[role] += 1
        if self.restarts[role] > MAX_RESTARTS:
            raise RLError(f"the {role} on {where} failed {MAX_RESTARTS + 1} times; last it {why}")

    def _lost(self, role: str, why: str, restart: bool) -> None:
        """A role's live incarnation is gone: count it, give back its work, and await the next one."""
        info, self.info[role] = self.info[role], None
        where = cluster.node_of(info["node_id"]) if info else "its node"
        self._count(role, where, why)
        if role == "trainer":
            print(f"rl: the trainer on {where} {why}; it restarts from its last state", flush=True)
            if restart:  # a step raised midway: its weights and optimizer may be half-updated
                self.ray.kill(self.trainer, no_restart=False)
        elif info is not None:
            lost = self.orch.worker_lost(info["name"])
            WeightStore(self.store_url).forget(info["name"])  # its marker would pin old versions
            print(f"rl: {role} on {where} {why}; re-queued groups {lost}", flush=True)
        for ref, (r, kind, _, _) in list(self.calls.items()):
            if r == role and kind != "rollout":  # answers of the old incarnation no longer matter
                del self.calls[ref]
        self.ready_at[role] = time.monotonic()

    def _waiting(self) -> str:
        now, out = time.monotonic(), []
        for role, kind, payload, since in self.calls.values():
            info = self.info[role]
            where = cluster.node_of(info["node_id"]) if info else "a node not yet known"
            what = ("to start" if kind == "ready" else f"group {payload['group']}" if kind == "rollout"
                    else f"training on groups {payload}" if kind == "train" else "newer weights")
            out.append(f"the {role} on {where} ({what}, {now - since:.0f} s)")
        out += [f"the {role} to come back after a restart" for role in self.ready_at]
        if self.info["trainer"] is not None and not self._busy("trainer", "train"):
            out.append(f"the trainer for {self.rl.groups_per_step - len(self.handed)} more finished group(s)")
        return "; ".join(out) or "nothing"

    def _get(self, ref, role: str, what: str):
        from ray.exceptions import GetTimeoutError, RayError

        try:
            return self.ray.get(ref, timeout=self.rl.timeout_s)
        except GetTimeoutError:
            raise RLError(f"the {role} did not finish {what} within {self.rl.timeout_s:.0f} s") from None
        except RayError as e:
            raise RLError(f"the {role} failed {what}: {_first_line(e)}") from None

    def _stop(self) -> None:
        """Idle workers stop their engines first; then every actor and the placement group go."""
        idle = [w for role, w in zip(self.roles[1:], self.workers) if not self._busy(role, "rollout")]
        # A dead worker's close fails at once; the wait only bounds the live ones.
        if idle:
            self.ray.wait([w.close.remote() for w in idle], num_returns=len(idle), timeout=30)
        for a in [self.trainer, *self.workers]:
            self.ray.kill(a, no_restart=True)
        self.ray.util.remove_placement_group(self.pg)


def _bundle(key: str, resources: dict[str, float]) -> dict[str, float]:
    b = {k: float(v) for k, v in resources.items() if v > 0}
    if not b:
        raise RLError(f"{key} = {resources}: give the role at least one resource above 0 "
                      f"(e.g. {{CPU = 0.5}}); Ray cannot reserve an empty bundle")
    return b


def _metrics(run: Path):
    from kiln.pretrain.checkpointing import MetricsLog

    return MetricsLog(run / "metrics.jsonl")


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    tail = next((ln for ln in reversed(lines) if not ln.startswith(" ")), "")  # the exception line of a traceback
    return f"{type(e).__name__}: {tail or (lines[0] if lines else '')}"[:500]


def actor_name(role: str, rl_dir) -> str:
    return f"kiln-rl {role} {Path(rl_dir).resolve()}"


def rl_dir_of(cfg) -> str:
    return os.path.join(cfg.run.out_dir, cfg.run.name, "rl")
