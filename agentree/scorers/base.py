"""The process-scorer contract (PATR Eq. 3): s = S(x, tau) in [0, 1] for partial trajectories.

A scorer sees the task and, for each branch, its root-to-leaf nodes (actions, observations,
rewards, env info). It returns one `Score` per branch. `value=None` means "could not score"
(a timeout, a garbage judge reply, a PRM failure); the controller then applies its fallback
policy and counts it under `scorer/fallbacks`. A scorer that substitutes a score of its own
(the judge using its heuristic) says so with `info["fallback"] = "<name>"`; the controller counts
those under `scorer/fallbacks` too, and per kind under `rollout/scorer_fallback_<name>`.
Whatever the scorer saw or produced goes in `Score.info` and is stored on the scored node, so
trees show why a branch was expanded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from agentree.envs.base import Task, format_validation_error
from agentree.registry import Registry
from agentree.tree import Node

NodePath = Sequence[Node]
"""A partial trajectory: the nodes from the root (the task prompt) to the branch's leaf."""


@dataclass
class Score:
    value: float | None
    info: dict[str, Any] = field(default_factory=dict)


class ScorerConfig(BaseModel):
    """Base for a scorer's settings; unknown keys are an error naming the key."""

    model_config = ConfigDict(extra="forbid")


class Scorer:
    """Subclass and implement `score`. Scorers must be safe to call with an empty batch."""

    name: ClassVar[str] = "scorer"
    Config: ClassVar[type[ScorerConfig]] = ScorerConfig
    holds_model: ClassVar[bool] = False
    """True for scorers that load a model: on Ray they run as one shared actor."""

    def __init__(self, config: ScorerConfig | None = None) -> None:
        self.config = config or self.Config()

    def score(self, task: Task, branches: Sequence[NodePath]) -> list[Score]:
        raise NotImplementedError

    def close(self) -> None:
        """Release models, clients, servers."""


SCORERS: Registry[type[Scorer]] = Registry(
    "scorer",
    Scorer,
    {
        "bfs": "agentree.scorers.bfs:BFSScorer",
        "random": "agentree.scorers.random:RandomScorer",
        "heuristic": "agentree.scorers.heuristic:TrajectoryHeuristicScorer",
        "prm": "agentree.scorers.prm:PRMScorer",
        "judge": "agentree.scorers.judge:JudgeScorer",
        "none": "agentree.scorers.base:NoScorer",
        "sokoban": "agentree.scorers.sokoban:SokobanScorer",
        "babyai": "agentree.scorers.babyai:BabyAIScorer",
    },
)


def register_scorer(name: str) -> Callable[[type[Scorer]], type[Scorer]]:
    return SCORERS.register(name)


def scorer_names() -> list[str]:
    return SCORERS.names()


def scorer_class(name: str) -> type[Scorer]:
    return SCORERS.get(name)


def make_scorer(name: str, **kwargs: Any) -> Scorer:
    cls = scorer_class(name)
    try:
        cfg = cls.Config(**kwargs)
    except ValidationError as e:
        raise ValueError(format_validation_error(e, "scorer")) from None
    return cls(cfg)


class NoScorer(Scorer):
    """For controllers that never score (grpo, arpo): every branch is unscored."""

    name = "none"

    def score(self, task: Task, branches: Sequence[NodePath]) -> list[Score]:
        return [Score(None) for _ in branches]
