"""What a finished training run reports, and writes to `RUN/summary.json`: held-out success
before and after training, the weights it started from (sha256: one recipe has built
different weights on different machines), the times, and the scripted walker's success on the
same held-out tasks, the reference a curve is read against (where the env has a walker).

Two times: `wall_s` is this process's, from start to summary (evaluations included);
`trained_s` is the whole run's training, steps and checkpoints, summed over every process that
trained it (it travels in the checkpoints), so a run stopped and resumed reports what it cost
in all. A resumed run also says the step it resumed at (`resumed_at_step`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentree.config import ExperimentConfig
from agentree.models.warm import walker_baseline


def run_summary(
    cfg: ExperimentConfig,
    history: dict[str, Any],
    *,
    wall_s: float,
    trained_s: float | None = None,
    resumed_at_step: int | None = None,
    policy_sha256: str | None = None,
) -> dict[str, Any]:
    """The summary of a run whose `Trainer.fit` returned `history`."""
    before = history.get("eval_before", {}).get("eval/success_rate")
    summary: dict[str, Any] = {
        "eval_before": before,
        "eval_after": history["eval_after"]["eval/success_rate"],
        "wall_s": round(wall_s, 1),
    }
    if trained_s is not None:
        summary["trained_s"] = round(trained_s, 1)
    if resumed_at_step is not None:  # step 0 too: a stop during the first evaluation
        summary["resumed_at_step"] = resumed_at_step
    if policy_sha256:
        summary["policy_sha256"] = policy_sha256
    walker = walker_baseline(cfg)
    if walker is not None:
        summary["walker_success"] = walker
    return summary


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))


POLICY_LINE = "# policy weights sha256: "


def record_policy(run_dir: Path, path: str, sha256: str | None) -> None:
    """Name the weights a run started from at the end of its `config.yaml` (a comment: the
    config stays what the user asked for, and `--resume` reads it unchanged)."""
    config = run_dir / "config.yaml"
    if sha256 is None or not config.exists():
        return
    text = config.read_text()
    if POLICY_LINE not in text:  # a resumed run's rewritten config.yaml gets it once again
        config.write_text(f"{text.rstrip()}\n{POLICY_LINE}{sha256} ({path})\n")
