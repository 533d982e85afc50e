"""Which agentree modules one training step enters, in order, and the layers it passes through.

Runs the embedded default (or `--config NAME`) for one `Trainer.train_step` under a profiler
hook, in the main thread and in every thread the step starts (the env turns the turn runner
plays on its workers), and records every call into agentree's own code: the modules entered
(first entry order), and the walk through layers (folders, `tests/test_imports.py` LAYERS),
consecutive repeats collapsed. A return trip is a call from a lower layer back into a higher
one (an upward call, e.g. through a callback), which the layering should make rare. Loads the
policy the config names (the default's warm start is built once if it is not cached).

    python benchmarks/step_walk.py [--config NAME] [--set key=value ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path

import agentree
from agentree.config import load_config
from agentree.signals import interrupt_on_sigterm

ROOT = Path(agentree.__file__).parent


def module_of(filename: str) -> str | None:
    p = Path(filename)
    try:
        rel = p.relative_to(ROOT).with_suffix("")
    except ValueError:
        return None
    return ".".join(["agentree", *[x for x in rel.parts if x != "__init__"]])


def room(module: str) -> str:
    """The folder or top-level module a module belongs to (as tests/test_imports.py counts)."""
    return ".".join(module.split(".")[:2])


def layers() -> list[tuple[str, list[str]]]:
    sys.path.insert(0, str(ROOT.parent / "tests"))
    # deferred: the layer table lives with the test that enforces it
    from test_imports import LAYERS

    return LAYERS


def walk(config: str | None, overrides: list[str]) -> dict:
    # deferred: the trainer imports torch; --help should not pay for it
    from agentree.run.trainer import Trainer

    table = layers()
    layer_of = {r: i for i, (_, rooms) in enumerate(table) for r in rooms}
    cfg = load_config(config, overrides=overrides)
    with tempfile.TemporaryDirectory(prefix="agentree-walk-") as tmp:
        cfg = cfg.model_copy(update={"output": tmp})
        trainer = Trainer(cfg, Path(tmp), log=lambda _m: None)
        entered: list[str] = []
        functions: dict[str, list[str]] = {}
        calls: list[tuple[str, str]] = []  # (caller module, callee module) across modules
        # one call stack per thread: the turn runner plays env turns on worker threads
        local = threading.local()

        def hook(frame, event, _arg):
            stack = local.__dict__.setdefault("stack", [])
            if event == "call":
                mod = module_of(frame.f_code.co_filename)
                caller = next((m for m in reversed(stack) if m is not None), None)
                if mod is not None:
                    if mod not in entered:
                        entered.append(mod)
                    names = functions.setdefault(mod, [])
                    if frame.f_code.co_qualname not in names:
                        names.append(frame.f_code.co_qualname)
                    if caller is not None and caller != mod:
                        calls.append((caller, mod))
                stack.append(mod)
            elif event == "return" and stack:
                stack.pop()

        threading.setprofile(hook)
        sys.setprofile(hook)
        try:
            trainer.train_step()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            trainer.close()
    rooms_walk: list[str] = []
    for m in entered:
        r = room(m)
        if not rooms_walk or rooms_walk[-1] != r:
            rooms_walk.append(r)
    upward = sorted(
        {f"{a} -> {b}" for a, b in calls if layer_of.get(room(b), 0) > layer_of.get(room(a), 0)}
    )
    return {
        "modules": entered,
        "count": len(entered),
        "rooms": rooms_walk,
        "upward_calls": upward,
        "functions": functions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out = walk(args.config, args.overrides)
    print(f"{out['count']} modules entered in one training step:")
    for m in out["modules"]:
        names = out["functions"][m]
        more = f" (+{len(names) - 4} more)" if len(names) > 4 else ""
        print(f"  {m}: {', '.join(names[:4])}{more}")
    print("upward calls (a lower layer calling into a higher one):")
    for c in out["upward_calls"] or ["  none"]:
        print(f"  {c}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    with interrupt_on_sigterm():  # `kill` removes the run directory, as Ctrl-C
        main()
