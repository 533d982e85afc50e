"""`agentree plot`: learning curves of one or more runs from their `metrics.jsonl`, overlaid.

One panel per quantity (held-out and training success, reward, env steps, forks, pruned
fraction, KL, policy tokens per second); each run is one line, named after its directory (or
`NAME=RUN_DIR`). A panel no run has data for is left out. Uses matplotlib's Agg backend, so it
works without a display.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def _ratio(num: str, den: str) -> Callable[[Row], float | None]:
    def f(row: Row) -> float | None:
        if num in row and row.get(den):
            return row[num] / row[den]
        return None

    return f


def _key(name: str) -> Callable[[Row], float | None]:
    return lambda row: row.get(name)


PANELS: list[tuple[str, str, Callable[[Row], float | None]]] = [
    ("held-out success", "eval/success_rate", _key("eval/success_rate")),
    ("training success", "train/success_rate", _key("train/success_rate")),
    ("reward (group mean)", "train/reward_mean", _key("train/reward_mean")),
    ("env steps per step", "rollout/env_steps", _key("rollout/env_steps")),
    ("forks per step", "rollout/forks", _key("rollout/forks")),
    ("pruned fraction", "train/pruned_frac", _key("train/pruned_frac")),
    ("KL to reference (k3)", "train/kl", _key("train/kl")),
    (
        "policy tokens / s (rollout)",
        "rollout/tokens_per_s",
        _ratio("rollout/policy_tokens_generated", "time/rollout_s"),
    ),
]
"""(title, series name, value of a metrics row or None)."""


def read_metrics(run_dir: Path) -> list[Row]:
    path = run_dir / "metrics.jsonl" if run_dir.is_dir() else run_dir
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: pass the directory of an `agentree train` run")
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash does not hide the rest of the run
    return rows


def series(rows: Sequence[Row]) -> dict[str, tuple[list[int], list[float]]]:
    """Each panel's (steps, values), in step order; a step's last value wins."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for _, name, value in PANELS:
        points: dict[int, float] = {}
        for row in rows:
            v = value(row)
            if isinstance(v, int | float) and not isinstance(v, bool):
                points[int(row.get("step", 0))] = float(v)
        if points:
            steps = sorted(points)
            out[name] = (steps, [points[s] for s in steps])
    return out


def _parse_run(spec: str) -> tuple[str, Path]:
    if "=" in spec and not Path(spec).exists():
        name, _, path = spec.partition("=")
        return name, Path(path)
    path = Path(spec)
    return path.resolve().name, path


def plot_runs(runs: Sequence[str], output: str | Path, *, smooth: int = 1) -> dict[str, list[str]]:
    """Write the figure to OUTPUT; returns run name -> the series drawn for it.

    `smooth` > 1 draws a trailing moving average over that many points (noisy per-step
    metrics), with the raw values faint behind it.
    """
    if not runs:
        raise ValueError("agentree plot needs at least one run directory")
    try:
        # deferred: matplotlib is the optional [view] extra
        import matplotlib
    except ImportError:
        raise ImportError(
            "agentree plot needs matplotlib, which is not installed; pip install 'agentree[view]'"
        ) from None

    matplotlib.use("Agg")
    # deferred: the [view] extra too, and pyplot is imported once the backend is chosen
    import matplotlib.pyplot as plt

    data = {}
    for spec in runs:
        name, path = _parse_run(spec)
        data[name] = series(read_metrics(path))
    panels = [p for p in PANELS if any(p[1] in s for s in data.values())]
    if not panels:
        raise ValueError(f"no known metrics in {', '.join(runs)}: is metrics.jsonl empty?")
    cols = min(4, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.1 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn: dict[str, list[str]] = {name: [] for name in data}
    for ax, (title, key, _) in zip(axes.flat, panels, strict=False):
        for i, (name, s) in enumerate(data.items()):
            if key not in s:
                continue
            x, y = s[key]
            c = colors[i % len(colors)]
            eval_like = key.startswith("eval/") or len(x) < 8
            if smooth > 1 and not eval_like:
                ax.plot(x, y, color=c, alpha=0.25, lw=1)
                y = _moving_average(y, smooth)
            ax.plot(x, y, color=c, lw=1.8, marker="o" if eval_like else None, ms=4, label=name)
            drawn[name].append(key)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("step", fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if "success" in key:
            ax.set_ylim(-0.02, 1.02)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat:
        h, lab = ax.get_legend_handles_labels()
        if len(lab) > len(labels):
            handles, labels = h, lab
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 6), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def _moving_average(y: Sequence[float], n: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(y):
        total += v
        if i >= n:
            total -= y[i - n]
        out.append(total / min(i + 1, n))
    return out


def add_plot_command(sub: Any) -> None:
    p = sub.add_parser("plot", help="learning curves of one or more runs (metrics.jsonl) as PNG")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or NAME=RUN_DIR)")
    p.add_argument("--output", required=True, help="image file to write (.png, .pdf, .svg)")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window (points)")
    p.set_defaults(func=_cmd_plot)


def _cmd_plot(args: Any) -> int:
    drawn = plot_runs(args.runs, args.output, smooth=args.smooth)
    for name, keys in drawn.items():
        print(f"{name}: {len(keys)} series")
    print(f"wrote {args.output}")
    return 0
