"""PATR vs flat GRPO on generated SWE tasks: held-out resolved rate against env steps.

Runs `agentree train --env swebench` from the warm SWE policy once per (rollout, seed) in a
subprocess, exactly as a user would, with a held-out evaluation after every step. While a run
goes, the Docker daemon is polled for the containers that process owns (peak container count).
Afterwards each run directory gives: held-out resolved rate per step against cumulative env
steps, the steps whose training episodes resolved a task (non-zero reward) and the updates that
learned from a reward (a kept group whose rewards differ, and a non-zero gradient; the KL term
alone moves the weights a little on every step after the first), forks, scorer calls, and
sandbox seconds per env step (from the saved trees).

Sized for a 2-core machine by default (one task per step, small trees, short episodes); the
knobs are flags and `--set` overrides. With `--keep DIR` a run is resumable: a finished run
(`DIR/<rollout>-seed<N>/bench.json`) is reused, and one stopped after a checkpoint continues
with `agentree train --resume` (runs save every step), so a long comparison survives
Ctrl-C, a reboot or a session's end.

    agentree swe generate --n 200 --output gen/tasks.jsonl
    POLICY=$(agentree swe warm --tasks gen/tasks.train.jsonl | tail -n 1)
    python benchmarks/swe_learning.py --tasks gen/tasks --policy $POLICY --seeds 0 1
    POLICY=$(agentree swe warm --tasks gen/tasks.train.jsonl --policy smollm2-135m | tail -n 1)
    python benchmarks/swe_learning.py --tasks gen/tasks --policy $POLICY \
        --config swebench_patr_smollm2 --max-tokens 96 --keep runs/swe-rl      # resumable
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agentree.signals import Children, interrupt_on_sigterm

ROLLOUT_SETS = {
    # PATR: B0 branches, advance K turns, expand top_k by M children each (forking containers)
    "patr": ["rollout.B0=2", "rollout.K=2", "rollout.M=2", "rollout.top_k=1"],
    # flat GRPO: G independent episodes, no forking
    "grpo": ["rollout.G=4"],
}


_RUNS = Children()
"""The runs' `agentree train` processes, started on the pool's threads."""


def _watch_containers(pid: int, stop: threading.Event, peak: list[int]) -> None:
    """Peak number of live containers labelled as owned by process `pid`."""
    from agentree.envs.swe import runtime

    api = runtime.client().api
    flt = {"label": f"{runtime.OWNER}={socket.gethostname()}:{pid}"}
    while not stop.wait(1.0):
        with contextlib.suppress(Exception):  # the daemon is busy: try again next tick
            peak[0] = max(peak[0], len(api.containers(filters=flt)))


def run(rollout: str, seed: int, out: Path, args: argparse.Namespace, heldout: Path) -> dict:
    """One (rollout, seed) run: reused when finished, resumed from its last checkpoint when
    stopped after one, started afresh otherwise."""
    if (out / "bench.json").exists():
        return json.loads((out / "bench.json").read_text())
    if (out / "checkpoints").exists():  # the saved config.yaml holds every setting below
        print(f"resuming {out}", flush=True)
        cmd = [sys.executable, "-m", "agentree", "train", "--output", str(out), "--resume"]
        return _finish(rollout, seed, out, cmd, resume=True)
    if out.exists():  # stopped before its first checkpoint: nothing to keep
        shutil.rmtree(out)
    cmd = [
        sys.executable, "-m", "agentree", "train", "--config", args.config,
        "--rollout", rollout, "--scorer", args.scorer, "--policy", args.policy,
        "--tasks", f"{args.tasks}.train.jsonl", "--steps", str(args.steps),
        "--output", str(out),
    ]  # fmt: skip
    sets = [
        f"seed={seed}",
        f"eval.tasks={heldout}",
        f"eval.samples={args.samples}",
        f"train.eval_every={args.eval_every}",
        "train.tasks_per_step=1",
        "train.trees_every=1",
        "train.save_every=1",  # a stopped run resumes from its last step (2 checkpoints kept)
        f"env.step_limit={args.step_limit}",
        f"engine.max_tokens={args.max_tokens}",
        *ROLLOUT_SETS[rollout],
        *args.set,
    ]
    for s in sets:
        cmd += ["--set", s]
    return _finish(rollout, seed, out, cmd, resume=False)


def _finish(rollout: str, seed: int, out: Path, cmd: list[str], *, resume: bool) -> dict:
    """Run `cmd` (an `agentree train` into `out`) while counting its containers, then read the
    run directory into the benchmark's figures, kept in `out/bench.json`."""
    stop, peak = threading.Event(), [0]
    t0 = time.perf_counter()

    def watch(proc: subprocess.Popen) -> None:
        args = (proc.pid, stop, peak)
        threading.Thread(target=_watch_containers, args=args, daemon=True).start()

    try:
        rc = _RUNS.run(cmd, started=watch)  # the main thread stops it if the benchmark stops
    finally:
        stop.set()
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"agentree train ({rollout}, seed {seed}) failed with exit code {rc}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps, curve, env_steps = 0, [], 0.0
    totals = {"forks": 0.0, "scorer_calls": 0.0, "env_steps": 0.0, "train_s": 0.0}
    rewarded = updates = 0  # steps whose episodes resolved something; that learned from rewards
    for r in rows:
        if "rollout/env_steps" in r:
            steps += 1
            rewarded += r.get("train/success_rate", 0.0) > 0
            # a policy-gradient update: some kept group's rewards differed and the gradient
            # moved the weights (a step without one still moves them a little, by the KL term
            # alone)
            informative = r.get("train/groups_informative", 0) > 0
            updates += informative and r.get("train/grad_norm", 0.0) > 0
            totals["train_s"] += r.get("time/step_s", 0.0)
            env_steps += r["rollout/env_steps"]
            totals["env_steps"] += r["rollout/env_steps"]
            totals["forks"] += r.get("rollout/forks", 0.0)
            totals["scorer_calls"] += r.get("scorer/calls", 0.0)
        if "eval/success_rate" in r:
            curve.append((int(env_steps), r["eval/success_rate"], r.get("eval/pass_at_k")))
    sandbox = _sandbox_seconds(out / "trees")
    result = {
        "rollout": rollout,
        "seed": seed,
        "wall_s": round(wall, 1),  # of this process only, when resumed
        "resumed": resume,
        "curve": curve,
        "steps": steps,
        "rewarded_steps": rewarded,
        "updates": updates,
        **totals,
        "sandbox_s_per_env_step": sandbox,
        "peak_containers": peak[0],
    }
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    return result


