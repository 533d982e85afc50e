"""PATR: process-scorer guided adaptive tree rollout (PATR paper, Algorithm 1).

Start B0 branches per task. Repeatedly: advance every active branch K turns; score the active
ones (Eq. 3); expand the top-k by M children each (Eq. 4; children fork the parent's env state);
prune branches scoring below median(active) - alpha (Eq. 5) and, as Algorithm 1 line 8 has it,
unexpanded branches whose last theta actions are the same (the Theta-repeat criterion, checked
at checkpoints); the rest survive. `theta_at: every_turn` instead stops a repeating branch at
the turn it reaches theta repeats, expanded or not. Every finished branch, pruned or not, is in
the group (Eq. 6, "keep all"); `group: best-n` drops pruned ones.

Where the paper is silent: a branch whose score is unavailable (scorer failure) survives
unexpanded and counts as a fallback; ties in the top-k are broken at random; `max_active`
caps the live branches of one tree so a generous config cannot explode.

With `env_step_budget: N` (exact env steps per task) the tree keeps growing until N steps are
spent: when all of a task's branches have ended and steps are left, Algorithm 1 starts again
below the same root (B0 new branches, the same group), and a tree never holds more live branches
than it has steps left (fewer expansions at a checkpoint, fewer branches in a new round). The
branches live when the budget runs out end with `budget` and stay out of the group. With
`budget_reserve` a checkpoint expands, and a round starts, only the branches the unreserved
budget can finish (to the env's turn limit); none is cut.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from agentree.envs.base import Task
from agentree.rollout.base import Controller, RolloutContext, RolloutStats, TurnConfig
from agentree.rollout.turn.turns import Branch, TurnRunner
from agentree.tree import EndReason, Trajectory, Tree


class PATRConfig(TurnConfig):
    B0: int = Field(4, ge=1)
    """Initial branches per task."""
    K: int = Field(5, ge=1)
    """Turns between scoring checkpoints (paper: 5 FrozenLake, 13 SWE)."""
    M: int = Field(2, ge=1)
    """Children per expanded branch."""
    top_k: int = Field(2, ge=0)
    """Branches expanded at each checkpoint."""
    alpha: float | None = 0.5
    """Prune margin below the median score (Eq. 5); null disables score pruning."""
    theta: int | None = Field(6, ge=2)
    """Stop a branch that repeats the same action this many times in a row; null disables."""
    theta_at: Literal["checkpoint", "every_turn"] = "checkpoint"
    """When the theta-repeat stop applies: at scoring checkpoints to unexpanded branches
    (Algorithm 1, line 8) or after every turn."""
    group: Literal["keep-all", "best-n"] = "keep-all"
    """Rollout group: every finished branch (paper default) or only unpruned ones."""
    max_active: int = Field(64, ge=1)
    """Upper bound on live branches per tree."""


class PATR(Controller):
    name = "patr"
    Config = PATRConfig
    requires_fork = True
    uses_scorer = True
    config: PATRConfig

    def rollout(
        self, tasks: Sequence[Task], ctx: RolloutContext
    ) -> tuple[list[Tree], RolloutStats]:
        cfg = self.config
        stats = RolloutStats()
        t0 = time.perf_counter()
        with TurnRunner(ctx, stats, cfg.env_step_budget, reserve=cfg.budget_reserve) as runner:
            b0 = cfg.B0 if runner.budget is None else min(cfg.B0, runner.budget)
            groups = runner.start(tasks, b0, fork=True)
            trees = [g[0].tree for g in groups]
            active = [list(g) for g in groups]
            while any(active):
                steps = stats.env_steps
                for _ in range(cfg.K):
                    live = [b for bs in active for b in bs]
                    if not live:
                        break
                    theta = cfg.theta if cfg.theta_at == "every_turn" else None
                    still, _ = runner.advance(live, theta=theta)
                    keep = {id(b) for b in still}
                    active = [[b for b in bs if id(b) in keep] for bs in active]
                    ctx.report(f"{self.name}: {len(still)} active branches")
                for i, task in enumerate(tasks):
                    if active[i]:
                        active[i] = self._checkpoint(runner, task, active[i], ctx, stats)
                    elif runner.budget is not None and stats.env_steps > steps:
                        # another round of Algorithm 1 below the same root
                        n = min(cfg.B0, runner.left(trees[i]))
                        if n > 0:
                            active[i] = runner.add_root_branches(trees[i], task, n)
        return self.finish(trees, stats, t0)

    def _scores(self, runner: TurnRunner, task: Task, branches: list[Branch], ctx: RolloutContext):
        return runner.score(task, branches)

    def _checkpoint(
        self,
        runner: TurnRunner,
        task: Task,
        branches: list[Branch],
        ctx: RolloutContext,
        stats: RolloutStats,
    ) -> list[Branch]:
        """Score, then route each branch to expansion, survival or pruning (Alg. 1, l. 6-10)."""
        cfg = self.config
        scores = self._scores(runner, task, branches, ctx)
        scored = [(s, ctx.rng.random(), i) for i, s in enumerate(scores) if s is not None]
        scored.sort(reverse=True)
        n_expand = min(cfg.top_k, len(scored))
        tree, turn = branches[0].tree, branches[0].turn
        # every branch still steps once (truncate), or each new one must be finishable (reserve)
        room = len(branches) + runner.room(tree, turn) if runner.reserve else runner.left(tree)
        cap = min(cfg.max_active, room)
        while n_expand and len(branches) + n_expand * (cfg.M - 1) > cap:
            n_expand -= 1
        expand = {i for _, _, i in scored[:n_expand]}
        prune: set[int] = set()
        if cfg.alpha is not None and scored:
            cut = statistics.median(s for s, _, _ in scored) - cfg.alpha
            prune = {i for s, _, i in scored if s < cut and i not in expand}
        repeat: set[int] = set()
        if cfg.theta is not None and cfg.theta_at == "checkpoint":
            # scored or not: the repeat criterion does not depend on the scorer
            repeat = {
                i
                for i, b in enumerate(branches)
                if i not in expand and i not in prune and b.repeats() >= cfg.theta
            }
        out: list[Branch] = []
        for i, b in enumerate(branches):
            if i in prune:
                runner.end(b, EndReason.PRUNED_LOW_SCORE)
            elif i in repeat:
                runner.end(b, EndReason.PRUNED_REPEAT)
            elif i in expand:
                stats.expanded += 1
                children = runner.fork(b, cfg.M)
                b.tree.nodes[b.node].info["expanded"] = len(children)
                out.extend(children)
            else:
                out.append(b)
        return out

    def group(self, tree: Tree) -> list[Trajectory]:
        return tree.trajectories(include_pruned=self.config.group == "keep-all")


class TreeRandomConfig(PATRConfig):
    alpha: float | None = None
    """Random scores carry no signal, so score pruning is off by default."""


class TreeRandom(PATR):
    """The paper's Tree-Random baseline: PATR's tree with uniformly random expansion choices
    (and PATR's rule for an env-step budget: further rounds below the root, `budget` cuts)."""

    name = "tree-random"
    Config = TreeRandomConfig
    uses_scorer = False

    def _scores(self, runner: TurnRunner, task: Task, branches: list[Branch], ctx: RolloutContext):
        values = [ctx.rng.random() for _ in branches]
        for b, v in zip(branches, values, strict=True):
            b.tree.nodes[b.node].score = v
        return values
