"""Connecting to Ray, and a throwaway multi-node cluster on this machine (tests, benchmarks).

`distributed.address`: `local` starts a private Ray instance owned by this process (stopped by
`disconnect`), `auto` joins the cluster started with `ray start` on this machine, and
`ray://host:port` goes through Ray Client to a remote head.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentree.config import DistributedConfig, ExperimentConfig
from agentree.learner.launch import free_port
from agentree.rollout.base import make_controller
from agentree.scorers.base import scorer_class

WORKER_NICENESS = "RAY_worker_niceness"
"""Ray starts its worker processes at niceness 15 so its own daemons stay responsive; on a
machine shared with other work that starves the actors, which then run ~1.5x slower than the
same rollout in the (niceness 0) driver. Clusters this module starts run them at 0; for a
cluster started with `ray start`, set `RAY_worker_niceness=0` in that command's environment."""

FORWARDED_ENV = ("AGENTREE_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "DOCKER_HOST")
"""Variables of the driver that workers on every node need to see the same files/daemons."""


def import_ray() -> Any:
    try:
        # deferred: ray is the optional [ray] extra; the CLI imports this module at start
        import ray
    except ImportError:
        raise ImportError(
            "distributed.backend=ray needs Ray: pip install 'agentree[ray]'"
        ) from None
    return ray


def connect(dc: DistributedConfig, *, num_cpus: float = 0.0) -> bool:
    """Attach this process to Ray; True when it started a private instance it must stop."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    env_vars = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    runtime_env: dict[str, Any] = {"env_vars": env_vars} if env_vars else {}
    if dc.py_modules:  # Ray uploads local directories only for a job, not per actor
        runtime_env["py_modules"] = list(dc.py_modules)
    kwargs: dict[str, Any] = {
        "runtime_env": runtime_env or None,
        "logging_level": "WARNING",
        "log_to_driver": os.environ.get("AGENTREE_RAY_LOGS") == "1",
    }
    sigterm = signal.getsignal(signal.SIGTERM)
    if dc.address == "local":
        os.environ.setdefault(WORKER_NICENESS, "0")  # read by the raylet ray.init starts
        # Logical CPUs: actors mostly wait on engines and Docker, so the private instance
        # admits every actor the config asks for even on a 2-core machine.
        cpus = max(os.cpu_count() or 1, int(num_cpus + 0.999))
        try:
            ray.init(num_cpus=cpus, include_dashboard=False, **kwargs)
        except BaseException:  # Ctrl-C mid-start: nothing else stops what it started
            stop_interrupted_start(ray)
            raise
        _keep_sigterm(sigterm)
        return True
    try:
        ray.init(address=dc.address, **kwargs)
    except ConnectionError as e:
        raise RuntimeError(
            f"cannot reach the Ray cluster at distributed.address={dc.address} ({e}); start it "
            "with `ray start --head` or use distributed.address=local"
        ) from None
    _keep_sigterm(sigterm)
    return False


def stop_interrupted_start(ray: Any) -> None:
    """Stop what a `ray.init` of a private instance started before it was interrupted. Ray
    knows only what a finished start made, and the agents the raylet starts outlive it (a
    minute or more), but every process of the start holds files in the session directory Ray
    names after this process (`session_<time>_<pid>`)."""
    with contextlib.suppress(Exception):
        ray.shutdown()
    # deferred, as ray is: Ray's temp dir (RAY_TMPDIR, else TMPDIR, else /tmp, then ray/)
    from ray._common.utils import get_default_ray_temp_dir

    root = Path(get_default_ray_temp_dir())
    sessions = [f"{d}{os.sep}" for d in root.glob(f"session_*_{os.getpid()}")]
    if sessions:
        kill_processes(processes_matching(*sessions, open_files=True))


def disconnect(started: bool) -> None:
    ray = import_ray()
    if ray.is_initialized():
        ray.shutdown()
        _sigterm_again()


def _keep_sigterm(before: Any) -> None:
    """Put back the SIGTERM handler a command had before `ray.init`, which installs its own
    (exit at once): agentree's stop the command chose (a checkpoint, or unwinding as Ctrl-C
    does, `agentree.signals`) stays the command's. Ray's stays where there was none."""
    if callable(before) and signal.getsignal(signal.SIGTERM) is not before:
        with contextlib.suppress(ValueError):  # off the main thread, Ray installed none
            signal.signal(signal.SIGTERM, before)


def _sigterm_again() -> None:
    """Register the SIGTERM handler Python reports once more: `ray.shutdown` removes its core
    worker's handler below Python, which leaves SIGTERM ending the process outright while
    Python still reports the command's own handler."""
    handler = signal.getsignal(signal.SIGTERM)
    if handler is not None:
        with contextlib.suppress(ValueError):  # off the main thread: nothing to do
            signal.signal(signal.SIGTERM, handler)


