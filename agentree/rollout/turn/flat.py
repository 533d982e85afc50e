"""Flat GRPO sampling: G independent trajectories per task, no forking (the standard baseline).

Every trajectory resets its own env and is stepped to the end; policy calls are still batched
across all trajectories of all tasks, one turn at a time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pydantic import Field

from agentree.envs.base import Task
from agentree.rollout.base import Controller, ControllerConfig, RolloutContext, RolloutStats
from agentree.rollout.turn.turns import TurnRunner
from agentree.tree import Tree


class FlatConfig(ControllerConfig):
    G: int = Field(8, ge=1)
    """Trajectories per task (the paper's GRPO/DAPO group size is 8)."""


class FlatGRPO(Controller):
    name = "grpo"
    Config = FlatConfig
    config: FlatConfig

    def group_size(self) -> int:
        return self.config.G

    def rollout(
        self, tasks: Sequence[Task], ctx: RolloutContext
    ) -> tuple[list[Tree], RolloutStats]:
        stats = RolloutStats()
        t0 = time.perf_counter()
        with TurnRunner(ctx, stats) as runner:
            groups = runner.start(tasks, self.config.G, fork=False)
            live = [b for g in groups for b in g]
            turn = 0
            while live:
                live, _ = runner.advance(live)
                turn += 1  # a line a turn: a turn of long contexts can take minutes
                ctx.report(f"{self.name}: turn {turn}, {len(live)} active trajectories")
        trees = [g[0].tree for g in groups]
        return self.finish(trees, stats, t0)
