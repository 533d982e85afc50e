"""ARPO baseline: entropy-guided branching after observations (Dong et al., 2025).

N global trajectories start from the task. Each trajectory's initial entropy H_init is the mean
token entropy of the first k tokens of its first response. After every observation the policy's
next response is sampled; if its first-k mean entropy H_t has risen relative to H_init, i.e.
alpha + beta * (H_t - H_init) / H_init > tau, the branch forks Z extra partial samples from that
same state (env forked by snapshot/restore). Branching stops when the group budget G is
reached; if every branch ends below G, fresh global samples top the group up.

The paper normalises the entropy change without fixing the scale; we use the relative change,
which makes tau readable ("branch when entropy rose by more than 20%").

With `env_step_budget: N_env` (exact env steps per task) the rollout above is one round: when
all of a task's branches have ended with steps left, a new round starts below the same root (N
fresh global samples, G trajectories at most, one group), until the steps are spent; the top-up
is left to the next round. A fork also needs a step left for every live branch. The branches
live when the budget runs out end with `budget` and stay out of the group. With
`budget_reserve` a fork or a round gets only the branches the unreserved budget can finish (to
the env's turn limit), so fewer than Z near the budget's end; none is cut.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pydantic import Field

from agentree.engines.base import Completion
from agentree.envs.base import Task
from agentree.rollout.base import Controller, RolloutContext, RolloutStats, TurnConfig
from agentree.rollout.turn.turns import Branch, TurnRunner
from agentree.tree import Tree


class ARPOConfig(TurnConfig):
    G: int = Field(8, ge=1)
    """Total trajectory budget per task (per round with an env-step budget)."""
    N: int = Field(4, ge=1)
    """Initial global trajectories."""
    Z: int = Field(2, ge=1)
    """Extra partial samples forked at a high-entropy step."""
    k: int = Field(10, ge=1)
    """Leading response tokens whose mean entropy is compared."""
    alpha: float = 0.0
    """Base branching propensity."""
    beta: float = 1.0
    """Weight of the relative entropy change."""
    tau: float = 0.2
    """Branch when alpha + beta * dH exceeds this."""


class ARPO(Controller):
    name = "arpo"
    Config = ARPOConfig
    requires_fork = True
    config: ARPOConfig

    def group_size(self) -> int | None:
        return None if self.config.env_step_budget else self.config.G

    def rollout(
        self, tasks: Sequence[Task], ctx: RolloutContext
    ) -> tuple[list[Tree], RolloutStats]:
        cfg = self.config
        stats = RolloutStats()
        t0 = time.perf_counter()
        h_init: dict[int, float] = {}  # id(branch) -> initial entropy of its trajectory
        with TurnRunner(ctx, stats, cfg.env_step_budget, reserve=cfg.budget_reserve) as runner:
            budget = runner.budget
            first = min(cfg.N, cfg.G, budget or cfg.G)
            groups = runner.start(tasks, first, fork=True)
            trees = [g[0].tree for g in groups]
            count = {id(t): len(g) for t, g in zip(trees, groups, strict=True)}
            live = [b for g in groups for b in g]
            while live:
                # with a budget, forks also need a step left for each live branch
                spare = {id(t): runner.left(t) for t in trees}
                for b in live:
                    spare[id(b.tree)] -= 1
                steps = stats.env_steps
                comps = runner.generate(live, entropy=True)
                extra: list[Branch] = []
                for b, c in zip(live, comps, strict=True):
                    h = _lead_entropy(c, cfg.k)
                    if b.turn == 0:
                        h_init[id(b)] = h
                        continue
                    base = h_init.get(id(b), h)
                    dh = (h - base) / base if base > 0 else 0.0
                    room = min(cfg.G - count[id(b.tree)], spare[id(b.tree)])
                    if cfg.alpha + cfg.beta * dh > cfg.tau and room > 0:
                        forks = runner.fork(b, min(cfg.Z, room) + 1)[1:]  # reserve: maybe fewer
                        z = len(forks)
                        if not z:
                            continue
                        count[id(b.tree)] += z
                        spare[id(b.tree)] -= z
                        stats.expanded += 1
                        b.tree.nodes[b.node].info["arpo_branch"] = {"dH": dh, "Z": z}
                        for f in forks:
                            h_init[id(f)] = base
                        extra += forks
                comps = list(comps)
                if extra:
                    comps += runner.generate(extra, entropy=True)
                live, _ = runner.advance(live + extra, comps)
                if budget is not None:
                    if stats.env_steps > steps:
                        live += self._restart(runner, trees, tasks, live, count)
                elif not live:
                    live = self._top_up(runner, trees, tasks, count, h_init)
                ctx.report(f"{self.name}: {len(live)} active branches")
        return self.finish(trees, stats, t0)

    def _restart(self, runner, trees, tasks, live, count) -> list[Branch]:
        """A new round (N fresh global samples, G trajectories at most) for the trees with no
        live branch and steps left."""
        busy = {id(b.tree) for b in live}
        out: list[Branch] = []
        for tree, task in zip(trees, tasks, strict=True):
            n = min(self.config.N, self.config.G, runner.left(tree))
            if id(tree) not in busy and n > 0:
                fresh = runner.add_root_branches(tree, task, n)
                count[id(tree)] = len(fresh)
                out += fresh
        return out

    def _top_up(self, runner, trees, tasks, count, h_init) -> list[Branch]:
        """Fresh global samples for trees that ended below the budget."""
        out: list[Branch] = []
        for tree, task in zip(trees, tasks, strict=True):
            missing = self.config.G - count[id(tree)]
            if missing > 0:
                count[id(tree)] += missing
                out += runner.add_root_branches(tree, task, missing)
        return out


def _lead_entropy(c: Completion, k: int) -> float:
    ents = (c.entropies or [])[:k]
    return sum(ents) / len(ents) if ents else 0.0
