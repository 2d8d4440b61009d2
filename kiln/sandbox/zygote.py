"""The zygote: one small helper process per client process that creates and destroys sandboxes.

It lives in a user + mount namespace of its own (so its mounts never appear on the host and
vanish with it), mounts each sandbox's copy-on-write layer, and forks the sandbox's pid 1.
Requests arrive on a SOCK_SEQPACKET socket as JSON (+ passed fds); every request gets one
reply. When the client's end closes (the client exited or was killed) it tears every sandbox
down and removes its run directory, so nothing outlives the client.

Per sandbox, inside the zygote's private tmpfs `<state>/run/<zygote pid>/`:
  <sid>/        a tmpfs of `disk_mb` (the hard disk limit of the upper layer)
    upper/ work/  overlayfs upper and work dirs
    ws/           overlay mount point (lower layers = the snapshot's layers, read-only)
    root/         the sandbox's root filesystem (see rootfs.py)
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import traceback

from . import cgroups, fsutil, init, ns, pytest_fork, rootfs
from .snapshot import mark_owner


class Zygote:
    def __init__(self, ctl: socket.socket, state_dir: str):
        self.ctl = ctl
        self.run_dir = os.path.join(state_dir, "run", str(os.getpid()))
        self.layers_dir = os.path.join(state_dir, "layers")
        self.use_cgroups = cgroups.available()
        self.boxes: dict[str, dict] = {}  # sid -> {"keeper": pid, "init": pid, "cgroups": [...]}
        self._pytest: dict | None | bool = False  # pytest_fork.preload()'s answer; False: not asked yet
        self.home_cpus = os.sched_getaffinity(0)  # its client's, where a sandbox without sandbox.cpus runs

    def setup(self) -> None:
        uid, gid = os.getuid(), os.getgid()
        os.makedirs(self.run_dir, exist_ok=True)  # on the host: `kiln sandbox gc` finds it if we die
        _set_oom_score(-900)  # inherited by keepers and inits; each command resets it to 0
        ns.unshare(ns.CLONE_NEWUSER | ns.CLONE_NEWNS)
        ns.map_ids("self", 0, uid, gid)
        ns.mount("none", "/", None, ns.MS_REC | ns.MS_PRIVATE)
        ns.mount("tmpfs", self.run_dir, "tmpfs", ns.MS_NOSUID | ns.MS_NODEV, "mode=0700")
        # Layer paths in mount options are relative to here: the option string is capped at
        # one page, and short relative names leave room for hundreds of stacked snapshots.
        os.chdir(self.layers_dir)

    def loop(self) -> None:
        while True:
            msg, fds, _, _ = socket.recv_fds(self.ctl, 1 << 16, 1)
            if not msg:
                return
            req = json.loads(msg)
            reply_fds: list[int] = []
            try:
                out = getattr(self, "op_" + req["op"])(req)
                reply, reply_fds = out if isinstance(out, tuple) else (out, [])
                reply["ok"] = True
            except Exception as e:  # reported to the caller, who raises it
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            socket.send_fds(self.ctl, [json.dumps(reply).encode()], reply_fds)
            for fd in reply_fds + fds:
                os.close(fd)

    def op_create(self, req: dict) -> tuple[dict, list[int]]:
        sid, spec = req["sid"], req["spec"]
        self._place(spec.get("cpus"))
        box = os.path.join(self.run_dir, sid)
        self.boxes[sid] = entry = {"keeper": None, "cgroups": []}  # registered first: any failure tears down
        try:
            return self._start(sid, box, spec, req, entry)
        except BaseException:
            self.op_close({"sid": sid})
            raise

    def _start(self, sid: str, box: str, spec: dict, req: dict, entry: dict) -> tuple[dict, list[int]]:
        os.mkdir(box)
        ns.mount("tmpfs", box, "tmpfs", ns.MS_NOSUID | ns.MS_NODEV, f"size={spec['disk_mb']}m,mode=0755")
        if req.get("copy_from"):
            fsutil.copy_tree(os.path.join(self.run_dir, req["copy_from"], "upper"), box + "/upper")
        else:
            os.mkdir(box + "/upper")
        for d in ("work", "ws", "root"):
            os.mkdir(f"{box}/{d}")
        lower = ":".join(f"{layer}/tree" for layer in req["layers"])
        ns.mount("overlay", box + "/ws", "overlay", 0,
                 f"userxattr,lowerdir={lower},upperdir={box}/upper,workdir={box}/work")
        if self.use_cgroups:
            entry["cgroups"] = cgroups.create(f"{os.getpid()}-{sid}", spec["memory_mb"], spec["max_procs"])
        spec = {**spec, "cgroups": bool(entry["cgroups"])}
        if spec.get("fork_pytest"):
            spec["pytest_fork"] = self.pytest_base()
        client_end, init_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ready_r, ready_w = os.pipe()
        entry["keeper"] = os.fork()
        if entry["keeper"] == 0:
            client_end.close()
            os.close(ready_r)
            _keeper(self.ctl, init_end, ready_w, box, spec, entry["cgroups"])
        init_end.close()
        os.close(ready_w)
        with os.fdopen(ready_r, "rb") as f:  # EOF once the keeper reported and init is ready
            info = {k: v for line in f.read().splitlines() for k, v in json.loads(line).items()}
        if "error" in info or "init" not in info:
            client_end.close()
            raise RuntimeError(info.get("error", "sandbox init died during start-up"))
        return {"init": info["init"], "cgroups": spec["cgroups"], "upper": box + "/upper"}, [client_end.detach()]

    def _place(self, cpus: list[int] | None) -> None:
        """Work where the sandbox being made will run (sandbox.cpus): its mounts, a fork's copy of the
        upper layer and its keeper's fork are the sandbox's work, not the client's. An RL worker pins
        itself to its engine's CPU, where the zygote's ~16 ms a create and ~7 ms a close took turns
        with decoding (moving it: benchmarks/rl_async.py's asynchronous arm 5-6% faster, docs)."""
        try:
            os.sched_setaffinity(0, cpus or self.home_cpus)
        except OSError:
            pass  # ids this machine lacks: the keeper reports them to the caller

    def pytest_base(self) -> dict | None:
        """pytest imported here once, on the first sandbox that wants it (see pytest_fork.py)."""
        if self._pytest is False:
            self._pytest = pytest_fork.preload()
        return self._pytest

    def op_close(self, req: dict) -> dict:
        """Tear a sandbox down; tolerates one that failed half-way through start-up."""
        entry = self.boxes.pop(req["sid"], None)
        if entry is None:
            return {}
        if entry["keeper"]:
            try:
                os.kill(entry["keeper"], signal.SIGKILL)
                os.waitpid(entry["keeper"], 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        cgroups.remove(entry["cgroups"])
        path = os.path.join(self.run_dir, req["sid"])
        for mount_point in (path + "/ws", path):
            try:
                ns.umount(mount_point)
            except OSError:
                pass  # never mounted
        if os.path.isdir(path):
            os.rmdir(path)
        return {}

    def op_snapshot(self, req: dict) -> dict:
        """Freeze the sandbox's upper layer as a new read-only layer on disk."""
        dest = os.path.join(self.layers_dir, req["layer"])
        os.mkdir(dest)
        mark_owner(dest)
        n = fsutil.copy_tree(os.path.join(self.run_dir, req["sid"], "upper"), dest + "/tree.part")
        os.rename(dest + "/tree.part", dest + "/tree")  # a layer is usable only once complete
        return {"entries": n}

    def shutdown(self) -> None:
        for sid in list(self.boxes):
            try:
                self.op_close({"sid": sid})
            except OSError:
                pass
        try:
            ns.umount(self.run_dir)
            os.rmdir(self.run_dir)
        except OSError:
            pass  # the state dir was removed under us: nothing left to clean


def _set_oom_score(value: int) -> None:
    """Make the OOM killer pick a sandbox's command, not its pid 1 (lowering needs real root)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
    except OSError:
        pass


def _keeper(ctl: socket.socket, init_end: socket.socket, ready_w: int, box: str, spec: dict, cg: list[str]) -> None:
    """Forked per sandbox: owns its namespaces and lives exactly as long as its pid 1."""
    try:
        ctl.close()
        ns.prctl(ns.PR_SET_PDEATHSIG, signal.SIGKILL)  # zygote gone -> sandbox gone
        cgroups.join(cg, os.getpid())
        if spec.get("cpus"):
            try:
                os.sched_setaffinity(0, spec["cpus"])
            except OSError as e:
                os.write(ready_w, json.dumps({"error": f"sandbox.cpus {spec['cpus']}: {e.strerror} (this machine's "
                                              f"CPUs are 0-{os.cpu_count() - 1}; [] runs sandboxes where their starter "
                                              "runs)"}).encode() + b"\n")
                return
        # A build step keeps the host's network (apt-get fetches packages); nothing else ever does.
        ns.unshare(ns.CLONE_NEWNS | ns.CLONE_NEWPID | (0 if spec.get("build") else ns.CLONE_NEWNET))
        pid = os.fork()
        if pid == 0:
            _init_main(init_end, ready_w, box, spec)
        init_end.close()
        os.write(ready_w, json.dumps({"init": pid}).encode() + b"\n")
        os.close(ready_w)
        os.waitpid(pid, 0)
    finally:
        os._exit(0)


def _init_main(init_end: socket.socket, ready_w: int, box: str, spec: dict) -> None:
    try:
        ns.prctl(ns.PR_SET_PDEATHSIG, signal.SIGKILL)
        if not spec.get("build"):
            ns.loopback_up()
        rootfs.build_and_enter(box, spec)
        os.close(ready_w)
        init.serve(init_end, spec)
    except Exception as e:
        os.write(ready_w, json.dumps({"error": f"sandbox start failed: {e}"}).encode() + b"\n")
        os.close(ready_w)
    finally:
        os._exit(0)


def main() -> None:
    ctl = socket.socket(fileno=int(sys.argv[1]))
    z = Zygote(ctl, json.loads(ctl.recv(1 << 16))["state_dir"])
    try:
        z.setup()
        socket.send_fds(ctl, [json.dumps({"ok": True, "pid": os.getpid(), "cgroups": z.use_cgroups}).encode()], [])
    except Exception as e:
        socket.send_fds(ctl, [json.dumps({"ok": False, "error": f"sandbox service failed to start: {e}"}).encode()], [])
        return
    try:
        z.loop()
    finally:
        z.shutdown()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client decides when we stop (EOF)
    main()
