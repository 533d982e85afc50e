"""Checkpoints that survive a crash while saving, and resumes that are exact wherever the run
stopped: a checkpoint cut short at random byte offsets falls back to the newest complete one,
and a stop during the initial (step-0) evaluation, or during an update before its first
optimiser step, resumes to the uninterrupted run's rows."""

from __future__ import annotations

import os
import random
import shutil
import signal
from pathlib import Path

import pytest
import torch
from small_policy import metric_rows

import agentree.run.trainer as trainer_module
from agentree.config import load_config
from agentree.run.checkpoint import (
    begin_checkpoint,
    checkpoint_problem,
    finish_checkpoint,
    latest_checkpoint,
)
from agentree.run.trainer import Trainer

SMALL = [
    "train.tasks_per_step=2",
    "train.micro_batch_size=4",
    "eval.tasks=2",
    "eval.samples=1",
    "engine.max_tokens=6",
    "env.max_turns=4",
    "rollout.K=2",
    "train.trees_every=0",
    "train.lr=0.01",
]


def config(run: Path, *extra: str, steps: int):
    return load_config(
        "frozenlake_patr",
        select={"steps": str(steps), "output": str(run)},
        overrides=SMALL + list(extra),
    )


def trainer(run: Path, cfg, log=lambda s: None) -> Trainer:
    """A trainer on maps with the goal next to the start: groups mix wins and losses, so every
    step's update moves the weights and the optimiser's moments."""
    tr = Trainer(cfg, run, log=log)
    easy = {"desc": ["SGF", "FFF", "FFF"]}
    tr.train_tasks = [t.__class__(t.id, None, easy) for t in tr.train_tasks[:4]]
    tr._order, tr._cursor = [], 0
    return tr


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_manifest_names_the_file_that_is_short(tmp_path):
    ckpt_tmp = begin_checkpoint(tmp_path, 1)
    (ckpt_tmp / "dcp").mkdir()
    (ckpt_tmp / "dcp" / "__0_0.distcp").write_bytes(bytes(range(200)))
    torch.save({"step": 1}, ckpt_tmp / "trainer_state.pt")
    ckpt = finish_checkpoint(tmp_path, 1, keep=2)
    assert checkpoint_problem(ckpt) is None
    shard = ckpt / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:77])
    assert checkpoint_problem(ckpt) == "dcp/__0_0.distcp has 77 bytes, 200 were written"
    shard.write_bytes(bytes(200))  # the right length, other bytes
    assert checkpoint_problem(ckpt) == (
        "dcp/__0_0.distcp does not match the checksum it was written with"
    )
    skipped: list[str] = []
    assert latest_checkpoint(tmp_path, log=skipped.append) is None
    assert skipped == [
        "skipping checkpoint step_000001: dcp/__0_0.distcp does not match the checksum it "
        "was written with"
    ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_frozenlake) -> tuple[Path, dict[str, torch.Tensor]]:
    """Three steps, a checkpoint after each (all kept), the final one after the evaluation."""
    run = tmp_path_factory.mktemp("a")
    cfg = config(run, "train.save_every=1", "train.keep_checkpoints=3", steps=3)
    tr = trainer(run, cfg)
    tr.fit()
    final = weights(tr)
    tr.close()
    return run, final


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_checkpoint_cut_short_falls_back_to_the_newest_complete_one(
    tmp_path, uninterrupted, seed
):
    """The last checkpoint's trainer_state.pt, weights shard or any other file cut at a
    random byte: --resume skips it (one line), resumes from step 2 and ends as the
    uninterrupted run did: the same rows and the same weights."""
    a, final = uninterrupted
    b = tmp_path / "b"
    shutil.copytree(a, b)
    rng = random.Random(seed)
    last = b / "checkpoints" / "step_000003"
    files = sorted(p for p in last.rglob("*") if p.is_file() and p.name != "manifest.json")
    victim = [last / "trainer_state.pt", last / "dcp" / "__0_0.distcp", rng.choice(files)][seed]
    size = victim.stat().st_size
    cut = rng.randrange(size)
    with open(victim, "r+b") as f:
        f.truncate(cut)
    rel = victim.relative_to(last)

    logs: list[str] = []
    cfg = config(b, "train.save_every=1", "train.keep_checkpoints=3", steps=3)
    again = trainer(b, cfg, log=logs.append)
    assert again.resume() == b / "checkpoints" / "step_000002" and again.step == 2
    assert f"skipping checkpoint step_000003: {rel} has {cut} bytes, {size} were written" in logs
    again.fit()
    resumed = weights(again)
    again.close()
    assert metric_rows(b) == metric_rows(a)
    for k, v in resumed.items():
        assert torch.equal(v, final[k]), k


