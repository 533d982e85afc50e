"""BabyAI progress from the env's planner (the `babyai` process scorer).

s = 1 - n / n0, where n is the length of a shortest plan that completes the mission from the
branch's current state (`agentree.envs.babyai.plan`: breadth-first over the true grid, agent
position and direction, doors, objects and what is carried) and n0 that length at the start of
the episode: 1 once the mission is done, 0 where it can no longer be done (no plan) and for a
branch that is farther from done than it started, clipped to [0, 1]. The env runs the planner
as it steps and reports n and n0 in its `info` (`plan_left`, `start_plan`); the scorer reads
them, so any env that reports those works.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentree.envs.base import Task
from agentree.scorers.base import NodePath, Score, Scorer


class BabyAIScorer(Scorer):
    name = "babyai"

    def score(self, task: Task, branches: Sequence[NodePath]) -> list[Score]:
        return [self._one(b) for b in branches]

    def _one(self, branch: NodePath) -> Score:
        first = branch[0].info.get("env", {})
        last = branch[-1].info.get("env", {})
        if "plan_left" not in last:
            return Score(None, {"error": "env info lacks plan_left (not a BabyAI branch?)"})
        n0 = first.get("start_plan", last.get("start_plan"))
        n = last["plan_left"]
        if last.get("success"):
            return Score(1.0, {"plan_left": 0})
        if n is None:
            return Score(0.0, {"plan_left": None, "unreachable": True})
        if not n0:
            return Score(1.0 if n == 0 else 0.0, {"plan_left": n})
        return Score(min(1.0, max(0.0, 1.0 - n / n0)), {"plan_left": n, "start_plan": n0})
