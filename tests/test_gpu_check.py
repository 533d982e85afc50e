"""`benchmarks/gpu_check.py --device cpu`: the GPU machine's prepared check, run with small
shapes so that it cannot rot between the days a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"

pytestmark = pytest.mark.slow


def test_gpu_check_runs_on_cpu_and_its_layouts_agree(tmp_path: Path, tiny_frozenlake) -> None:
    out = tmp_path / "summary.json"
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert json.loads(proc.stdout[proc.stdout.index("{") :]) == s  # the one printed summary
    assert s["device"] == "cpu" and s["shape"] == "small"
    gen = s["generation"]
    assert gen["batch1"]["generated_tokens"] >= 1 and gen["batch32"]["generated_tokens"] >= 32
    assert gen["batch32"]["tokens_per_s"] > 0
    assert s["patr"]["trajectories"] >= 2 and s["patr"]["forks"] > 0
    upd = s["grpo_update"]
    # the same tokens are trained either way; packing forwards the shared prefixes once
    assert upd["padded"]["policy_tokens"] == upd["tree"]["policy_tokens"] > 0
    assert upd["tree"]["forward_tokens"] < upd["padded"]["forward_tokens"]
    assert upd["grad_norm"] > 0 and upd["grads_equal"] and upd["grad_rel_diff"] < 2e-2
    fsdp = s["fsdp2"]
    assert fsdp["world_size"] == 1 and fsdp["policy_tokens"] == upd["padded"]["policy_tokens"]
    assert fsdp["grad_norm"] > 0
