"""The agentree command, run in-process on small settings."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from agentree.commands.cli import main
from agentree.config import load_config
from agentree.policy import resolve_policy
from agentree.tree import Tree

FAST = ["--set", "engine.max_tokens=6", "--set", "env.max_turns=4", "--set", "rollout.K=2"]


def test_rollout_writes_trees_and_stats(tmp_path, tiny_frozenlake):
    out = tmp_path / "r"
    rc = main(
        [
            "rollout",
            "--env",
            "frozenlake",
            "--rollout",
            "patr",
            "--scorer",
            "bfs",
            "--tasks",
            "3",
            "--output",
            str(out),
            *FAST,
        ]
    )
    assert rc == 0
    stats = json.loads((out / "rollout_stats.json").read_text())
    for key in (
        "trajectories",
        "env_steps",
        "forks",
        "expanded",
        "pruned",
        "policy_tokens_generated",
        "policy_tokens_prefilled",
        "wall_s",
    ):
        assert key in stats
    files = sorted((out / "trees").glob("*.json"))
    assert len(files) == 3
    tree = Tree.load(files[0])
    for node in json.loads(files[0].read_text())["nodes"]:
        for key in ("parent", "turn", "action", "observation", "reward", "score", "end_reason"):
            assert key in node
    assert all(leaf.end_reason is not None for leaf in tree.leaves())
    assert (out / "config.yaml").exists()


def test_train_with_a_user_env(tmp_path, monkeypatch, capsys):
    out = tmp_path / "t"
    rc = main(
        [
            "train",
            "--env",
            "custom_env.mygame:GuessEnv",
            "--scorer",
            "random",
            "--steps",
            "1",
            "--output",
            str(out),
            "--set",
            "eval.tasks=2",
            "--set",
            "eval.samples=1",
            "--set",
            "train.tasks_per_step=2",
            "--set",
            "engine.max_tokens=4",
            "--set",
            "engine.stop=[]",
            "--set",
            "rollout.K=2",
        ]
    )
    assert rc == 0
    assert (out / "checkpoints" / "latest").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_after"] is not None
    # the run names the weights it started from, in its summary and its config.yaml
    policy = Path(summary_policy(out))
    assert summary["policy_sha256"] == _sha256(policy / "model.safetensors")
    config = (out / "config.yaml").read_text()
    assert f"# policy weights sha256: {summary['policy_sha256']} ({policy})" in config
    assert load_config(str(out / "config.yaml")).env["name"] == "custom_env.mygame:GuessEnv"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in r for r in rows)
    assert "(2 tasks x 1 sample, pass@1 " in capsys.readouterr().err


def test_eval_writes_eval_json(tmp_path, tiny_frozenlake, capsys):
    out = tmp_path / "e"
    assert main(["eval", "--tasks", "3", "--samples", "2", "--output", str(out), *FAST]) == 0
    data = json.loads((out / "eval.json").read_text())
    assert data["summary"]["tasks"] == 3 and len(data["per_task"]) == 3
    assert all(p["samples"] == 2 for p in data["per_task"])
    # what sampling cost, as the trees count it
    cost = data["rollout_stats"]
    trees = [json.loads(f.read_text()) for f in (out / "trees").iterdir()]
    steps = sum(len(t["nodes"]) - 1 for t in trees)  # every node below the root is a step
    assert (cost["trajectories"], cost["env_steps"]) == (6, steps)
    err = capsys.readouterr().err
    assert f"6 trajectories, {steps} env steps" in err
    # the figure names the weights behind it: those of the policy the config resolves to
    policy = Path(resolve_policy(load_config(str(out / "config.yaml")), log=lambda _: None))
    assert data["summary"]["policy_sha256"] == _sha256(policy / "model.safetensors")
    # off a terminal (a log file) a long line is written whole: the hash stays one string
    assert f"policy weights: sha256 {data['summary']['policy_sha256']}\n" in err
    assert f"-> {out / 'eval.json'}\n" in err


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def summary_policy(run_dir: Path) -> str:
    """The policy directory a run started from, as its config.yaml's last line names it."""
    line = (run_dir / "config.yaml").read_text().splitlines()[-1]
    return line.rsplit("(", 1)[1].rstrip(")")


def test_bad_config_is_one_clear_line(tmp_path, capsys):
    rc = main(["train", "--set", "train.lrr=1", "--output", str(tmp_path / "x")])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err == "agentree: error: unknown config key 'train.lrr'"


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "agentree", "configs"], capture_output=True, text=True, check=True
    )
    assert "frozenlake_patr" in out.stdout.split()


def test_import_is_light():
    code = (
        "import sys, agentree, agentree.envs, agentree.scorers; "
        "print(any(m in sys.modules for m in ('torch', 'docker', 'vllm', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_dry_run_plans_the_default_policy_and_a_named_checkpoint(tmp_path, monkeypatch, capsys):
    """`--dry-run` reads every policy name the way training does (`agentree.policy`): the
    default `tiny-warm` is the tiny policy's architecture, `smollm2-135m` its checkpoint's,
    from the built-in table while it is not fetched yet; nothing is built or downloaded."""
    monkeypatch.setenv("AGENTREE_CACHE", str(tmp_path / "empty-cache"))
    assert main(["train", "--dry-run"]) == 0
    assert "architecture: policy.tiny settings" in capsys.readouterr().out
    assert main(["train", "--dry-run", "--policy", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert "built-in architecture table for HuggingFaceTB/SmolLM2-135M-Instruct" in out
    assert "parameters: 134.52M (full)" in out
    assert not (tmp_path / "empty-cache").exists()
