"""vLLM vs the transformers engine on the same tree rollouts: throughput and prefix reuse.

    python benchmarks/engine_compare.py [--policy tiny|PATH] [--engines vllm,transformers]

For each engine: start-up time (policy load plus engine start), then the same seeded FrozenLake
tasks rolled out with PATR (paper defaults B0=4, M=2, top-k=2, K=5, BFS scorer) and with flat
GRPO (G=8 independent trajectories). Reported per rollout: trajectories/s, generated tokens/s,
prompt tokens prefilled vs served from the prefix cache, and the hit rate
cached / (cached + prefilled). For vLLM these counts are vLLM's own per-request
`num_cached_tokens`; for the transformers engine, its prefix KV cache. A warm-up rollout on
other tasks runs first and is not counted.

`--policy PATH` takes a real checkpoint (e.g. a Qwen2.5 instruct model on a GPU machine);
`--set key=value` passes config overrides (e.g. engine.vllm.gpu_memory_utilization=0.5).
Numbers depend on the machine and its load (printed in the header).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def run_engine(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    from agentree.config import load_config
    from agentree.rollout.base import make_controller
    from agentree.run.runtime import Runtime

    cfg = load_config(
        "frozenlake_patr",
        select={"policy": args.policy},
        overrides=[f"engine.backend={backend}", f"seed={args.seed}", *args.set],
    )
    t0 = time.perf_counter()
    rt = Runtime(cfg, log=lambda m: None)
    startup = time.perf_counter() - t0
    out: dict[str, Any] = {"engine": backend, "startup_s": round(startup, 2)}
    try:
        tasks = rt.load_tasks(args.tasks + 2)
        warm, bench = tasks[:2], tasks[2:]
        controllers = {
            "patr": rt.controller,
            "grpo": make_controller("grpo", G=args.group),
        }
        for name, ctrl in controllers.items():
            ctrl.rollout(warm, rt.rollouts.context())
            rt.engine.seed(args.seed)
            before = rt.engine.stats.snapshot()
            t1 = time.perf_counter()
            trees, stats = ctrl.rollout(bench, rt.rollouts.context())
            wall = time.perf_counter() - t1
            after = rt.engine.stats.snapshot()
            trajs = sum(len(ctrl.group(t)) for t in trees)
            gen = after["tokens_generated"] - before["tokens_generated"]
            pre = after["tokens_prefilled"] - before["tokens_prefilled"]
            cached = after["tokens_cached"] - before["tokens_cached"]
            out[name] = {
                "wall_s": round(wall, 2),
                "trajectories": trajs,
                "trajectories_per_s": round(trajs / wall, 2),
                "tokens_generated": gen,
                "tokens_per_s": round(gen / wall, 1),
                "tokens_prefilled": pre,
                "tokens_cached": cached,
                "prefix_hit_rate": round(cached / max(cached + pre, 1), 3),
                "engine_calls": after["calls"] - before["calls"],
                "env_steps": stats.env_steps,
            }
    finally:
        rt.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="tiny", help="tiny (built locally) or a checkpoint")
    ap.add_argument("--engines", default="vllm,transformers")
    ap.add_argument("--tasks", type=int, default=8, help="tasks per measured rollout")
    ap.add_argument("--group", type=int, default=8, help="G of the flat GRPO rollout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--output", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    load = os.getloadavg()
    print(f"cpus={os.cpu_count()} load average={load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    results = [run_engine(e.strip(), args) for e in args.engines.split(",") if e.strip()]
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    cols = ["wall_s", "trajectories_per_s", "tokens_per_s", "tokens_prefilled", "tokens_cached"]
    print(f"{'engine':13} {'start_s':>8} {'rollout':8} " + " ".join(f"{c:>18}" for c in cols))
    for r in results:
        for name in ("patr", "grpo"):
            row = r[name]
            vals = " ".join(f"{row[c]:>18}" for c in cols)
            print(f"{r['engine']:13} {r['startup_s']:>8} {name:8} {vals}")
        hit = "  ".join(f"{n}={r[n]['prefix_hit_rate']:.1%}" for n in ("patr", "grpo"))
        print(f"{'':13} prefix-cache hit rate: {hit}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"load_before": load, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
