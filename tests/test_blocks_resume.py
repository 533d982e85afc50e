"""Stop a real `agentree eval` or `agentree rollout` process between its blocks of tasks, then
`--resume` it.

The command runs under a small launcher that pauses as its second block is about to be saved
(the first block saved, the second sampled but not written), or in the second block's first SWE
step, and drops a flag file; the test then sends SIGTERM, SIGHUP or SIGKILL. Nothing is
replaced: sampling (PATR's forking trees for the rollout), saving and resuming run for real.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import interruptible, signal_at_pause
from swe_support import local_records_fixture, owned_by  # noqa: F401

from agentree.commands.cli import main
from agentree.config import load_config
from agentree.hub.store import BUILD_META
from agentree.run.evaluation import evaluate
from agentree.run.runtime import Runtime
from agentree.tree import Tree

ARGS = [
    "eval",
    "--policy",
    "tiny",
    "--env",
    "frozenlake",
    "--tasks",
    "5",
    "--samples",
    "2",
    "--set",
    "eval.save_every=2",  # blocks of 2, 2 and 1 tasks
    "--set",
    "engine.max_tokens=6",
    "--set",
    "env.max_turns=4",
]

ROLLOUT_ARGS = [
    "rollout",
    "--policy",
    "tiny",
    "--env",
    "frozenlake",
    "--tasks",
    "5",
    "--save-every",
    "2",  # blocks of 2, 2 and 1 tasks
    "--set",
    "engine.max_tokens=6",
    "--set",
    "env.max_turns=4",
]

LAUNCHER = textwrap.dedent(
    """
    import os, sys, threading, time
    from pathlib import Path

    from agentree.commands.cli import main
    from agentree.run.blocks import SavedBlocks

    FLAG = Path(os.environ["PROBE_FLAG"])
    save = SavedBlocks.save
    saved = []
    once = threading.Lock()


    def pause():  # until the test has sent its signal
        if once.acquire(blocking=False):
            session = ""
            if os.environ.get("PROBE_SWE_STEP"):  # names the Docker resources this run owns
                from agentree.envs.swe import runtime

                session = runtime.session_id()
            FLAG.write_text(session)
            go = FLAG.with_suffix(".go")
            for _ in range(1200):
                if go.exists():
                    break
                time.sleep(0.1)


    def paused(self, k, block):
        if k == 1 and not os.environ.get("PROBE_SWE_STEP"):
            pause()  # the second block is sampled, not yet saved
        save(self, k, block)
        saved.append(k)


    SavedBlocks.save = paused
    if os.environ.get("PROBE_SWE_STEP"):  # pause in the second block's first env step instead
        from agentree.envs.swe.env import SWEEnv

        step = SWEEnv.step

        def paused_step(self, action):
            out = step(self, action)  # a container is running the episode
            if saved == [0]:
                pause()
            return out

        SWEEnv.step = paused_step
    sys.exit(main(sys.argv[1:]))
    """
)


def _stop_in_second_block(
    tmp_path: Path,
    out: Path,
    sig: int,
    args: list[str] = ARGS,
    at_pause: Callable[[], None] | None = None,
    **env: str,
) -> tuple[int, str]:
    flag = tmp_path / "flag"
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    argv = [sys.executable, str(launcher), *args, "--output", str(out)]
    env = {**os.environ, **env, "PROBE_FLAG": str(flag)}
    return signal_at_pause(argv, flag, sig, args[0], at_pause, env=env, preexec_fn=interruptible)


def _results(out: Path) -> tuple[dict, dict[str, object]]:
    """eval.json and the trees, without the timings (the one thing two runs may differ in)."""
    body = json.loads((out / "eval.json").read_text())
    body["summary"].pop("wall_s")
    for item in body["per_task"]:
        item.pop("wall_s")
    body["rollout_stats"] = _counters(body["rollout_stats"])  # summed over the blocks
    return body, _trees(out)


def _rollout_results(out: Path) -> tuple[dict, dict[str, object]]:
    """rollout_stats.json and the trees, without the timings."""
    return _counters(json.loads((out / "rollout_stats.json").read_text())), _trees(out)


def _counters(stats: dict) -> dict:
    """A rollout's counters without its timings."""
    return {k: v for k, v in stats.items() if not k.endswith("_s")}


def _refusal(capsys: pytest.CaptureFixture[str]) -> Callable[[list[str]], str]:
    """Runs a command that must be refused (exit 2) and returns its one-line error."""

    def error(argv: list[str]) -> str:
        capsys.readouterr()
        assert main(argv) == 2
        return capsys.readouterr().err.strip()

    return error


