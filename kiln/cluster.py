"""Ray for kiln: a light local Ray by default, a cluster by address, and folders carried to nodes.

- `connect(ray_cfg)`: attach to `ray.address`, else `$RAY_ADDRESS`, else start a local Ray
  (no dashboard, a small object store, on loopback, workers not reniced). A Ray already initialised in this process is
  used as it is. Returns True when the caller started or attached it and so must shut it down.
- `ray_options(resources)`: a config's `{"CPU": 1, "GPU": 1, "memory": ..., "custom": 2}` as
  `.options()` keywords; `check_fits` refuses a request no cluster node could ever meet, at once,
  instead of leaving it pending.
- `Shipped`: a folder on the driver's node that an actor or task on another node needs (a task
  suite, a checkpoint). On the driver's node it is the folder itself; elsewhere its bytes come
  through Ray's object store once and are unpacked into a node-local cache. Nothing assumes a
  shared filesystem.
"""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import socket
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

_ROLE_KEYS = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}


class ClusterError(RuntimeError):
    """Ray cannot be reached, or cannot ever run what was asked of it."""


_own_local = False  # this process started the Ray it uses, on one machine (no node can join it)


def connect(ray_cfg, min_cpus: float = 0) -> bool:
    """Make this process a Ray driver (see the module doc); `min_cpus`: what the caller's roles need
    at once, so a local Ray on a smaller machine still schedules them (they share its cores)."""
    import ray

    global _own_local
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # never phone home
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS", "")
    t, _own_local = time.monotonic(), False
    try:
        if address:
            _probe(address)
            _token_auth(address)
            try:
                ray.init(address=address, log_to_driver=True, configure_logging=False)
            except ConnectionError as e:  # it speaks gRPC (the probe) but did not let us in
                raise ConnectionError(f"{e}; if the cluster uses token authentication (Ray turns it on when the "
                                      f"head has ~/.ray/auth_token), give this machine the same token: copy the "
                                      f"head's ~/.ray/auth_token here, or set RAY_AUTH_TOKEN") from None
        else:
            ncpu = ray_cfg.num_cpus or max(len(os.sched_getaffinity(0)), int(-(-min_cpus // 1)))
            # A one-machine Ray binds to loopback only. Ray takes the host's routable address unless
            # multi-node clusters are off (the mode it uses on macOS and Windows), a flag it reads once,
            # at import: the variable is for the processes it starts, the constant for this one.
            from ray._private import ray_constants

            old, old_flag = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"), ray_constants.ENABLE_RAY_CLUSTER
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
            ray_constants.ENABLE_RAY_CLUSTER = False
            try:
                # worker_niceness 0: Ray renices its workers by +15 by default, and here the workers are
                # the run itself (measured: an actor at nice 19 did not finish loading in 4 minutes on a
                # busy 2-core machine); they keep the priority kiln was started with, as processes did.
                # address="local": a Ray of its own even when another runs here (attach with ray.address=auto).
                ray.init(address="local", num_cpus=ncpu, include_dashboard=False, object_store_memory=ray_cfg.object_store_mb << 20,
                         log_to_driver=True, configure_logging=False, _system_config={"worker_niceness": 0})
                _own_local = True
            finally:
                ray_constants.ENABLE_RAY_CLUSTER = old_flag
                if old is None:
                    os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
                else:
                    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = old
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = f"the Ray cluster at {address!r}" if address else "a local Ray"
        raise ClusterError(f"cannot start or reach {where}: {e}") from None
    where = f"cluster {address}" if address else "local Ray"
    nodes = alive_nodes()
    print(f"ray: {where}, {len(nodes)} node(s) at {', '.join(sorted({n['NodeManagerAddress'] for n in nodes}))}, "
          f"{ray.cluster_resources().get('CPU', 0):g} CPUs (ready in {time.monotonic() - t:.1f} s)", flush=True)
    return True


PROBE_S = 10.0


def _probe(address: str) -> None:
    """Fail in seconds when nothing answers at a cluster's address: ray.init itself retries for many
    minutes, printing only warnings. `address` as ray.init takes it: host:port, "auto" (the Ray last
    started on this machine), or ray://host:port (Ray Client)."""
    from ray._private import services

    try:
        if address.startswith("ray://"):
            host, port = services.parse_address(address[len("ray://"):]) or (address[len("ray://"):], "10001")
        else:  # as ray.init resolves it ("auto" from this machine's record, localhost to the node's address)
            host, port = services.parse_address(services.canonicalize_bootstrap_address_or_die(address))
        port = int(port)
    except (ValueError, ConnectionError, TypeError) as e:
        raise ValueError(f"{str(e).rstrip('.')}; give HEAD_HOST:PORT, the address `ray start --head` printed "
                         f"(port 6379 by default)") from None
    try:
        conn = socket.create_connection((host, port), timeout=PROBE_S)
    except OSError as e:
        raise ConnectionError(f"nothing answers at {host}:{port} ({e.strerror or e or 'timed out'}): is `ray start "
                              f"--head` running there, and is the port reachable from this machine?") from None
    try:  # Ray's GCS is a gRPC server: to HTTP/2's preface it answers with a SETTINGS frame (type 4)
        conn.settimeout(PROBE_S)
        conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
        first = conn.recv(9)
    except OSError:
        first = b""
    finally:
        conn.close()
    if len(first) < 4 or first[3] != 4:
        raise ConnectionError(f"{host}:{port} takes connections but is not a Ray head's GCS (it "
                              f"{'answered ' + repr(first[:16]) if first else 'said nothing'}): give the port "
                              f"`ray start --head` printed (6379 by default), not the dashboard's (8265)")


def _token_auth(address: str) -> None:
    """Send the cluster's token when its head asks for one. Ray 2.60's `ray start --head` turns token
    authentication on when the head has ~/.ray/auth_token, and ray.init looks for a token only for
    address="auto". Sending one to a head without authentication is not harmless: this driver would
    then demand it of every worker fetching its objects. So the GCS is asked first, without a token
    and under a made-up cluster id: InvalidAuthToken means it wants one. $RAY_AUTH_MODE, when set,
    decides instead."""
    if "RAY_AUTH_MODE" in os.environ or address.startswith("ray://"):
        return
    try:
        from ray._private import services
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
        from ray._raylet import GcsClient

        gcs = services.canonicalize_bootstrap_address_or_die(address)
    except (ImportError, ValueError, ConnectionError):  # a Ray without token authentication; or ray.init will say
        return
    try:
        GcsClient(address=gcs, cluster_id="01" * 28).internal_kv_get(b"kiln-probe", None, timeout=PROBE_S)
        return
    except Exception as e:  # noqa: BLE001 - WrongClusterID (no token asked for) or InvalidAuthToken
        if "InvalidAuthToken" not in str(e):
            return
    if not maybe_enable_token_auth_if_token_available(warn_if_disabled=False):
        raise ConnectionError(f"the Ray cluster at {gcs} uses token authentication and this machine has no token: "
                              f"copy the head's ~/.ray/auth_token here, or set RAY_AUTH_TOKEN")


def alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def ray_options(resources: dict[str, float]) -> dict:
    """Config resources -> keywords of `.options()` (CPU/GPU/memory by name, the rest custom)."""
    opts: dict = {"num_cpus": 0}  # Ray's default of 1 CPU per actor would reserve what the config did not ask
    custom = {}
    for k, v in resources.items():
        if k in _ROLE_KEYS:
            opts[_ROLE_KEYS[k]] = int(v) if k == "memory" else v
        else:
            custom[k] = v
    if custom:
        opts["resources"] = custom
    return opts


def check_fits(role: str, key: str, resources: dict[str, float], count: int = 1) -> None:
    """Refuse at once what no node of the cluster has (Ray would keep it pending forever)."""
    for k, v in resources.items():
        if v < 0:
            raise ClusterError(f"{key}: {k} = {v} is negative")
    nodes = alive_nodes()
    if not any(all(n["Resources"].get(k, 0) >= v for k, v in resources.items() if v) for n in nodes):
        have = "; ".join(f"{describe(n)}: {_fmt(n['Resources'])}" for n in nodes)
        raise ClusterError(f"no node can run the {role} ({key} = {resources}): the nodes have {have}; "
                           f"change {key} or add a node that has it")
    total = {k: sum(n["Resources"].get(k, 0) for n in nodes) for k in resources}
    short = {k: v * count for k, v in resources.items() if v * count > total[k] + 1e-9}
    if short:
        raise ClusterError(f"{count} {role}(s) need {short} in all ({key} = {resources} each), the cluster has "
                           f"{ {k: total[k] for k in short} }: lower {key} or the count, or add nodes")


def check_total(roles: list[tuple[str, dict[str, float], int]], hint: str) -> None:
    """Refuse at once roles that fit one by one but not all together (a placement group of them would
    wait forever): `roles` as (name, resources each, count)."""
    need: dict[str, float] = {}
    for _, res, count in roles:
        for k, v in res.items():
            need[k] = need.get(k, 0) + v * count
    nodes = alive_nodes()
    total = {k: sum(n["Resources"].get(k, 0) for n in nodes) for k in need}
    short = {k: v for k, v in need.items() if v > total[k] + 1e-9}
    if short:
        who = " and ".join(f"{count} {name}(s)" if count != 1 else f"the {name}" for name, _, count in roles)
        raise ClusterError(f"{who} need {short} in all, the cluster has { {k: total[k] for k in short} }: {hint}")


def describe(node: dict) -> str:
    """A node as error messages name it: its address and the start of its id (", gone" once dead)."""
    gone = "" if node.get("Alive", True) else ", gone"
    return f"node {node.get('NodeManagerAddress', '?')} ({node.get('NodeID', '?')[:8]}{gone})"


def node_of(node_id: str) -> str:
    import ray

    return next((describe(n) for n in ray.nodes() if n["NodeID"] == node_id), f"node ? ({node_id[:8]}, gone)")


def here() -> dict:
    """Where the calling actor or task runs: node id and address, host name, pid."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address(),
            "host": os.uname().nodename, "pid": os.getpid()}


def _fmt(res: dict) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(res.items())
                     if not k.startswith("node:") and k not in ("memory", "object_store_memory"))


@dataclass
class Shipped:
    """A folder of the driver's node, made available on whichever node asks for it (`local()`)."""
    path: str
    node_id: str
    ref: object = None  # ObjectRef of the folder as a tar, only when the cluster has other nodes

    @classmethod
    def of(cls, path: str, skip: tuple[str, ...] = ()) -> Shipped:
        import ray

        node = ray.get_runtime_context().get_node_id()
        if _own_local and len(alive_nodes()) < 2:  # a cluster of one node now may gain more (autoscaling)
            return cls(str(path), node)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(path, arcname=".", filter=lambda ti: None if Path(ti.name).name in skip else ti)
        return cls(str(path), node, ray.put(buf.getvalue()))

    def local(self) -> str:
        """The folder on this node: the original on the driver's node, else an unpacked copy."""
        import ray

        if self.ref is None or ray.get_runtime_context().get_node_id() == self.node_id:
            return self.path
        data = ray.get(self.ref, timeout=600)
        cache = Path(os.environ.get("KILN_SHIP_CACHE", Path.home() / ".cache" / "kiln" / "shipped"))
        dest = cache / hashlib.sha256(data).hexdigest()[:16] / Path(self.path).name
        if not dest.is_dir():  # unpacked beside, then renamed: a half-unpacked folder is never used
            tmp = dest.parent / f".tmp-{os.getpid()}"
            tmp.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                tar.extractall(tmp, filter="tar")
            try:
                tmp.rename(dest)
            except OSError:  # another actor of this node unpacked it first
                shutil.rmtree(tmp, ignore_errors=True)
        return str(dest)
