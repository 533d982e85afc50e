"""The Ray runtime on a real two-node Ray cluster on this machine (a head and a second
`ray start` process group): same trees as in-process, trees on both nodes, a worker killed
mid-rollout, Ctrl-C, `kill` or a closed terminal of `agentree rollout` with nothing left, and
asynchronous training.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

ray = pytest.importorskip("ray", reason="pip install 'agentree[ray]'")

from helpers import interruptible  # noqa: E402
from swe_support import local_records_fixture  # noqa: E402, F401

from agentree.config import load_config  # noqa: E402
from agentree.distributed.cluster import LocalCluster, processes_matching  # noqa: E402
from agentree.distributed.engine import RemoteEngine, block_hashes  # noqa: E402
from agentree.engines.base import SamplingParams  # noqa: E402
from agentree.learner.launch import free_port  # noqa: E402
from agentree.learner.update import PolicyUpdate  # noqa: E402
from agentree.run.runtime import Runtime  # noqa: E402
from agentree.tree import EndReason, Tree  # noqa: E402

SMALL = [
    "engine.max_tokens=6",
    "env.max_turns=4",
    "rollout.K=2",
    "rollout.B0=2",
    "engine.temperature=0",  # greedy: the same trees wherever they run
    "train.tasks_per_step=4",
    "train.micro_batch_size=8",
    "train.kl_coef=0",
    "train.trees_every=0",
    "train.save_every=0",
    "eval.tasks=2",
    "eval.samples=1",
]


def ray_overrides(address: str) -> list[str]:
    return [
        "distributed.backend=ray",
        f"distributed.address={address}",
        "distributed.rollout_workers=2",
        "distributed.engine_replicas=1",
        "distributed.max_restarts=2",
    ]


@pytest.fixture(scope="module")
def cluster(agentree_cache):
    # 4 logical CPUs a node: the module's runtime (3 actors) and the Ctrl-C run's (3) fit
    c = LocalCluster(port=free_port(), nodes=2, cpus_per_node=4)
    saved = dict(os.environ)
    # the nodes have the tests' own packages installed, as a user's nodes have theirs
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, saved.get("PYTHONPATH")]))
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


@pytest.fixture(scope="module")
def rt(cluster, tiny_frozenlake):
    cfg = load_config("frozenlake_patr", overrides=SMALL + ray_overrides(cluster.address))
    runtime = Runtime(cfg, log=lambda _m: None)
    yield runtime
    runtime.close()


def strip(tree: Tree) -> list[tuple]:
    """What the policy and the env decided, node by node (timings and placement excluded)."""
    return [
        (n.parent, n.action_ids, n.obs_ids, n.reward, n.score, str(n.end_reason), n.children)
        for n in tree.nodes
    ]


def test_route_by_prefix_affinity():
    eng = RemoteEngine(
        [None, None], tokenizer=None, info={"eos_token_ids": [0], "max_model_len": 9}
    )
    a, b = list(range(40)), list(range(100, 140))
    assert [eng.route(a), eng.route(b)] == [0, 1]  # new trees: least-used replica
    assert eng.route(a + [7] * 20) == 0  # a branch continuing tree a stays with a's replica
    assert eng.route(b + [8] * 33) == 1
    assert eng.route(list(range(200, 230))) == 0  # next new tree balances again
    assert len(block_hashes(list(range(40)))) == 2  # 16-token blocks, partial block ignored


def test_ray_trees_equal_in_process_and_land_on_both_nodes(rt, tiny_frozenlake):
    tasks = rt.load_tasks(4)
    trees, stats = rt.rollouts.rollout(tasks, rng=random.Random(11))
    assert stats.extra["distributed/chunks"] == 2
    # the in-process reference: the same controller on the same chunks with the same seeds
    seed = random.Random(11).getrandbits(63)
    local_cfg = rt.cfg.model_copy(deep=True)
    local_cfg.distributed.backend = "local"
    local = Runtime(local_cfg, log=lambda _m: None)
    try:
        ref = []
        size = rt.rollouts.chunk_size(len(tasks))
        for c in range(0, len(tasks), size):
            ctx = local.rollouts.context()
            ctx.rng = random.Random(seed + c // size)
            ref += local.controller.rollout(tasks[c : c + size], ctx)[0]
    finally:
        local.close()
    assert [t.task_id for t in trees] == [t.task_id for t in ref]
    for got, want in zip(trees, ref, strict=True):
        assert strip(got) == strip(want)
        for g, w in zip(got.nodes, want.nodes, strict=True):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    placed = {t.meta["distributed"]["node_id"] for t in trees}
    assert len(nodes) == 2 and placed == nodes  # one worker per node (SPREAD)
    assert {t.meta["distributed"]["worker"] for t in trees} == {0, 1}
    assert stats.env_errors == 0 and stats.extra["distributed/worker_restarts"] == 0
    # the cluster runs actors at the driver's priority (0 unless the tests run under `nice`),
    # not Ray's default niceness of 15 above it
    driver = os.nice(0)
    assert {ray.get(w.ready.remote())["niceness"] for w in rt.rollouts.workers} == {driver}


def test_killed_worker_fails_only_its_trees(rt):
    pids = [ray.get(w.ready.remote())["pid"] for w in rt.rollouts.workers]
    tasks = rt.load_tasks(32)  # seconds of work, so the kill lands mid-call
    pending = rt.rollouts.start(tasks, rt.controller, 0, None, 5)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # kill worker 0 once its rollout is under way
        st = {s.get("index"): s for s in rt.rollouts.status()}
        if "trees" in st.get(0, {}).get("status", ""):
            break
        time.sleep(0.05)
    os.kill(pids[0], signal.SIGKILL)
    trees, stats = pending.result()
    assert len(trees) == 32
    lost = [t for t in trees if "error" in t.meta["distributed"]]
    kept = [t for t in trees if "error" not in t.meta["distributed"]]
    assert 0 < len(lost) < len(trees)  # the chunk that was on worker 0, not the others
    assert {t.meta["distributed"]["worker"] for t in lost} == {0}
    for t in lost:
        assert [str(n.end_reason) for n in t.leaves()] == ["env_error"]
        assert all(tr.num_policy_tokens == 0 for tr in t.trajectories())
    assert all(n.end_reason != EndReason.ENV_ERROR for t in kept for n in t.leaves())
    assert stats.env_errors == len(lost)
    assert stats.extra["distributed/worker_restarts"] == 1
    # Ray restarted the actor: the next rollout uses both workers again
    trees, stats = rt.rollouts.rollout(tasks[:2])
    assert stats.env_errors == 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # Ray restarts the actor in a new process
        try:
            assert ray.get(rt.rollouts.workers[0].ready.remote())["pid"] != pids[0]
            break
        except ray.exceptions.ActorUnavailableError:
            time.sleep(1.0)
    else:
        pytest.fail("the killed worker was not restarted")


ACTOR_CLASSES = ("RolloutWorker", "EngineReplica", "ScorerActor")


class JobActors:
    """The agentree actors of Ray jobs that start after this is made (a CLI run's driver is
    one job), read from the cluster's actor table, so that the module's own runtime, a
    restarted actor of another test, or a worker process Ray recycles is never counted."""

    def __init__(self, cluster: LocalCluster):
        from agentree.config import DistributedConfig
        from agentree.distributed.cluster import connect

        connect(DistributedConfig(backend="ray", address=cluster.address))  # as a Runtime does
        self.known = {a["JobID"] for a in self.table()}
        self.known.add(ray.get_runtime_context().get_job_id())
        self.pids: set[int] = set()  # every process an actor of the new jobs ran in

    @staticmethod
    def table() -> list[dict]:
        from ray._private import state

        return [a for a in state.actors().values() if a["ActorClassName"] in ACTOR_CLASSES]

    def alive(self) -> list[dict]:
        """The new jobs' live actors (their pids are remembered)."""
        out = [a for a in self.table() if a["JobID"] not in self.known and a["State"] == "ALIVE"]
        self.pids |= {a["Pid"] for a in out if a.get("Pid")}
        return out

    def running(self) -> set[int]:
        """Remembered actor processes still running here under their `ray::` title."""
        titled = set(processes_matching(*(f"ray::{c}" for c in ACTOR_CLASSES)))
        return self.pids & titled

    def gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while (self.alive() or self.running()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return not self.alive() and not self.running()

    @staticmethod
    def describe(actors: list[dict]) -> str:
        return ", ".join(
            f"{a['ActorClassName']} pid {a['Pid']} ({a['NumRestarts']} restarts)" for a in actors
        )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_ctrl_c_of_a_ray_rollout_leaves_nothing(cluster, tmp_path, tiny_frozenlake, sig):
    """Ctrl-C, `kill` or a closed terminal: the rollout stops as Ctrl-C stops it (exit 130,
    nothing written) and its actors go with it."""
    run = JobActors(cluster)  # not the module's runtime: 2 workers, 1 engine replica
    cmd = [
        sys.executable, "-m", "agentree", "rollout", "--tasks", "64", "--output", str(tmp_path),
        *[x for o in SMALL + ray_overrides(cluster.address) for x in ("--set", o)],
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=cluster.env(), stderr=subprocess.PIPE, text=True, preexec_fn=interruptible
    )
    seen = ""
    assert proc.stderr is not None
    for line in proc.stderr:  # wait until the trees are being rolled out on the workers
        seen += line
        if "agentree rollout" in line:
            break
    deadline = time.monotonic() + 60
    while len(run.alive()) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    alive = run.alive()
    assert len(alive) == 3, seen + run.describe(alive)  # this run's 2 workers and 1 replica
    proc.send_signal(sig)
    out = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, seen + out
    assert run.gone(30), "an actor of the interrupted run is still running"
    assert not (tmp_path / "rollout_stats.json").exists()


def node_of(pid: int) -> int:
    """The raylet that started an actor process (its parent): one per Ray node."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def container_owners() -> set[int]:
    """Pids on this host that own an agentree container."""
    import socket

    from agentree.envs.swe import runtime

    host = socket.gethostname()
    out = set()
    for c in runtime.client().api.containers(all=True, filters={"label": runtime.LABEL}):
        h, _, pid = (c.get("Labels") or {}).get(runtime.OWNER, "").rpartition(":")
        if h == host and pid.isdigit():
            out.add(int(pid))
    return out


def docker_owned_by(pids: set[int]) -> tuple[list[str], list[str]]:
    """Containers and snapshot images whose `agentree.owner` label is one of `pids` here."""
    import socket

    from agentree.envs.swe import runtime

    api = runtime.client().api
    owners = {f"{socket.gethostname()}:{p}" for p in pids}
    flt = {"label": runtime.LABEL}
    containers = [
        c["Id"]
        for c in api.containers(all=True, filters=flt)
        if (c.get("Labels") or {}).get(runtime.OWNER) in owners
    ]
    images = [
        i["Id"]
        for i in api.images(all=True, filters=flt)
        if (i.get("Labels") or {}).get(runtime.OWNER) in owners
        and (i.get("Labels") or {}).get(runtime.KIND) == "snapshot"
    ]
    return containers, images


@pytest.mark.docker
def test_ctrl_c_with_sandboxes_on_both_nodes_leaves_nothing(cluster, tmp_path, local_records):
    """SWE trees in flight on two workers, one per node, each holding Docker sandboxes: SIGINT
    to `agentree rollout` leaves no actor, container or snapshot image on either node."""
    run = JobActors(cluster)
    sets = [
        "engine.max_tokens=16",
        "rollout.K=2",
        *ray_overrides(cluster.address),
    ]
    cmd = [
        sys.executable, "-m", "agentree", "rollout", "--config", "swebench_patr",
        "--tasks", "local", "--output", str(tmp_path / "run"),
        *[x for o in sets for x in ("--set", o)],
    ]  # fmt: skip
    log = tmp_path / "stderr.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            cmd, env=cluster.env(), stderr=err, text=True, preexec_fn=interruptible
        )
    try:
        deadline = time.monotonic() + 300
        holders: set[int] = set()
        snapshots: list[str] = []
        while time.monotonic() < deadline and proc.poll() is None:
            run.alive()
            holders = container_owners() & run.pids
            snapshots = docker_owned_by(run.pids)[1]
            if len(holders) == 2 and snapshots:
                break
            time.sleep(0.5)
        assert proc.poll() is None, log.read_text()
        assert len(holders) == 2, f"sandboxes held by {holders} of actors {run.pids}"
        assert snapshots, "no tree forked before the deadline"
        assert len({node_of(p) for p in holders}) == 2  # the two workers are on both nodes
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, log.read_text()
    # an actor removes its containers and snapshot images before it exits, which a Docker
    # daemon busy with other sandboxes (another run, the other test worker) takes a while to do
    assert run.gone(90), "an actor of the interrupted run is still running"
    assert docker_owned_by(run.pids) == ([], [])
    assert not (tmp_path / "run" / "rollout_stats.json").exists()


def test_prm_scorer_is_one_actor_and_scores_as_in_process(cluster, tiny_frozenlake):
    """`--scorer prm` on Ray: the PRM is loaded once, in a scorer actor the workers call, and
    every score on the trees equals the in-process PRM's score of the same branch."""
    from agentree.scorers.base import NoScorer, make_scorer

    overrides = [
        *SMALL,
        *ray_overrides(cluster.address),
        "scorer.name=prm",
        "scorer.model=tiny",
        "rollout.K=1",  # a checkpoint after every turn: many scored branches
        "distributed.worker_cpus=0.5",
        "distributed.engine_cpus=0.5",
        "distributed.scorer_cpus=0.5",
    ]
    before = set(processes_matching("ray::ScorerActor"))
    rt_prm = Runtime(load_config("frozenlake_patr", overrides=overrides), log=lambda _m: None)
    local = make_scorer("prm", model="tiny")
    try:
        assert isinstance(rt_prm.rollouts.parts.scorer, NoScorer)  # the driver holds no PRM
        status = rt_prm.rollouts.status()
        assert [s["scorer"] for s in status] == ["RemoteScorer", "RemoteScorer"]
        assert len(set(processes_matching("ray::ScorerActor")) - before) == 1
        tasks = rt_prm.load_tasks(4)
        trees, stats = rt_prm.rollouts.rollout(tasks)
        assert stats.scorer_calls > 0 and stats.scorer_fallbacks == 0
        by_id = {t.id: t for t in tasks}
        scored = 0
        for tree in trees:
            task = by_id[tree.task_id]
            for node in tree.nodes:
                if node.score is None:
                    continue
                want = local.score(task, [tree.path(node.id)])[0].value
                assert node.score == pytest.approx(want, abs=1e-5)
                scored += 1
        assert scored >= 4
        info = ray.get(rt_prm.rollouts.scorer_actor.info.remote())
        assert info["scorer"] == "PRMScorer" and info["calls"] > 0
    finally:
        local.close()
        rt_prm.close()
    deadline = time.monotonic() + 30  # ray.kill returns before the process has exited
    while set(processes_matching("ray::ScorerActor")) - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not set(processes_matching("ray::ScorerActor")) - before


def test_eval_of_a_users_env_on_ray_ships_its_package(cluster, tmp_path):
    """`agentree eval --env package.module:Class` with the Ray flags: without
    `distributed.py_modules` the workers (started by the cluster, not by this driver) cannot
    import the package and the run stops with one sentence saying so; with it, Ray ships the
    package and the tasks are evaluated on the workers."""
    import json
    import shutil
    from pathlib import Path

    pkg = tmp_path / "guess_pkg"  # a user's package, in a directory only the driver sees
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    shutil.copy(Path(__file__).parent / "custom_env" / "mygame.py", pkg / "mygame.py")
    env = {**cluster.env(), "PYTHONPATH": str(tmp_path)}
    sets = [
        *ray_overrides(cluster.address),
        "engine.max_tokens=4",
        "engine.stop=[]",
        "distributed.worker_cpus=0.5",
        "distributed.engine_cpus=0.5",
        "distributed.start_timeout_s=120",
    ]

    def run(out: str, *extra: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable, "-m", "agentree", "eval", "--env", "guess_pkg.mygame:GuessEnv",
            "--tasks", "4", "--output", str(tmp_path / out),
            *[x for o in [*sets, *extra] for x in ("--set", o)],
        ]  # fmt: skip
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)

    bad = run("bad")
    assert bad.returncode != 0, bad.stderr
    last = bad.stderr.strip().splitlines()[-1]
    assert "guess_pkg" in last and "distributed.py_modules" in last, bad.stderr
    assert "Traceback" not in bad.stderr
    good = run("good", f"distributed.py_modules=[{pkg}]")
    assert good.returncode == 0, good.stderr
    result = json.loads((tmp_path / "good" / "eval.json").read_text())
    assert result["summary"]["tasks"] == 4
    trees = sorted((tmp_path / "good" / "trees").glob("*.json"))
    workers = {json.loads(t.read_text())["meta"]["distributed"]["worker"] for t in trees}
    assert len(trees) == 4 and workers <= {0, 1} and workers
    assert any(x.startswith("rollout: ") and "w0@" in x for x in good.stderr.splitlines())


