"""Rollout workers: Ray actors that run the in-process controller code on chunks of trees.

A worker builds an ordinary `Runtime` (env class, controller, scorer, chat format) with the
engine replicas' client as its engine (or its own local engine when `engine_replicas=0`), and
runs `controller.rollout(chunk, ctx)` exactly as `agentree rollout` does in-process. A tree
never leaves the worker that started it, so its forks (env snapshots, Docker snapshot images)
stay on that worker's host. Every env the worker creates is tracked, so `close()` releases
them even while a rollout is still running on the other thread.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray
from transformers import AutoTokenizer

from agentree.config import validate_config
from agentree.distributed.engine import RemoteEngine
from agentree.distributed.scorer import RemoteScorer
from agentree.envs.base import Env, Task
from agentree.policy import build_engine, resolve_policy
from agentree.rollout.base import Controller, RolloutStats
from agentree.rollouts import LocalRollouts, rollout_parts
from agentree.tree import Tree


class RolloutWorker:
    def __init__(
        self,
        cfg_data: dict[str, Any],
        index: int,
        replicas: Sequence[Any],
        weights: dict[str, Any] | None,
        scorer: Any = None,
    ) -> None:
        self.index = index
        self.node_id = ray.get_runtime_context().get_node_id()
        data = {**cfg_data, "distributed": {**cfg_data["distributed"], "backend": "local"}}
        try:
            cfg = validate_config(data)
        except (ValueError, ImportError) as e:
            why = " ".join(str(e).split())  # one line: the driver reports it as the error
            raise RuntimeError(
                f"rollout worker {index} on node {self.node_id[:12]} cannot load the config "
                f"({why}); install the env's package on every node or list it in "
                "distributed.py_modules"
            ) from None
        self.cfg = cfg
        self._lock = threading.Lock()
        self._live: list[Env] = []
        self.peak_envs = 0
        self.status_line = "starting"
        self.busy_s = 0.0
        self.calls = 0
        if ray.get_runtime_context().was_current_actor_reconstructed:
            # the previous incarnation was killed: its sandboxes and snapshots are orphans now
            sweep_docker(stale=True, force=True)
        self.rollouts = self._rollouts(cfg, replicas, weights, scorer)
        make_env = self.rollouts.make_env
        self.rollouts.make_env = lambda: self._track(make_env())  # type: ignore[method-assign]
        self.status_line = "idle"

    @staticmethod
    def _rollouts(
        cfg: Any, replicas: Sequence[Any], weights: dict[str, Any] | None, scorer_actor: Any
    ) -> LocalRollouts:
        """The in-process rollouts of `cfg`, sampling from the shared engine replicas (or a
        private engine when there are none), scoring with the shared scorer actor if any."""
        scorer = RemoteScorer(scorer_actor) if scorer_actor is not None else None
        parts = rollout_parts(cfg, scorer=scorer)
        path = resolve_policy(cfg, lambda _m: None)
        if not replicas:  # a private engine in this process
            engine, model, tokenizer = build_engine(cfg, path)
            if weights is not None:
                model.load_state_dict(weights)
                engine.sync_weights(model)
            return LocalRollouts(cfg, parts, engine, tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(path)
        info = ray.get(replicas[0].info.remote())
        return LocalRollouts(cfg, parts, RemoteEngine(replicas, tokenizer, info), tokenizer)

    def _track(self, env: Env) -> Env:
        close = env.close

        def tracked_close() -> None:
            with self._lock:
                if env in self._live:
                    self._live.remove(env)
            close()

        env.close = tracked_close  # type: ignore[method-assign]
        with self._lock:
            self._live.append(env)
            self.peak_envs = max(self.peak_envs, len(self._live))
        return env

    def ready(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "node_id": self.node_id,
            "pid": os.getpid(),
            "niceness": os.nice(0),
        }

    def rollout(
        self,
        tasks: list[Task],
        controller: Controller,
        step: int,
        temperature: float | None,
        seed: int,
        version: int = 0,
    ) -> tuple[list[Tree], RolloutStats, dict[str, Any]]:
        """The same call `Runtime.rollout` makes in-process, on this worker's envs; `version`
        is the trainer's weight version (engine replicas behind it are not used)."""
        t0 = time.perf_counter()
        engine = self.rollouts.engine
        failovers = 0
        if isinstance(engine, RemoteEngine):
            engine.revive(version)
            failovers = engine.failovers
        self.peak_envs = len(self._live)
        self.status_line = f"{len(tasks)} trees"

        def report(msg: str) -> None:
            self.status_line = f"{len(tasks)} trees: {msg}"

        ctx = self.rollouts.context(step=step, temperature=temperature, progress=report)
        ctx.rng = random.Random(seed)
        try:
            trees, stats = controller.rollout(tasks, ctx)
        finally:
            self.status_line = "idle"
            self.busy_s += time.perf_counter() - t0
            self.calls += 1
        meta = {"worker": self.index, "node_id": self.node_id, "pid": os.getpid()}
        for tree in trees:
            tree.meta["distributed"] = dict(meta)
        if isinstance(engine, RemoteEngine):
            failovers = engine.failovers - failovers
        info = {"busy_s": time.perf_counter() - t0, "peak_envs": self.peak_envs}
        return trees, stats, {**info, "engine_failovers": failovers}

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Only for a worker with its own engine (`engine_replicas=0`)."""
        engine = self.rollouts.engine
        if not isinstance(engine, RemoteEngine):
            engine.model.load_state_dict(weights)
            engine.sync_weights(engine.model)

    # -- control (runs on its own thread, beside a running rollout) ----------------------------
    def status(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "node_id": self.node_id,
            "scorer": type(self.rollouts.scorer).__name__,
            "status": self.status_line,
            "live_envs": len(self._live),
            "busy_s": self.busy_s,
        }

    def close(self) -> int:
        """Close every env this worker still holds (containers, snapshot images); how many."""
        with self._lock:
            live = list(self._live)
        for env in live:
            with contextlib.suppress(Exception):  # keep closing the others
                env.close()
        self.rollouts.scorer.close()
        sweep_docker(stale=False)
        return len(live)


def sweep_docker(*, stale: bool, force: bool = False) -> None:
    """Remove this process's Docker resources (and, with `stale`, those of dead processes on
    this host). Only when this process used Docker sandboxes, unless `force`."""
    if "agentree.envs.swe.runtime" not in sys.modules and not force:
        return
    with contextlib.suppress(Exception):  # no Docker here: nothing to sweep
        # deferred: a loaded agentree.envs.swe.runtime is the sign (above) that this process used
        # Docker; importing it at module level would make every worker look like one
        from agentree.envs.swe import runtime

        runtime.cleanup(session=runtime.session_id(), stale=stale)
