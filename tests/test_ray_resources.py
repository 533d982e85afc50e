"""Ray fails fast: what a run reserves is compared with the cluster before any actor starts,
and `distributed.engine_replicas: auto` puts an engine in each worker on CPU-only clusters;
Ctrl-C while a private instance starts leaves none of its processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import interruptible, signal_at_pause
from pydantic import ValidationError

from agentree.config import DistributedConfig, load_config
from agentree.distributed.cluster import (
    Need,
    check_resources,
    engine_replicas,
    kill_processes,
    processes_matching,
    run_needs,
    total,
)

RAY = ["distributed.backend=ray"]


def needs(overrides: list[str], *, cluster_gpus: float = 0.0, scorer: bool = False) -> list[Need]:
    cfg = load_config("frozenlake_patr", overrides=RAY + overrides)
    replicas = engine_replicas(cfg.distributed, cluster_gpus)
    return run_needs(cfg, replicas=replicas, scorer_actor=scorer, cluster_gpus=cluster_gpus)


def test_auto_engine_replicas_is_an_engine_per_worker_unless_engines_hold_gpus() -> None:
    assert DistributedConfig().engine_replicas == "auto"
    auto = DistributedConfig()
    assert engine_replicas(auto, cluster_gpus=0) == 0
    assert engine_replicas(auto, cluster_gpus=8) == 0  # engine_gpus 0: engines run on CPU
    on_gpu = DistributedConfig(engine_gpus=1)
    assert engine_replicas(on_gpu, cluster_gpus=8) == 1
    assert engine_replicas(on_gpu, cluster_gpus=0) == 0  # no GPU in the cluster
    assert engine_replicas(DistributedConfig(engine_replicas=3), cluster_gpus=0) == 3
    assert DistributedConfig(engine_replicas=0).engine_replicas == 0
    for bad in (-1, "many"):
        with pytest.raises(ValidationError):
            DistributedConfig(engine_replicas=bad)


def test_the_default_run_fits_two_one_cpu_nodes() -> None:
    # 2 workers x 1 CPU, auto -> no replica: 2 CPUs
    n = needs([])
    assert total(n, "CPU") == 2.0 and total(n, "GPU") == 0.0
    check_resources(n, {"CPU": 2.0}, [{"CPU": 1.0}, {"CPU": 1.0}])


def test_a_run_larger_than_the_cluster_is_refused_in_one_line() -> None:
    n = needs(["distributed.engine_replicas=1"])  # 2 x 1 + 1 x 1 = 3 CPUs
    with pytest.raises(ValueError) as e:
        check_resources(n, {"CPU": 2.0}, [{"CPU": 1.0}, {"CPU": 1.0}])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        "the Ray cluster has 2 CPU in all but this run reserves 3 "
        "(2 rollout workers x 1 + 1 engine replica x 1); lower distributed.rollout_workers"
    )
    assert "distributed.engine_replicas (0: an engine in each worker)" in msg

    # the scorer actor (a PRM) and 2 training ranks: 2 + 0.5 + 2 = 4.5 CPUs
    n = needs(["distributed.scorer_cpus=0.5", "train.world_size=2", "train.fsdp=true"], scorer=True)
    assert total(n, "CPU") == 4.5
    with pytest.raises(ValueError, match=r"has 4 CPU in all but this run reserves 4\.5 "):
        check_resources(n, {"CPU": 4.0})
    check_resources(n, {"CPU": 4.5})


def test_gpus_and_node_sizes_are_checked() -> None:
    n = needs(["distributed.engine_replicas=2", "distributed.engine_gpus=1"])
    with pytest.raises(ValueError, match=r"has 1 GPU in all but this run reserves 2 \(2 engine"):
        check_resources(n, {"CPU": 8.0, "GPU": 1.0})
    check_resources(n, {"CPU": 8.0, "GPU": 2.0})
    # 3 CPUs in all, but no node holds a 2-CPU worker
    n = needs(["distributed.rollout_workers=1", "distributed.worker_cpus=2"])
    with pytest.raises(ValueError, match=r"each rollout worker reserves 2 CPU but the largest"):
        check_resources(n, {"CPU": 3.0}, [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}])
    check_resources(n, {"CPU": 3.0}, [{"CPU": 2.0}, {"CPU": 1.0}])


@pytest.fixture(scope="module")
def small_cluster(agentree_cache):
    """Two nodes of one CPU each (the case from the issue)."""
    ray = pytest.importorskip("ray", reason="pip install 'agentree[ray]'")
    from agentree.distributed.cluster import LocalCluster
    from agentree.learner.launch import free_port

    c = LocalCluster(port=free_port(), nodes=2, cpus_per_node=1)
    saved = dict(os.environ)
    try:
        c.start()
        os.environ.update(c.env())
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.stop()
        os.environ.clear()
        os.environ.update(saved)
        assert c.pids() == [], "processes of the test cluster were left running"


SMALL = ["policy.path=tiny", "engine.max_tokens=6", "env.max_turns=2", "rollout.K=2"]


def test_two_one_cpu_nodes_refuse_a_shared_replica_at_once(small_cluster, tiny_frozenlake):
    from agentree.run.runtime import Runtime

    cfg = load_config(
        "frozenlake_patr",
        overrides=SMALL
        + RAY
        + [f"distributed.address={small_cluster.address}", "distributed.engine_replicas=1"],
    )
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        Runtime(cfg, log=lambda _m: None)
    took = time.monotonic() - t0
    assert "\n" not in str(e.value)
    assert "the Ray cluster has 2 CPU in all but this run reserves 3" in str(e.value)
    assert took < 60, took  # before: start_timeout_s (300 s) of actors waiting for a CPU


def test_two_one_cpu_nodes_run_the_default_placement(small_cluster, tiny_frozenlake):
    """engine_replicas auto on CPU: a worker on each node, each with its own engine."""
    from agentree.run.runtime import Runtime

    cfg = load_config(
        "frozenlake_patr",
        overrides=SMALL + RAY + [f"distributed.address={small_cluster.address}"],
    )
    rt = Runtime(cfg, log=lambda _m: None)
    try:
        assert len(rt.rollouts.workers) == 2 and rt.rollouts.replicas == []
        assert len(rt.rollouts.nodes) == 2
    finally:
        rt.close()


STARTING = """
import os, sys, time
from pathlib import Path

