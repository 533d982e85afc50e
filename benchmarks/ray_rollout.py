"""Rollout throughput in-process vs on Ray with 1 and 2 rollout workers, in one run.

    python benchmarks/ray_rollout.py [--envs frozenlake,swebench] [--tasks 8] [--swe-tasks 2]
        [--workers 1,2] [--engine-replicas 1] [--rounds 3] [--threads 1]
        [--set key=value ...] [--json FILE]

For each env (FrozenLake with PATR + BFS scorer; SWE PATR on the bundled local suite, which
needs the local Docker images: `agentree swe build-local`) one runtime per mode is built on a
private Ray instance (actor start-up is reported and not timed), every mode does an untimed
warm-up rollout on other tasks, and then the timed rollouts of the same seeded tasks run
**interleaved**: round r rolls out in-process, then on Ray x1, then on Ray x2, so load from
other work on the machine falls on every mode alike. Reported per mode: the median over rounds
of the wall time, trajectories/s and env steps/s over all rounds, and the Ray cost relative
to in-process (by env steps/s, since sampled trees differ in size at temperature 1; pass
`--set engine.temperature=0` for identical trees).

Compute is held equal across modes: `--threads N` sets the driver's torch threads (the
in-process engine) and gives every Ray actor N CPUs (`distributed.worker_cpus` and
`engine_cpus`; Ray sets an actor's OMP/torch threads to its CPUs). Without it the in-process
engine would use every core while a 1-CPU engine actor uses one. `--engine-replicas 0` gives
each worker its own engine (no request hop); a list (`1,0`) measures both.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

CONFIGS = {"frozenlake": "frozenlake_patr", "swebench": "swebench_patr"}


def build(env: str, workers: int, replicas: int, args: argparse.Namespace) -> Any:
    from agentree.config import load_config
    from agentree.run.runtime import Runtime

    extra = []
    if workers:
        extra = [
            "distributed.backend=ray",
            f"distributed.rollout_workers={workers}",
            f"distributed.engine_replicas={replicas}",
            f"distributed.worker_cpus={args.threads}",
            f"distributed.engine_cpus={args.threads}",
        ]
    cfg = load_config(CONFIGS[env], overrides=[f"seed={args.seed}", *args.set, *extra])
    return Runtime(cfg, log=lambda m: None)


def run_env(env: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    modes = [("in-process", 0, 0)]
    for r in [int(x) for x in args.engine_replicas.split(",")]:
        for w in [int(x) for x in args.workers.split(",")]:
            label = f"ray x{w}" + ("" if r else " (engine per worker)")
            modes.append((label, w, r))
    runtimes: dict[str, Any] = {}
    startup: dict[str, float] = {}
    rows: dict[str, list[tuple[float, Any]]] = {m[0]: [] for m in modes}
    n = args.swe_tasks if env == "swebench" else args.tasks
    try:
        for label, w, r in modes:
            t0 = time.perf_counter()
            runtimes[label] = build(env, w, r, args)
            startup[label] = time.perf_counter() - t0
        first = runtimes["in-process"]
        tasks = first.load_tasks("local" if env == "swebench" else n + 2)
        if env == "swebench":
            first.env_cls.prepare_tasks(tasks, progress=lambda m: None, **first.env_kwargs)
            warm, bench = tasks[-1:], tasks[:n]
        else:
            warm, bench = tasks[n:], tasks[:n]
        for rt in runtimes.values():
            rt.rollouts.rollout(warm)
        for rnd in range(args.rounds):
            for label, rt in runtimes.items():
                t1 = time.perf_counter()
                _trees, stats = rt.rollouts.rollout(bench, rng=random.Random(args.seed + rnd))
                rows[label].append((time.perf_counter() - t1, stats))
    finally:
        for rt in runtimes.values():
            rt.close()
    out = []
    for label, w, _r in modes:
        got = rows[label]
        wall = sum(g[0] for g in got)
        trajs = sum(g[1].trajectories for g in got)
        steps = sum(g[1].env_steps for g in got)
        row = {
            "env": env,
            "mode": label,
            "threads": args.threads if w else torch.get_num_threads(),
            "startup_s": round(startup[label], 1),
            "tasks": len(bench) * len(got),
            "trajectories": trajs,
            "env_steps": steps,
            "median_wall_s": round(statistics.median(g[0] for g in got), 3),
            "trajectories_per_s": round(trajs / wall, 3),
            "env_steps_per_s": round(steps / wall, 2),
            "env_errors": sum(g[1].env_errors for g in got),
        }
        if w:
            last = got[-1][1].extra
            row["busy_frac"] = round(last.get("distributed/busy_frac", 0.0), 3)
            row["transfer_s"] = round(last.get("distributed/transfer_s", 0.0), 4)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", default="frozenlake,swebench")
    p.add_argument("--tasks", type=int, default=8, help="FrozenLake tasks per timed rollout")
    p.add_argument("--swe-tasks", type=int, default=2, help="local-suite SWE tasks per rollout")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--engine-replicas", default="1", help="comma list, e.g. 1,0")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds per mode")
    p.add_argument("--threads", type=int, default=1, help="torch threads / CPUs per actor")
    p.add_argument("--niceness", type=int, default=0, help="of Ray's worker processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from agentree.distributed.cluster import WORKER_NICENESS

    # Actors at the driver's priority (Ray's default is niceness 15); `--niceness 15` measures
    # what a cluster started without RAY_worker_niceness=0 gives.
    os.environ[WORKER_NICENESS] = str(args.niceness)
    import ray
    import torch

    torch.set_num_threads(args.threads)
    print(
        f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
        f"torch threads / CPUs per actor {args.threads}, Ray worker niceness {args.niceness}"
    )
    t0 = time.perf_counter()
    # Logical CPUs: every mode's actors stay up for the whole run (they mostly wait).
    ray.init(num_cpus=32, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    print(f"# private Ray instance started in {time.perf_counter() - t0:.1f}s")
    results = []
    try:
        for env in args.envs.split(","):
            results += run_env(env, args)
    finally:
        ray.shutdown()
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")
    print()
    print(
        "| env | mode | trajectories/s | env steps/s | vs in-process | median wall s | startup s |"
    )
    print("|---|---|---|---|---|---|---|")
    base: dict[str, float] = {}
    for r in results:
        if r["mode"] == "in-process":
            base[r["env"]] = r["env_steps_per_s"]
        rel = r["env_steps_per_s"] / base[r["env"]] if base.get(r["env"]) else float("nan")
        print(
            f"| {r['env']} | {r['mode']} | {r['trajectories_per_s']} | {r['env_steps_per_s']} "
            f"| {rel:.2f}x | {r['median_wall_s']} | {r['startup_s']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
