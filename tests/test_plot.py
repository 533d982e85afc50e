"""`agentree plot`: two runs' metrics.jsonl overlaid, one panel per quantity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentree.commands.cli import main
from agentree.commands.plot import plot_runs, series


def write_run(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(slope: float) -> list[dict]:
    out = [{"step": 0, "eval/success_rate": 0.1}]
    for s in range(1, 11):
        out.append(
            {
                "step": s,
                "train/success_rate": min(1.0, slope * s),
                "train/reward_mean": slope * s,
                "rollout/env_steps": 60 + s,
                "rollout/policy_tokens_generated": 400.0,
                "time/rollout_s": 2.0,
                "train/kl": 0.001 * s,
            }
        )
    out.append({"step": 10, "eval/success_rate": slope * 5})
    return out


def test_series_from_metrics_rows():
    s = series(rows(0.05))
    assert s["eval/success_rate"] == ([0, 10], [0.1, 0.25])
    assert s["rollout/tokens_per_s"][1] == [200.0] * 10  # 400 tokens / 2 s
    assert s["train/kl"][1][-1] == pytest.approx(0.01)
    assert "rollout/forks" not in s  # no data, no panel


def test_two_runs_overlaid(tmp_path: Path, capsys):
    a = write_run(tmp_path / "patr", rows(0.05))
    b = write_run(tmp_path / "grpo", rows(0.03))
    out = tmp_path / "curves.png"
    drawn = plot_runs([str(a), f"flat={b}"], out, smooth=3)
    expected = [
        "eval/success_rate",
        "train/success_rate",
        "train/reward_mean",
        "rollout/env_steps",
        "train/kl",
        "rollout/tokens_per_s",
    ]
    assert drawn == {"patr": expected, "flat": expected}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    h, w = matplotlib.image.imread(out).shape[:2]
    assert w > h > 300  # 6 panels in 2 rows of 4 columns

    assert main(["plot", str(a), str(b), "--output", str(tmp_path / "cli.png")]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "cli.png").exists()


def test_missing_metrics_is_one_clear_error(tmp_path: Path, capsys):
    assert main(["plot", str(tmp_path), "--output", str(tmp_path / "x.png")]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err
