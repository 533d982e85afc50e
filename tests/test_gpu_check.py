"""The GPU machine's prepared scripts, run with small shapes on CPU so that they cannot rot
between the days a GPU is lent: `benchmarks/gpu_check.py` (engine, rollout, update, FSDP2),
`benchmarks/hf_decode.py` (where the transformers engine's decode time goes) and
`benchmarks/packing_break_even.py` (the `auto` layout rule's kappa)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import BENCHMARKS as BENCH

pytestmark = pytest.mark.slow


def run_script(name: str, tmp_path: Path, *args: str) -> tuple[str, dict]:
    """(stdout, the summary written to --out) of `benchmarks/<name>.py --device cpu`."""
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--device", "cpu", "--out", str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_gpu_check_runs_on_cpu_and_its_layouts_agree(tmp_path: Path, tiny_frozenlake) -> None:
    stdout, s = run_script("gpu_check", tmp_path)
    assert json.loads(stdout[stdout.index("{") :]) == s  # the one printed summary
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


def test_hf_decode_times_the_three_loops_and_profiles_the_engine(tmp_path: Path) -> None:
    _, s = run_script("hf_decode", tmp_path, "--tokens", "4")
    for batch in (1, 32):
        walls = s[f"batch{batch}_ms_per_step"]
        assert set(walls) == {"forward", "engine", "hf_generate"}
        assert all(v > 0 for v in walls.values())
    ops = {row["op"] for row in s["profile_top_self_cpu"]}
    assert any(op.startswith("aten::") for op in ops)


def test_packing_break_even_solves_the_cost_model_for_kappa(tmp_path: Path) -> None:
    _, s = run_script("packing_break_even", tmp_path, "--repeats", "1")
    length = s["row_tokens"]
    assert [p["total_tokens"] for p in s["points"]] == [512, 1024]
    for p in s["points"]:
        r, total = p["dense_s"] / p["rows_s"], p["total_tokens"]
        if p["kappa"] is None:
            assert r <= 1.0 + 1e-3
            continue
        # the kappa reported puts the measured ratio back into forward_cost's two prices
        k = p["kappa"]
        model_ratio = (1 + total / k) / (1 + length / (2 * k))
        assert model_ratio == pytest.approx(r, rel=2e-2)
