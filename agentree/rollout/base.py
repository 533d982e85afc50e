"""The rollout-controller contract: tasks in, one tree per task out.

A controller gets a batch of tasks and a `RolloutContext` (policy engine, chat format, sampling
settings, env factory, process scorer) and returns one `Tree` per task whose finished leaves are
the rollout group, plus `RolloutStats`. Controllers batch policy calls across every live branch
of every tree, so one engine call serves the whole batch.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentree.chat import ChatFormat
from agentree.engines.base import Engine, SamplingParams
from agentree.envs.base import Env, Task, format_validation_error
from agentree.registry import Registry
from agentree.scorers.base import NoScorer, Scorer
from agentree.tools import ToolAction
from agentree.tree import Trajectory, Tree


class ControllerConfig(BaseModel):
    """Base for a controller's settings; unknown keys are an error naming the key."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TurnConfig(ControllerConfig):
    """Settings every turn-level controller (grpo, patr, tree-random, arpo, tree-grpo, tsr)
    shares."""

    env_step_budget: int | None = Field(None, ge=0)
    """Exact env steps per task (`rollout.env_step_budget=N`): every controller draws until N
    steps of the task are spent, never more, so methods compare at equal env steps. Branches
    still live when it runs out end with reason `budget` and stay out of the group; each
    controller's docstring says how it spends it. Give it a few episodes' worth: branches that
    run side by side (PATR's B0) and all outlive it leave an empty group. 0 or null: off (the
    controller's own sizes)."""

    budget_reserve: bool = False
    """With `env_step_budget`: start a trajectory or branch only when the budget can finish it.
    Each one reserves the steps it may still take up to the env's turn limit
    (`Env.turn_limit()`) when it starts and gives back what it did not use when it ends, so no
    branch is cut and the group is not biased towards short episodes (the cut ones are the
    longest). The price: the budget stays up to one turn limit short of N, and near its end
    fewer branches run side by side. False (the default): truncate (see above)."""


def call_info(action: Any) -> dict[str, Any]:
    """What a node records of a parsed action: its calls (`tool_calls`) and why it has none
    (`tool_error`); nothing for a free-text action."""
    if not isinstance(action, ToolAction):
        return {}
    info: dict[str, Any] = {
        "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in action.calls]
    }
    if action.error:
        info["tool_error"] = action.error
    return info


LEVELS: dict[str, str] = {
    "distributed/workers": "max",
    "distributed/nodes": "max",
    "distributed/queue_depth": "max",
    "distributed/busy_frac": "mean",
    "distributed/weight_sync_s": "last",
}
"""Extras that are levels, not amounts (the Ray rollouts report them), and how
`RolloutStats.add` combines two rollouts' values: the larger, the later, or the mean weighted
by each rollout's wall time. Every other extra is an amount and is summed."""


def _combine(key: str, mine: float, theirs: float, weights: tuple[float, float]) -> float:
    rule = LEVELS.get(key)
    if rule == "max":
        return max(mine, theirs)
    if rule == "last":
        return theirs
    if rule == "mean":
        total = weights[0] + weights[1]
        return (mine * weights[0] + theirs * weights[1]) / total if total > 0 else theirs
    return mine + theirs


@dataclass
class RolloutStats:
    """Counters for one rollout call (summed over its trees); keys of rollout_stats.json."""

    trajectories: int = 0
    env_steps: int = 0
    forks: int = 0
    """Env states restored into another branch (children beyond the first)."""
    expanded: int = 0
    """Branches selected for expansion."""
    pruned: int = 0
    policy_tokens_generated: int = 0
    policy_tokens_prefilled: int = 0
    policy_tokens_cached: int = 0
    policy_tokens_evicted: int = 0
    """Prefilled tokens the engine's prefix cache had held and dropped for room (a cache too
    small for the rollout's live branches recomputes them; transformers engine only)."""
    scorer_calls: int = 0
    scorer_fallbacks: int = 0
    env_errors: int = 0
    wall_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def count_calls(self, action: Any, info: dict[str, Any]) -> None:
        """Count a stepped action's tool calls, and a malformed or env-refused one as an error
        (no-op for a free-text action)."""
        if not isinstance(action, ToolAction):
            return
        self.extra["tool_calls"] = self.extra.get("tool_calls", 0.0) + len(action.calls)
        if action.error or info.get("format_error"):
            self.extra["tool_call_errors"] = self.extra.get("tool_call_errors", 0.0) + 1

    def add(self, other: RolloutStats) -> None:
        """Count `other` in (a refill round, a saved block): amounts are summed, the extras in
        `LEVELS` combined as levels."""
        weights = (self.wall_s, other.wall_s)
        for k, v in asdict(other).items():
            if k == "extra":
                for ek, ev in v.items():
                    mine = self.extra.get(ek)
                    self.extra[ek] = ev if mine is None else _combine(ek, mine, ev, weights)
            else:
                setattr(self, k, getattr(self, k) + v)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        d.update(extra)
        d["wall_s"] = round(d["wall_s"], 3)
        n = max(self.trajectories, 1)
        d["per_trajectory"] = {
            "env_steps": self.env_steps / n,
            "forks": self.forks / n,
            "policy_tokens_generated": self.policy_tokens_generated / n,
            "policy_tokens_prefilled": self.policy_tokens_prefilled / n,
        }
        return d