def test_rollout_cli_on_ray_prints_per_worker_progress(cluster, tmp_path, tiny_frozenlake):
    """`agentree rollout` with the Ray flags, without a terminal: it completes, the trees record
    the worker that ran them, and the progress shows every worker, one line per change."""
    import json

    sets = [
        *SMALL,
        *ray_overrides(cluster.address),
        "distributed.worker_cpus=0.5",
        "distributed.engine_cpus=0.5",
    ]
    cmd = [
        sys.executable, "-m", "agentree", "rollout", "--tasks", "24",
        "--output", str(tmp_path), *[x for o in sets for x in ("--set", o)],
    ]  # fmt: skip
    r = subprocess.run(cmd, env=cluster.env(), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("rollout: ")]
    assert any("w0@" in x and "w1@" in x and " envs)" in x for x in lines), r.stderr
    assert all(a != b for a, b in itertools.pairwise(lines))
    assert json.loads((tmp_path / "rollout_stats.json").read_text())["tasks"] == 24
    trees = [json.loads(t.read_text()) for t in (tmp_path / "trees").glob("*.json")]
    assert len(trees) == 24
    assert {t["meta"]["distributed"]["worker"] for t in trees} == {0, 1}


def test_train_cli_on_ray_prints_per_worker_progress(cluster, tmp_path, tiny_frozenlake):
    """`agentree train` with the Ray flags, without a terminal: the step's rollout progress names
    every worker while it runs, and the run finishes."""
    sets = [
        *SMALL,
        *ray_overrides(cluster.address),
        "distributed.worker_cpus=0.5",
        "distributed.engine_cpus=0.5",
        "train.tasks_per_step=8",
        "train.eval_every=0",
    ]
    cmd = [
        sys.executable, "-m", "agentree", "train", "--policy", "tiny", "--steps", "1",
        "--output", str(tmp_path / "run"), *[x for o in sets for x in ("--set", o)],
    ]  # fmt: skip
    r = subprocess.run(cmd, env=cluster.env(), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("rollout: ")]
    assert any("w0@" in x and "w1@" in x for x in lines), r.stderr
    assert "step 1/1" in r.stderr