import ray._private.node

from agentree.config import DistributedConfig
from agentree.distributed.cluster import connect

FLAG = Path(sys.argv[1])
start = ray._private.node.Node.start_ray_processes


def paused(self):  # the raylet is up, ray.init is not done: Ray knows of no node yet
    start(self)
    FLAG.write_text("")
    go = FLAG.with_suffix(".go")
    for _ in range(1200):  # until the test has sent its Ctrl-C
        if go.exists():
            break
        time.sleep(0.1)


ray._private.node.Node.start_ray_processes = paused
try:
    connect(DistributedConfig(backend="ray", address="local"))
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_ctrl_c_while_ray_starts_leaves_no_ray_process(tmp_path) -> None:
    # Ray's temp dir, short (its socket paths must fit 107 bytes): every process the start
    # makes runs from it or holds its log files there
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    flag = tmp_path / "flag"

    def agents_up() -> None:  # the raylet's agents, which outlived it, have started
        deadline = time.monotonic() + 120
        while not [
            p
            for p in processes_matching(str(ray_tmp), open_files=True)
            if "ray::" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")
        ]:
            assert time.monotonic() < deadline, "the raylet started no agent"
            time.sleep(0.2)

    try:
        env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
        argv = [sys.executable, "-c", STARTING, str(flag)]
        code, out = signal_at_pause(
            argv, flag, signal.SIGINT, "ray.init", agents_up, env=env, preexec_fn=interruptible
        )
        assert code == 130, out
        settle = time.monotonic() + 5  # what stops with its parent has gone by then
        while (left := processes_matching(str(ray_tmp), open_files=True)) and (
            time.monotonic() < settle
        ):
            time.sleep(0.2)
        assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]
    finally:
        kill_processes(processes_matching(str(ray_tmp), open_files=True))
        shutil.rmtree(ray_tmp, ignore_errors=True)


KEEPS = """
import os, signal, time

from agentree.config import DistributedConfig
from agentree.distributed.cluster import connect, disconnect


def ours(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, ours)
started = connect(DistributedConfig(backend="ray", address="local"))
print("after ray.init:", signal.getsignal(signal.SIGTERM) is ours, flush=True)
disconnect(started)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
except KeyboardInterrupt as stop:
    print("after ray.shutdown:", stop, flush=True)
"""


def test_a_commands_own_sigterm_handler_survives_ray() -> None:
    """`ray.init` installs a SIGTERM handler that exits at once, and `ray.shutdown` leaves
    SIGTERM ending the process outright below Python: the command's own stop (a checkpoint,
    or unwinding as Ctrl-C does) holds before, during and after Ray all the same."""
    out = subprocess.run([sys.executable, "-c", KEEPS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "after ray.init: True" in out.stdout, out.stdout + out.stderr
    assert "after ray.shutdown: signal 15" in out.stdout, out.stdout + out.stderr
