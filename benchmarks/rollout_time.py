"""Wall time of rollout calls, and the env time inside them.

Builds the config's runtime, draws `--tasks` held-out tasks and runs `--repeats` rollout calls
after a warm-up, each from the same engine seed with a cold prefix cache. For each it reports
the wall time, the env steps, their summed seconds (each node's `step_s`: the env's own time,
run `env_workers` at a time), the policy tokens generated and a digest of every node's action
and reward, which says whether two checkouts did the same work. Compare two checkouts by
running the same command with `PYTHONPATH=OTHER_CHECKOUT`, on a quiet machine.

    python benchmarks/rollout_time.py --config swebench_grpo_smollm2 --tasks 2 \
        --set env.step_limit=4                      # SmolLM2-135M in Docker sandboxes
    python benchmarks/rollout_time.py --config frozenlake_patr --tasks 16
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

from agentree.config import load_config
from agentree.run.runtime import Runtime
from agentree.signals import interrupt_on_sigterm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="frozenlake_patr")
    ap.add_argument("--policy", default=None, help="a named checkpoint or a path")
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="timed calls after a warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="config overrides key=value")
    ap.add_argument("--json", help="also write the calls to this file")
    args = ap.parse_args()
    cfg = load_config(args.config, select={"policy": args.policy}, overrides=args.set)
    rt = Runtime(cfg, log=lambda s: None)
    calls = []
    try:
        tasks = rt.load_tasks(args.tasks, split="eval")
        for _ in range(args.repeats + 1):
            rt.engine.seed(args.seed)
            rt.engine.sync_weights(rt.model)  # a cold prefix cache
            t0 = time.perf_counter()
            trees, stats = rt.rollouts.rollout(tasks)
            wall = time.perf_counter() - t0
            nodes = [n for tree in trees for n in tree.nodes[1:]]
            work = json.dumps([(n.action, n.reward) for n in nodes]).encode()
            calls.append(
                {
                    "wall_s": wall,
                    "env_steps": len(nodes),
                    "env_step_s": sum(float(n.info.get("step_s", 0.0)) for n in nodes),
                    "tokens_generated": stats.policy_tokens_generated,
                    "digest": hashlib.sha1(work).hexdigest()[:12],
                }
            )
    finally:
        rt.close()
    timed = calls[1:]
    print(
        f"# {args.config}, {args.tasks} tasks, env_workers {cfg.engine.env_workers}, load "
        f"{os.getloadavg()[0]:.2f}"
    )
    print("| call | wall (s) | env steps | env seconds | tokens generated | work digest |")
    print("|---:|---:|---:|---:|---:|---|")
    for k, c in enumerate(timed):
        print(
            f"| {k} | {c['wall_s']:.2f} | {c['env_steps']} | {c['env_step_s']:.2f} | "
            f"{c['tokens_generated']} | {c['digest']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "set": args.set, "calls": calls}, f, indent=1)


if __name__ == "__main__":
    with interrupt_on_sigterm():
        main()