def test_hung_worker_is_bounded_by_the_timeout(cluster):
    """A worker stuck in an env step (a stalled sandbox) past `tree_timeout_s` is killed: its
    tree ends as env_error, the other worker's tree completes, Ray restarts the worker and the
    next rollout uses both workers again."""
    overrides = [
        *SMALL,
        *ray_overrides(cluster.address),
        "engine.stop=[]",
        "distributed.tree_timeout_s=20",
        "distributed.worker_cpus=0.5",
        "distributed.engine_cpus=0.5",
    ]
    cfg = load_config(select={"env": "custom_env.stall:StallEnv"}, overrides=overrides)
    stall_rt = Runtime(cfg, log=lambda _m: None)
    try:
        tasks = stall_rt.load_tasks(16)
        hangs = next(t for t in tasks if t.seed % 2 == 1)
        fine = [t for t in tasks if t.seed % 2 == 0]
        t0 = time.monotonic()
        trees, stats = stall_rt.rollouts.rollout([hangs, fine[0]])
        assert time.monotonic() - t0 < 120
        lost, kept = trees
        assert [str(n.end_reason) for n in lost.leaves()] == ["env_error"]
        assert lost.meta["distributed"]["error"].startswith("worker lost")
        assert all(n.end_reason != EndReason.ENV_ERROR for n in kept.leaves())
        assert stats.env_errors == 1 and stats.extra["distributed/worker_restarts"] == 1
        deadline = time.monotonic() + 120
        while len(stall_rt.rollouts._idle) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)  # Ray restarts the killed worker; then it takes work again
        trees, stats = stall_rt.rollouts.rollout(fine[1:3])
        assert stats.env_errors == 0
        assert {t.meta["distributed"]["worker"] for t in trees} == {0, 1}
    finally:
        stall_rt.close()


