"""Tree-GRPO: agent-step tree search for rollouts (Ji et al., arXiv 2509.21240).

Initialization: M independent chains per task, each the first path of its own tree. Sampling:
from each tree, N non-leaf nodes chosen uniformly at random. Expansion: each chosen node p is
continued to the end of the episode from its context and env state (a fork of the state
snapshotted when the chain stood at p), and the new branch is inserted under p. Sampling and
expansion repeat L times, so every tree ends with 1 + L * N trajectories and the task's group
with M (1 + L N). A node is one agent step (action and observation), as in the paper.

The paper's advantage is the sum of the intra-tree and inter-tree GRPO advantages:
set `train.advantage=treegrpo` (agentree's M trees hang below one root, a tree being the
trajectories sharing their first turn). Where the paper is silent: a tree with fewer than N
non-leaf nodes expands all of them; the root (the prompt) is never expanded, so the M trees
stay apart; every node's env state is snapshotted as the chains advance (free for FrozenLake
and Sokoban, an image commit per turn for SWE).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from agentree.envs.base import Task
from agentree.rollout.base import Controller, ControllerConfig, RolloutContext, RolloutStats
from agentree.rollout.turn.turns import Branch, TurnRunner
from agentree.tree import Tree


class TreeGRPOConfig(ControllerConfig):
    M: int = Field(2, ge=1)
    """Trees per task, each started from one independent chain."""
    N: int = Field(2, ge=1)
    """Non-leaf nodes expanded per tree in each iteration."""
    L: int = Field(1, ge=0)
    """Expansion iterations."""


class TreeGRPO(Controller):
    name = "tree-grpo"
    Config = TreeGRPOConfig
    requires_fork = True
    config: TreeGRPOConfig

    def group_size(self) -> int:
        c = self.config
        return c.M * (1 + c.L * c.N)

    def rollout(
        self, tasks: Sequence[Task], ctx: RolloutContext
    ) -> tuple[list[Tree], RolloutStats]:
        cfg = self.config
        stats = RolloutStats()
        t0 = time.perf_counter()
        states: list[dict[int, Any]] = [{} for _ in tasks]  # node -> env snapshot, per task
        with TurnRunner(ctx, stats) as runner:
            groups = runner.start(tasks, cfg.M, fork=False)
            trees = [g[0].tree for g in groups]
            self._run(runner, [b for g in groups for b in g], trees, states)
            for it in range(cfg.L):
                new: list[Branch] = []
                for k, (tree, task) in enumerate(zip(trees, tasks, strict=True)):
                    for first in tree.root.children:  # one Tree-GRPO tree per first turn
                        pool = [n for n in self._inner(tree, first) if n in states[k]]
                        picks = ctx.rng.sample(pool, min(cfg.N, len(pool)))
                        stats.expanded += len(picks)
                        for n in picks:
                            tree.nodes[n].info["expanded"] = (
                                tree.nodes[n].info.get("expanded", 0) + 1
                            )
                            new.append(runner.branch_at(tree, task, n, states[k][n]))
                ctx.report(f"{self.name}: iteration {it + 1}, {len(new)} expansions")
                self._run(runner, new, trees, states)
        return self.finish(trees, stats, t0)

    @staticmethod
    def _inner(tree: Tree, top: int) -> list[int]:
        """Non-leaf nodes of the subtree under `top` (inclusive), in id order."""
        out, stack = [], [top]
        while stack:
            n = tree.nodes[stack.pop()]
            if n.children:
                out.append(n.id)
                stack.extend(n.children)
        return sorted(out)

    @staticmethod
    def _run(
        runner: TurnRunner, live: list[Branch], trees: list[Tree], states: list[dict[int, Any]]
    ) -> None:
        """Advance branches to the end of their episodes, snapshotting every state passed."""
        index = {id(t): k for k, t in enumerate(trees)}
        while live:
            live, _ = runner.advance(live)
            for b in live:
                assert b.env is not None
                states[index[id(b.tree)]][b.node] = b.env.snapshot()
