"""Do trees learn faster? Held-out success against rollout budget, from the warm-started policy.

FrozenLake 4x4 (`--case frozenlake`), Sokoban 6x6 with one box (`--case sokoban`, or
`--env sokoban`) and the long-horizon configs from low-success warm starts (`--case
frozenlake8`, `sokoban2`, `babyai`): `patr`, `tree-random`, `grpo`, `arpo`, `gigpo` (GiGPO's
advantage over flat groups, as published), `tree-grpo` (Tree-GRPO's tree and intra+inter-tree
advantage), `tree-grpo+grpo` (Tree-GRPO's tree, GRPO's advantage over each task's leaves: the
inter-tree term alone), `grpo+tree-grpo` (flat groups, Tree-GRPO's advantage: GRPO's plus r for
each trajectory, the intra-tree term of a one-trajectory tree), `tsr` (TSR's beam search,
optimiser unchanged) and `patr+gigpo` (PATR's tree, GiGPO's advantage), trained from the env's
warm-started tiny policy (`policy.path: tiny-warm`) on the same maps.

Budgets are matched in env steps per optimiser step, not in group sizes: B is the env steps
PATR's default tree spends per task and E the warm policy's episode length (turns per
trajectory), and every method's group is sized to spend about B per task (`sized_methods`:
flat methods G = B / E; Tree-GRPO M chains plus M N half-length expansions, M = B / (E (1 + N
L / 2)); TSR's beam W beams x N candidates per turn, W = B / (N E)). Both are measured from
the warm start before the first run (`calibrate`: one `agentree rollout` of PATR's tree and
one of flat episodes on `--calibrate` training tasks), kept in `DIR/<case>/sizing.json` so a
resumed benchmark sizes its groups the same; `--budget` and `--turns` set them by hand. The
sizes only set how many trajectories each method runs at a time: every method also gets
`rollout.env_step_budget=B`, so each rollout spends exactly B env steps per task (at most one
episode fewer) however long episodes get as the policy learns; the branches live when it ends
are cut, which leans groups towards short episodes (`--budget-reserve` starts only what the
budget can finish instead: `rollout.budget_reserve`). Truncation is safe only where failures
end early: on Sokoban 7x7, whose failures all run to the turn limit, it cut every failure of
flat GRPO's groups at the calibrated budget, which then trained on successes alone. The
summary says which rule its runs used (read from each run's saved config; runs under
different rules are refused, not mixed), the branches cut per step, and the
env steps each method drew per step, and budgets are compared on the x axis:
`env_steps_to_grpo_final` is the cumulative env steps at which a method's seed-mean held-out
curve first reaches flat GRPO's final value (null for every method when GRPO's seed-mean final
is not above its starting value: that target is met before any training).

Countdown (`--case countdown`): the token-level samplers `latr`, `treepo`, `eptree` against flat
`grpo`: held-out accuracy and pass@k against cumulative forward tokens (sampled plus prefilled).

Every (method, seed) is an ordinary `agentree train` run in a fresh process under
`DIR/<case>/<method>/seed<N>`; a finished run (its `summary.json`) is reused and an
unfinished one continues with `--resume` (its saved config, whatever the flags now say) from
the checkpoint it wrote when the benchmark was stopped (Ctrl-C or SIGTERM; from the start if
it has none), drawing what it would have drawn uninterrupted, so an interrupted benchmark
resumes where it stopped; a run killed outright resumes from its checkpoint of every fifth
step. A run's console output, every segment's, is `seed<N>.log` beside it, and shows here
as it comes (each line prefixed with its method and seed under `--jobs` > 1).
Seeds need not stay on disk to be summarised: `--earlier X_details.json` adds the per-seed
curves of an earlier summary (its `X_summary.json` beside it) to the runs here, and refuses one
trained under another budget rule or from other warm weights, one that lacks a method, and a
seed given twice.
Seeds change the training and held-out maps and the sampling; the warm start is the same
build for every seed, so per-seed results pair up across methods.

    python benchmarks/learning_efficiency.py --seeds 0 1 2 3 4 --out DIR             # frozenlake
    python benchmarks/learning_efficiency.py --seeds 0 1 2 3 4 --out DIR --env sokoban
    python benchmarks/learning_efficiency.py --seeds 0 1 2 3 4 --out DIR --case frozenlake8 \
        --steps 60                                           # long horizon: 8x8, 16 turns
    python benchmarks/learning_efficiency.py --seeds 0 --out DIR --steps 2 --eval-every 1 \
        --eval-tasks 4 --methods grpo gigpo                                             # smoke

Writes `DIR/summary.json` (FrozenLake; `DIR/<case>_summary.json` otherwise):
{"methods": {name: {"final_success": mean over seeds of the last held-out success,
"final_success_se": its standard error over seeds, "env_steps_to_grpo_final": env steps
(tokens for Countdown) at which the seed-mean held-out curve first reaches flat GRPO's final
mean, or null (also when GRPO did not learn: "grpo_learned": false), "pass_at_4",
"mean_eval_success": mean over seeds of each run's held-out success averaged over its
evaluations after step 0 (the area under its curve; `--area-every K` keeps those at multiples
of K, listed in "area_steps"), "mean_eval_success_se", "env_steps_per_step",
"budget_cut_per_step", "forks", "wall_s", "seeds", "advantage": the estimator the runs'
configs name}}, "paired_vs_grpo": {name: per-seed differences in final success, their mean,
standard error and wins/ties/losses},
"paired_patr_vs": {name: the same for PATR minus that method}, "paired_vs_grpo_mean_eval" and
"paired_patr_vs_mean_eval": the same for the area,
"sizing": {"budget_per_task": B, "turns": E}, "budget": {"env_step_budget": N,
"budget_reserve": bool} as the runs' configs say, "warm_start": the warm build's cache key,
"warm_start_sha256": the sha256 of its weights}, the PNG
curves `DIR/<case>_curves.png`, and `DIR/<case>_details.json`
with the per-seed curves and the walker's figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentree.signals import Children, with_hangup


def sized_methods(budget: float, turns: float) -> dict[str, list[str]]:
    """Each method's CLI settings, sized to spend about `budget` env steps per task when a
    trajectory takes about `turns` turns (see the module docstring for the formulas)."""
    g = max(2, round(budget / turns))
    n, steps = 2, 1  # Tree-GRPO: N expansions per tree per iteration, L iterations
    m = max(1, round(budget / (turns * (1 + n * steps / 2))))
    width = max(1, round(budget / (2 * turns)))  # TSR beam: 2 candidates per beam and turn
    flat = ["--rollout", "grpo", "--set", f"rollout.G={g}"]
    tree_grpo = ["--rollout", "tree-grpo", "--set", f"rollout.M={m}", "--set", f"rollout.N={n}"]
    tree_grpo += ["--set", f"rollout.L={steps}"]
    methods = {
        "patr": [],
        "tree-random": ["--rollout", "tree-random"],
        "grpo": flat,
        "arpo": ["--rollout", "arpo", "--set", f"rollout.G={g}"],
        "gigpo": [*flat, "--set", "train.advantage=gigpo"],
        "tree-grpo": [*tree_grpo, "--set", "train.advantage=treegrpo"],
        "tree-grpo+grpo": [*tree_grpo, "--set", "train.advantage=grpo"],
        "grpo+tree-grpo": [*flat, "--set", "train.advantage=treegrpo"],
        "tsr": [
            "--rollout",
            "tsr",
            "--set",
            "rollout.mode=beam",
            "--set",
            f"rollout.width={width}",
            "--set",
            "rollout.N=2",
        ],
        "patr+gigpo": ["--set", "train.advantage=gigpo"],
    }
    exact = ["--set", f"rollout.env_step_budget={max(1, round(budget))}"]
    return {name: [*args, *exact] for name, args in methods.items()}


# `budget_per_task` and `turns` are the fallbacks of `calibrate --calibrate 0`. FrozenLake's were
# read from an earlier warm policy (5-6 PATR leaves of ~5.4 turns); from the warm start of the
# five-seed run episodes ran about 4 turns and PATR drew 18.5 env steps per task, so flat G=6
# drew 32% more than PATR: hence the calibration.
CASES: dict[str, dict[str, Any]] = {
    "frozenlake": {
        "config": "frozenlake_patr",
        "budget_per_task": 32,
        "turns": 5.4,
        "budget": "rollout/env_steps",
        "xlabel": "env steps",
    },
    "sokoban": {
        "config": "sokoban_patr",
        "budget_per_task": 48,
        "turns": 8.0,
        "budget": "rollout/env_steps",
        "xlabel": "env steps",
    },
    # the long-horizon configs, from low-success warm starts (docs/results/long-horizon.md)
    "frozenlake8": {
        "config": "frozenlake8_patr",
        "budget_per_task": 64,
        "turns": 12.0,
        "budget": "rollout/env_steps",
        "xlabel": "env steps",
    },
    "sokoban2": {
        "config": "sokoban2_patr",
        "budget_per_task": 56,
        "turns": 12.0,
        "budget": "rollout/env_steps",
        "xlabel": "env steps",
    },
    "babyai": {
        "config": "babyai_patr",
        "budget_per_task": 128,
        "turns": 30.0,
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


def methods_of(case: str, args: argparse.Namespace) -> dict[str, list[str]]:
    spec = CASES[case]
    if "methods" in spec:
        return spec["methods"]
    return sized_methods(*sizing_of(case, args))


def sizing_of(case: str, args: argparse.Namespace) -> tuple[float, float]:
    """(B, E): set by hand, else calibrated, else the case's fixed estimates."""
    spec = CASES[case]
    sizing = getattr(args, "sizing", {}).get(case) or {}
    budget = args.budget or sizing.get("budget_per_task") or spec["budget_per_task"]
    return budget, args.turns or sizing.get("turns") or spec["turns"]


