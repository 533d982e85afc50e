"""Kill a real `agentree train` process at several points of a step, then `--resume` it.

The training process runs under a small launcher that pauses (sleeps) at one point of a step
and drops a flag file; the test then sends SIGKILL, SIGTERM or SIGHUP while the process sits
there. Nothing is replaced: the rollout, the update and the checkpoint write all run for real,
the pause only makes the moment of the kill deterministic.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from helpers import signal_at_pause
from small_policy import WARM_2_LAYERS

from agentree.commands.cli import main
from agentree.run.checkpoint import begin_checkpoint, finish_checkpoint, latest_checkpoint
from agentree.run.resume import trim_metrics

STEPS = 3
ARGS = [
    "train",
    *[x for o in WARM_2_LAYERS for x in ("--set", o)],
    "--rollout",
    "grpo",
    "--steps",
    str(STEPS),
    "--set",
    "train.save_every=2",
    "--set",
    "train.tasks_per_step=2",
    "--set",
    "train.trees_every=0",
    "--set",
    "eval.tasks=1",
    "--set",
    "eval.samples=1",
    "--set",
    "engine.max_tokens=4",
    "--set",
    "env.max_turns=2",
    "--set",
    "rollout.G=2",
]

LAUNCHER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path

    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as at a terminal, if the tests run under nohup

    import torch

    import agentree.rollouts
    import agentree.learner.update
    from agentree.commands.cli import main

    AT, STEP = os.environ["PROBE_AT"], int(os.environ["PROBE_STEP"])
    FLAG = Path(os.environ["PROBE_FLAG"])


    def pause():  # until the test has sent its signal (a held SIGTERM does not end a sleep)
        if not FLAG.exists():
            FLAG.write_text(AT)
            go = FLAG.with_suffix(".go")
            for _ in range(1200):
                if go.exists():
                    break
                time.sleep(0.1)


    rollout = agentree.rollouts.LocalRollouts.rollout
    update = agentree.learner.update.PolicyUpdate.__call__
    save = torch.save
    calls = []


    def paused_rollout(self, tasks, *, step=0, progress=None, **kw):
        out = rollout(self, tasks, step=step, progress=progress, **kw)  # ran; still inside it
        if AT == "rollout" and step == STEP and kw.get("controller") is None:  # not an eval
            pause()
        return out


    def paused_update(self, *args, **kwargs):
        out = update(self, *args, **kwargs)  # weights updated, the step not finished yet
        calls.append(1)
        if AT == "update" and len(calls) == STEP + 1:
            pause()
        return out


    def paused_save(obj, path, *args, **kwargs):
        # weights, optimiser and tokenizer are written, trainer_state.pt not yet
        named = isinstance(path, str | os.PathLike)  # a distributed checkpoint saves to buffers
        if AT == "save" and named and Path(path).parent.name == f".tmp_step_{STEP:06d}":
            pause()
        return save(obj, path, *args, **kwargs)


    agentree.rollouts.LocalRollouts.rollout = paused_rollout
    agentree.learner.update.PolicyUpdate.__call__ = paused_update
    torch.save = paused_save
    sys.exit(main(sys.argv[1:]))
    """
)


def _kill_during(tmp_path: Path, at: str, step: int, sig: int) -> tuple[Path, int, str]:
    run = tmp_path / "run"
    flag = tmp_path / "flag"
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    env = {**os.environ, "PROBE_AT": at, "PROBE_STEP": str(step), "PROBE_FLAG": str(flag)}
    argv = [sys.executable, str(launcher), *ARGS, "--output", str(run)]
    code, out = signal_at_pause(argv, flag, sig, f"training (at the {at})", env=env)
    return run, code, _flat(out)


def _flat(text: str) -> str:
    """Text without whitespace: the console wraps long lines, even inside paths."""
    return "".join(text.split())


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _train_steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if "train/loss" in r]


def _eval_steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if "eval/success_rate" in r]


@pytest.fixture(scope="module")
def small_warm(agentree_cache: Path) -> Path:
    """The runs' policy, built before a run starts: its build would eat the pause deadline."""
    from agentree.config import load_config
    from agentree.policy import resolve_policy

    return Path(resolve_policy(load_config(overrides=WARM_2_LAYERS), lambda _: None))


# (signal, where the process is, the step index it is in, the checkpoint --resume must use)
CASES = [
    (signal.SIGKILL, "rollout", 1, None),  # before the first checkpoint: nothing to resume
    (signal.SIGKILL, "update", 2, 2),
    (signal.SIGKILL, "save", 3, 2),  # the last write is cut; rows of step 3 must go
    (signal.SIGTERM, "rollout", 2, 2),  # SIGTERM checkpoints like Ctrl-C
    (signal.SIGTERM, "update", 1, 2),  # the update finishes its step before the checkpoint
    (signal.SIGTERM, "save", 2, 2),  # the cut write is redone by the interrupt handler
    (signal.SIGHUP, "rollout", 2, 2),  # a closed terminal checkpoints like Ctrl-C
]


