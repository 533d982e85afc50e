"""Process scorers (see `base.py` for the contract)."""

from agentree.scorers.base import (
    NodePath,
    Score,
    Scorer,
    ScorerConfig,
    make_scorer,
    register_scorer,
    scorer_class,
    scorer_names,
)

__all__ = [
    "NodePath",
    "Score",
    "Scorer",
    "ScorerConfig",
    "make_scorer",
    "register_scorer",
    "scorer_class",
    "scorer_names",
]