@dataclass
class RolloutContext:
    engine: Engine
    chat: ChatFormat
    sampling: SamplingParams
    env_factory: Callable[[], Env]
    scorer: Scorer = field(default_factory=NoScorer)
    max_context: int = 4096
    """Token budget for a branch's whole context; a branch that would exceed it ends."""
    history: int | None = None
    """History window (`engine.history`): each turn's prompt holds the task and the last
    `history` turns; None keeps every turn (append-only)."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """The env's tool schemas (`agentree.tools.tool_schemas(env.tools())`, read once when the
    rollouts are built): prompts carry them and turns are parsed as calls against them. Empty:
    free-text actions. A context for an env with tools must pass them."""
    rng: random.Random = field(default_factory=random.Random)
    env_workers: int = 8
    """Threads stepping envs concurrently (Docker execs are I/O bound)."""
    progress: Callable[[str], None] | None = None
    """Called with a short status line as the rollout advances."""
    step: int = 0
    """Training step, for schedules such as LATR's hybrid eta."""

    def report(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(msg)


class Controller:
    """Subclass, set `name`/`Config`, implement `rollout`."""

    name: ClassVar[str] = "controller"
    Config: ClassVar[type[ControllerConfig]] = ControllerConfig
    requires_fork: ClassVar[bool] = False
    uses_scorer: ClassVar[bool] = False

    def __init__(self, config: ControllerConfig | None = None) -> None:
        self.config = config or self.Config()

    def group_size(self) -> int | None:
        """Nominal trajectories per task, when fixed (flat sampling); None for adaptive trees."""
        return None

    def rollout(
        self, tasks: Sequence[Task], ctx: RolloutContext
    ) -> tuple[list[Tree], RolloutStats]:
        raise NotImplementedError

    def group(self, tree: Tree) -> list[Trajectory]:
        """The rollout group of a finished tree: by default every finished leaf."""
        return tree.trajectories()

    def finish(
        self, trees: list[Tree], stats: RolloutStats, t0: float
    ) -> tuple[list[Tree], RolloutStats]:
        """Every controller's closing lines: its name and config on each tree, the rollout
        group counted, the wall time since `t0` (a `time.perf_counter()` reading)."""
        for tree in trees:
            tree.meta.update({"controller": self.name, "config": self.config.model_dump()})
        stats.trajectories = sum(len(self.group(t)) for t in trees)
        stats.wall_s = time.perf_counter() - t0
        return trees, stats


CONTROLLERS: Registry[type[Controller]] = Registry(
    "rollout",
    Controller,
    {
        "patr": "agentree.rollout.turn.patr:PATR",
        "tree-random": "agentree.rollout.turn.patr:TreeRandom",
        "grpo": "agentree.rollout.turn.flat:FlatGRPO",
        "arpo": "agentree.rollout.turn.arpo:ARPO",
        "latr": "agentree.rollout.token.latr:LATR",
        "treepo": "agentree.rollout.token.treepo:TreePO",
        "eptree": "agentree.rollout.token.eptree:EPTree",
        "tree-grpo": "agentree.rollout.turn.treegrpo:TreeGRPO",
        "tsr": "agentree.rollout.turn.tsr:TSR",
    },
)


def controller_names() -> list[str]:
    return CONTROLLERS.names()


def controller_class(name: str) -> type[Controller]:
    return CONTROLLERS.get(name)


def make_controller(name: str, **kwargs: Any) -> Controller:
    cls = controller_class(name)
    try:
        return cls(cls.Config(**kwargs))
    except ValidationError as e:
        raise ValueError(format_validation_error(e, "rollout")) from None


def action_format(trees: Sequence[Tree]) -> tuple[int, int]:
    """(well-formed, judged) actions of `trees`: env steps whose info reports `format_error`,
    and those where it is False."""
    well = judged = 0
    for tree in trees:
        for node in tree.nodes:
            error = node.info.get("env", {}).get("format_error")
            if error is not None:
                judged += 1
                well += not error
    return well, judged


def describe_action_format(well: int, judged: int) -> str | None:
    """The summary line on well-formed actions; None when the env does not judge them."""
    if not judged:
        return None
    if not well:
        return (
            f"warning: none of the {judged} actions was well-formed, so the environment never "
            "acted on one; the policy must produce the env's action format first (e.g. a "
            "stronger or fine-tuned policy)"
        )
    return f"well-formed actions: {100 * well / judged:.1f}% ({well}/{judged})"
