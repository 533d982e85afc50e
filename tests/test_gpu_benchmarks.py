"""The GPU machine's two profiling scripts, run with small shapes on CPU so that they cannot rot
between the days a GPU is lent: `benchmarks/hf_decode.py` (where the transformers engine's
decode time goes) and `benchmarks/packing_break_even.py` (the `auto` layout rule's kappa)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = pytest.mark.slow


def run_script(name: str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--device", "cpu", "--out", str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_hf_decode_times_the_three_loops_and_profiles_the_engine(tmp_path: Path) -> None:
    s = run_script("hf_decode", tmp_path, "--tokens", "4")
    for batch in (1, 32):
        walls = s[f"batch{batch}_ms_per_step"]
        assert set(walls) == {"forward", "engine", "hf_generate"}
        assert all(v > 0 for v in walls.values())
    ops = {row["op"] for row in s["profile_top_self_cpu"]}
    assert any(op.startswith("aten::") for op in ops)


def test_packing_break_even_solves_the_cost_model_for_kappa(tmp_path: Path) -> None:
    s = run_script("packing_break_even", tmp_path, "--repeats", "1")
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