def calibrate(case: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """B (PATR's env steps per task) and E (turns per flat episode), measured from the warm
    start on the first `args.calibrate` training tasks of seed 0, or read back from an earlier
    calibration of this benchmark directory."""
    path = out / case / "sizing.json"
    if path.exists():
        return json.loads(path.read_text())
    spec = CASES[case]
    stats = {}
    for name, extra in (("patr", []), ("flat", ["--rollout", "grpo", "--set", "rollout.G=4"])):
        # beside the runs rather than in /tmp: a stopped benchmark exits at once (`stop_runs`)
        rollouts = out / case / f"calibration-{name}"
        shutil.rmtree(rollouts, ignore_errors=True)  # a stopped calibration's
        cmd = [sys.executable, "-m", "agentree", "rollout", "--config", spec["config"], *extra]
        for item in [*spec.get("env", []), "seed=0", *args.set]:
            cmd += ["--set", item]
        cmd += ["--policy", "tiny-warm", "--tasks", str(args.calibrate), "--output", str(rollouts)]
        print(f"[{time.strftime('%H:%M:%S')}] {case} calibration: {name}", flush=True)
        RUNS.run(cmd, check=True, stdout=subprocess.DEVNULL)
        stats[name] = json.loads((rollouts / "rollout_stats.json").read_text())
        shutil.rmtree(rollouts)
    sizing = {
        "budget_per_task": stats["patr"]["env_steps"] / args.calibrate,
        "turns": stats["flat"]["env_steps"] / stats["flat"]["trajectories"],
        "tasks": args.calibrate,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sizing, indent=1))
    return sizing