def two_replicas(address: str) -> list[str]:
    """A small run on the cluster at `address` with one rollout worker and two engine
    replicas."""
    return [
        *SMALL,
        *ray_overrides(address),
        "distributed.rollout_workers=1",
        "distributed.engine_replicas=2",
        "distributed.worker_cpus=0.5",
        "distributed.engine_cpus=0.5",
    ]


def test_killed_engine_replica_fails_over_to_the_other(cluster, tiny_frozenlake):
    """With two engine replicas, one killed: its requests go to the other replica (no tree is
    lost), the restarted replica is not asked to sample until it holds the trainer's weights,
    and after the next weight sync both serve again."""
    overrides = two_replicas(cluster.address)
    frt = Runtime(load_config("frozenlake_patr", overrides=overrides), log=lambda _m: None)
    try:
        tasks = frt.load_tasks(8)
        _trees, stats = frt.rollouts.rollout(tasks[:4])
        assert stats.extra["distributed/engine_failovers"] == 0
        pid = ray.get(frt.rollouts.replicas[0].info.remote())["pid"]
        os.kill(pid, signal.SIGKILL)
        trees, stats = frt.rollouts.rollout(tasks[4:])
        assert stats.env_errors == 0 and stats.extra["distributed/worker_restarts"] == 0
        assert stats.extra["distributed/engine_failovers"] >= 1
        assert all(n.end_reason != EndReason.ENV_ERROR for t in trees for n in t.leaves())
        frt.rollouts.sync_weights(frt.model)  # reaches the restarted replica once it is back
        deadline = time.monotonic() + 120
        info: dict = {}
        while time.monotonic() < deadline:
            try:
                info = ray.get(frt.rollouts.replicas[0].info.remote())
            except ray.exceptions.ActorUnavailableError:
                info = {}
            if info.get("version") == frt.rollouts.weight_version:
                break
            time.sleep(1.0)
        assert info["pid"] != pid and info["version"] == frt.rollouts.weight_version
        want = sum(float(v.double().sum()) for v in frt.model.state_dict().values())
        assert ray.get(frt.rollouts.replicas[0].checksum.remote()) == pytest.approx(want)
        _trees, stats = frt.rollouts.rollout(tasks[:4])
        assert stats.env_errors == 0 and stats.extra["distributed/engine_failovers"] == 0
    finally:
        frt.close()


