"""One real tiny training run with TensorBoard and W&B (offline) on, its output not a terminal:
the event file holds the scalars, the W&B run directory holds the metrics and the tree-viewer
artifact, stderr holds one progress line per step, and `agentree plot` draws the run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agentree.commands.cli import main

STEPS = 2
TRAIN = [
    "train",
    "--steps",
    str(STEPS),
    "--set",
    "train.tasks_per_step=2",
    "--set",
    "train.trees_every=1",
    "--set",
    "eval.tasks=2",
    "--set",
    "eval.samples=1",
    "--set",
    "engine.max_tokens=6",
    "--set",
    "env.max_turns=4",
    "--set",
    "rollout.K=2",
]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, tiny_frozenlake) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("tracked")
    mp = pytest.MonkeyPatch()
    for var, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp / "wandb-data"),
    }.items():
        mp.setenv(var, value)
    run = tmp / "run"
    err = tmp / "stderr.txt"
    old = sys.stderr
    # a file, not a terminal: what CI logs and nohup give the command
    with open(err, "w") as f:
        sys.stderr = f
        try:
            rc = main(
                [
                    *TRAIN,
                    "--output",
                    str(run),
                    "--set",
                    "log.tensorboard=true",
                    "--set",
                    "log.wandb.project=agentree-test",
                ]
            )
        finally:
            sys.stderr = old
    mp.undo()
    assert rc == 0, err.read_text()
    return run, err.read_text()


def test_progress_lines_without_a_terminal(tracked_run):
    _, err = tracked_run
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == [f"{i}/{STEPS}" for i in range(1, STEPS + 1)]
    for line in lines:
        assert "success " in line and "reward " in line and "s/step" in line
    # every step but the last says how long the rest of the run should take, at its pace so far
    left = [float(line.split("about ")[1].split(" min left")[0]) for line in lines[:-1]]
    assert len(left) == STEPS - 1 and all(x >= 0 for x in left)
    assert "min left" not in lines[-1]


def test_tensorboard_event_file_has_the_scalars(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = tracked_run
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/success_rate", "rollout/env_steps", "eval/success_rate"} <= tags
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    logged = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert logged == pytest.approx(loss)
    assert sorted(e.step for e in acc.Scalars("eval/success_rate")) == [0, STEPS]


def test_wandb_offline_run_has_metrics_and_tree_view_artifact(tracked_run):
    run, _ = tracked_run
    runs = list((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (record,) = runs[0].glob("run-*.wandb")
    blob = record.read_bytes()
    assert b"train/success_rate" in blob and b"eval/success_rate" in blob
    # the viewer page was rendered from the saved trees and logged as an artifact
    assert b"tree-view" in blob and b"view.html" in blob
    page = (run / "view.html").read_text()
    assert "data-node-id" in page or "agentree view" in page
    assert len(list((run / "trees").glob(f"step{STEPS:06d}_*.json"))) == 2


def test_plot_draws_the_run(tracked_run, tmp_path):
    from agentree.commands.plot import plot_runs

    run, _ = tracked_run
    out = tmp_path / "curves.png"
    drawn = plot_runs([f"tiny={run}"], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    expected = {"eval/success_rate", "train/success_rate", "rollout/env_steps", "train/pruned_frac"}
    assert expected <= set(drawn["tiny"])


def test_trackers_are_not_imported_unless_enabled(tmp_path):
    import subprocess

    code = (
        "import sys\n"
        "from agentree.config import load_config\n"
        "from agentree.run.tracking import Tracker\n"
        f"t = Tracker(load_config().log, {str(tmp_path)!r}, {{}})\n"
        "t.log({'step': 1, 'train/loss': 1.0}); t.close()\n"
        "assert not t.enabled\n"
        "print(sorted(m for m in ('wandb', 'tensorboard', 'torch.utils.tensorboard')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