def train_command(
    case: str, method: str, seed: int, run: Path, args: argparse.Namespace
) -> list[str]:
    """The `agentree train` command of one (method, seed) from the warm start."""
    spec = CASES[case]
    cmd = [sys.executable, "-m", "agentree", "train", "--config", spec["config"]]
    cmd += methods_of(case, args)[method]
    for item in spec.get("env", []):
        cmd += ["--set", item]
    cmd += ["--policy", "tiny-warm", "--steps", str(args.steps), "--output", str(run)]
    for item in [
        f"seed={seed}",
        f"train.tasks_per_step={args.tasks_per_step}",
        f"train.eval_every={args.eval_every}",
        f"eval.tasks={args.eval_tasks}",
        f"eval.samples={args.eval_samples}",
        "train.save_every=5",  # a run killed outright (no SIGTERM) loses at most 5 steps
        "train.trees_every=0",
        *args.set,
    ]:
        cmd += ["--set", item]
    return cmd


def run_one(case: str, method: str, seed: int, out: Path, args: argparse.Namespace) -> Path:
    """`agentree train` for one (method, seed); reuses a finished run."""
    run = out / case / method / f"seed{seed}"
    if (run / "summary.json").exists():
        return run
    if (run / "config.yaml").exists():  # interrupted: continue from the checkpoint its stop wrote
        cmd = [sys.executable, "-m", "agentree", "train", "--output", str(run), "--resume"]
    else:
        cmd = train_command(case, method, seed, run, args)
    env = dict(os.environ)
    if args.jobs > 1:  # parallel runs share the cores: one thread each instead of oversubscribing
        env["OMP_NUM_THREADS"] = "1"
    run.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{time.strftime('%H:%M:%S')}] {case} {method} seed {seed}", flush=True)
    run_train(cmd, run, f"{method} seed {seed}: " if args.jobs > 1 else "", env)
    return run


