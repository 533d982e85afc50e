"""Uniform random scores: the process-signal-free control for tree rollouts."""

from __future__ import annotations

import random
from collections.abc import Sequence

from agentree.envs.base import Task
from agentree.scorers.base import NodePath, Score, Scorer, ScorerConfig


class RandomScorerConfig(ScorerConfig):
    seed: int = 0
    """Seed of the score stream."""


class RandomScorer(Scorer):
    name = "random"
    Config = RandomScorerConfig

    def __init__(self, config: RandomScorerConfig | None = None) -> None:
        super().__init__(config)
        self._rng = random.Random(self.config.seed)

    def score(self, task: Task, branches: Sequence[NodePath]) -> list[Score]:
        return [Score(self._rng.random()) for _ in branches]
