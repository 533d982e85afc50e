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

from pydantic import BaseModel, ConfigDict

from agentree.envs.base import Task, format_validation_error, import_object
from agentree.tree import Node

Branch = Sequence[Node]
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

    def score(self, task: Task, branches: Sequence[Branch]) -> list[Score]:
        raise NotImplementedError

    def close(self) -> None:
        """Release models, clients, servers."""


_BUILTIN: dict[str, str] = {
    "bfs": "agentree.scorers.bfs:BFSScorer",
    "random": "agentree.scorers.random:RandomScorer",
    "heuristic": "agentree.scorers.heuristic:TrajectoryHeuristicScorer",
    "prm": "agentree.scorers.prm:PRMScorer",
    "judge": "agentree.scorers.judge:JudgeScorer",
    "none": "agentree.scorers.base:NoScorer",
    "sokoban": "agentree.scorers.sokoban:SokobanScorer",
}
_REGISTRY: dict[str, type[Scorer]] = {}


def register_scorer(name: str) -> Callable[[type[Scorer]], type[Scorer]]:
    def deco(cls: type[Scorer]) -> type[Scorer]:
        _REGISTRY[name] = cls
        return cls

    return deco


def scorer_names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def scorer_class(name: str) -> type[Scorer]:
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _BUILTIN:
        cls = import_object(_BUILTIN[name])
    elif ":" in name:
        cls = import_object(name)
    else:
        raise ValueError(
            f"unknown scorer {name!r}; known: {', '.join(scorer_names())}, "
            "or pass 'package.module:Class'"
        )
    if not (isinstance(cls, type) and issubclass(cls, Scorer)):
        raise ValueError(f"{name!r} is not a subclass of agentree.scorers.Scorer")
    return cls


def make_scorer(name: str, **kwargs: Any) -> Scorer:
    from pydantic import ValidationError

    cls = scorer_class(name)
    try:
        cfg = cls.Config(**kwargs)
    except ValidationError as e:
        raise ValueError(format_validation_error(e, "scorer")) from None
    return cls(cfg)


class NoScorer(Scorer):
    """For controllers that never score (grpo, arpo): every branch is unscored."""

    name = "none"

    def score(self, task: Task, branches: Sequence[Branch]) -> list[Score]:
        return [Score(None) for _ in branches]
