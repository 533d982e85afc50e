"""`RayRollouts`: the driver side of the Ray runtime, one implementation of the rollout seam
(`agentree.rollouts.Rollouts`; the other runs in this process).

Owns the engine replicas and rollout workers, splits a batch of tasks into chunks of trees,
hands each chunk to the next idle worker (a worker runs one chunk at a time, so a slow worker
simply takes fewer chunks), and collects the trees. A chunk is at most
`ceil(tasks / workers)` trees and at most as many trees as fit the worker's sandbox limit.

Faults: when a worker dies (process killed, node lost) or runs past its timeout, the trees of
its chunk are lost with it; each comes back as a tree whose only branch ends as `env_error`
(kept out of the loss by the trainer), Ray restarts the actor (`max_restarts`), and the step
completes with the counts in `rollout/env_errors` and `distributed/worker_restarts`.
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from agentree.config import ExperimentConfig
from agentree.distributed.cluster import (
    check_cluster,
    connect,
    disconnect,
    engine_replicas,
    import_ray,
    run_needs,
    scorer_actor_needed,
    total,
)
from agentree.envs.base import Task
from agentree.learner.lora import plain_state_dict
from agentree.rollout.base import Controller, RolloutStats
from agentree.rollouts import RolloutParts, check_not_empty
from agentree.tree import EndReason, Tree


class RayRollouts:
    """The controller on Ray rollout workers; `engine` is the driver's own (it holds the
    weights the replicas start from and gets every sync, as in-process)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        parts: RolloutParts,
        engine: Any,
        model: Any,
        log: Callable[[str], None] = print,
    ) -> None:
        ray = import_ray()
        self.ray = ray
        self.cfg = cfg
        self.parts = parts
        self.controller = parts.controller
        self.engine = engine
        self.rng = random.Random(cfg.seed)
        dc = cfg.distributed
        scorer = scorer_actor_needed(cfg)
        # a private instance gets room for every actor (its GPUs are known once it runs)
        most = engine_replicas(dc, cluster_gpus=dc.engine_gpus)
        need = run_needs(cfg, replicas=most, scorer_actor=scorer, cluster_gpus=0.0)
        self.started = connect(dc, num_cpus=total(need, "CPU"))
        self.workers: list[Any] = []
        self.replicas: list[Any] = []
        self.scorer_actor: Any = None
        self.metrics: dict[str, float] = {}
        self.restarts = 0
        self.weight_version = 0
        self._weights: Any = None
        self._closed = False
        self._idle: list[int] = []
        self._idle_lock = threading.Condition()
        try:
            # refused at once, not after start_timeout_s of actors waiting for room
            self.replica_count = check_cluster(cfg, scorer_actor=scorer)
            self._start(cfg, model, log)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: ExperimentConfig, model: Any, log: Callable[[str], None]) -> None:
        # deferred: these modules import ray at load; import_ray() in __init__ says first that
        # it is the optional [ray] extra
        from agentree.distributed.engine import EngineReplica
        from agentree.distributed.worker import RolloutWorker

        ray, dc = self.ray, cfg.distributed
        data = cfg.model_dump()
        t0 = time.perf_counter()
        # Weights go in after start, not as constructor arguments: a restarted actor must get
        # the latest weights (`_refresh`), not the ones it was created with.
        replica_cls = ray.remote(EngineReplica).options(
            num_cpus=dc.engine_cpus,
            num_gpus=dc.engine_gpus,
            max_restarts=dc.max_restarts,
        )
        self.replicas = [replica_cls.remote(data, None) for _ in range(self.replica_count)]
        self._start_scorer(cfg)
        # rollouts run one at a time; status and close answer beside a running rollout
        worker_cls = ray.remote(concurrency_groups={"control": 2})(RolloutWorker).options(
            num_cpus=dc.worker_cpus,
            max_restarts=dc.max_restarts,
            scheduling_strategy="SPREAD",
        )
        self.workers = [
            worker_cls.remote(data, i, self.replicas, None, self.scorer_actor)
            for i in range(dc.rollout_workers)
        ]
        ready = [w.ready.remote() for w in self.workers]
        if self.scorer_actor is not None:
            ready.append(self.scorer_actor.info.remote())
        try:
            infos = ray.get(ready, timeout=dc.start_timeout_s)[: len(self.workers)]
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"Ray actors did not start within {dc.start_timeout_s:.0f}s; the cluster needs "
                f"{dc.rollout_workers} x {dc.worker_cpus} CPUs for workers and "
                f"{self.replica_count} x {dc.engine_cpus} CPUs for engines (see `ray status`)"
            ) from None
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(actor_failure(e)) from None
        if model is not None:
            self.push_weights(model)
        self.nodes = sorted({i["node_id"] for i in infos})
        self._idle = list(range(len(self.workers)))
        self._envs_per_tree = float(_nominal_width(cfg))
        log(
            f"ray: {len(self.workers)} rollout workers on {len(self.nodes)} node(s), "
            f"{len(self.replicas)} engine replica(s), ready in {time.perf_counter() - t0:.1f}s"
        )

    def _start_scorer(self, cfg: ExperimentConfig) -> None:
        """One actor for a scorer that holds a model (PRM), shared by every worker."""
        if not scorer_actor_needed(cfg):
            return
        name, settings = cfg.component("scorer")
        # deferred: it imports ray at load (the optional [ray] extra; see _start)
        from agentree.distributed.scorer import ScorerActor

        dc = cfg.distributed
        self.scorer_actor = (
            self.ray.remote(ScorerActor)
            .options(
                num_cpus=dc.scorer_cpus,
                num_gpus=dc.scorer_gpus,
                max_restarts=dc.max_restarts,
            )
            .remote(name, settings)
        )

    # -- rollouts -----------------------------------------------------------------------------
    def chunk_size(self, n: int) -> int:
        by_load = math.ceil(n / len(self.workers))
        by_sandboxes = int(self.cfg.distributed.max_sandboxes_per_worker // self._envs_per_tree)
        return max(1, min(by_load, by_sandboxes))

    def rollout(
        self,
        tasks: Sequence[Task],
        *,
        step: int = 0,
        progress: Any = None,
        controller: Controller | None = None,
        temperature: float | None = None,
        rng: random.Random | None = None,
    ) -> tuple[list[Tree], RolloutStats]:
        controller = controller or self.controller
        seed = (rng or self.rng).getrandbits(63)
        trees, stats = self.start(tasks, controller, step, temperature, seed).result(progress)
        check_not_empty(self.cfg, self.engine.max_model_len, controller, trees)
        return trees, stats

    def submit(self, tasks: Sequence[Task], *, step: int = 0) -> Pending:
        return self.start(tasks, self.controller, step, None, self.rng.getrandbits(63))

    def start(
        self,
        tasks: Sequence[Task],
        controller: Controller,
        step: int,
        temperature: float | None,
        seed: int,
    ) -> Pending:
        """Start rolling out `tasks` now; the returned handle's `result()` collects them."""
        return Pending(self, list(tasks), controller, step, temperature, seed)

    def _release(self, w: int) -> None:
        with self._idle_lock:
            self._idle.append(w)
            self._idle_lock.notify_all()

    def _revive(self, w: int) -> None:
        """Wait (on a thread) until Ray has restarted worker `w`, give the engines the latest
        weights (a restarted actor starts from the checkpoint's), then let it take work."""

        def wait() -> None:
            deadline = time.monotonic() + self.cfg.distributed.start_timeout_s
            while time.monotonic() < deadline and not self._closed:
                try:
                    self.ray.get(self.workers[w].ready.remote(), timeout=30)
                    self._refresh()
                    self._release(w)
                    return
                except self.ray.exceptions.RayError:
                    time.sleep(1.0)

        threading.Thread(target=wait, daemon=True).start()

    def sync_weights(self, model: Any, *, busy: bool = False) -> None:
        """Trainer -> the driver's engine, and every replica (or worker-local engine) through
        the object store unless a submitted rollout is still sampling from them (`busy`)."""
        self.engine.sync_weights(model)
        if not busy:
            self.push_weights(model)

    def push_weights(self, model: Any) -> None:
        t0 = time.perf_counter()
        self.weight_version += 1
        self._weights = self.ray.put(state_dict(model))
        self._refresh()
        self.metrics["distributed/weight_sync_s"] = time.perf_counter() - t0

    def _refresh(self) -> None:
        """Push the latest weights to every engine (also after an actor restart)."""
        ray, ref = self.ray, self._weights
        if ref is None:
            return
        if self.replicas:
            refs = [r.load_weights.remote(ref, self.weight_version) for r in self.replicas]
            for i, r in enumerate(refs):
                try:
                    ray.get(r)
                except ray.exceptions.RayActorError:
                    # killed or restarting: the workers fail over to the other replicas
                    # meanwhile; it gets the weights once it is back
                    self._revive_replica(i)
        else:
            ray.get([w.load_weights.remote(ref) for w in self.workers])

    def _revive_replica(self, i: int) -> None:
        """Wait (on a thread) until Ray has restarted replica `i`, then give it the latest
        weights, after which the workers route to it again (`RemoteEngine.revive`)."""

        def wait() -> None:
            deadline = time.monotonic() + self.cfg.distributed.start_timeout_s
            while time.monotonic() < deadline and not self._closed:
                try:
                    replica = self.replicas[i]
                    self.ray.get(replica.info.remote(), timeout=30)
                    self.ray.get(replica.load_weights.remote(self._weights, self.weight_version))
                    return
                except self.ray.exceptions.RayError:
                    time.sleep(1.0)

        threading.Thread(target=wait, daemon=True).start()

    def status(self) -> list[dict[str, Any]]:
        refs = [w.status.options(concurrency_group="control").remote() for w in self.workers]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=1.0)
        done = set(ready)
        out = []
        for r in refs:
            if r in done:
                try:
                    out.append(self.ray.get(r))
                except self.ray.exceptions.RayError:
                    out.append({"status": "restarting"})
        return out

    def state(self) -> dict[str, Any]:
        """The seeds of the next rollouts' workers. The engines' samplers are not saved: workers
        share replicas in whatever order their requests arrive, so a Ray run draws differently
        from run to run anyway."""
        return {"rng": self.rng.getstate()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.rng.setstate(state["rng"])

    def close(self) -> None:
        """Close every env on every worker, then end the actors (and a private Ray)."""
        if self._closed:
            return
        self._closed = True
        ray = self.ray
        try:
            if self.workers:
                refs = [w.close.options(concurrency_group="control").remote() for w in self.workers]
                ray.wait(refs, num_returns=len(refs), timeout=60)
            if self.scorer_actor is not None:
                ray.wait([self.scorer_actor.close.remote()], timeout=30)
            for a in [*self.workers, *self.replicas, self.scorer_actor]:
                if a is None:
                    continue
                with contextlib.suppress(Exception):  # already gone
                    ray.kill(a, no_restart=True)
        finally:
            self.workers, self.replicas, self.scorer_actor = [], [], None
            if self.started:
                disconnect(True)
            try:
                self.parts.scorer.close()
            finally:
                self.engine.close()


class Pending:
    """A rollout in flight: a driver thread feeds chunks to idle workers and gathers trees."""

    def __init__(
        self,
        owner: RayRollouts,
        tasks: list[Task],
        controller: Controller,
        step: int,
        temperature: float | None,
        seed: int,
    ) -> None:
        self.owner = owner
        self.future: Future = Future()
        size = owner.chunk_size(len(tasks))
        chunks = [tasks[i : i + size] for i in range(0, len(tasks), size)]
        self.args = (controller, step, temperature)
        self.seed = seed
        self.total = len(tasks)
        self.trees_done = 0
        self.t0 = time.perf_counter()
        thread = threading.Thread(target=self._run, args=(chunks,), daemon=True)
        thread.start()

    def result(
        self, progress: Callable[[str], None] | None = None
    ) -> tuple[list[Tree], RolloutStats]:
        while not self.future.done():
            if progress is not None:
                progress(self.progress_line())
            try:
                return self.future.result(timeout=1.0)
            except TimeoutError:
                continue
        return self.future.result()

    def progress_line(self) -> str:
        """One line with every worker's state: `w0@<node>: <trees: controller's progress>
        (<live envs> envs)`, plus the trees done so far."""
        parts = []
        for s in self.owner.status():
            if "index" not in s:
                parts.append(str(s.get("status")))
                continue
            where = f"w{s['index']}@{s['node_id'][:6]}"
            parts.append(f"{where}: {s['status']} ({s['live_envs']} envs)")
        done = f"{self.trees_done}/{self.total} trees"
        return " | ".join([done, *parts]) if parts else f"{done}, waiting for workers"

    def _run(self, chunks: list[list[Task]]) -> None:
        try:
            self.future.set_result(self._gather(chunks))
        except BaseException as e:
            self.future.set_exception(e)

    def _gather(self, chunks: list[list[Task]]) -> tuple[list[Tree], RolloutStats]:
        owner, ray = self.owner, self.owner.ray
        dc = owner.cfg.distributed
        controller, step, temperature = self.args
        queue = deque(enumerate(chunks))
        results: dict[int, list[Tree]] = {}
        stats = RolloutStats()
        inflight: dict[Any, tuple[int, int, float]] = {}  # ref -> (chunk, worker, started)
        busy = transfer = 0.0
        restarts = depth = failovers = 0
        killed: set[Any] = set()
        waited = 0.0
        while queue or inflight:
            while queue and not owner._closed:
                with owner._idle_lock:
                    if not owner._idle:
                        break
                    w = owner._idle.pop(0)
                c, chunk = queue.popleft()
                ref = owner.workers[w].rollout.remote(
                    chunk, controller, step, temperature, self.seed + c, owner.weight_version
                )
                inflight[ref] = (c, w, time.perf_counter())
            depth = max(depth, len(queue))
            if owner._closed:
                raise RuntimeError("the Ray runtime was closed while a rollout was running")
            if not inflight:  # every worker is busy elsewhere or restarting
                waited = waited or time.perf_counter()
                if time.perf_counter() - waited > dc.start_timeout_s + dc.tree_timeout_s:
                    for c, chunk in queue:  # no worker came back: these trees are lost
                        results[c] = lost_trees(chunk, -1, "no rollout worker available")
                        stats.env_errors += len(chunk)
                    queue.clear()
                time.sleep(0.05)
                continue
            waited = 0.0
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
            now = time.perf_counter()
            for ref in ready:
                c, w, started = inflight.pop(ref)
                t_get = time.perf_counter()
                try:
                    trees, st, info = ray.get(ref)
                    transfer += time.perf_counter() - t_get
                    stats.add(st)
                    busy += info["busy_s"]
                    failovers += info["engine_failovers"]
                    owner._envs_per_tree = max(
                        owner._envs_per_tree, info["peak_envs"] / max(len(trees), 1)
                    )
                except ray.exceptions.RayError as e:
                    if isinstance(e, ray.exceptions.RayTaskError) and not isinstance(
                        getattr(e, "cause", None), ray.exceptions.RayActorError
                    ):
                        raise  # the controller itself failed: a bug to see, not a lost worker
                    trees = lost_trees(chunks[c], w, f"worker lost: {type(e).__name__}")
                    stats.env_errors += len(trees)
                    restarts += 1
                    results[c] = trees
                    owner._revive(w)  # back in the idle pool once Ray has restarted it
                    continue
                results[c] = trees
                self.trees_done += len(trees)
                owner._release(w)
            for ref, (c, w, started) in list(inflight.items()):
                if ref not in killed and now - started > dc.tree_timeout_s * len(chunks[c]):
                    # ray.kill with restart: the hung call fails and is handled above
                    ray.kill(owner.workers[w], no_restart=False)
                    killed.add(ref)
        wall = time.perf_counter() - self.t0
        owner.restarts += restarts
        trees = [t for c in range(len(chunks)) for t in results[c]]
        stats.wall_s = wall
        stats.trajectories = sum(len(controller.group(t)) for t in trees)
        n = len(owner.workers)
        stats.extra.update(
            {
                "distributed/workers": float(n),
                "distributed/nodes": float(len(owner.nodes)),
                "distributed/busy_frac": busy / max(wall * n, 1e-9),
                "distributed/queue_depth": float(depth),
                "distributed/chunks": float(len(chunks)),
                "distributed/transfer_s": transfer,
                "distributed/worker_restarts": float(restarts),
                "distributed/engine_failovers": float(failovers),
                **owner.metrics,
            }
        )
        return trees, stats


def actor_failure(e: Exception) -> str:
    """The one line a user can act on from an actor that failed to start: the message of the
    exception its constructor raised (Ray wraps it in a traceback), else Ray's first line."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    for line in reversed(lines):
        name, sep, msg = line.partition(": ")
        if sep and name.isidentifier() and name.endswith(("Error", "Exception")) and msg:
            return msg
    return f"a Ray actor failed to start: {lines[0] if lines else type(e).__name__}"


def lost_trees(tasks: Sequence[Task], worker: int, why: str) -> list[Tree]:
    """Trees whose worker was lost: one branch, ended as env_error, that carries no tokens."""
    out = []
    for task in tasks:
        tree = Tree(task.id, task.to_dict())
        tree.add_root("", [])
        tree.add_child(0, end_reason=EndReason.ENV_ERROR, info={"error": why})
        tree.meta["distributed"] = {"worker": worker, "node_id": None, "error": why}
        out.append(tree)
    return out


def state_dict(model: Any) -> dict[str, Any]:
    """What replicas and worker engines load: plain weights, with LoRA adapters merged (the
    driver's engine may run them in place; the others hold a model without adapters)."""
    return {k: v.detach().cpu() for k, v in plain_state_dict(model).items()}


def _nominal_width(cfg: ExperimentConfig) -> int:
    """Envs one tree holds at first (B0 root branches, G flat samples), for chunk sizing."""
    r = cfg.rollout
    return int(r.get("B0") or r.get("G") or r.get("k") or 1)
