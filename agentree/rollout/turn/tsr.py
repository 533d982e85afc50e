"""TSR: trajectory-search rollouts (Djuhera et al., arXiv 2602.11767).

Search moves from inference to the rollout stage: at every turn the policy proposes several
candidate actions, each is stepped in a fork of the current env state, and the task scorer
(`--scorer`, e.g. FrozenLake's BFS progress or Sokoban's remaining pushes) picks which one the
training trajectory continues with. The optimiser is unchanged; only the trajectories differ.

- `best_of_n`: each of the G trajectories of a task, at every turn, steps N candidates and
  keeps the highest-scoring one (the others end as `pruned_low_score`).
- `beam`: one beam search per task: every live beam steps N candidates, and the `width`
  best-scoring candidates of the task survive; a surviving candidate that ended the episode is
  a finished trajectory. The group is what the beams finish with (at most `width`).
- `lookahead`: as best_of_n, but each candidate is judged by the score after `depth` more
  sampled turns taken in a fork of it (the look-ahead turns stay in the tree as pruned
  branches and count as env steps; the trajectory continues from the candidate itself).

Instance filtering: with `filter: true` a task whose trajectories all have the same
reward is left out of the update (`group` returns nothing for it; `rollout/filtered` counts
them), unless every task of the batch is such a task, when all are kept. Where the paper is silent:
ties go to the earlier candidate; a candidate the scorer cannot score ranks last; a candidate
that ends the episode is scored like any other (the scorers give a solved state 1).

With `env_step_budget: N` (exact env steps per task; every candidate and look-ahead step counts)
a task searches until N steps are spent: when all of its trajectories (or its beam search) have
ended with steps left, G new trajectories (a new beam search) start from the task, at most one
per N steps left. Candidates the budget cuts take no step and are not chosen; branches live
when it runs out end with `budget` and stay out of the group. With `budget_reserve` each
candidate and look-ahead probe reserves its steps to the env's turn limit: near the budget's
end a branch draws fewer candidates (at least itself), and none is cut.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from agentree.envs.base import Task
from agentree.rollout.base import Controller, RolloutContext, RolloutStats, TurnConfig
from agentree.rollout.turn.turns import Branch, TurnRunner
from agentree.tree import EndReason, Trajectory, Tree


class TSRConfig(TurnConfig):
    mode: Literal["best_of_n", "beam", "lookahead"] = "best_of_n"
    """Per-turn search: best-of-N, beam search, or shallow lookahead."""
    G: int = Field(4, ge=1)
    """Trajectories per task (best_of_n, lookahead)."""
    N: int = Field(4, ge=1)
    """Candidate actions per trajectory (or per beam) and turn."""
    width: int = Field(4, ge=1)
    """Beams per task (beam mode); also its group size."""
    depth: int = Field(1, ge=1)
    """Look-ahead turns behind each candidate (lookahead mode)."""
    filter: bool = False
    """Instance filtering: leave out tasks whose trajectories all have the same reward."""


class TSR(Controller):
    name = "tsr"
    Config = TSRConfig
    requires_fork = True
    uses_scorer = True
    config: TSRConfig

    def group_size(self) -> int | None:
        if self.config.env_step_budget:
            return None
        return self.config.width if self.config.mode == "beam" else self.config.G

    def rollout(
        self, tasks: Sequence[Task], ctx: RolloutContext
    ) -> tuple[list[Tree], RolloutStats]:
        cfg = self.config
        stats = RolloutStats()
        t0 = time.perf_counter()
        with TurnRunner(ctx, stats, cfg.env_step_budget, reserve=cfg.budget_reserve) as runner:
            # beam search starts from the task's root state alone (one beam of width 1)
            starts = 1 if cfg.mode == "beam" else cfg.G
            if runner.budget is not None:
                starts = max(1, min(starts, runner.budget // cfg.N))
            groups = runner.start(tasks, starts, fork=True)
            trees = [g[0].tree for g in groups]
            # one pool per task in beam mode, one pool per trajectory otherwise
            pools = groups if cfg.mode == "beam" else [[b] for g in groups for b in g]
            turn = 0
            while any(pools):
                turn += 1
                steps = stats.env_steps
                pools = self._turn(runner, tasks, trees, pools, ctx)
                if runner.budget is not None and stats.env_steps > steps:
                    pools += self._restart(runner, tasks, trees, pools)
                ctx.report(f"{self.name}: turn {turn}, {sum(map(len, pools))} live")
        if cfg.filter:
            uniform = [len({t.reward for t in self._kept(tree)}) <= 1 for tree in trees]
            if not all(uniform):  # a batch with nothing left would leave nothing to train on
                for tree, u in zip(trees, uniform, strict=True):
                    tree.meta["filtered"] = u
            stats.extra["filtered"] = float(sum(uniform)) if not all(uniform) else 0.0
        return self.finish(trees, stats, t0)

    def _restart(
        self,
        runner: TurnRunner,
        tasks: Sequence[Task],
        trees: list[Tree],
        pools: list[list[Branch]],
    ) -> list[list[Branch]]:
        """New searches for the tasks with nothing live and steps left (see the module)."""
        cfg = self.config
        busy = {id(b.tree) for pool in pools for b in pool}
        out: list[list[Branch]] = []
        for tree, task in zip(trees, tasks, strict=True):
            left = runner.left(tree)
            if id(tree) in busy or left <= 0:
                continue
            if cfg.mode == "beam":
                out.append(runner.add_root_branches(tree, task, 1))
            else:
                n = max(1, min(cfg.G, left // cfg.N))
                out += [[b] for b in runner.add_root_branches(tree, task, n)]
        return out

    def _turn(
        self,
        runner: TurnRunner,
        tasks: Sequence[Task],
        trees: list[Tree],
        pools: list[list[Branch]],
        ctx: RolloutContext,
    ) -> list[list[Branch]]:
        """One search turn for every pool: N candidates per live branch, then selection."""
        cfg = self.config
        task_of = {id(t): task for t, task in zip(trees, tasks, strict=True)}
        cands: list[list[Branch]] = [
            [c for b in pool for c in runner.fork(b, cfg.N)] for pool in pools
        ]
        flat = [c for cs in cands for c in cs]
        still, _ = runner.advance(flat)
        if runner.cut:  # candidates the budget cut took no step: nothing to choose
            cands = [[c for c in cs if id(c) not in runner.cut] for cs in cands]
            flat = [c for cs in cands for c in cs]
        live = {id(b) for b in still}
        scores: dict[int, float] = {}
        if cfg.mode == "lookahead":
            scores = self._lookahead(runner, [c for c in flat if id(c) in live], task_of)
        by_task: dict[int, list[Branch]] = {}
        for c in flat:
            by_task.setdefault(id(c.tree), []).append(c)
        for tid, cs in by_task.items():
            need = [c for c in cs if id(c) not in scores]
            values = self._score_nodes(runner, task_of[tid], need)
            scores.update({id(c): v for c, v in zip(need, values, strict=True)})
        out: list[list[Branch]] = []
        keep = cfg.width if cfg.mode == "beam" else 1
        for cs in cands:
            order = sorted(range(len(cs)), key=lambda i: (-scores[id(cs[i])], i))
            chosen = set(order[:keep])
            nxt = []
            for i, c in enumerate(cs):
                if i not in chosen:
                    if id(c) in live:
                        runner.end(c, EndReason.PRUNED_LOW_SCORE)
                    else:  # it ended the episode: its leaf is kept out of the group
                        c.tree.nodes[c.node].info["rejected"] = True
                elif id(c) in live:
                    nxt.append(c)
            if cs:
                runner.stats.expanded += 1
            out.append(nxt)
        return out

    def _score_nodes(self, runner: TurnRunner, task: Task, branches: list[Branch]) -> list[float]:
        """Scorer values of the branches' current nodes; unscorable ones rank last."""
        if not branches:
            return []
        values = runner.score(task, branches)
        return [-1.0 if v is None else v for v in values]

    def _lookahead(
        self, runner: TurnRunner, cands: list[Branch], task_of: dict[int, Task]
    ) -> dict[int, float]:
        """Score each live candidate by the state `depth` sampled turns after it."""
        probes: dict[int, Branch] = {}  # c keeps its env; a probe moves
        for c in cands:
            fork = runner.fork(c, 2)
            if len(fork) > 1:  # budget_reserve may admit none: c is scored where it stands
                probes[id(c)] = fork[1]
        live = list(probes.values())
        for _ in range(self.config.depth):
            if not live:
                break
            live, _ = runner.advance(live)
        scores: dict[int, float] = {}
        by_task: dict[int, list[tuple[int, Branch]]] = {}
        for cid, p in probes.items():
            by_task.setdefault(id(p.tree), []).append((cid, p))
        for pairs in by_task.values():
            task = task_of[id(pairs[0][1].tree)]
            values = self._score_nodes(runner, task, [p for _, p in pairs])
            for (cid, p), v in zip(pairs, values, strict=True):
                scores[cid] = v
                runner.end(p, EndReason.PRUNED_LOW_SCORE)  # look-ahead steps never train
                node = p.tree.nodes[p.node]
                node.info["lookahead"] = True
                if node.end_reason is not None and node.end_reason != EndReason.PRUNED_LOW_SCORE:
                    node.info["rejected"] = True
        return scores

    @staticmethod
    def _kept(tree: Tree) -> list[Trajectory]:
        return [
            t
            for t in tree.trajectories(include_pruned=False)
            if not tree.nodes[t.leaf].info.get("rejected")
        ]

    def group(self, tree: Tree) -> list[Trajectory]:
        return [] if tree.meta.get("filtered") else self._kept(tree)
