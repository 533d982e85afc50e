"""Tree-GRPO: agent-step tree search for rollouts (Ji et al., arXiv 2509.21240).

Initialization: M independent chains per task, each the first path of its own tree. Sampling:
from each tree, N nodes drawn uniformly at random, with replacement, from its root and its
non-leaf nodes. Expansion: each drawn node p is continued to the end of the episode from its
context and env state (a fork of the state snapshotted when the chain stood at p; a fresh reset
for the root), and the new branch is inserted under p. Sampling and expansion repeat L times,
so every tree ends with exactly 1 + L * N trajectories and the task's group with M (1 + L N).
A node is one agent step (action and observation), as in the paper. This is how the authors'
code does it (AMAP-ML/Tree-GRPO, `TreeNode.get_expand_node`: `random.choices` over the root
and the non-leaf nodes of its subtree).

agentree keeps a task's M trees below one root: each first-turn node records its tree in
`info["tree_index"]`, so an expansion of a tree's root (a new first turn) stays in that tree,
and the `treegrpo` advantage's intra-tree groups follow the record. The paper's advantage is
the sum of the intra-tree and inter-tree GRPO advantages: set `train.advantage=treegrpo`.

Departures, each an option: `expand_root: false` leaves the root out of the candidates (a tree
is then the trajectories sharing a first turn), `replace: false` draws without replacement (a
tree with fewer than N candidates expands all of them). Every node's env state is snapshotted
as the chains advance (free for FrozenLake and Sokoban, an image commit per turn for SWE). The
reference then keeps k sampled leaves per tree (`sample_leaf`); agentree keeps them all
(k = 1 + L N, as the paper's configurations set it).

With `env_step_budget: N_env` (exact env steps per task) the expansion iterations go on until
the budget is spent (L is then no limit), each drawing at most as many nodes of a task as it has
steps left; the branches live when it runs out end with `budget` and stay out of the group.
With `budget_reserve` a drawn node is expanded only when the unreserved budget can finish a
branch from it (to the env's turn limit); none is cut.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from agentree.envs.base import Task
from agentree.rollout.base import Controller, RolloutContext, RolloutStats, TurnConfig
from agentree.rollout.turn.turns import Branch, TurnRunner
from agentree.tree import Tree


class TreeGRPOConfig(TurnConfig):
    M: int = Field(2, ge=1)
    """Trees per task, each started from one independent chain."""
    N: int = Field(2, ge=1)
    """Nodes expanded per tree in each iteration."""
    L: int = Field(1, ge=0)
    """Expansion iterations (with an env-step budget: until it is spent)."""
    expand_root: bool = True
    """The tree's root is a candidate, as in the authors' code (false: non-leaf nodes below
    it only, and a tree is the trajectories sharing a first turn; with an env-step budget a tree
    with no other candidate still expands its root)."""
    replace: bool = True
    """Draw the N nodes with replacement, as in the authors' code (false: without)."""


class TreeGRPO(Controller):
    name = "tree-grpo"
    Config = TreeGRPOConfig
    requires_fork = True
    config: TreeGRPOConfig

    def group_size(self) -> int | None:
        c = self.config
        return None if c.env_step_budget else c.M * (1 + c.L * c.N)

    def rollout(
        self, tasks: Sequence[Task], ctx: RolloutContext
    ) -> tuple[list[Tree], RolloutStats]:
        cfg = self.config
        stats = RolloutStats()
        t0 = time.perf_counter()
        states: list[dict[int, Any]] = [{} for _ in tasks]  # node -> env snapshot, per task
        with TurnRunner(ctx, stats, cfg.env_step_budget, reserve=cfg.budget_reserve) as runner:
            m = cfg.M if runner.budget is None else min(cfg.M, runner.budget)
            groups = runner.start(tasks, m, fork=False)
            trees = [g[0].tree for g in groups]
            owner = {id(b): k for g in groups for k, b in enumerate(g)}  # branch -> its tree
            self._run(runner, [b for g in groups for b in g], trees, states, owner)
            it = 0
            while it < cfg.L if runner.budget is None else any(runner.left(t) > 0 for t in trees):
                steps = stats.env_steps
                new: list[Branch] = []
                for k, (tree, task) in enumerate(zip(trees, tasks, strict=True)):
                    new += self._expand(runner, tree, task, states[k], owner, ctx)
                it += 1
                ctx.report(f"{self.name}: iteration {it}, {len(new)} expansions")
                self._run(runner, new, trees, states, owner)
                if stats.env_steps == steps:  # nothing could step: the budget cannot be spent
                    break
        return self.finish(trees, stats, t0)

    def _expand(
        self,
        runner: TurnRunner,
        tree: Tree,
        task: Task,
        states: dict[int, Any],
        owner: dict[int, int],
        ctx: RolloutContext,
    ) -> list[Branch]:
        """One iteration's expansions of one task: N draws from each of its trees."""
        cfg = self.config
        picks: list[tuple[int, int]] = []  # (tree index, node)
        firsts: dict[int, list[int]] = {}  # tree index -> its first-turn nodes
        for f in tree.root.children:
            firsts.setdefault(tree.nodes[f].info["tree_index"], []).append(f)
        for k, fs in sorted(firsts.items()):
            pool = [n for f in fs for n in self._inner(tree, f) if n in states]
            if cfg.expand_root or (not pool and runner.budget is not None):
                pool = [0, *pool]  # without the root, a budget could be left unspendable
            if cfg.replace:
                drawn = ctx.rng.choices(pool, k=cfg.N) if pool else []
            else:
                drawn = ctx.rng.sample(pool, min(cfg.N, len(pool)))
            picks += [(k, n) for n in drawn]
        del picks[max(0, runner.left(tree)) :]  # at most one new branch per step left
        out: list[Branch] = []
        for k, n in picks:
            if n == 0:
                b = next(iter(runner.add_root_branches(tree, task, 1)), None)
            else:
                b = runner.branch_at(tree, task, n, states[n])
            if b is None:  # budget_reserve: the budget cannot finish a branch from there
                continue
            runner.stats.expanded += 1
            node = tree.nodes[n]
            node.info["expanded"] = node.info.get("expanded", 0) + 1
            owner[id(b)] = k
            out.append(b)
        return out

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
        runner: TurnRunner,
        live: list[Branch],
        trees: list[Tree],
        states: list[dict[int, Any]],
        owner: dict[int, int],
    ) -> None:
        """Advance branches to the end of their episodes, snapshotting every state passed; a
        branch's first turn records the tree it belongs to."""
        index = {id(t): k for k, t in enumerate(trees)}
        while live:
            starting = [b for b in live if b.node == 0]
            live, _ = runner.advance(live)
            for b in starting:
                if b.node != 0:
                    b.tree.nodes[b.node].info["tree_index"] = owner[id(b)]
            for b in live:
                assert b.env is not None
                states[index[id(b.tree)]][b.node] = b.env.snapshot()
