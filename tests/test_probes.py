"""The faults a new user meets, each answered with one line and a non-zero exit, nothing
written: outputs that would replace another command's files, inputs that select nothing, a
malformed config, an env that breaks the reset contract, a run without trees, a missing extra.
And runs that end well: a finished run resumed is "already complete"."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agentree.commands.cli import main

FAST = ["--set", "engine.max_tokens=4", "--set", "env.max_turns=2", "--set", "rollout.K=2"]
SMALL_TRAIN = [
    *FAST[:4],
    "--rollout",
    "grpo",
    "--set",
    "rollout.G=2",
    "--set",
    "train.tasks_per_step=2",
    "--set",
    "eval.tasks=2",
    "--set",
    "eval.samples=1",
    "--set",
    "train.trees_every=0",
    "--set",
    "policy.path=tiny",
]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("agentree: error: "), err
    assert "Traceback" not in "\n".join(err)
    return err[-1].removeprefix("agentree: error: ")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def training_run(tmp_path) -> Path:
    """A run directory as `agentree train` leaves it (a checkpoint, metrics, its config)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 3\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


@pytest.mark.parametrize("command", ["eval", "rollout"])
def test_eval_and_rollout_refuse_a_training_run(training_run, capsys, command, tiny_frozenlake):
    before = snapshot(training_run)
    assert main([command, "--output", str(training_run), "--tasks", "1", *FAST]) == 2
    assert one_line_error(capsys) == (
        f"{training_run} holds a training run, which agentree {command} would overwrite; pass "
        f"another --output, e.g. {training_run / command}"
    )
    assert snapshot(training_run) == before


def test_train_refuses_a_folder_it_did_not_write(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: own notes\n")
    before = snapshot(mine)
    argv = ["train", "--output", str(mine), "--policy", str(tmp_path / "nonexistent")]
    assert main(argv) == 2
    assert one_line_error(capsys) == (
        f"{mine} holds files agentree did not write; pass a new or empty --output directory "
        "for agentree train"
    )
    assert snapshot(mine) == before
    assert main(["train", "--output", str(mine), "--resume"]) == 2
    assert "is not an agentree training run directory" in one_line_error(capsys)
    assert snapshot(mine) == before


def test_train_writes_nothing_before_its_inputs_are_valid(tmp_path, capsys):
    out = tmp_path / "new"
    argv = ["train", "--output", str(out), "--policy", str(tmp_path / "nonexistent")]
    assert main(argv) == 2
    assert "does not exist" in one_line_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tasks", "0"], "--tasks 0 selects no tasks; pass a count of at least 1"),
        (["--tasks", "EMPTY"], "selects no tasks; pass a count of at least 1"),
        (["--tasks", "2", "--samples", "0"], "--samples 0: pass at least 1 trajectory per task"),
    ],
    ids=["tasks-0", "empty-task-file", "samples-0"],
)
def test_eval_that_would_measure_nothing_is_an_error(tmp_path, capsys, flags, message):
    empty = tmp_path / "tasks.jsonl"
    empty.write_text("")
    flags = [str(empty) if f == "EMPTY" else f for f in flags]
    out = tmp_path / "eval"
    assert main(["eval", "--output", str(out), *flags, *FAST]) == 2
    assert message in one_line_error(capsys)
    assert not out.exists()


def test_malformed_yaml_config(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("env: [frozenlake\n  rollout: {\n")
    assert main(["train", "--config", str(bad), "--output", str(tmp_path / "o")]) == 2
    assert one_line_error(capsys) == (
        f"config {bad} is not valid YAML at line 2, column 10: expected ',' or ']', but got ':'"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ("NumberObservation", "NumberObservation.reset() must return a str observation, got int"),
        (
            "BareObservation",
            'BareObservation.reset() must return (observation, info), got "a bare string"',
        ),
    ],
)
def test_env_whose_reset_breaks_the_contract(tmp_path, capsys, env, message):
    out = tmp_path / "o"
    argv = ["eval", "--env", f"custom_env.bad_reset:{env}", "--tasks", "1", "--output", str(out)]
    assert main([*argv, "--policy", "tiny"]) == 2
    line = one_line_error(capsys)
    assert line.startswith(message) and line.endswith(
        "check_env(env) checks the whole env contract"
    )
    assert not out.exists()


def test_view_of_a_run_without_trees(training_run, capsys):
    (training_run / "summary.json").write_text(json.dumps({"eval_after": 0.5}))
    assert main(["view", str(training_run)]) == 2
    assert one_line_error(capsys) == (
        f"{training_run} has no trees/ folder, so there are no trees to view; a training run "
        "saves them every train.trees_every steps (set it above 0), an evaluation or a "
        "rollout once its last task is done (a stopped one finishes with agentree eval "
        "--resume or agentree rollout --resume)"
    )
    assert not (training_run / "view.html").exists()


def test_plot_without_matplotlib(training_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the extra has
    assert main(["plot", str(training_run), "--output", str(tmp_path / "c.png")]) == 2
    assert one_line_error(capsys) == (
        "agentree plot needs matplotlib, which is not installed; pip install 'agentree[view]'"
    )


def test_resuming_a_finished_run_is_already_complete(tmp_path, capsys, tiny_frozenlake):
    run = tmp_path / "run"
    assert main(["train", "--output", str(run), "--steps", "1", *SMALL_TRAIN]) == 0
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", "--output", str(run), "--resume"]) == 0
    out = "".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert "".join(f"{run} is already complete: 1 of 1 steps trained".split()) in out
    assert snapshot(run) == before  # no second evaluation row, no new checkpoint
