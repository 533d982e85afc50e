"""Stop a real `agentree eval` process between its blocks of tasks, then `--resume` it.

The evaluation runs under a small launcher that pauses inside the second block's sampling (the
first block saved, the second sampled but not saved) and drops a flag file; the test then sends
SIGTERM, SIGHUP or SIGKILL. Nothing is replaced: sampling, saving and resuming run for real.
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

LAUNCHER = textwrap.dedent(
    """
    import os, sys, threading, time
    from pathlib import Path

    import agentree.run.evaluation as evaluation
    from agentree.commands.cli import main

    FLAG = Path(os.environ["PROBE_FLAG"])
    evaluate, run_scripted = evaluation.evaluate, evaluation.run_scripted
    blocks = []
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


    def paused(*args, **kwargs):
        blocks.append(1)
        out = evaluate(*args, **kwargs)  # the block is sampled, not yet saved
        if len(blocks) == 2:
            pause()
        return out


    def counted(*args, **kwargs):
        blocks.append(1)
        return run_scripted(*args, **kwargs)


    evaluation.evaluate, evaluation.run_scripted = paused, counted
    if os.environ.get("PROBE_SWE_STEP"):  # pause in the second block's first env step instead
        from agentree.envs.swe.env import SWEEnv

        step = SWEEnv.step

        def paused_step(self, action):
            out = step(self, action)  # a container is running the episode
            if len(blocks) == 2:
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
    return signal_at_pause(
        argv, flag, sig, "the evaluation", at_pause, env=env, preexec_fn=interruptible
    )


def _results(out: Path) -> tuple[dict, dict[str, object]]:
    """eval.json and the trees, without the timings (the one thing two runs may differ in)."""
    body = json.loads((out / "eval.json").read_text())
    body["summary"].pop("wall_s")
    for item in body["per_task"]:
        item.pop("wall_s")
    trees = {}
    for f in sorted((out / "trees").iterdir()):
        tree = json.loads(f.read_text())
        for node in tree["nodes"]:
            node["info"].pop("step_s", None)
        trees[f.name] = tree
    return body, trees


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_a_stopped_evaluation_resumes_to_the_results_of_one_never_stopped(
    tmp_path, tiny_frozenlake, sig
):
    whole = tmp_path / "whole"
    assert main([*ARGS, "--output", str(whole)]) == 0
    assert not (whole / "blocks").exists()  # the blocks go once the results are written

    out = tmp_path / "stopped"
    rc, text = _stop_in_second_block(tmp_path, out, sig)
    assert rc == (-signal.SIGKILL if sig == signal.SIGKILL else 130), text
    if sig != signal.SIGKILL:
        said = "".join(text.split())  # the console wraps long lines, even inside paths
        assert "interruptedwith2of5taskssaved" in said, text
        assert f"continuewith:agentreeeval--output{out}--resume" in said, text
    # only the first block was saved: the second was sampled, not written
    assert sorted(p.name for p in (out / "blocks").iterdir()) == ["block_00000", "plan.json"]
    assert not (out / "eval.json").exists()

    assert main(["eval", "--output", str(out), "--resume"]) == 0
    assert not (out / "blocks").exists()
    assert _results(out) == _results(whole)


def test_a_stopped_evaluation_is_neither_overwritten_nor_changed_on_resume(
    tmp_path, tiny_frozenlake, capsys
):
    policy = tmp_path / "policy"  # a checkpoint of the user's own (no build record)
    shutil.copytree(tiny_frozenlake, policy, ignore=shutil.ignore_patterns(BUILD_META))
    args = [x if x != "tiny" else str(policy) for x in ARGS]
    out = tmp_path / "e"
    rc, text = _stop_in_second_block(tmp_path, out, signal.SIGTERM, args)
    assert rc == 130, text

    def error(argv: list[str]) -> str:
        capsys.readouterr()
        assert main(argv) == 2
        return capsys.readouterr().err.strip()

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