def two_step_runs(tmp_path: Path) -> tuple[Trainer, dict[str, torch.Tensor]]:
    """Run `a` trained uninterrupted for two steps (its final weights returned) and run `b`,
    the same run, not started yet."""
    runs = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        runs[name] = trainer(tmp_path / name, config(tmp_path / name, steps=2))
    runs["a"].fit()
    final = weights(runs["a"])
    runs["a"].close()
    return runs["b"], final


def test_a_stop_during_the_initial_evaluation_resumes_exactly(
    tmp_path, tiny_frozenlake, monkeypatch
):
    """Ctrl-C at the end of the step-0 evaluation (every sample drawn, the row not written):
    the checkpoint holds the state from before it, the resumed run evaluates step 0 again, and
    its rows and final weights equal the uninterrupted run's."""
    b, final = two_step_runs(tmp_path)

    real = trainer_module.evaluate

    def stopped_at_step_0(rt, cfg, seed):
        real(rt, cfg, seed=seed)
        raise KeyboardInterrupt("SIGINT")

    monkeypatch.setattr(trainer_module, "evaluate", stopped_at_step_0)
    with pytest.raises(KeyboardInterrupt):
        b.fit()
    b.save()  # what `agentree train` does on Ctrl-C
    b.close()
    monkeypatch.undo()
    again = trainer(tmp_path / "b", config(tmp_path / "b", steps=2))
    assert again.resume() is not None and again.step == 0
    again.fit()
    resumed = weights(again)
    again.close()
    rows = metric_rows(tmp_path / "a")
    assert any(r.get("train/grad_norm", 0) > 0 for r in rows)  # the updates moved something
    assert metric_rows(tmp_path / "b") == rows
    for k, v in resumed.items():
        assert torch.equal(v, final[k]), k


def test_a_sigterm_before_the_first_optimiser_step_abandons_the_step_and_resumes_exactly(
    tmp_path, tiny_frozenlake, monkeypatch
):
    """A real SIGTERM, delivered while the second step's update computes its gradients, is
    honoured at once (not held to the end of the update): the checkpoint holds the weights and
    the state from before that step's rollout, and the resumed run redoes the step and ends
    with the uninterrupted run's rows and weights."""
    import agentree.learner.update as update_module

    b, final = two_step_runs(tmp_path)

    real = update_module.policy_loss
    raised_in_loss = []

    def signalled_in_step_1(*args, **kwargs):
        if b.step == 1 and not raised_in_loss:
            raised_in_loss.append(True)
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises before the next line
            raised_in_loss.append(False)
        return real(*args, **kwargs)

    monkeypatch.setattr(update_module, "policy_loss", signalled_in_step_1)
    b.stop.install()
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            b.fit()
        assert raised_in_loss == [True]  # raised inside the gradient pass, not at its end
        assert b.step == 1
        ckpt = b.save()  # what `agentree train` does on the interrupt
    finally:
        b.stop.uninstall()
    b.close()
    monkeypatch.undo()
    assert ckpt.name == "step_000001"
    again = trainer(tmp_path / "b", config(tmp_path / "b", steps=2))
    assert again.resume() == ckpt and again.step == 1
    again.fit()
    resumed = weights(again)
    again.close()
    rows = metric_rows(tmp_path / "a")
    assert any(r.get("train/grad_norm", 0) > 0 for r in rows)
    assert metric_rows(tmp_path / "b") == rows
    for k, v in resumed.items():
        assert torch.equal(v, final[k]), k