def _trees(out: Path) -> dict[str, object]:
    trees = {}
    for f in sorted((out / "trees").iterdir()):
        tree = json.loads(f.read_text())
        for node in tree["nodes"]:
            node["info"].pop("step_s", None)
        tree["meta"].pop("wall_s", None)
        trees[f.name] = tree
    return trees


@pytest.mark.parametrize(
    "command, sig",
    [
        ("eval", signal.SIGTERM),
        ("eval", signal.SIGHUP),
        ("eval", signal.SIGKILL),
        ("rollout", signal.SIGTERM),
        ("rollout", signal.SIGKILL),
    ],
)
def test_a_stopped_command_resumes_to_the_results_of_one_never_stopped(
    tmp_path, tiny_frozenlake, command, sig
):
    args, results, written = {
        "eval": (ARGS, _results, "eval.json"),
        "rollout": (ROLLOUT_ARGS, _rollout_results, "rollout_stats.json"),
    }[command]
    whole = tmp_path / "whole"
    assert main([*args, "--output", str(whole)]) == 0
    assert not (whole / "blocks").exists()  # the blocks go once the results are written
    assert len(list((whole / "trees").iterdir())) == 5

    out = tmp_path / "stopped"
    rc, text = _stop_in_second_block(tmp_path, out, sig, args)
    assert rc == (-signal.SIGKILL if sig == signal.SIGKILL else 130), text
    if sig != signal.SIGKILL:
        said = "".join(text.split())  # the console wraps long lines, even inside paths
        assert "interruptedwith2of5taskssaved" in said, text
        assert f"continuewith:agentree{command}--output{out}--resume" in said, text
    # only the first block was saved: the second was sampled, not written
    assert sorted(p.name for p in (out / "blocks").iterdir()) == ["block_00000", "plan.json"]
    assert not (out / written).exists() and not (out / "trees").exists()

    assert main([command, "--output", str(out), "--resume"]) == 0
    assert not (out / "blocks").exists()
    assert results(out) == results(whole)
    if command == "eval":  # what sampling cost, summed over the three blocks
        assert results(out)[0]["rollout_stats"]["trajectories"] == 5 * 2


def test_a_stopped_evaluation_is_neither_overwritten_nor_changed_on_resume(
    tmp_path, tiny_frozenlake, capsys
):
    policy = tmp_path / "policy"  # a checkpoint of the user's own (no build record)
    shutil.copytree(tiny_frozenlake, policy, ignore=shutil.ignore_patterns(BUILD_META))
    args = [x if x != "tiny" else str(policy) for x in ARGS]
    out = tmp_path / "e"
    rc, text = _stop_in_second_block(tmp_path, out, signal.SIGTERM, args)
    assert rc == 130, text

    error = _refusal(capsys)
    # the same command again would throw the saved block away: refused
    err = error([*args, "--output", str(out)])
    assert "holds an evaluation stopped before its last task; pass --resume" in err
    # flags that would change what is evaluated are refused on resume
    err = error(["eval", "--output", str(out), "--resume", "--samples", "3"])
    assert "with --samples 2, and --samples 3 would change it" in err
    err = error(["eval", "--output", str(out), "--resume", "--set", "eval.save_every=3"])
    assert "--set eval.save_every=3 would change it" in err
    # other weights at the same path: refused, nothing sampled
    weights = policy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    assert "holds other weights than those" in error(["eval", "--output", str(out), "--resume"])
    assert sorted(p.name for p in (out / "blocks").iterdir()) == ["block_00000", "plan.json"]


