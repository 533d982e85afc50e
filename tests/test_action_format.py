"""Summaries report the fraction of well-formed actions (the env's `format_error` info key) and
warn when none was: a policy that never acts would otherwise look like a policy that fails."""

from __future__ import annotations

import json

import pytest
from swe_support import local_records_fixture  # noqa: F401

from agentree.commands.cli import main
from agentree.envs import make_env
from agentree.rollout.base import describe_action_format

FAST = ["--set", "engine.max_tokens=6", "--set", "env.max_turns=3", "--set", "rollout.K=2"]


def _flat(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize(
    ("env", "good", "bad"),
    [
        ("frozenlake", "```Up```", "up please"),
        ("countdown", None, "I give up"),
        ("math", None, "the answer is 4"),
    ],
)
def test_envs_report_format_errors(env, good, bad):
    e = make_env(env)
    task = type(e).load_tasks(1)[0]
    e.reset(seed=task.seed, options=task.options)
    good = good or e.example_actions()[0]
    state = e.snapshot()
    assert e.step(good)[4]["format_error"] is False
    e.restore(state)
    assert e.step(bad)[4]["format_error"] is True


def test_describe_action_format():
    assert describe_action_format(0, 0) is None  # the env does not judge actions
    assert describe_action_format(3, 4) == "well-formed actions: 75.0% (3/4)"
    assert describe_action_format(0, 72) == (
        "warning: none of the 72 actions was well-formed, so the environment never acted on "
        "one; the policy must produce the env's action format first (e.g. a stronger or "
        "fine-tuned policy)"
    )


def test_rollout_summary_reports_the_fraction(tmp_path, capsys, tiny_frozenlake):
    out = tmp_path / "r"
    assert main(["rollout", "--tasks", "2", "--output", str(out), *FAST]) == 0
    stats = json.loads((out / "rollout_stats.json").read_text())
    frac = stats["well_formed_actions"]
    assert 0.0 < frac <= 1.0
    err = _flat(capsys.readouterr().err)
    assert _flat(f"well-formed actions: {100 * frac:.1f}% (") in err


def test_train_summary_reports_the_fraction(tmp_path, capsys, tiny_frozenlake):
    out = tmp_path / "t"
    argv = ["train", "--steps", "1", "--output", str(out), *FAST]
    argv += ["--set", "train.tasks_per_step=2", "--set", "eval.tasks=1", "--set", "eval.samples=1"]
    assert main(argv) == 0
    row = next(
        json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "train/loss" in x
    )
    well, judged = row["rollout/actions_well_formed"], row["rollout/actions_judged"]
    assert judged == row["rollout/env_steps"] and 0 < well <= judged
    err = _flat(capsys.readouterr().err)
    assert _flat(f"well-formed actions: {100 * well / judged:.1f}% ({well}/{judged})") in err


@pytest.mark.docker
def test_swe_rollout_with_the_tiny_policy_warns(tmp_path, capsys, local_records):
    out = tmp_path / "swe"
    argv = ["rollout", "--env", "swebench", "--tasks", "1", "--output", str(out)]
    argv += ["--set", "env.step_limit=2", "--set", "env.grade=false", "--set", "rollout.K=1"]
    argv += ["--set", "rollout.B0=2", "--set", "engine.max_tokens=16"]
    assert main(argv) == 0
    stats = json.loads((out / "rollout_stats.json").read_text())
    assert stats["well_formed_actions"] == 0.0
    assert _flat("warning: none of the") in _flat(capsys.readouterr().err)
