"""Fork latency of the SWE sandbox: snapshot and restore-to-ready vs replaying the history.

For a sandbox after 0, 5 and 20 edits this measures
  snapshot        `Sandbox.snapshot()` (docker commit of the container),
  restore-ready   `other.restore(snapshot)` plus the first command answered in `other` (what a
                  tree branch pays to continue from its parent's state),
  fork            snapshot + restore-ready, the whole cost of one branch,
in three situations:
  cold            no spare containers (prewarm=0), restore right after the snapshot;
  immediate       default prewarm=1, restore right after the snapshot (the spare is starting);
  paused          default prewarm=1, restore after a pause (the policy generating tokens, a
                  judge scoring) in which the spare got ready,
and compares them with re-creating the state the way a non-forking rollout must: a fresh
container from the task image plus replaying a 10-action history.

    python benchmarks/swe_fork_latency.py [--reps 15]

Modes and replays are interleaved rep by rep, so load changes on the machine hit all alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

from agentree.envs.swe import images, local_suite
from agentree.envs.swe.sandbox import ImageStore, Sandbox, SandboxConfig

HISTORY = [  # a typical start of an agent episode on the `textkit` task
    "ls -la && git log --oneline | head -5",
    "cat textkit/slug.py",
    "grep -rn 'def slugify' .",
    "cat tests/test_textkit.py | head -30",
    "python3 -c 'from textkit import slugify; print(slugify(\"Hello,  World!\"))'",
    "sed -i 's/\\[^a-z0-9\\]/[^a-z0-9]+/' textkit/slug.py",
    "sed -i 's/text.lower())$/text.lower()).strip(sep)/' textkit/slug.py",
    "python3 -c 'from textkit import slugify; print(slugify(\"Hello,  World!\"))'",
    "python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tail -3",
    "git diff",
]


def edit(sb: Sandbox, i: int) -> None:
    """One agent-style edit: change a tracked file and write a new one."""
    sb.exec(
        f"sed -i '1i # edit {i}' textkit/wrap.py && printf 'x = {i}\\n' > scratch_{i}.py",
        timeout=30,
    )


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


MODES = {"cold": (0, False), "immediate": (1, False), "paused": (1, True)}
"""mode -> (prewarm, pause between snapshot and restore)"""


def replay_once(image: str) -> float:
    """A fresh container from the task image plus the 10-action history, to the last output."""
    t = time.perf_counter()
    with Sandbox(image, SandboxConfig(prewarm=0)) as sb:
        for cmd in HISTORY:
            sb.exec(cmd, timeout=60)
    return time.perf_counter() - t


def measure(image: str, edits: int, reps: int, settle_s: float) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"snapshot": [], "replay": []}
    store = ImageStore.get()
    clock = time.perf_counter
    pairs: dict[str, tuple[Sandbox, Sandbox]] = {}
    try:
        for mode, (prewarm, _) in MODES.items():
            cfg = SandboxConfig(prewarm=prewarm)
            pairs[mode] = Sandbox(image, cfg), Sandbox(image, cfg)
            for i in range(edits):
                edit(pairs[mode][0], i)
        want = pairs["cold"][0].exec("git status --porcelain | md5sum").output
        for _ in range(reps):
            for mode, (_, pause) in MODES.items():
                parent, child = pairs[mode]
                store.flush()  # no background work left from the previous measurement
                t = clock()
                snap = parent.snapshot()
                t_snap = clock() - t
                if pause:
                    time.sleep(settle_s)
                t = clock()
                child.restore(snap)
                child.exec("true")
                t_restore = clock() - t
                out["snapshot"].append(t_snap)
                out.setdefault(f"restore_{mode}", []).append(t_restore)
                out.setdefault(f"fork_{mode}", []).append(t_snap + t_restore)
                snap = None
            store.flush()
            out["replay"].append(replay_once(image))
        for _, child in pairs.values():
            assert child.exec("git status --porcelain | md5sum").output == want
    finally:
        for parent, child in pairs.values():
            parent.close()
            child.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--settle", type=float, default=0.5, help="seconds between fork and restore")
    args = ap.parse_args()

    images.build_local(only=["textkit"], progress=print)
    image = local_suite.record("textkit")["image"]
    with Sandbox(image, SandboxConfig(prewarm=0)) as warm:  # first-use costs out of the way
        warm.snapshot()
        for cmd in HISTORY:
            warm.exec(cmd)
    rows = [(edits, measure(image, edits, args.reps, args.settle)) for edits in (0, 5, 20)]
    ImageStore.get().flush()

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} / {pct(xs, 0.95):.3f}"

    p50 = statistics.median
    print(f"\nseconds, p50 / p95 over {args.reps} reps")
    head = ["edits", "snapshot", *[f"restore-ready {m}" for m in MODES]]
    head += [*[f"fork {m}" for m in MODES], "replay 10 actions"]
    head += [f"replay/fork {m}" for m in MODES]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for edits, m in rows:
        cells = [str(edits), cell(m["snapshot"])]
        cells += [cell(m[f"restore_{k}"]) for k in MODES] + [cell(m[f"fork_{k}"]) for k in MODES]
        cells += [cell(m["replay"])]
        cells += [f"{p50(m['replay']) / p50(m[f'fork_{k}']):.1f}x" for k in MODES]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
