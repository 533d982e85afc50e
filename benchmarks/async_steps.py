"""`train.async_steps=1` vs `0` on the same config and seed: wall time per step, held-out success.

    python benchmarks/async_steps.py [--steps 10] [--backend ray|local] [--set key=value ...]

Runs `agentree train` twice (synchronous, then one-step asynchronous) with the same seed and
config, and reports the mean step time (after the first step, which has nothing to overlap),
the rollout wait and update time per step, the staleness, and held-out success before/after.
Numbers depend on the machine and its load (printed in the header).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from agentree.signals import interrupt_on_sigterm, run_child


def run(async_steps: int, args: argparse.Namespace, root: Path) -> dict:
    out = root / f"async{async_steps}"
    sets = [
        f"train.async_steps={async_steps}",
        f"distributed.backend={args.backend}",
        f"distributed.rollout_workers={args.workers}",
        "train.save_every=0",
        "train.trees_every=0",
        *args.set,
    ]
    cmd = [sys.executable, "-m", "agentree", "train", "--steps", str(args.steps)]
    cmd += ["--output", str(out), *[x for s in sets for x in ("--set", s)]]
    run_child(cmd, check=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step_s" in r]
    later = steps[1:] or steps
    summary = json.loads((out / "summary.json").read_text())

    def mean(key: str) -> float:
        return round(sum(r.get(key, 0.0) for r in later) / len(later), 3)

    return {
        "async_steps": async_steps,
        "step_s": mean("time/step_s"),
        "rollout_wait_s": mean("time/rollout_s"),
        "update_s": mean("time/update_s"),
        "staleness": [r["train/staleness"] for r in steps],
        "eval_before": summary["eval_before"],
        "eval_after": summary["eval_after"],
        "wall_s": summary["wall_s"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--backend", default="ray", choices=["ray", "local"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="agentree-async-") as tmp:
        results = [run(a, args, Path(tmp)) for a in (0, 1)]
    for r in results:
        print(json.dumps(r))
    print("\n| async_steps | s/step | rollout wait s | update s | success before -> after |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['async_steps']} | {r['step_s']} | {r['rollout_wait_s']} | {r['update_s']} "
            f"| {100 * r['eval_before']:.1f}% -> {100 * r['eval_after']:.1f}% |"
        )


if __name__ == "__main__":
    with interrupt_on_sigterm():  # `kill` stops the runs and removes the directory, as Ctrl-C
        main()