def _sandbox_seconds(trees: Path) -> float | None:
    """Mean seconds a command ran in the sandbox per env step, over the saved training trees."""
    times = []
    for f in trees.rglob("*.json"):
        for node in json.loads(f.read_text()).get("nodes", []):
            info = node.get("info")
            if isinstance(info, str):
                try:
                    info = ast.literal_eval(info)
                except (ValueError, SyntaxError):
                    continue
            env = (info or {}).get("env") or {}
            if "elapsed" in env:
                times.append(float(env["elapsed"]))
    return round(sum(times) / len(times), 3) if times else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", required=True, help="generated tasks path without .jsonl")
    ap.add_argument("--policy", required=True, help="the warm SWE policy directory")
    ap.add_argument(
        "--config",
        default="swebench_patr",
        help="the runs' config (swebench_patr_smollm2 for a SmolLM2 policy: its context size)",
    )
    ap.add_argument("--rollouts", nargs="+", default=["patr", "grpo"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=2, help="optimiser steps per run")
    ap.add_argument("--scorer", default="heuristic", help="process scorer (heuristic, prm, ...)")
    ap.add_argument("--eval-every", type=int, default=1, help="held-out evaluation interval")
    ap.add_argument("--heldout-n", type=int, default=8, help="held-out tasks evaluated")
    ap.add_argument("--samples", type=int, default=1, help="held-out samples per task")
    ap.add_argument("--step-limit", type=int, default=12, help="actions per episode")
    ap.add_argument("--max-tokens", type=int, default=160, help="tokens per action")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument(
        "--parallel",
        action="store_true",
        help="run all (rollout, seed) at once (two SmolLM2 runs need more than 23 GB of memory)",
    )
    ap.add_argument("--keep", help="keep run directories under this folder")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="agentree-bench-") as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        held = Path(f"{args.tasks}.heldout.jsonl").read_text().splitlines()[: args.heldout_n]
        heldout = root / "heldout.jsonl"
        heldout.write_text("\n".join(held) + "\n")
        jobs = [(r, s) for s in args.seeds for r in args.rollouts]
        # --parallel runs every (rollout, seed) at once: on a shared machine the wall time
        # then measures contention, so compare env steps, forks and resolved rates instead
        with ThreadPoolExecutor(len(jobs) if args.parallel else 1) as pool:
            futures = [
                pool.submit(run, r, s, root / f"{r}-seed{s}", args, heldout) for r, s in jobs
            ]
            try:
                results = [f.result() for f in futures]
            except BaseException:  # Ctrl-C or `kill`: the runs checkpoint before the pool ends
                pool.shutdown(wait=False, cancel_futures=True)  # no run starts after this
                _RUNS.stop()
                raise
    head = f"{'rollout':>7} {'seed':>4} {'wall':>6} {'env steps':>9} {'forks':>5} {'scorer':>6}"
    head += f" {'rewarded':>8} {'updates':>7} {'sandbox/step':>12} {'containers':>10}"
    print(head + "  held-out resolved (env steps: %)")
    for r in results:
        curve = " ".join(f"{s}:{100 * v:.0f}%" for s, v, _ in r["curve"])
        sb = r["sandbox_s_per_env_step"]
        print(
            f"{r['rollout']:>7} {r['seed']:>4} {r['wall_s']:>5.0f}s {r['env_steps']:>9.0f} "
            f"{r['forks']:>5.0f} {r['scorer_calls']:>6.0f} "
            f"{r.get('rewarded_steps', '?'):>8} {r.get('updates', '?'):>7} "
            f"{'-' if sb is None else f'{sb:.2f}s':>12} {r['peak_containers']:>10}  {curve}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    with interrupt_on_sigterm():  # `kill` stops the runs (they resume) as Ctrl-C does
        main()
