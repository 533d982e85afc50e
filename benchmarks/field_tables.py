"""The tables of docs/results/field.md, printed as Markdown from a learning-efficiency run.

    python benchmarks/field_tables.py DIR --case frozenlake     # DIR/summary.json
    python benchmarks/field_tables.py DIR --case sokoban       # DIR/sokoban_summary.json

Reads the summary and the per-seed curves `benchmarks/learning_efficiency.py` wrote and prints
three tables: per method the seed-mean held-out success at every tenth step, the final success
with its standard error, env steps per step, env steps to flat GRPO's final, pass@4, forks and
train wall time per run; PATR minus each method per seed, in final success and (where the
summary has it) in held-out success averaged over the evaluations after step 0; and each
method's seed-mean success at equal env steps (interpolated linearly between evaluations, at
quarters of the smallest budget any method spent). `--runs LABEL` prints instead a row per
run, as the long-horizon page lists them:

    python benchmarks/field_tables.py DIR --case frozenlake8 --runs "FrozenLake 8x8"
    python benchmarks/field_tables.py DIR --case frozenlake8 --runs "FrozenLake 8x8" \
        --method "grpo, 32 tasks"                                  # a variant's own --out
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

NAMES = {
    "patr": "PATR",
    "tree-random": "Tree-Random",
    "grpo": "flat GRPO",
    "arpo": "ARPO",
    "gigpo": "GiGPO (flat groups)",
    "tree-grpo": "Tree-GRPO",
    "tree-grpo+grpo": "Tree-GRPO's tree + GRPO",
    "grpo+tree-grpo": "flat GRPO + Tree-GRPO's advantage",
    "tsr": "TSR (beam)",
    "patr+gigpo": "PATR + GiGPO",
}


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def interpolate(xs: list[float], ys: list[float], x: float) -> float | None:
    """y at x on the piecewise-linear curve through (xs, ys); None beyond its last point."""
    for i in range(len(xs) - 1):
        (x0, y0), (x1, y1) = (xs[i], ys[i]), (xs[i + 1], ys[i + 1])
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def main_table(summary: dict[str, Any], details: dict[str, Any]) -> list[str]:
    methods = summary["methods"]
    mean = details["mean"]
    steps = next(iter(mean.values()))["step"]  # every method's: the steps all seeds share
    shown = [s for s in steps if s % 10 == 0]
    head = " / ".join(str(s) for s in shown)
    out = [
        f"| method ({len(details['seeds'])} seeds) | held-out success, steps {head} "
        "| final ± SE | env steps per step | env steps to GRPO's final | pass@4 "
        "| forks per run | train wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, row in methods.items():
        curve = dict(zip(mean[m]["step"], mean[m]["success"], strict=True))
        se = row["final_success_se"]
        reach = row["env_steps_to_grpo_final"]
        reached = "not reached" if reach is None else f"{reach:,.0f}"
        out.append(
            f"| {NAMES.get(m, m)} | {' / '.join(pct(curve[s]) for s in shown)} "
            f"| {pct(row['final_success'])} ± {pct(se) if se is not None else '-'} "
            f"| {row['env_steps_per_step']:.0f} | {reached} "
            f"| {pct(row['pass_at_4'])}% | {row['forks']:,.0f} | {row['wall_s']:.0f} s |"
        )
    if details.get("walker_success") is not None:
        out.append(f"| random-valid-move walker | {pct(details['walker_success'])}% | | | | | | |")
    return out


def paired_table(summary: dict[str, Any], measure: str = "") -> list[str]:
    """PATR minus each method per seed: in final success, or with `measure="_mean_eval"` in
    each run's held-out success averaged over its evaluations after step 0."""
    out = [
        "| PATR − | per-seed differences (points) | mean ± SE | PATR wins / ties / losses |",
        "|---|---|---|---|",
    ]
    for m, p in summary.get("paired_patr_vs" + measure, {}).items():
        diffs = ", ".join(f"{100 * d:+.1f}".replace("-", "−") for d in p["diffs"])
        mu = f"{100 * p['mean']:+.1f}".replace("-", "−")
        se = f"{100 * p['se']:.1f}" if p["se"] is not None else "-"
        out.append(
            f"| {NAMES.get(m, m)} | {diffs} | {mu} ± {se} "
            f"| {p['wins']} / {p['ties']} / {p['losses']} |"
        )
    return out


