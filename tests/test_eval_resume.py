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
from pathlib import Path

import pytest
from helpers import interruptible, signal_at_pause

from agentree.commands.cli import main
from agentree.hub.store import BUILD_META

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
    import os, sys, time
    from pathlib import Path

    import agentree.run.evaluation as evaluation
    from agentree.commands.cli import main

    FLAG = Path(os.environ["PROBE_FLAG"])
    evaluate = evaluation.evaluate
    calls = []


    def paused(*args, **kwargs):
        out = evaluate(*args, **kwargs)  # the block is sampled, not yet saved
        calls.append(1)
        if len(calls) == 2:
            FLAG.write_text("")
            go = FLAG.with_suffix(".go")
            for _ in range(1200):  # until the test has sent its signal
                if go.exists():
                    break
                time.sleep(0.1)
        return out


    evaluation.evaluate = paused
    sys.exit(main(sys.argv[1:]))
    """
)


def _stop_in_second_block(
    tmp_path: Path, out: Path, sig: int, args: list[str] = ARGS
) -> tuple[int, str]:
    flag = tmp_path / "flag"
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    argv = [sys.executable, str(launcher), *args, "--output", str(out)]
    env = {**os.environ, "PROBE_FLAG": str(flag)}
    return signal_at_pause(argv, flag, sig, "the evaluation", env=env, preexec_fn=interruptible)


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
