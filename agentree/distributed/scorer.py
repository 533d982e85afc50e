"""A scorer that holds a model (the PRM) as one Ray actor shared by every rollout worker.

Loading a 7B PRM into each worker would put a copy of it on every host; instead the driver
starts one `ScorerActor` (`distributed.scorer_cpus` / `scorer_gpus`), which builds the scorer
from the config exactly as `agentree rollout` does in-process, and each worker's controller
gets a `RemoteScorer`: the same `Scorer.score(task, branches)` call, answered by the actor.
Scorers without a model (bfs, heuristic, judge: a client of a remote endpoint) stay in the
workers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import ray

from agentree.envs.base import Task
from agentree.scorers.base import NodePath, Score, Scorer, make_scorer


class ScorerActor:
    """The config's scorer, built once in its own process."""

    def __init__(self, name: str, settings: dict[str, Any]) -> None:
        self.scorer = make_scorer(name, **settings)
        self.calls = 0

    def info(self) -> dict[str, Any]:
        return {
            "scorer": type(self.scorer).__name__,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "calls": self.calls,
        }

    def score(self, task: Task, branches: Sequence[NodePath]) -> list[Score]:
        self.calls += 1
        return self.scorer.score(task, branches)

    def close(self) -> None:
        self.scorer.close()


class RemoteScorer(Scorer):
    """`Scorer` whose `score` runs on a `ScorerActor`; what a worker's controller calls."""

    name = "remote"

    def __init__(self, actor: Any) -> None:
        super().__init__()
        self.actor = actor

    def score(self, task: Task, branches: Sequence[NodePath]) -> list[Score]:
        if not branches:
            return []
        return ray.get(self.actor.score.remote(task, list(branches)))

    def close(self) -> None:
        """The actor belongs to the driver (`RayRollouts.close`), not to a worker."""