def test_replica_router_with_params_per_prompt_answers_as_in_process(cluster, tiny_frozenlake):
    """A call with params of its own for each prompt, split by the router across two engine
    replicas, answers each prompt as the in-process engine over the same weights does (greedy:
    the same tokens and finish reasons), and tells each completion's end to `on_done`."""
    overrides = two_replicas(cluster.address)
    frt = Runtime(load_config("frozenlake_patr", overrides=overrides), log=lambda _m: None)
    try:
        tok = frt.tokenizer
        replicas = frt.rollouts.replicas
        remote = RemoteEngine(replicas, tok, ray.get(replicas[0].info.remote()))
        prompts = [tok.encode(f"{i} P _ _ G") for i in range(6)]  # no shared prefix
        each = [
            SamplingParams(max_tokens=2 + i, temperature=0.0, n=1 + i % 2, stop_token_ids=())
            for i in range(6)
        ]
        ended: list[int] = []
        got = remote.generate(prompts, each, on_done=lambda i, _c: ended.append(i))
        want = frt.engine.generate(prompts, each)
        assert sum(r > 0 for r in remote.routed) == 2  # both replicas answered
        assert [[(c.token_ids, c.finish_reason) for c in comps] for comps in got] == [
            [(c.token_ids, c.finish_reason) for c in comps] for comps in want
        ]
        assert [len(c) for c in got] == [1, 2, 1, 2, 1, 2]
        assert sorted(ended) == list(range(9))
    finally:
        frt.close()