def run_train(cmd: list[str], run: Path, prefix: str, env: dict[str, str]) -> None:
    """`cmd` (an `agentree train` into `run`) to the end, as a child that a stopping benchmark
    stops and waits for (`stop_runs`), its output copied to `run`'s log and here (`echo`)."""
    mine: list[subprocess.Popen] = []

    def copy_output(proc: subprocess.Popen) -> None:
        copier = threading.Thread(
            target=echo, args=(proc, run.with_suffix(".log"), prefix), daemon=True
        )
        _ECHO[proc] = (run, copier)
        mine.append(proc)
        copier.start()

    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    try:
        RUNS.run(cmd, check=True, started=copy_output, env=env, errors="replace", **popen)
    finally:
        for proc in mine:  # kept in `_ECHO`: a stop names the runs it killed from there
            _ECHO[proc][1].join()
            proc.stdout.close()  # the copier read it to the end; one pipe a run otherwise


def echo(proc: subprocess.Popen, log_path: Path, prefix: str) -> None:
    """A run's console output (its stdout and stderr, where `agentree train` reports) appended
    to its log, every segment's, line by line, and shown here too (`prefix`ed when runs share
    the console)."""
    with open(log_path, "a", buffering=1) as log:
        for line in proc.stdout:
            log.write(line)
            sys.stdout.write(prefix + line)
            sys.stdout.flush()


RUNS = Children()
"""The runs and calibrations in flight, started on pool threads. A benchmark stopped by Ctrl-C
or SIGTERM stops them and waits for them to exit (`stop_runs`), so that a resumed benchmark
never restarts a run whose old process still writes to it."""
_ECHO: dict[subprocess.Popen, tuple[Path, threading.Thread]] = {}  # each run's directory, copier
STOP_GRACE_S = 120
"""How long a stopped run may take to checkpoint. A run honours SIGTERM within seconds unless
it is inside an optimiser step or a checkpoint write; one still running after this is killed."""


def stop_runs(signum: int, _frame: Any) -> None:
    """The benchmark's Ctrl-C, SIGTERM and SIGHUP: stop the runs, each allowed `STOP_GRACE_S`
    to checkpoint, and exit; the same command resumes them."""
    live, killed = RUNS.stop(STOP_GRACE_S)
    for proc in killed:
        run = _ECHO[proc][0] if proc in _ECHO else Path(proc.args[-1])
        print(
            f"{run} did not checkpoint within {STOP_GRACE_S} s of SIGTERM and was killed; "
            f"it resumes from its last checkpoint (see {run.with_suffix('.log')})",
            flush=True,
        )
    for _run, thread in list(_ECHO.values()):  # the runs' last lines (where each stopped)
        thread.join(timeout=5)
    print(f"stopped {len(live)} run(s); run the same command again to resume", flush=True)
    os._exit(128 + signum)


TRAIN_KEYS = (
    "train/group_size",
    "train/success_rate",
    "train/groups_informative",
    "rollout/trajectories",
)


