"""The embedded default's learning curve: `agentree train` for several seeds, as a user runs it.

Runs the command in a subprocess per seed (fresh process, tiny policy built locally), then
reads each run directory: wall time, held-out success rate before/after, and the held-out curve
when `train.eval_every` is set.

    python benchmarks/frozenlake_learning.py --seeds 0 1
    python benchmarks/frozenlake_learning.py --seeds 0 --set train.eval_every=25   # the curve

With `--keep DIR` the runs are kept in `DIR/seedS`, and a second invocation resumes: a seed
whose run finished (it has `summary.json`) is read, not run again, and one that was stopped
continues from its last checkpoint (`--resume`). `--against DIR` pairs the final held-out
success, seed by seed, with the runs kept in another such folder (another recipe on the same
seeds, hence the same warm start and held-out maps):

    python benchmarks/frozenlake_learning.py --seeds 0 1 2 3 4 --keep runs/long/default \
        --set train.steps=400 --set train.eval_every=50
    python benchmarks/frozenlake_learning.py --seeds 0 1 2 3 4 --keep runs/long/lr3e-4 \
        --set train.steps=400 --set train.eval_every=50 --set train.lr=3e-4 \
        --against runs/long/default
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from learning_efficiency import paired

from agentree.signals import interrupt_on_sigterm, run_child


def run(seed: int, out: Path, extra: list[str]) -> dict:
    if not (out / "summary.json").exists():  # else it finished: read it
        cmd = [sys.executable, "-m", "agentree", "train", "--output", str(out)]
        cmd += ["--set", f"seed={seed}", *(["--resume"] if out.exists() else [])]
        for item in extra:
            cmd += ["--set", item]
        run_child(cmd, check=True)
    return read(seed, out)


def read(seed: int, out: Path) -> dict:
    """A finished run's figures: its wall time (`summary.json`'s: the process that finished it,
    evaluations included) and its held-out curve."""
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["eval/success_rate"]) for r in rows if "eval/success_rate" in r]
    before, after = curve[0][1], curve[-1][1]
    return {
        "seed": seed,
        "wall_s": summary["wall_s"],
        "before": before,
        "after": after,
        "curve": curve,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument("--keep", help="keep run directories under this folder (and resume there)")
    ap.add_argument("--against", help="a --keep folder of the same seeds to pair the finals with")
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
    if args.against:
        base = [read(r["seed"], Path(args.against) / f"seed{r['seed']}") for r in results]
        p = paired([100 * r["after"] for r in results], [100 * b["after"] for b in base])
        each = " ".join(f"{r['seed']}:{d:+.1f}" for r, d in zip(results, p["diffs"], strict=True))
        se = "" if p["se"] is None else f" +/- {p['se']:.1f} (SE)"
        print(
            f"final minus {args.against}'s, per seed: {each}; mean {p['mean']:+.1f}{se}, "
            f"higher on {p['wins']} of {len(results)} seeds"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    with interrupt_on_sigterm():  # `kill` stops the runs and removes the directory, as Ctrl-C
        main()
