"""Sokoban progress from the env's own solver (the `sokoban` process scorer).

s = 1 - p / p0, where p is the fewest box pushes that solve the branch's current room
(`agentree.envs.sokoban.solve_pushes`) and p0 that number at the start of the episode: 1 once
every box is on a target, 0 on a dead-lock (no solution is left, e.g. a box pushed into a
corner) and for a branch that made the room harder than it started, clipped to [0, 1]. Reads
the env's `info` (`room`, `start_pushes`), so any env that reports those works.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentree.envs.base import Task
from agentree.envs.sokoban import solve_pushes
from agentree.scorers.base import NodePath, Score, Scorer


class SokobanScorer(Scorer):
    name = "sokoban"

    def score(self, task: Task, branches: Sequence[NodePath]) -> list[Score]:
        return [self._one(b) for b in branches]

    def _one(self, branch: NodePath) -> Score:
        first = branch[0].info.get("env", {})
        last = branch[-1].info.get("env", {})
        if "room" not in last:
            return Score(None, {"error": "env info lacks room (not a Sokoban branch?)"})
        p0 = first.get("start_pushes", last.get("start_pushes"))
        p = solve_pushes(last["room"])
        if p is None:
            return Score(0.0, {"pushes_left": None, "deadlock": True})
        if not p0:
            return Score(1.0 if p == 0 else 0.0, {"pushes_left": p})
        return Score(min(1.0, max(0.0, 1.0 - p / p0)), {"pushes_left": p, "start_pushes": p0})
