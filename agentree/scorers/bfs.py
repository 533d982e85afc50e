"""BFS progress heuristic for grid navigation (PATR §4.2, appendix A: FrozenLake scorer).

s = clip(R + (1 - d / d0), 0, 1), where R is the reward accumulated along the branch, d the BFS
shortest-path distance from the current cell to G with holes blocked, and d0 that distance from
the start cell. A branch that has not moved scores 0 + R; one standing next to G scores close
to 1; moving away from G scores 0. Reads the env's `info` (`pos`, `goal`, `desc`), so any grid
env that reports those works.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentree.envs.base import Task
from agentree.envs.frozenlake import shortest_path
from agentree.scorers.base import NodePath, Score, Scorer


class BFSScorer(Scorer):
    name = "bfs"

    def score(self, task: Task, branches: Sequence[NodePath]) -> list[Score]:
        return [self._one(b) for b in branches]

    def _one(self, branch: NodePath) -> Score:
        first = branch[0].info.get("env", {})
        last = branch[-1].info.get("env", {})
        if not {"pos", "goal", "desc"} <= last.keys() or "pos" not in first:
            return Score(None, {"error": "env info lacks pos/goal/desc"})
        desc, goal = last["desc"], tuple(last["goal"])
        d = shortest_path(desc, tuple(last["pos"]), goal)
        d0 = shortest_path(desc, tuple(first["pos"]), goal)
        reward = sum(n.reward for n in branch)
        progress = 0.0 if d is None or not d0 else 1.0 - d / d0
        value = min(1.0, max(0.0, reward + progress))
        return Score(value, {"distance": d, "start_distance": d0, "reward": reward})