# -- what a run reserves ----------------------------------------------------------------------
@dataclass(frozen=True)
class Need:
    """`count` actors of one kind, each reserving `each` (Ray resource name -> amount)."""

    what: str
    count: int
    each: dict[str, float]
    settings: str
    """The settings that size this part, named when the cluster is too small for it."""


def engine_replicas(dc: DistributedConfig, cluster_gpus: float) -> int:
    """`distributed.engine_replicas` as a count. `auto` is 0 (an engine in each rollout worker)
    when the engines run on CPU (engine_gpus 0 or no GPU in the cluster): measured on CPU, a
    shared replica cost throughput against an engine per worker (docs/scaling.md); else 1."""
    if dc.engine_replicas != "auto":
        return dc.engine_replicas
    return 1 if dc.engine_gpus > 0 and cluster_gpus > 0 else 0


def scorer_actor_needed(cfg: ExperimentConfig) -> bool:
    """A scorer that holds a model (PRM) runs as one actor shared by the workers, when the
    rollout controller scores at all."""
    rollout_name, rollout_kwargs = cfg.component("rollout")
    if not make_controller(rollout_name, **rollout_kwargs).uses_scorer:
        return False
    return bool(scorer_class(cfg.component("scorer")[0]).holds_model)


def rank_gpus(cfg: ExperimentConfig, cluster_gpus: float) -> float:
    """GPUs each training rank actor holds: one when the cluster has them and the policy is not
    pinned to the CPU."""
    return 1.0 if cluster_gpus > 0 and cfg.policy.device != "cpu" else 0.0


def run_needs(
    cfg: ExperimentConfig, *, replicas: int, scorer_actor: bool, cluster_gpus: float
) -> list[Need]:
    """Every actor a run on Ray reserves: rollout workers, engine replicas, the scorer actor,
    and the training ranks when `train.world_size > 1` runs them as actors."""
    dc = cfg.distributed
    needs = [
        Need(
            "rollout worker",
            dc.rollout_workers,
            {"CPU": dc.worker_cpus},
            "distributed.rollout_workers, distributed.worker_cpus",
        ),
        Need(
            "engine replica",
            replicas,
            {"CPU": dc.engine_cpus, "GPU": dc.engine_gpus},
            "distributed.engine_replicas (0: an engine in each worker), distributed.engine_cpus, "
            "distributed.engine_gpus",
        ),
    ]
    if scorer_actor:
        needs.append(
            Need(
                "scorer actor",
                1,
                {"CPU": dc.scorer_cpus, "GPU": dc.scorer_gpus},
                "distributed.scorer_cpus, distributed.scorer_gpus",
            )
        )
    if cfg.train.world_size > 1:
        needs.append(
            Need(
                "training rank",
                cfg.train.world_size,
                {"CPU": 1.0, "GPU": rank_gpus(cfg, cluster_gpus)},
                "train.world_size",
            )
        )
    return needs


def total(needs: Sequence[Need], resource: str) -> float:
    return sum(n.count * n.each.get(resource, 0.0) for n in needs)


def check_resources(
    needs: Sequence[Need], cluster: dict[str, float], nodes: Sequence[dict[str, float]] = ()
) -> None:
    """Refuse, in one line that names the settings to change, a run whose actors cannot all be
    placed: more of a resource in all than `cluster` holds, or one actor larger than every node
    in `nodes` (Ray would otherwise keep the actors pending until the start timeout)."""
    for res in sorted({r for n in needs for r, v in n.each.items() if v > 0 and n.count}):
        parts = [n for n in needs if n.count and n.each.get(res, 0.0) > 0]
        want, have = total(parts, res), float(cluster.get(res, 0.0))
        if want > have + 1e-6:
            detail = " + ".join(
                f"{n.count} {n.what}{'s' if n.count != 1 else ''} x {n.each[res]:g}" for n in parts
            )
            raise ValueError(
                f"the Ray cluster has {have:g} {res} in all but this run reserves {want:g} "
                f"({detail}); lower {'; '.join(n.settings for n in parts)}, or add nodes"
            )
    for n in needs:
        for res, amount in n.each.items():
            if n.count and amount > 0 and nodes and all(x.get(res, 0.0) < amount for x in nodes):
                most = max(x.get(res, 0.0) for x in nodes)
                raise ValueError(
                    f"each {n.what} reserves {amount:g} {res} but the largest node of the Ray "
                    f"cluster has {most:g}; lower {n.settings}, or add a larger node"
                )


