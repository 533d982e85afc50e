"""Do trees learn faster? Held-out success against rollout budget, from the warm-started policy.

FrozenLake (`--case frozenlake`): `patr`, `tree-random`, `grpo` and `arpo` trained from the
warm-started tiny policy (`policy.path: tiny-warm`, the default run's policy) on the same maps,
each with its group shaped to draw about the same env steps per optimiser step (flat GRPO's
G equals PATR's typical group size; ARPO's budget likewise). Plotted: held-out success against
cumulative env steps and against training wall time, mean and spread over seeds, with the
random-valid-move walker on the same held-out maps as a line.

Countdown (`--case countdown`): the token-level samplers `latr`, `treepo`, `eptree` against flat
`grpo`: held-out accuracy and pass@k against cumulative forward tokens (sampled plus prefilled).

Every (method, seed) is an ordinary `agentree train` run in a fresh process under
`DIR/<case>/<method>/seed<N>`; a finished run is reused, so an interrupted benchmark resumes.

    python benchmarks/learning_efficiency.py --seeds 0 1 2 --out DIR                # frozenlake
    python benchmarks/learning_efficiency.py --seeds 0 1 2 --out DIR --case countdown
    python benchmarks/learning_efficiency.py --seeds 0 --out DIR --steps 10 --eval-tasks 8

Writes `DIR/summary.json` (FrozenLake; `DIR/countdown_summary.json` for Countdown):
{"methods": {name: {"final_success": mean over seeds of the last held-out success,
"env_steps_to_grpo_final": env steps (tokens for Countdown) at which the seed-mean held-out
curve first reaches flat GRPO's final mean, or null}}}, the PNG curves `DIR/<case>_curves.png`,
and `DIR/<case>_details.json` with the per-seed curves and the walker's figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# Per-method settings on top of the case's base config. Budgets: PATR's default tree
# (B0=4, M=2, top-k=2, 10 turns) spends 22-35 env steps per 4x4 task from the warm policy
# (measured: 5-6 leaves of ~5.4 turns), so flat GRPO and ARPO draw G=6 trajectories.
CASES: dict[str, dict[str, Any]] = {
    "frozenlake": {
        "config": "frozenlake_patr",
        "methods": {
            "patr": [],
            "tree-random": ["--rollout", "tree-random"],
            "grpo": ["--rollout", "grpo", "--set", "rollout.G=6"],
            "arpo": ["--rollout", "arpo", "--set", "rollout.G=6"],
        },
        "budget": "rollout/env_steps",
        "xlabel": "env steps",
    },
    "countdown": {
        "config": "countdown_latr",
        # Countdown-3to4 (numbers to 99) is out of the tiny policy's reach: tiny-warm solves
        # none of it, so every curve would sit at 0. Two or three single-digit numbers and
        # targets to 30 (random well-formed guesses solve about 20%) leave it something to learn.
        "env": ["env.min_numbers=2", "env.max_numbers=3", "env.max_number=9", "env.max_target=30"],
        "methods": {
            "latr": [],
            "treepo": ["--rollout", "treepo"],
            "eptree": ["--rollout", "eptree"],
            "grpo": ["--rollout", "grpo", "--set", "rollout.G=8"],
        },
        "budget": ("rollout/policy_tokens_generated", "rollout/policy_tokens_prefilled"),
        "xlabel": "forward tokens (sampled + prefilled)",
    },
}


def run_one(case: str, method: str, seed: int, out: Path, args: argparse.Namespace) -> Path:
    """`agentree train` for one (method, seed); reuses a finished run."""
    run = out / case / method / f"seed{seed}"
    if (run / "summary.json").exists():
        return run
    if run.exists():  # an interrupted run: start it again from scratch
        import shutil

        shutil.rmtree(run)
    spec = CASES[case]
    cmd = [sys.executable, "-m", "agentree", "train", "--config", spec["config"]]
    cmd += spec["methods"][method]
    for item in spec.get("env", []):
        cmd += ["--set", item]
    cmd += ["--policy", "tiny-warm", "--steps", str(args.steps), "--output", str(run)]
    for item in [
        f"seed={seed}",
        f"train.tasks_per_step={args.tasks_per_step}",
        f"train.eval_every={args.eval_every}",
        f"eval.tasks={args.eval_tasks}",
        f"eval.samples={args.eval_samples}",
        "train.save_every=0",
        "train.trees_every=0",
        *args.set,
    ]:
        cmd += ["--set", item]
    print(f"[{time.strftime('%H:%M:%S')}] {case} {method} seed {seed}", flush=True)
    env = dict(os.environ)
    if args.jobs > 1:  # parallel runs share the cores: one thread each instead of oversubscribing
        env["OMP_NUM_THREADS"] = "1"
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    return run


def read_curve(run: Path, budget: str | tuple[str, ...]) -> dict[str, list[float]]:
    """Held-out points of a run: step, cumulative budget, cumulative train wall, success."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    keys = (budget,) if isinstance(budget, str) else budget
    spent, wall = {0: 0.0}, {0: 0.0}
    total = seconds = 0.0
    for r in rows:
        if "time/step_s" in r:
            total += sum(float(r.get(k, 0.0)) for k in keys)
            seconds += float(r["time/step_s"])
            spent[r["step"]], wall[r["step"]] = total, seconds
    curve: dict[str, list[float]] = {"step": [], "budget": [], "wall_s": [], "success": []}
    curve["pass_at_k"] = []
    for r in rows:
        if "eval/success_rate" in r:
            curve["step"].append(r["step"])
            curve["budget"].append(spent[r["step"]])
            curve["wall_s"].append(wall[r["step"]])
            curve["success"].append(r["eval/success_rate"])
            curve["pass_at_k"].append(r["eval/pass_at_k"])
    return curve


