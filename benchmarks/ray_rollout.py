"""Rollout throughput in-process vs on Ray with 1 and 2 rollout workers, in one run.

    python benchmarks/ray_rollout.py [--envs frozenlake,swebench] [--tasks 8] [--swe-tasks 2]
        [--workers 1,2] [--engine-replicas 1] [--repeats 1] [--set key=value ...]

For each env (FrozenLake with PATR + BFS scorer; SWE PATR on the bundled local suite, which
needs the local Docker images: `agentree swe build-local`) the same seeded tasks are rolled out
in-process and then through `distributed.backend=ray` on a private Ray instance started once
for the whole run (actor start-up is reported separately and not timed). Every mode first does
an untimed warm-up rollout on other tasks. Reported: trajectories/s and env steps/s per mode,
and the Ray overhead relative to in-process (by env steps/s, since sampled trees differ in
size between modes at temperature 1; pass `--set engine.temperature=0` for identical trees).
Numbers depend on the machine and its load (printed in the header).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

CONFIGS = {"frozenlake": "frozenlake_patr", "swebench": "swebench_patr"}


def run_mode(env: str, mode: str, workers: int, args: argparse.Namespace) -> dict[str, Any]:
    from agentree.config import load_config
    from agentree.runtime import Runtime

    extra = []
    if mode == "ray":
        extra = [
            "distributed.backend=ray",
            f"distributed.rollout_workers={workers}",
            f"distributed.engine_replicas={args.engine_replicas}",
        ]
    cfg = load_config(CONFIGS[env], overrides=[f"seed={args.seed}", *args.set, *extra])
    t0 = time.perf_counter()
    rt = Runtime(cfg, log=lambda m: None)
    startup = time.perf_counter() - t0
    n = args.swe_tasks if env == "swebench" else args.tasks
    try:
        tasks = rt.load_tasks("local" if env == "swebench" else n + 2)
        if env == "swebench":
            rt.env_cls.prepare_tasks(tasks, progress=lambda m: None, **rt.env_kwargs)
            warm, bench = tasks[-1:], tasks[:n]
        else:
            warm, bench = tasks[n:], tasks[:n]
        rt.rollout(warm)
        rows = []
        for _ in range(args.repeats):
            t1 = time.perf_counter()
            _trees, stats = rt.rollout(bench)
            rows.append((time.perf_counter() - t1, stats))
    finally:
        rt.close()
    wall = sum(r[0] for r in rows)
    trajs = sum(r[1].trajectories for r in rows)
    steps = sum(r[1].env_steps for r in rows)
    out = {
        "env": env,
        "mode": "in-process" if mode == "local" else f"ray x{workers}",
        "startup_s": round(startup, 1),
        "tasks": len(bench) * args.repeats,
        "trajectories": trajs,
        "env_steps": steps,
        "wall_s": round(wall, 2),
        "trajectories_per_s": round(trajs / wall, 3),
        "env_steps_per_s": round(steps / wall, 2),
        "env_errors": sum(r[1].env_errors for r in rows),
    }
    last = rows[-1][1].extra
    if mode == "ray":
        out["busy_frac"] = round(last.get("distributed/busy_frac", 0.0), 3)
        out["nodes"] = int(last.get("distributed/nodes", 0))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", default="frozenlake,swebench")
    p.add_argument("--tasks", type=int, default=8, help="FrozenLake tasks per timed rollout")
    p.add_argument("--swe-tasks", type=int, default=2, help="local-suite SWE tasks per rollout")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--engine-replicas", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    t0 = time.perf_counter()
    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    print(f"# private Ray instance started in {time.perf_counter() - t0:.1f}s")
    results = []
    try:
        for env in args.envs.split(","):
            modes = [("local", 0)] + [("ray", int(w)) for w in args.workers.split(",")]
            for mode, w in modes:
                r = run_mode(env, mode, w, args)
                results.append(r)
                print(json.dumps(r), flush=True)
    finally:
        ray.shutdown()
    print()
    print("| env | mode | trajectories/s | env steps/s | vs in-process | wall s | startup s |")
    print("|---|---|---|---|---|---|---|")
    base: dict[str, float] = {}
    for r in results:
        if r["mode"] == "in-process":
            base[r["env"]] = r["env_steps_per_s"]
        rel = r["env_steps_per_s"] / base[r["env"]] if base.get(r["env"]) else float("nan")
        print(
            f"| {r['env']} | {r['mode']} | {r['trajectories_per_s']} | {r['env_steps_per_s']} "
            f"| {rel:.2f}x | {r['wall_s']} | {r['startup_s']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