def check_cluster(cfg: ExperimentConfig, *, scorer_actor: bool) -> int:
    """Compare what the run reserves with the connected cluster (`check_resources`); returns
    the number of engine replicas to start."""
    ray = import_ray()
    cluster = {k: float(v) for k, v in ray.cluster_resources().items()}
    nodes = [dict(x.get("Resources") or {}) for x in ray.nodes() if x.get("Alive")]
    gpus = cluster.get("GPU", 0.0)
    replicas = engine_replicas(cfg.distributed, gpus)
    needs = run_needs(cfg, replicas=replicas, scorer_actor=scorer_actor, cluster_gpus=gpus)
    check_resources(needs, cluster, nodes)
    return replicas


class LocalCluster:
    """A head plus `nodes - 1` more nodes on this machine, each its own `ray start` process
    group, all under one private temp dir; `stop()` kills exactly the processes of that dir.

    Token authentication is off (`RAY_AUTH_MODE=disabled`) for every process of the cluster
    and for drivers started with `env()`.
    """

    def __init__(self, *, port: int = 6391, nodes: int = 2, cpus_per_node: int = 2) -> None:
        self.port = port
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        # Ray's socket paths must stay under 107 bytes, so the dir name is short.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="atr", dir="/tmp"))
        self.address = f"127.0.0.1:{port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["RAY_AUTH_MODE"] = "disabled"
        env["RAY_TMPDIR"] = str(self.temp_dir)
        env.setdefault("RAY_DISABLE_USAGE_STATS", "1")
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        env.setdefault(WORKER_NICENESS, "0")
        return env

    def _ray(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", *args]
        out = subprocess.run(
            cmd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=180,
            start_new_session=True,
        )
        if out.returncode != 0:
            raise RuntimeError(f"ray start failed: {out.stderr[-2000:]}")

    def start(self, attempts: int = 3) -> LocalCluster:
        """Start the nodes; Ray gives a node 30 s to register, which a loaded machine can miss,
        so a failed start is cleaned up and tried again."""
        errors = []
        for attempt in range(attempts):
            try:
                return self._start()
            except RuntimeError as e:
                errors.append(f"attempt {attempt + 1}: {e}")
                if attempt == attempts - 1:
                    raise RuntimeError("\n".join(errors)) from e
                _wait_port_free(self.port)
                self.temp_dir.mkdir(parents=True, exist_ok=True)
        return self

    def _start(self) -> LocalCluster:
        try:
            self._ray(
                "--head",
                f"--port={self.port}",
                f"--num-cpus={self.cpus_per_node}",
                f"--temp-dir={self.temp_dir}",
                "--include-dashboard=false",
                f"--dashboard-port={free_port()}",
                f"--ray-client-server-port={free_port()}",
                *self._node_ports(),
            )
            for _ in range(self.nodes - 1):
                self._ray(
                    f"--address={self.address}",
                    f"--num-cpus={self.cpus_per_node}",
                    *self._node_ports(),
                )
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _node_ports() -> list[str]:
        # Ray's fixed default ports would collide with any other cluster on this machine.
        return [
            "--disable-usage-stats",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]

    def pids(self) -> list[int]:
        """Processes of this cluster: every Ray process names the cluster's temp dir or port."""
        return processes_matching(str(self.temp_dir), f":{self.port}", open_files=True)

    def stop(self, timeout: float = 20.0) -> None:
        """Raylets first, then the rest. SIGTERM to every process at once left the raylets and
        the GCS all alive after 25 s here, each waiting on the others; raylets stopped first
        exit at once (with their workers) and the GCS right after. The autoscaler's monitor
        ignores SIGTERM, so what is left after a short grace is killed."""
        pids = self.pids()
        raylets = [p for p in pids if "/raylet " in _cmdline(p)]
        kill_processes(raylets, timeout)
        kill_processes([p for p in pids if p not in raylets], timeout=2.0)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def processes_matching(*needles: str, open_files: bool = False) -> list[int]:
    """Pids (not ours) whose command line contains any of `needles`, or with `open_files`,
    that hold a file whose path does (Ray's agents retitle themselves `ray::...` but keep
    their log files in the cluster's temp dir open)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        cmd = _cmdline(int(entry.name))
        if any(n in cmd for n in needles) or (open_files and _holds(entry, needles)):
            out.append(int(entry.name))
    return out


def _wait_port_free(port: int, timeout: float = 20.0) -> None:
    """Wait until nothing listens on 127.0.0.1:`port` (a stopped GCS lets go of it), so a
    retried head does not join the previous attempt's GCS."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.2)


def _cmdline(pid: int) -> str:
    """A process's command line, words joined by spaces ("" once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def _holds(proc: Path, needles: tuple[str, ...]) -> bool:
    try:
        fds = list((proc / "fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if any(n in os.readlink(fd) for n in needles):
                return True
    return False


def kill_processes(pids: list[int], timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL what is left after `timeout` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return
            time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