def mean_curve(curves: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Pointwise mean (and spread) over seeds, on the eval steps all seeds share."""
    n = min(len(c["step"]) for c in curves)
    out: dict[str, list[float]] = {"step": curves[0]["step"][:n]}
    for key in ("budget", "wall_s", "success", "pass_at_k"):
        cols = [[c[key][i] for c in curves] for i in range(n)]
        out[key] = [statistics.fmean(col) for col in cols]
        out[key + "_sd"] = [statistics.pstdev(col) for col in cols]
    return out


def first_reach(curve: dict[str, list[float]], target: float) -> float | None:
    """Budget at which the mean curve first reaches `target`."""
    for budget, success in zip(curve["budget"], curve["success"], strict=True):
        if success >= target - 1e-9:
            return budget
    return None


def summarise(case: str, seeds: list[int], out: Path, baseline: float | None) -> dict:
    spec = CASES[case]
    curves = {
        m: [read_curve(out / case / m / f"seed{s}", spec["budget"]) for s in seeds]
        for m in spec["methods"]
    }
    means = {m: mean_curve(c) for m, c in curves.items()}
    target = means["grpo"]["success"][-1]
    summary = {
        "methods": {
            m: {
                "final_success": statistics.fmean(c["success"][-1] for c in curves[m]),
                "env_steps_to_grpo_final": first_reach(means[m], target),
            }
            for m in spec["methods"]
        }
    }
    details = {
        "seeds": seeds,
        "grpo_final": target,
        "walker_success": baseline,
        "budget": spec["xlabel"],
        "mean": means,
        "per_seed": curves,
        "final_pass_at_k": {
            m: statistics.fmean(c["pass_at_k"][-1] for c in curves[m]) for m in curves
        },
    }
    (out / f"{case}_details.json").write_text(json.dumps(details, indent=1))
    plot(case, means, baseline, out)
    return summary


def plot(case: str, means: dict[str, dict[str, list[float]]], baseline: float | None, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = CASES[case]
    panels = [("budget", spec["xlabel"], "success"), ("wall_s", "train wall time (s)", "success")]
    if case == "countdown":
        panels = [("budget", spec["xlabel"], "success"), ("budget", spec["xlabel"], "pass_at_k")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (x, xlabel, y) in zip(axes, panels, strict=True):
        for m, c in means.items():
            lo = [a - b for a, b in zip(c[y], c[y + "_sd"], strict=True)]
            hi = [a + b for a, b in zip(c[y], c[y + "_sd"], strict=True)]
            ax.plot(c[x], c[y], marker="o", label=m)
            ax.fill_between(c[x], lo, hi, alpha=0.15)
        if baseline is not None and y == "success":
            ax.axhline(baseline, color="gray", linestyle="--", label="random-valid-move walker")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out " + ("accuracy" if case == "countdown" else "success"))
        if y == "pass_at_k":
            ax.set_ylabel("held-out pass@k")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{case}: mean over seeds, band = one standard deviation")
    fig.tight_layout()
    fig.savefig(out / f"{case}_curves.png", dpi=120)
    plt.close(fig)


def walker_baseline(seeds: list[int], args: argparse.Namespace) -> float:
    """The random-valid-move walker on the same held-out maps the runs evaluate on."""
    from agentree.config import load_config
    from agentree.envs.frozenlake import FrozenLakeEnv
    from agentree.models.warm import walker_success

    rates = []
    for seed in seeds:
        cfg = load_config("frozenlake_patr", overrides=[f"seed={seed}", *args.set])
        _, kwargs = cfg.component("env")
        tasks = FrozenLakeEnv.load_tasks(args.eval_tasks, seed=seed, split="eval")
        # at least 32 walks per map, as `agentree train` reports it: the walker costs no model
        # call, and a handful of walks would make the reference noisier than the curves
        samples = max(args.eval_samples, 32)
        rates.append(walker_success(kwargs, tasks, samples=samples, seed=seed))
    return statistics.fmean(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=[*CASES, "both"], default="frozenlake")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", required=True, help="output directory (reused runs are kept)")
    ap.add_argument("--steps", type=int, default=40, help="optimiser steps per run")
    ap.add_argument("--tasks-per-step", type=int, default=8, help="trees per optimiser step")
    ap.add_argument("--eval-every", type=int, default=10, help="held-out evaluation interval")
    ap.add_argument("--eval-tasks", type=int, default=32, help="held-out tasks per evaluation")
    ap.add_argument("--eval-samples", type=int, default=2, help="samples per held-out task")
    ap.add_argument("--methods", nargs="+", help="run only these methods (default: all)")
    ap.add_argument("--set", action="append", default=[], help="extra config override")
    ap.add_argument(
        "--jobs", type=int, default=1, help="runs at once (each then uses one torch thread)"
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for case in CASES if args.case == "both" else [args.case]:
        methods = args.methods or list(CASES[case]["methods"])
        t0 = time.perf_counter()
        runs = [(m, s) for m in methods for s in args.seeds]
        with ThreadPoolExecutor(args.jobs) as pool:
            for done in [pool.submit(run_one, case, m, s, out, args) for m, s in runs]:
                done.result()
        if set(CASES[case]["methods"]) - set(methods):
            continue  # a partial run: summarise once every method has finished
        baseline = walker_baseline(args.seeds, args) if case == "frozenlake" else None
        summary = summarise(case, args.seeds, out, baseline)
        name = "summary.json" if case == "frozenlake" else f"{case}_summary.json"
        (out / name).write_text(json.dumps(summary, indent=1))
        print(f"{case} ({time.perf_counter() - t0:.0f}s): {json.dumps(summary)}")
        if baseline is not None:
            print(f"random-valid-move walker on the same held-out maps: {100 * baseline:.1f}%")


if __name__ == "__main__":
    main()