@pytest.mark.parametrize(
    ("sig", "at", "step", "resume_from"),
    CASES,
    ids=[f"{signal.Signals(c[0]).name}-{c[1]}" for c in CASES],
)
def test_kill_and_resume(tmp_path, small_warm, capsys, sig, at, step, resume_from):
    run, rc, out = _kill_during(tmp_path, at, step, sig)
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL
    else:
        assert rc == 130, out
        assert _flat(f"interrupted by {signal.Signals(sig).name} at step {resume_from}") in out
        assert _flat(f"Continue with: agentree train --output {run} --resume") in out
    if at == "save":
        assert (run / "checkpoints" / f".tmp_step_{step:06d}").exists() or sig != signal.SIGKILL
    config_before = (run / "config.yaml").read_text()

    ckpt = latest_checkpoint(run)
    if resume_from is None:
        assert ckpt is None  # a half-written checkpoint is never picked up
    else:
        assert ckpt == run / "checkpoints" / f"step_{resume_from:06d}"

    assert main(["train", "--output", str(run), "--resume"]) == 0
    err = _flat(capsys.readouterr().err)
    if resume_from is None:
        assert _flat(f"nothing to resume in {run} (no checkpoint yet): starting at step 0") in err
    else:
        assert _flat(f"resuming from step {resume_from} (checkpoint {ckpt})") in err
    rows = _rows(run)
    assert _train_steps(rows) == list(range(1, STEPS + 1))
    assert _eval_steps(rows) == [0, STEPS]
    assert (run / "config.yaml").read_text() == config_before
    state = torch.load(latest_checkpoint(run) / "trainer_state.pt", weights_only=False)
    assert state["step"] == STEPS
    # the summary counts the whole run's training, the steps of the stopped process included
    summary = json.loads((run / "summary.json").read_text())
    assert summary.get("resumed_at_step") == resume_from
    step_s = sum(r["time/step_s"] for r in rows if "train/loss" in r)
    assert summary["trained_s"] == round(state["trained_s"], 1)
    assert summary["trained_s"] >= round(step_s, 1) - 0.1, (summary, step_s)


def test_latest_pointer_missing_target_falls_back(tmp_path):
    """A kill between replacing a checkpoint and re-pointing `latest` still resumes."""
    for step in (1, 2):
        torch.save({"step": step}, begin_checkpoint(tmp_path, step) / "trainer_state.pt")
        finish_checkpoint(tmp_path, step, keep=3)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step_000002"
    (root / "step_000002").rename(root / ".trash_step_000002")
    assert latest_checkpoint(tmp_path) == root / "step_000001"
    state = torch.load(latest_checkpoint(tmp_path) / "trainer_state.pt", weights_only=False)
    assert state["step"] == 1


def test_trim_metrics_keeps_rows_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/x": 1}, {"step": 1}, {"step": 2}, {"step": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "tra')
    assert trim_metrics(path, 2) == 2  # step 3 and the line cut off by a kill
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2]
    assert trim_metrics(path, None) == 3
    assert path.read_text() == ""


def _saved_run(tmp_path: Path) -> Path:
    """A run directory as `agentree train` starts it: its marker and its config."""
    from agentree.config import load_config
    from agentree.run.outputs import mark

    run = tmp_path / "run"
    mark(run, "train")
    (run / "config.yaml").write_text(load_config(overrides=["train.steps=6"]).to_yaml())
    return run


def test_resume_rejects_flags_that_change_the_run(tmp_path, capsys):
    run = _saved_run(tmp_path)
    argv = ["train", "--output", str(run), "--resume", "--set", "train.lr=abc", "--env", "nosuch"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"agentree: error: --resume continues the run in {run} with its saved config.yaml, and "
        "--env nosuch, --set train.lr=abc would change it; drop those flags, or start a new run "
        "with another --output"
    )


def test_resume_accepts_flags_equal_to_the_saved_run_and_logs_steps(tmp_path):
    from agentree.run.resume import resume_config

    run = _saved_run(tmp_path)
    saved_lr = yaml.safe_load((run / "config.yaml").read_text())["train"]["lr"]
    logged: list[str] = []
    cfg = resume_config(
        run,
        config=None,
        select={"env": "frozenlake", "rollout": None},
        overrides=[f"train.lr={saved_lr}", "train.eps_high=0.28"],
        steps=8,
        log=logged.append,
    )
    assert cfg.train.steps == 8
    assert logged == ["--steps 8 overrides train.steps=6 of the saved run"]


def test_resume_may_reshape_the_work_and_logs_it(tmp_path):
    """Checkpoints reshard onto any learner, so `--resume --set train.world_size=N --set
    train.fsdp=true` is allowed and logged; any other key still counts as a change of the run."""
    from agentree.run.resume import resume_config

    run = _saved_run(tmp_path)
    logged: list[str] = []
    cfg = resume_config(
        run,
        config=None,
        select={},
        overrides=["train.world_size=2", "train.fsdp=true", "train.micro_batch_size=4"],
        steps=None,
        log=logged.append,
    )
    assert cfg.train.world_size == 2 and cfg.train.micro_batch_size == 4
    assert cfg.output == str(run)
    assert "--set train.world_size=2 overrides train.world_size=1 of the saved run" in logged
    with pytest.raises(ValueError, match=r"--set train.lr=0.5 would change it"):
        resume_config(
            run, config=None, select={}, overrides=["train.lr=0.5"], steps=None, log=print
        )
