"""Paired differences between two methods, from the run rows a results page lists.

    python benchmarks/paired_rows.py docs/results/long-horizon.md patr+gigpo grpo \
        --env "FrozenLake 8x8" [--seeds 0 1 2] [--section TEXT] [--until TEXT] \
        [--at 20 40]

Some seeds' run directories are gone and their summaries kept seed means only; the page keeps a
row per run (`benchmarks/field_tables.py --runs`: held-out % at every tenth step and the last).
This reads those rows, pairs method A with method B seed by seed (every seed both have, or
`--seeds`), and prints A - B per seed, its mean and standard error, and how many seeds A won, on
the final success and on the area (the mean held-out success over the evaluations after step
0). The rows are rounded to 0.1 points, so a figure may differ by 0.1 from one worked from
the unrounded curves. A (method, seed) that appears in two rows is refused: narrow the page
with `--section`, text after which the rows begin, and `--until`, text where they end (by
default the next heading). `--at STEP_A STEP_B` adds A's held-out success at STEP_A against
B's at STEP_B, e.g. at equal env steps when A trains on twice B's tasks a step, at the steps
the header of each row's table lists ("held-out % at 0 / 10 / 20 / 25").
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from learning_efficiency import paired

HEADER = "held-out % at "
"""How a run table's header names its steps (`field_tables.py --runs`)."""


def read_rows(
    text: str, env: str
) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], list[int]]]:
    """Held-out % per (method, seed) from the page's run rows of `env`, and the steps they are
    at where the table's header lists them ("held-out % at 0 / 10 / ...")."""
    rows: dict[tuple[str, int], list[float]] = {}
    steps: dict[tuple[str, int], list[int]] = {}
    header: list[int] | None = None
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            header = None  # a header names the steps of its own table only
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[3].startswith(HEADER):
            header = [int(x) for x in cells[3].removeprefix(HEADER).split(" / ")]
            continue
        if len(cells) < 4 or cells[0] != env or not cells[2].isdigit():
            continue
        key = (cells[1], int(cells[2]))
        if key in rows:
            raise SystemExit(f"{key[0]} seed {key[1]} has two rows; narrow it with --section")
        rows[key] = [float(x.strip("*")) for x in cells[3].split(" / ")]
        if header is not None and len(header) == len(rows[key]):
            steps[key] = header
    return rows, steps


def section(text: str, start: str | None, until: str | None) -> str:
    """The page after `start` up to `until` or the next heading (without `start`, the page up
    to `until`, or all of it)."""
    for mark in (start, until):
        if mark is not None and mark not in text:
            raise SystemExit(f"no text {mark!r} in the page")
    if start is None:
        return text if until is None else text.split(until, 1)[0]
    rest = text.split(start, 1)[1]
    return rest.split(until, 1)[0] if until is not None else rest.split("\n#", 1)[0]


def at_step(values: list[float], steps: list[int] | None, step: int, label: str) -> float:
    """The held-out % at `step`, from a row whose table header lists its steps."""
    if steps is None:
        raise SystemExit(f"{label}: no table header above it lists the steps of its values")
    if step not in steps:
        raise SystemExit(f"{label} lists steps {', '.join(map(str, steps))}: not {step}")
    return values[steps.index(step)]


def shown(a: list[float], b: list[float]) -> str:
    """A - B per seed, the mean ± its standard error and the wins (`learning_efficiency.paired`,
    the benchmark's own pairing)."""
    p = paired(a, b)
    each = ", ".join(f"{x:+.1f}" for x in p["diffs"])
    se = float("nan") if p["se"] is None else p["se"]
    return f"{each}; mean {p['mean']:+.1f} ± {se:.1f}, {p['wins']}/{len(p['diffs'])} won"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", type=Path)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--env", required=True, help="the rows' env label, e.g. 'FrozenLake 8x8'")
    ap.add_argument("--seeds", type=int, nargs="*")
    ap.add_argument("--section", help="text after which the rows begin")
    ap.add_argument("--until", help="text where the rows end (default: the next heading)")
    ap.add_argument(
        "--at", type=int, nargs=2, metavar=("STEP_A", "STEP_B"), help="A at one step, B at another"
    )
    args = ap.parse_args()
    rows, steps = read_rows(section(args.page.read_text(), args.section, args.until), args.env)
    have = [{s for m, s in rows if m == name} for name in (args.a, args.b)]
    seeds = sorted(args.seeds if args.seeds else have[0] & have[1])
    missing = [(m, s) for s in seeds for m in (args.a, args.b) if (m, s) not in rows]
    if not seeds or missing:
        raise SystemExit(f"no rows to pair: missing {missing or 'every seed'}")
    curves = {m: [rows[(m, s)] for s in seeds] for m in (args.a, args.b)}
    print(f"{args.a} - {args.b}, {args.env}, seeds {seeds}")
    for name, of in (("final", lambda v: v[-1]), ("area", lambda v: statistics.fmean(v[1:]))):
        a, b = ([of(v) for v in curves[m]] for m in (args.a, args.b))
        print(
            f"  {name}: {shown(a, b)} ({args.a} {statistics.fmean(a):.1f}, "
            f"{args.b} {statistics.fmean(b):.1f})"
        )
    if args.at:
        sa, sb = args.at
        a, b = (
            [at_step(rows[(m, s)], steps.get((m, s)), step, f"{m} seed {s}") for s in seeds]
            for m, step in ((args.a, sa), (args.b, sb))
        )
        print(
            f"  {args.a} at step {sa} - {args.b} at step {sb}: {shown(a, b)} "
            f"({args.a} {statistics.fmean(a):.1f}, {args.b} {statistics.fmean(b):.1f})"
        )


if __name__ == "__main__":
    main()
