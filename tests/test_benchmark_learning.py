"""benchmarks/frozenlake_learning.py keeps its runs: a stopped one resumes, a finished one is
read and not run again, and two kept recipes pair seed by seed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BENCHMARKS, printed, stop_when

SMALL = [
    *("--set", "policy.path=tiny", "--set", "train.steps=2", "--set", "eval.tasks=2"),
    *("--set", "eval.samples=1", "--set", "train.tasks_per_step=2", "--set", "rollout.K=2"),
]


def bench(*args: str) -> list[str]:
    return [sys.executable, str(BENCHMARKS / "frozenlake_learning.py"), *args]


def finals(folder: Path, seeds: list[int]) -> list[float]:
    """Each kept run's last held-out success, in points, from its metrics."""
    out = []
    for s in seeds:
        rows = (folder / f"seed{s}" / "metrics.jsonl").read_text().splitlines()
        evals = [json.loads(r) for r in rows if "eval/success_rate" in r]
        out.append(100 * evals[-1]["eval/success_rate"])
    return out


@pytest.mark.slow
def test_kept_runs_resume_are_read_again_and_pair(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    # stopped (SIGTERM, as a scheduler stops it) once seed 0 trained its first step
    log = tmp_path / "stopped.log"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    argv = bench("--seeds", "0", "1", "--keep", str(a), *SMALL)
    code, output, left = stop_when(argv, scratch, printed(log, "step 1/2"), 300, log)
    assert code not in (-signal.SIGTERM, -signal.SIGKILL) and not left, output
    assert not (a / "seed0" / "summary.json").exists() and (a / "seed0" / "checkpoints").exists()
    # run again: seed 0 continues from its checkpoint, seed 1 starts
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
    rows = [json.loads(r) for r in (a / "seed0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]  # each step trained once
    assert (a / "seed1" / "summary.json").exists()
    # finished runs are read, not run again
    stamps = {s: (a / f"seed{s}" / "metrics.jsonl").stat().st_mtime_ns for s in (0, 1)}
    again = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
    assert again.stdout == done.stdout
    assert stamps == {s: (a / f"seed{s}" / "metrics.jsonl").stat().st_mtime_ns for s in (0, 1)}
    # another recipe on the same seeds, paired with the first
    other = [*SMALL, "--set", "train.lr=3e-4"]
    paired = subprocess.run(
        bench("--seeds", "0", "1", "--keep", str(b), *other, "--against", str(a)),
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    diffs = [x - y for x, y in zip(finals(b, [0, 1]), finals(a, [0, 1]), strict=True)]
    mean = (diffs[0] + diffs[1]) / 2
    assert f"per seed: 0:{diffs[0]:+.1f} 1:{diffs[1]:+.1f}; mean {mean:+.1f} +/- " in paired