def equal_budget_table(details: dict[str, Any]) -> list[str]:
    mean = details["mean"]
    last = min(c["budget"][-1] for c in mean.values())
    unit = 10 ** max(0, math.floor(math.log10(last)) - 1)  # two significant figures
    points = [round(last * q / 4 / unit) * unit for q in (1, 2, 3)]
    points.append(math.floor(last / unit) * unit)  # inside every curve
    out = [
        f"| {details['budget']} | " + " | ".join(NAMES.get(m, m) for m in mean) + " |",
        "|---|" + "---|" * len(mean),
    ]
    for x in points:
        cells = []
        for c in mean.values():
            y = interpolate(c["budget"], c["success"], x)
            cells.append("-" if y is None else pct(y))
        out.append(f"| {x:,.0f} | " + " | ".join(cells) + " |")
    return out


def runs_table(details: dict[str, Any], label: str, method: str | None = None) -> list[str]:
    """A row per run, as docs/results/long-horizon.md lists them: held-out success at every
    tenth step and the last, pass@4 at the last, train success over the first and last ten steps,
    trajectories a task and cut a step, informative groups a step, env steps and train wall
    time. Runs summarised before `read_curve` kept the training groups have no row. `method`
    names every run's method instead (a variant run under its own `--out`, such as GRPO at
    another number of tasks a step, so that `paired_rows.py` can tell its rows apart)."""

    def shown(steps: list[int]) -> list[bool]:  # every tenth step and the last
        return [s % 10 == 0 or i == len(steps) - 1 for i, s in enumerate(steps)]

    first = next(iter(details["per_seed"].values()))[0]["step"]
    tenths = " / ".join(str(s) for s, keep in zip(first, shown(first), strict=True) if keep)
    out = [
        f"| env | method | seed | held-out % at {tenths} | pass@4 at end | train success, first"
        " → last 10 steps | trajectories a task / cut a step | informative groups a step |"
        " env steps | wall |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, curves in details["per_seed"].items():
        for seed, c in zip(details["seeds"], curves, strict=True):
            train = c.get("train")
            if not train or not train["success"]:
                continue
            keep = shown(c["step"])
            held = [pct(y) for y, k in zip(c["success"], keep, strict=True) if k]
            held[-1] = f"**{held[-1]}**"
            ok, totals = train["success"], c["totals"]
            head, tail = ok[:10], ok[-10:]
            tasks = max(train["tasks"])
            out.append(
                f"| {label} | {method or m} | {seed} | {' / '.join(held)} | "
                f"{pct(c['pass_at_k'][-1])} | "
                f"{pct(sum(head) / len(head))} → {pct(sum(tail) / len(tail))} | "
                f"{sum(train['group_size']) / len(ok):.1f} / "
                f"{totals['budget_cut'] / max(totals['steps'], 1):.0f} | "
                f"{sum(train['informative']) / len(ok):.1f} of {tasks} | "
                f"{totals['env_steps']:,.0f} | {wall(totals['wall_s'])} |"
            )
    return out


def wall(seconds: float) -> str:
    """Train wall time in minutes, or in seconds under a minute."""
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.0f} min"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the benchmark's --out directory")
    ap.add_argument("--case", default="frozenlake")
    ap.add_argument("--runs", metavar="LABEL", help="print only the table of runs, env LABEL")
    ap.add_argument("--method", help="with --runs: the method's name in every row")
    args = ap.parse_args()
    name = "summary.json" if args.case == "frozenlake" else f"{args.case}_summary.json"
    summary = json.loads((args.out / name).read_text())
    details = json.loads((args.out / f"{args.case}_details.json").read_text())
    if args.runs:
        print("\n".join(runs_table(details, args.runs, args.method)))
        return
    tables = [main_table(summary, details), paired_table(summary)]
    if "paired_patr_vs_mean_eval" in summary:  # summaries written before it lack the area
        tables.append(paired_table(summary, "_mean_eval"))
    for table in tables:
        print("\n".join(table), end="\n\n")
    print("\n".join(equal_budget_table(details)))


if __name__ == "__main__":
    main()