def read_curve(run: Path, budget: str | tuple[str, ...]) -> dict[str, Any]:
    """Held-out points of a run (step, cumulative budget and train wall, success, pass@k)
    and its totals: env steps, forks, optimiser steps, train wall time, and the training
    groups (`train`: per step, the success rate, trajectories a task and informative groups
    of the step's tasks)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    keys = (budget,) if isinstance(budget, str) else budget
    spent, wall = {0: 0.0}, {0: 0.0}
    total = seconds = env_steps = forks = cut = 0.0
    steps = 0
    train: dict[str, list[float]] = {k: [] for k in ("success", "group_size", "informative")}
    train["tasks"] = []  # the step's tasks: its trajectories over the mean group size
    for r in rows:
        if "time/step_s" in r:
            total += sum(float(r.get(k, 0.0)) for k in keys)
            seconds += float(r["time/step_s"])
            env_steps += float(r.get("rollout/env_steps", 0.0))
            forks += float(r.get("rollout/forks", 0.0))
            cut += float(r.get("rollout/budget_cut", 0.0))
            steps += 1
            spent[r["step"]], wall[r["step"]] = total, seconds
            if all(k in r for k in TRAIN_KEYS):  # rows of older runs may lack some
                size = float(r["train/group_size"])
                train["success"].append(float(r["train/success_rate"]))
                train["group_size"].append(size)
                train["informative"].append(float(r["train/groups_informative"]))
                train["tasks"].append(round(float(r["rollout/trajectories"]) / size))
    curve: dict[str, Any] = {"step": [], "budget": [], "wall_s": [], "success": []}
    curve["pass_at_k"] = []
    for r in rows:
        if "eval/success_rate" in r:
            curve["step"].append(r["step"])
            curve["budget"].append(spent.get(r["step"], total))
            curve["wall_s"].append(wall.get(r["step"], seconds))
            curve["success"].append(r["eval/success_rate"])
            curve["pass_at_k"].append(r["eval/pass_at_k"])
    curve["totals"] = {
        "env_steps": env_steps,
        "forks": forks,
        "budget_cut": cut,
        "steps": steps,
        "wall_s": seconds,
    }
    curve["train"] = train
    return curve


def budget_rule(
    runs: list[Path], earlier: list[tuple[str, dict[str, Any] | None]] = ()
) -> dict[str, Any] | None:
    """The env-step budget and its rule (`rollout.env_step_budget`, `rollout.budget_reserve`)
    the runs were trained under, read from their saved configs, and those `earlier` summaries
    (path, their "budget") recorded; None when none says. Runs under different rules measure
    different things, so a mix is refused."""
    # deferred: the config module is only needed once runs are summarised
    from agentree.config import load_config

    rules: dict[tuple[Any, bool], list[str]] = {}
    for path, rule in earlier:
        if rule is not None:
            rules.setdefault((rule["env_step_budget"], rule["budget_reserve"]), []).append(path)
    for run in runs:
        if (run / "config.yaml").exists():
            rollout = load_config(str(run / "config.yaml")).rollout
            rule = (rollout.get("env_step_budget"), bool(rollout.get("budget_reserve")))
            rules.setdefault(rule, []).append(str(run))
    if len(rules) > 1:
        seen = "; ".join(
            f"env_step_budget={b}, budget_reserve={r}: {', '.join(paths)}"
            for (b, r), paths in rules.items()
        )
        raise SystemExit(
            f"these runs were trained under different budgets and cannot be summarised "
            f"together ({seen}); give each rule its own --out"
        )
    if not rules:
        return None
    ((budget, reserve),) = rules
    return {"env_step_budget": budget, "budget_reserve": reserve}


def trained_advantage(runs: list[Path]) -> str | None:
    """The advantage estimator (`train.advantage`) a method's runs were trained with, read from
    their saved configs (a `--set train.advantage=...` replaces the method's own), None when no
    run has a config; runs of one method trained with different estimators are refused."""
    # deferred: the config module is only needed once runs are summarised
    from agentree.config import load_config

    names = {
        str(run): load_config(str(run / "config.yaml")).train.advantage
        for run in runs
        if (run / "config.yaml").exists()
    }
    if len(set(names.values())) > 1:
        raise SystemExit(
            f"these runs of one method were trained with different advantage estimators "
            f"({names}); give each its own --out"
        )
    return next(iter(names.values()), None)


def mean_curve(curves: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Pointwise mean (and spread) over seeds, on the eval steps all seeds share."""
    steps = sorted(set.intersection(*(set(c["step"]) for c in curves)))
    at = [{step: i for i, step in enumerate(c["step"])} for c in curves]
    out: dict[str, list[float]] = {"step": steps}
    for key in ("budget", "wall_s", "success", "pass_at_k"):
        cols = [[c[key][a[step]] for c, a in zip(curves, at, strict=True)] for step in steps]
        out[key] = [statistics.fmean(col) for col in cols]
        out[key + "_sd"] = [statistics.pstdev(col) for col in cols]
    return out


def first_reach(curve: dict[str, list[float]], target: float) -> float | None:
    """Budget at which the mean curve first reaches `target`."""
    for budget, success in zip(curve["budget"], curve["success"], strict=True):
        if success >= target - 1e-9:
            return budget
    return None


def mean_se(xs: list[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (sample std / sqrt(n); None for one value)."""
    mu = statistics.fmean(xs)
    return mu, (statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else None)


def paired(a: list[float], b: list[float]) -> dict[str, Any]:
    """Per-seed differences a - b (same seeds: same warm start and held-out maps)."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mu, se = mean_se(diffs)
    return {
        "diffs": diffs,
        "mean": mu,
        "se": se,
        "wins": sum(d > 0 for d in diffs),
        "ties": sum(d == 0 for d in diffs),
        "losses": sum(d < 0 for d in diffs),
    }


def area_steps(curve: dict[str, Any], every: int | None) -> list[int]:
    """The evaluations a run's area is taken over: those after step 0 whose step is a multiple
    of `every` (all of them when None)."""
    steps = [s for s in curve["step"] if s > 0 and (every is None or s % every == 0)]
    if not steps:
        raise SystemExit(f"no held-out evaluation after step 0 at a multiple of {every}")
    return steps


def mean_eval(curve: dict[str, Any], every: int | None) -> float:
    """A run's held-out success averaged over its evaluations after step 0 (`area_steps`): the
    area under its curve, which counts how early a method learns as well as where it ends."""
    at = dict(zip(curve["step"], curve["success"], strict=True))
    return statistics.fmean(at[s] for s in area_steps(curve, every))


@dataclass
class Earlier:
    """Runs summarised before and no longer on disk (`--earlier`): their per-seed curves by
    method, and what their summaries say they were run under, to be checked against the runs
    summarised with them."""

    curves: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    walker: list[tuple[float, int]] = field(default_factory=list)  # (walker's mean, its seeds)
    budgets: list[tuple[str, Any]] = field(default_factory=list)
    warm_starts: list[tuple[str, Any]] = field(default_factory=list)


def load_earlier(paths: list[Path], methods: list[str]) -> Earlier:
    """The per-seed curves of earlier summaries of this benchmark, each given as the
    `<...>details.json` it wrote with its `<...>summary.json` beside it, so that seeds run on
    another day (or machine) are summarised with today's without keeping their run directories.
    Each must hold every method summarised, and no seed may come from two places."""
    earlier = Earlier(curves={m: {} for m in methods})
    for path in paths:
        if "details" not in path.name:
            raise SystemExit(f"--earlier takes a benchmark's details file, not {path}")
        details = json.loads(path.read_text())
        # `<case>_details.json` sits beside `<case>_summary.json` (FrozenLake 4x4's: `summary.json`)
        beside = [
            path.with_name(path.name.replace("details", "summary")),
            path.with_name("summary.json"),
        ]
        found = [p for p in beside if p.exists()]
        if not found:
            raise SystemExit(f"{path} has no summary beside it ({beside[0].name})")
        summary = json.loads(found[0].read_text())
        missing = sorted(set(methods) - set(details["per_seed"]))
        if missing:
            raise SystemExit(f"{path} holds no runs of {missing}: its seeds would not pair up")
        for m in methods:
            for seed, curve in zip(details["seeds"], details["per_seed"][m], strict=True):
                if seed in earlier.curves[m]:
                    raise SystemExit(f"seed {seed} of {m} is in two --earlier files")
                earlier.curves[m][seed] = curve
        if details.get("walker_success") is not None:
            earlier.walker.append((details["walker_success"], len(details["seeds"])))
        earlier.budgets.append((str(path), summary.get("budget")))
        earlier.warm_starts.append((str(path), summary.get("warm_start_sha256")))
    return earlier


def summarise(
    case: str,
    methods: list[str],
    seeds: list[int],
    out: Path,
    baseline: float | None,
    area_every: int | None = None,
    earlier: Earlier | None = None,
) -> dict:
    spec = CASES[case]
    runs = [out / case / m / f"seed{s}" for m in methods for s in seeds]
    rule = budget_rule(runs, earlier.budgets if earlier is not None else [])
    kept = {
        m: {s: read_curve(out / case / m / f"seed{s}", spec["budget"]) for s in seeds}
        for m in methods
    }
    if earlier is not None:
        for m in methods:
            again = sorted(set(kept[m]) & set(earlier.curves[m]))
            if again:
                raise SystemExit(f"seeds {again} of {m} are both kept and in an --earlier file")
            kept[m].update(earlier.curves[m])
    seeds = sorted(next(iter(kept.values())))
    curves = {m: [kept[m][s] for s in seeds] for m in methods}
    means = {m: mean_curve(c) for m, c in curves.items()}
    # GRPO's final value is a target only if GRPO learned: a final at or below the shared
    # starting point is "reached" by every curve before any training, at 0 env steps
    grpo = means.get("grpo")
    learned = grpo is not None and grpo["success"][-1] > grpo["success"][0] + 1e-9
    target = grpo["success"][-1] if learned else None
    rows: dict[str, Any] = {}
    # each run's final success and its area (`mean_eval`), compared per seed below
    finals = {m: [c["success"][-1] for c in cs] for m, cs in curves.items()}
    areas = {m: [mean_eval(c, area_every) for c in cs] for m, cs in curves.items()}
    for m, cs in curves.items():
        mu, se = mean_se(finals[m])
        area, area_se = mean_se(areas[m])
        steps = sum(c["totals"]["steps"] for c in cs)
        rows[m] = {
            "final_success": mu,
            "final_success_se": se,
            "mean_eval_success": area,
            "mean_eval_success_se": area_se,
            "env_steps_to_grpo_final": None if target is None else first_reach(means[m], target),
            "pass_at_4": statistics.fmean(c["pass_at_k"][-1] for c in cs),
            "env_steps_per_step": sum(c["totals"]["env_steps"] for c in cs) / max(steps, 1),
            "budget_cut_per_step": sum(c["totals"]["budget_cut"] for c in cs) / max(steps, 1),
            "env_steps": statistics.fmean(c["totals"]["env_steps"] for c in cs),
            "forks": statistics.fmean(c["totals"]["forks"] for c in cs),
            "wall_s": statistics.fmean(c["totals"]["wall_s"] for c in cs),
            "seeds": seeds,
            "advantage": trained_advantage([out / case / m / f"seed{s}" for s in seeds]),
        }
    summary: dict[str, Any] = {"methods": rows}
    summary["area_steps"] = area_steps(next(iter(curves.values()))[0], area_every)
    if rule is not None:
        summary["budget"] = rule
    if grpo is not None:
        summary["grpo_learned"] = learned
    for suffix, of in {"": finals, "_mean_eval": areas}.items():
        if "grpo" in of:
            summary["paired_vs_grpo" + suffix] = {
                m: paired(xs, of["grpo"]) for m, xs in of.items() if m != "grpo"
            }
        if "patr" in of:  # the method this project proposes, against each of the others
            summary["paired_patr_vs" + suffix] = {
                m: paired(of["patr"], xs) for m, xs in of.items() if m != "patr"
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


def walker_baseline(case: str, seeds: list[int], args: argparse.Namespace) -> float | None:
    """The random(-valid-move) walker on the same held-out maps the runs evaluate on."""
    from agentree.config import load_config
    from agentree.models.warm import walker_baseline as reference

    if case == "countdown":
        return None
    rates = []
    for seed in seeds:
        cfg = load_config(CASES[case]["config"], overrides=[f"seed={seed}", *args.set])
        cfg = cfg.model_copy(
            update={"eval": cfg.eval.model_copy(update={"tasks": args.eval_tasks})}
        )
        # at least 32 walks per map, as `agentree train` reports it: the walker costs no model
        # call, and a handful of walks would make the reference noisier than the curves
        rate = reference(cfg)
        if rate is not None:
            rates.append(rate)
    return statistics.fmean(rates) if rates else None


def warm_start(run: Path) -> tuple[str, str | None]:
    """The cached warm build a run started from: its content key (everything it was built from)
    and the sha256 of its weights (one key has built different weights on different machines),
    so that results from different warm starts are not read as one."""
    # deferred: agentree.policy imports the model code, which only the summary needs here
    from agentree.config import load_config
    from agentree.hub.store import weights_sha256
    from agentree.policy import resolve_policy

    path = resolve_policy(load_config(str(run / "config.yaml")), log=lambda _: None)
    return Path(path).name, weights_sha256(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", "--env", choices=[*CASES, "all"], default="frozenlake")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--out", required=True, help="output directory (reused runs are kept)")
    ap.add_argument("--steps", type=int, default=40, help="optimiser steps per run")
    ap.add_argument("--tasks-per-step", type=int, default=8, help="trees per optimiser step")
    ap.add_argument("--eval-every", type=int, default=5, help="held-out evaluation interval")
    ap.add_argument("--eval-tasks", type=int, default=32, help="held-out tasks per evaluation")
    ap.add_argument("--eval-samples", type=int, default=4, help="samples per held-out task")
    ap.add_argument("--budget", type=float, help="env steps per task each method is sized to")
    ap.add_argument(
        "--calibrate",
        type=int,
        default=16,
        help="training tasks the sizing is measured on (0: the case's fixed estimates)",
    )
    ap.add_argument("--turns", type=float, help="expected turns per trajectory, for sizing")
    ap.add_argument("--methods", nargs="+", help="run only these methods (default: all)")
    ap.add_argument("--set", action="append", default=[], help="extra config override")
    ap.add_argument(
        "--budget-reserve",
        action="store_true",
        help="start only the trajectories the env-step budget can finish (rollout.budget_reserve)"
        " instead of cutting those live when it ends",
    )
    ap.add_argument(
        "--area-every",
        type=int,
        help="take each run's mean held-out success (its area) over the evaluations after"
        " step 0 at multiples of this step (default: all of them)",
    )
    ap.add_argument(
        "--jobs", type=int, default=1, help="runs at once (each then uses one torch thread)"
    )
    ap.add_argument(
        "--earlier",
        type=Path,
        nargs="+",
        default=[],
        help="details files of earlier summaries (their summary beside each) whose seeds are"
        " summarised with these runs' (same methods, budget rule and warm start)",
    )
    args = ap.parse_args()
    if args.budget_reserve:
        args.set.append("rollout.budget_reserve=true")
    for sig in with_hangup(signal.SIGINT, signal.SIGTERM):  # and a closed terminal
        signal.signal(sig, stop_runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.sizing = {}
    for case in CASES if args.case == "all" else [args.case]:
        sized = "methods" not in CASES[case] and not (args.budget and args.turns)
        if sized and args.calibrate:
            # on a thread, as the runs: a stop's handler (`stop_runs`, on the main thread) then
            # never finds the main thread holding the lock under which children are started
            with ThreadPoolExecutor(1) as pool:
                args.sizing[case] = pool.submit(calibrate, case, out, args).result()
            print(f"{case} sizing: {json.dumps(args.sizing[case])}", flush=True)
        known = list(methods_of(case, args))
        methods = args.methods or known
        unknown = set(methods) - set(known)
        if unknown:
            raise SystemExit(f"{case} has no method {sorted(unknown)}; choose from {known}")
        t0 = time.perf_counter()
        # seed by seed: an interrupted benchmark leaves whole seeds, paired across methods
        runs = [(m, s) for s in args.seeds for m in methods]
        with ThreadPoolExecutor(args.jobs) as pool:
            for done in [pool.submit(run_one, case, m, s, out, args) for m, s in runs]:
                done.result()
        key, sha256 = warm_start(out / case / methods[0] / f"seed{args.seeds[0]}")
        earlier = load_earlier(args.earlier, methods)
        for path, theirs in earlier.warm_starts:
            if theirs != sha256:
                raise SystemExit(
                    f"{path} started from warm weights {theirs}, these runs from {sha256}: "
                    "results from different warm starts are not summarised together"
                )
        baseline = walker_baseline(case, args.seeds, args)
        if baseline is not None and earlier.walker:  # each a mean over its seeds' maps
            walks = [(baseline, len(args.seeds)), *earlier.walker]
            baseline = sum(w * n for w, n in walks) / sum(n for _, n in walks)
        summary = summarise(case, methods, args.seeds, out, baseline, args.area_every, earlier)
        if "methods" not in CASES[case]:
            budget, turns = sizing_of(case, args)
            summary["sizing"] = {"budget_per_task": budget, "turns": turns}
        summary["warm_start"] = key
        summary["warm_start_sha256"] = sha256
        name = "summary.json" if case == "frozenlake" else f"{case}_summary.json"
        (out / name).write_text(json.dumps(summary, indent=1))
        print(f"{case} ({time.perf_counter() - t0:.0f}s): {json.dumps(summary)}")
        if baseline is not None:
            print(f"random walker on the same held-out maps: {100 * baseline:.1f}%")


if __name__ == "__main__":
    main()