def test_resume_needs_a_stopped_evaluation(tmp_path, tiny_frozenlake, capsys):
    out = tmp_path / "e"
    assert main([*ARGS, "--output", str(out)]) == 0
    capsys.readouterr()
    assert main(["eval", "--output", str(out), "--resume"]) == 2
    assert "holds a finished evaluation: nothing to resume" in capsys.readouterr().err
    assert main(["eval", "--output", str(tmp_path / "none"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "is not an agentree evaluation directory, so there is nothing to resume" in err
    # a finished evaluation is replaced by a new one, nothing of it kept
    assert main([*ARGS[:6], "3", *ARGS[7:], "--output", str(out)]) == 0
    assert len(list((out / "trees").iterdir())) == 3


@pytest.mark.docker
def test_a_swe_evaluation_stopped_mid_episode_leaves_no_container_and_resumes(
    tmp_path, local_records
):
    out = tmp_path / "e"
    args = ["eval", "--env", "swebench", "--policy", "gold", "--tasks", "local"]
    args += ["--set", "eval.save_every=2"]
    flag = tmp_path / "flag"

    def holds_a_container() -> None:  # the episode really runs in Docker when it is stopped
        assert owned_by(flag.read_text())[0]

    rc, text = _stop_in_second_block(
        tmp_path, out, signal.SIGTERM, args, holds_a_container, PROBE_SWE_STEP="1"
    )
    assert rc == 130, text
    assert owned_by(flag.read_text()) == ([], [])  # nothing of it left running
    assert main(["eval", "--output", str(out), "--resume"]) == 0
    summary = json.loads((out / "eval.json").read_text())["summary"]
    assert (summary["tasks"], summary["resolved_rate"]) == (len(local_records), 1.0)
    predictions = (out / "predictions.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["instance_id"] for x in predictions) == sorted(
        r["instance_id"] for r in local_records
    )


def test_an_evaluation_of_one_block_is_the_training_evaluation_at_the_configs_seed(tmp_path):
    # 5 tasks, one block: what the trainer's held-out evaluation samples at the config's seed
    out = tmp_path / "e"
    one_block = [x for x in ARGS if x != "eval.save_every=2"]
    one_block.remove("--set")  # the one before eval.save_every=2 (all --set flags read alike)
    assert main([*one_block, "--output", str(out)]) == 0
    cfg = load_config(str(out / "config.yaml"))
    rt = Runtime(cfg, log=lambda _: None)
    try:
        tasks = rt.load_tasks(5, split="eval")
        trees = evaluate(rt, cfg, seed=cfg.seed, tasks=tasks, samples=2)["trees"]
    finally:
        rt.close()
    assert sorted(f.name for f in (out / "trees").iterdir()) == [
        f"{i:03d}_{t.task_id}.json" for i, t in enumerate(trees)
    ]
    actions = [[n.action for n in t.nodes] for t in trees]
    saved = [[n.action for n in Tree.load(f).nodes] for f in sorted((out / "trees").iterdir())]
    assert saved == actions


def test_a_stopped_rollout_is_neither_overwritten_nor_changed_on_resume(
    tmp_path, tiny_frozenlake, capsys
):
    out = tmp_path / "r"
    rc, text = _stop_in_second_block(tmp_path, out, signal.SIGTERM, ROLLOUT_ARGS)
    assert rc == 130, text

    error = _refusal(capsys)
    err = error([*ROLLOUT_ARGS, "--output", str(out)])
    assert "holds a rollout stopped before its last task; pass --resume" in err
    err = error([*ROLLOUT_ARGS[:8], "0", *ROLLOUT_ARGS[9:], "--output", str(tmp_path / "z")])
    assert err.endswith("--save-every 0: save a block every 1 task or more")
    assert not (tmp_path / "z").exists()
    err = error(["rollout", "--output", str(out), "--resume", "--tasks", "6"])
    assert "with --tasks 5, and --tasks 6 would change it" in err
    err = error(["rollout", "--output", str(out), "--resume", "--save-every", "3"])
    assert "with --save-every 2, and --save-every 3 would change it" in err
    err = error(["rollout", "--output", str(out), "--resume", "--rollout", "grpo"])
    assert "--rollout grpo would change it" in err
    assert sorted(p.name for p in (out / "blocks").iterdir()) == ["block_00000", "plan.json"]

    assert main(["rollout", "--output", str(out), "--resume"]) == 0
    assert "holds a finished rollout: nothing to resume" in error(
        ["rollout", "--output", str(out), "--resume"]
    )
    # a finished rollout is replaced by a new one, nothing of it kept (its page either)
    assert main(["view", str(out)]) == 0 and (out / "view.html").exists()
    assert main([*ROLLOUT_ARGS[:6], "3", *ROLLOUT_ARGS[7:], "--output", str(out)]) == 0
    assert len(list((out / "trees").iterdir())) == 3 and not (out / "view.html").exists()
    assert json.loads((out / "rollout_stats.json").read_text())["tasks"] == 3


def test_a_rollout_of_one_block_is_the_one_batch_it_always_was(tmp_path, tiny_frozenlake):
    # the default block (64 tasks) holds all 5: the rollout the runtime makes at the config's
    # seed, as `agentree rollout` sampled before it saved blocks
    out = tmp_path / "r"
    one_block = [*ROLLOUT_ARGS[:7], *ROLLOUT_ARGS[9:]]
    assert main([*one_block, "--output", str(out)]) == 0
    cfg = load_config(str(out / "config.yaml"))
    rt = Runtime(cfg, log=lambda _: None, tasks={"train": 5})
    try:
        trees, stats = rt.rollouts.rollout(rt.tasks["train"])
    finally:
        rt.close()
    saved = [Tree.load(f) for f in sorted((out / "trees").iterdir())]
    assert [t.task_id for t in saved] == [t.task_id for t in trees]
    assert [[n.action for n in t.nodes] for t in saved] == [
        [n.action for n in t.nodes] for t in trees
    ]
    assert json.loads((out / "rollout_stats.json").read_text())["forks"] == stats.forks > 0
