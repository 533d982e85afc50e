"""PATR tree rollouts vs flat GRPO sampling at equal final group size, on the same tasks.

For every task, PATR builds its tree first; flat sampling then draws exactly as many independent
trajectories for that task as PATR's group holds. Reported per completed trajectory: env steps
(a tree simulates each shared prefix once), forks, policy tokens generated and prefilled (prompt
tokens the model actually computed; prefix-cache hits excluded).

    python benchmarks/rollout_compare.py --tasks 20            # tiny policy, CPU
    python benchmarks/rollout_compare.py --policy PATH --set engine.max_tokens=512
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from agentree.config import load_config
from agentree.rollout.base import RolloutStats
from agentree.rollout.turn.flat import FlatConfig, FlatGRPO
from agentree.run.runtime import Runtime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="frozenlake_patr")
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--policy", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    cfg = load_config(args.config, select={"policy": args.policy}, overrides=args.set)
    rt = Runtime(cfg, log=lambda s: None)
    tasks = rt.load_tasks(args.tasks, split="eval")
    try:
        rt.engine.seed(args.seed)
        rt.engine.sync_weights(rt.model)  # cold prefix cache for a fair start
        trees, patr = rt.rollouts.rollout(tasks)
        sizes = [len(rt.controller.group(t)) for t in trees]
        by_size: dict[int, list] = defaultdict(list)
        for task, g in zip(tasks, sizes, strict=True):
            by_size[g].append(task)
        rt.engine.sync_weights(rt.model)
        flat = RolloutStats()
        t0 = time.perf_counter()
        for g, group_tasks in sorted(by_size.items()):
            if g:
                _, st = FlatGRPO(FlatConfig(G=g)).rollout(group_tasks, rt.rollouts.context())
                flat.add(st)
        flat.wall_s = time.perf_counter() - t0
    finally:
        rt.close()

    rows = {"patr": patr.to_dict(), "grpo": flat.to_dict()}
    keys = ["env_steps", "forks", "policy_tokens_generated", "policy_tokens_prefilled"]
    print(
        f"{len(tasks)} tasks, {patr.trajectories} trajectories each way "
        f"(group sizes {min(sizes)}..{max(sizes)}, mean {sum(sizes) / len(sizes):.2f})"
    )
    print(f"{'per trajectory':<28}{'patr':>10}{'grpo':>10}{'patr/grpo':>11}")
    for k in keys:
        a, b = rows["patr"]["per_trajectory"][k], rows["grpo"]["per_trajectory"][k]
        ratio = f"{a / b:.2f}" if b else "-"
        print(f"{k:<28}{a:>10.1f}{b:>10.1f}{ratio:>11}")
    print(f"{'wall_s (total)':<28}{patr.wall_s:>10.1f}{flat.wall_s:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tasks": len(tasks), "group_sizes": sizes, **rows}, f, indent=1)


if __name__ == "__main__":
    main()
