"""The embedded default's learning curve: `agentree train` for several seeds, as a user runs it.

Runs the command in a subprocess per seed (fresh process, tiny policy built locally), then
reads each run directory: wall time, held-out success rate before/after, and the held-out curve
when `train.eval_every` is set.

    python benchmarks/frozenlake_learning.py --seeds 0 1
    python benchmarks/frozenlake_learning.py --seeds 0 --set train.eval_every=25   # the curve
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from agentree.signals import interrupt_on_sigterm, run_child


def run(seed: int, out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "agentree", "train", "--output", str(out), "--set", f"seed={seed}"]
    for item in extra:
        cmd += ["--set", item]
    t0 = time.perf_counter()
    run_child(cmd, check=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["eval/success_rate"]) for r in rows if "eval/success_rate" in r]
    before, after = curve[0][1], curve[-1][1]
    return {"seed": seed, "wall_s": wall, "before": before, "after": after, "curve": curve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument("--keep", help="keep run directories under this folder")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="agentree-bench-") as tmp:
        root = Path(args.keep or tmp)
        for seed in args.seeds:
            results.append(run(seed, root / f"seed{seed}", args.set))
    print(f"{'seed':>4} {'wall':>7} {'before':>8} {'after':>8} {'gain':>8}")
    for r in results:
        gain = 100 * (r["after"] - r["before"])
        print(
            f"{r['seed']:>4} {r['wall_s']:>6.0f}s {100 * r['before']:>7.1f}% "
            f"{100 * r['after']:>7.1f}% {gain:>+7.1f}"
        )
    for r in results:
        if len(r["curve"]) > 2:
            pts = " ".join(f"{s}:{100 * v:.1f}%" for s, v in r["curve"])
            print(f"seed {r['seed']} held-out curve: {pts}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    with interrupt_on_sigterm():  # `kill` stops the runs and removes the directory, as Ctrl-C
        main()
