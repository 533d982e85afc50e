"""Flat GRPO sampling: G independent trajectories per task, no forking (the standard baseline).

Every trajectory resets its own env and is stepped to the end; policy calls are still batched
across all trajectories of all tasks, one turn at a time.

With `env_step_budget: N` the group is no longer G trajectories: the task draws trajectories
until N env steps are spent, G at most at a time. A new one starts when another ends and the
steps the live ones are expected to take (by the mean length of the task's finished
trajectories) leave room for a whole one, or when none is live; so the only trajectories the
budget cuts (ending with `budget`, left out of the group) are those live at its very end,
usually one. With `budget_reserve` a new one starts whenever the unreserved budget covers a
whole episode (the env's turn limit), and none is cut. Nothing else changes: each trajectory
is an independent sample.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pydantic import Field

from agentree.envs.base import Task
from agentree.rollout.base import Controller, RolloutContext, RolloutStats, TurnConfig
from agentree.rollout.turn.turns import Branch, TurnRunner
from agentree.tree import Tree


class FlatConfig(TurnConfig):
    G: int = Field(8, ge=1)
    """Trajectories per task (the paper's GRPO/DAPO group size is 8); with an env-step budget,
    the most drawn at a time."""


class FlatGRPO(Controller):
    name = "grpo"
    Config = FlatConfig
    config: FlatConfig

    def group_size(self) -> int | None:
        return None if self.config.env_step_budget else self.config.G

    def rollout(
        self, tasks: Sequence[Task], ctx: RolloutContext
    ) -> tuple[list[Tree], RolloutStats]:
        cfg = self.config
        stats = RolloutStats()
        t0 = time.perf_counter()
        with TurnRunner(ctx, stats, cfg.env_step_budget, reserve=cfg.budget_reserve) as runner:
            g = cfg.G if runner.budget is None else min(cfg.G, runner.budget)
            groups = runner.start(tasks, g, fork=False)
            trees = [grp[0].tree for grp in groups]
            live = [b for grp in groups for b in grp]
            lengths: dict[int, list[int]] = {id(t): [] for t in trees}
            turn = 0
            while live:
                steps = stats.env_steps
                live, ended = runner.advance(live)
                for b in ended:
                    lengths[id(b.tree)].append(b.turn)
                if runner.budget is not None and stats.env_steps > steps:
                    live += self._draw(runner, trees, tasks, live, lengths)
                turn += 1  # a line a turn: a turn of long contexts can take minutes
                ctx.report(f"{self.name}: turn {turn}, {len(live)} active trajectories")
        return self.finish(trees, stats, t0)

    def _draw(
        self,
        runner: TurnRunner,
        trees: list[Tree],
        tasks: Sequence[Task],
        live: list[Branch],
        lengths: dict[int, list[int]],
    ) -> list[Branch]:
        """New trajectories for the tasks whose budget has room for them (see the module)."""
        out: list[Branch] = []
        for tree, task in zip(trees, tasks, strict=True):
            mine = [b for b in live if b.tree is tree]
            if runner.reserve:  # the runner admits what the unreserved budget can finish
                out += runner.add_root_branches(tree, task, self.config.G - len(mine))
                continue
            left = runner.left(tree)
            done = lengths[id(tree)]
            if left <= 0 or not done:  # the first G run before any length is known
                continue
            est = max(1.0, sum(done) / len(done))
            claimed = sum(max(est - b.turn, 1.0) for b in mine)
            n = 0
            while len(mine) + n < self.config.G and (
                len(mine) + n == 0 or left - claimed - n * est >= est
            ):
                n += 1
            if n:
                out += runner.add_root_branches(tree, task, n)
        return out
