"""Trajectory heuristic for SWE-style branches (PATR appendix B, "Heuristic score").

Starts from a neutral 0.5 and moves with observable behaviour over the recent steps:

    s = clip(base + sum_k bonus_k * min(n_k, cap) - sum_k penalty_k * min(n_k, cap), 0, 1)

Penalties: repeated identical actions (same action and same observation as an earlier recent
step: no new information), a premature finish (submitting with no edit, or with no test/run
after the last edit), failed commands, and edits made before any evidence (search, read, test
or run) was collected. Rewards: targeted test runs, passing tests (the latest test run),
informative tracebacks (frames in the project), search/read steps that discovered code or file
locations, and edits made after evidence. Evidence is looked up over the whole branch; counts
use the last `window` steps. Each count is capped so one behaviour cannot decide the score.

Usable alone (`--scorer heuristic`) and as the judge's blending partner (Eq. 8). On envs that
are not bash agents every step has tool type `other`, so only the repetition signal is live.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field

from agentree.envs.base import Task
from agentree.scorers.base import NodePath, Score, Scorer, ScorerConfig
from agentree.scorers.trajectory import StepView, step_views

EVIDENCE = frozenset({"search", "read", "test", "run"})


class HeuristicConfig(ScorerConfig):
    """Weights of the trajectory heuristic (PATR appendix B; the paper gives no numbers)."""

    base: float = Field(0.5, ge=0.0, le=1.0)
    """Neutral starting score."""
    window: int = Field(10, ge=1)
    """Recent steps whose behaviour is counted (evidence is looked up over the whole branch)."""
    cap: int = Field(3, ge=1)
    """Most occurrences of one signal that count."""
    repeat_penalty: float = Field(0.1, ge=0.0)
    """Per step that repeats an earlier recent action with the same observation."""
    premature_finish_penalty: float = Field(0.3, ge=0.0)
    """Submitting without an edit, or without a test/run after the last edit."""
    failure_penalty: float = Field(0.05, ge=0.0)
    """Per failed command (non-zero exit of a non-test command, shell error, timeout)."""
    blind_edit_penalty: float = Field(0.15, ge=0.0)
    """Per edit made before any search/read/test/run in the branch."""
    targeted_test_bonus: float = Field(0.08, ge=0.0)
    """Per test run aimed at specific tests (file, node id, -k, module)."""
    tests_pass_bonus: float = Field(0.15, ge=0.0)
    """The latest test run passed."""
    traceback_bonus: float = Field(0.04, ge=0.0)
    """Per informative traceback (a reproduced error with frames in the project)."""
    discovery_bonus: float = Field(0.03, ge=0.0)
    """Per search/read step that returned code or file locations."""
    grounded_edit_bonus: float = Field(0.08, ge=0.0)
    """Per edit made after evidence was collected."""


def trajectory_signals(steps: Sequence[StepView], window: int) -> dict[str, Any]:
    """Counts of the heuristic's signals over the last `window` of `steps`."""
    recent = steps[-window:]
    first_evidence = next((s.index for s in steps if s.tools & EVIDENCE and not s.failed), None)
    # a repeat is an action that already produced this very observation: no new information
    seen = {(s.key, s.observation) for s in steps[: len(steps) - len(recent)]}
    repeated: set[int] = set()
    for s in recent:
        if (s.key, s.observation) in seen:
            repeated.add(s.index)
        seen.add((s.key, s.observation))
    edits = [s.index for s in steps if "edit" in s.tools and not s.failed]
    recent_edits = [i for i in edits if i > steps[-1].index - len(recent)] if steps else []
    grounded = [i for i in recent_edits if first_evidence is not None and first_evidence < i]
    tests = [s for s in recent if "test" in s.tools and s.tests_passed is not None]
    premature = 0
    for s in recent:
        if "finish" in s.tools:
            before = [i for i in edits if i < s.index]
            verified = bool(before) and any(
                before[-1] < t.index < s.index and t.tools & {"test", "run"} for t in steps
            )
            premature += not verified
    return {
        "steps": len(steps),
        "window": len(recent),
        "tools": [s.tool for s in recent],
        "repeats": len(repeated),
        "failures": sum(s.failed for s in recent),
        "premature_finish": premature,
        "blind_edits": len(recent_edits) - len(grounded),
        "grounded_edits": len(grounded),
        "targeted_tests": sum(s.targeted for s in recent if "test" in s.tools),
        "last_tests_passed": tests[-1].tests_passed if tests else None,
        "informative_tracebacks": sum(s.informative_traceback for s in recent),
        "discoveries": sum(s.discovered and s.index not in repeated for s in recent),
        "files_seen": sorted({f for s in recent for f in s.files})[:10],
    }


def heuristic_value(signals: dict[str, Any], cfg: HeuristicConfig) -> float:
    """The clipped weighted sum of capped signal counts."""

    def n(key: str) -> int:
        return min(int(signals[key]), cfg.cap)

    value = (
        cfg.base
        - cfg.repeat_penalty * n("repeats")
        - cfg.premature_finish_penalty * n("premature_finish")
        - cfg.failure_penalty * n("failures")
        - cfg.blind_edit_penalty * n("blind_edits")
        + cfg.targeted_test_bonus * n("targeted_tests")
        + cfg.tests_pass_bonus * (signals["last_tests_passed"] is True)
        + cfg.traceback_bonus * n("informative_tracebacks")
        + cfg.discovery_bonus * n("discoveries")
        + cfg.grounded_edit_bonus * n("grounded_edits")
    )
    return min(1.0, max(0.0, value))


class TrajectoryHeuristicScorer(Scorer):
    """PATR's SWE trajectory heuristic; `Score.info` holds the signals it counted."""

    name = "heuristic"
    Config = HeuristicConfig
    config: HeuristicConfig

    def score(self, task: Task, branches: Sequence[NodePath]) -> list[Score]:
        return [self.score_one(b)[0] for b in branches]

    def score_one(self, branch: NodePath) -> tuple[Score, list[StepView]]:
        """The score of one branch and the step views it was computed from."""
        steps = step_views(branch)
        signals = trajectory_signals(steps, self.config.window)
        value = heuristic_value(signals, self.config)
        return Score(value, {"heuristic": round(value, 4), "signals": signals}), steps