def test_stale_update_uses_sampling_logprobs_as_pi_old(tiny_frozenlake):
    """rho = exp(log pi_theta - log pi_sample): with stored sampling log-probs of 0, the mean
    ratio is the mean of pi_theta over the policy tokens; on-policy it is exactly 1."""
    from agentree.algorithms.packing import padded_micro_batches, token_logprobs
    from agentree.hub.load import load_policy

    model, _tok = load_policy(tiny_frozenlake, dtype="float32", device="cpu")
    tree = Tree("t")
    tree.add_root("p", [5, 6, 7, 8])
    tree.add_child(0, action_ids=[9, 10, 11], logprobs=[0.0] * 3, reward=1.0)
    tree.add_child(0, action_ids=[12, 13], logprobs=[0.0] * 2, reward=0.0)
    for n in tree.leaves():
        n.end_reason = EndReason.COMPLETED
    group = tree.trajectories()
    cfg = load_config("frozenlake_patr", overrides=[*SMALL, "train.lr=1e-9"]).train
    b = padded_micro_batches(group, [[1.0] * len(t.token_ids) for t in group], 0, 8)[0]
    with torch.no_grad():
        lp = token_logprobs(model, b, 1.0)
    want = float((lp.exp() * b.mask).sum() / b.mask.sum())
    stale = PolicyUpdate(model, cfg)([tree], [group], lr=1e-9, stale=True)
    assert stale["train/ratio_mean"] == pytest.approx(want, rel=1e-4)
    assert want < 0.5  # far from 1: the ratio really is against the stored log-probs
    fresh = PolicyUpdate(model, cfg)([tree], [group], lr=1e-9)
    assert fresh["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_async_training_on_ray_is_one_step_stale(rt, tmp_path):
    from agentree.run.trainer import Trainer

    cfg = rt.cfg.model_copy(deep=True)
    cfg.train.steps, cfg.train.async_steps = 3, 1
    cfg.engine.temperature = 1.0
    tr = Trainer(cfg, tmp_path, log=lambda _m: None, runtime=rt)
    with torch.no_grad():  # greedy groups carry no advantage: make a change the sync must carry
        next(tr.model.parameters()).add_(0.01)
    rows = []
    while tr.step < cfg.train.steps:
        rows.append(tr.train_step())
        tr.step += 1
    assert [r["train/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(math.isfinite(r["train/loss"]) for r in rows if "train/loss" in r)
    assert rows[-1]["distributed/workers"] == 2
    # the replica holds the trainer's final weights (synced through the object store)
    want = sum(float(v.double().sum()) for v in tr.model.state_dict().values())
    assert ray.get(rt.rollouts.replicas[0].checksum.remote()) == pytest.approx(want, rel=1e-9)
    # a checkpoint holds the seeds the workers' next rollouts get; a resume restores them
    tr.save()
    drawn = rt.rollouts.rng.getrandbits(63)
    again = Trainer(cfg, tmp_path, log=lambda _m: None, runtime=rt)
    assert again.resume() and again.step == 3
    assert rt.rollouts.rng.getrandbits(63) == drawn


def test_lora_training_on_ray_sends_merged_weights_to_the_replica(
    cluster, tmp_path, tiny_frozenlake
):
    """With LoRA the driver's engine runs the adapters in place, but a replica holds a model
    without adapters: each sync sends base + (alpha / r) * B A under the plain weight names."""
    from agentree.learner.lora import merged_state_dict
    from agentree.run.trainer import Trainer

    overrides = [
        *SMALL,
        *ray_overrides(cluster.address),
        "distributed.rollout_workers=1",
        "distributed.worker_cpus=0.5",
        "distributed.engine_cpus=0.5",
        "train.lora.r=4",
        "train.steps=1",
    ]
    cfg = load_config("frozenlake_patr", overrides=overrides)
    tr = Trainer(cfg, tmp_path, log=lambda _m: None)
    try:
        with torch.no_grad():  # fresh adapters have B = 0: make a change the sync must carry
            for name, p in tr.learner.model.named_parameters():
                if "lora_B" in name:
                    p.add_(0.01)
        tr.train_step()
        lc = cfg.train.lora
        merged = merged_state_dict(tr.learner.engine_adapter.state_dict(), lc.alpha / lc.r)
        want = sum(float(v.double().sum()) for v in merged.values())
        got = ray.get(tr.rt.rollouts.replicas[0].checksum.remote())
        assert got == pytest.approx(want, rel=1e-9)
        # and the merge changed something: the replica does not hold the bare base weights
        bare = merged_state_dict(
            {k: v for k, v in tr.learner.engine_adapter.state_dict().items() if "lora_" not in k},
            1.0,
        )
        assert got != pytest.approx(sum(float(v.double().sum()) for v in bare.values()), rel=1e-9)
    finally:
        tr.rt.close()


def test_async_training_in_process_overlaps_on_a_snapshot_engine(tmp_path, tiny_frozenlake):
    from agentree.rollouts import ThreadRollout
    from agentree.run.trainer import Trainer

    cfg = load_config("frozenlake_patr", overrides=[*SMALL, "train.async_steps=1"])
    cfg.train.steps, cfg.engine.temperature = 3, 1.0
    tr = Trainer(cfg, tmp_path, log=lambda _m: None)
    try:
        rows = []
        while tr.step < cfg.train.steps:
            rows.append(tr.train_step())
            if tr.step == 0:
                assert isinstance(tr._pending[0], ThreadRollout)  # step 1 rolls out meanwhile
            tr.step += 1
        assert [r["train/staleness"] for r in rows] == [0.0, 1.0, 1.0]
        snap = tr.rt.rollouts.snapshot_engine().model
        assert snap is not tr.model  # the rollout thread never sees weights change mid-tree
        for k, v in tr.model.state_dict().items():  # synced after the last update
            assert torch.equal(snap.state_dict()[k], v)
    finally:
        tr.rt.close()
