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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentree.config import DistributedConfig

WORKER_NICENESS = "RAY_worker_niceness"
"""Ray starts its worker processes at niceness 15 so its own daemons stay responsive; on a
machine shared with other work that starves the actors, which then run ~1.5x slower than the
same rollout in the (niceness 0) driver. Clusters this module starts run them at 0; for a
cluster started with `ray start`, set `RAY_worker_niceness=0` in that command's environment."""

FORWARDED_ENV = ("AGENTREE_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "DOCKER_HOST")
"""Variables of the driver that workers on every node need to see the same files/daemons."""


def import_ray() -> Any:
    try:
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
    if dc.address == "local":
        os.environ.setdefault(WORKER_NICENESS, "0")  # read by the raylet ray.init starts
        # Logical CPUs: actors mostly wait on engines and Docker, so the private instance
        # admits every actor the config asks for even on a 2-core machine.
        cpus = max(os.cpu_count() or 1, int(num_cpus + 0.999))
        ray.init(num_cpus=cpus, include_dashboard=False, **kwargs)
        return True
    try:
        ray.init(address=dc.address, **kwargs)
    except ConnectionError as e:
        raise RuntimeError(
            f"cannot reach the Ray cluster at distributed.address={dc.address} ({e}); start it "
            "with `ray start --head` or use distributed.address=local"
        ) from None
    return False


def disconnect(started: bool) -> None:
    ray = import_ray()
    if ray.is_initialized():
        ray.shutdown()


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
        for attempt in range(attempts):
            try:
                return self._start()
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
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
        kill_processes(self.pids(), timeout)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def processes_matching(*needles: str, open_files: bool = False) -> list[int]:
    """Pids (not ours) whose command line contains any of `needles`, or with `open_files`,
    that hold a file whose path does (Ray's agents retitle themselves `ray::...` but keep
    their log files in the cluster's temp dir open)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(n in cmd for n in needles) or (open_files and _holds(entry, needles)):
            out.append(int(entry.name))
    return out


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
