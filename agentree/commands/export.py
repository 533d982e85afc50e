"""`agentree export RUN_DIR --output DIR`: the latest checkpoint of a run as a plain Hugging Face
checkpoint (LoRA adapters merged into the base weights), loadable by `--policy DIR` and vLLM.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from agentree.hub.adapters import write_merged
from agentree.hub.store import written_whole
from agentree.run.checkpoint import latest_checkpoint


def export(run_or_ckpt: str | Path, output: str | Path) -> Path:
    """Write the merged model and tokenizer of a run's latest checkpoint (or of a checkpoint
    directory) to `output`; return `output`."""
    src = Path(run_or_ckpt)
    ckpt = src if (src / "trainer_state.pt").exists() else latest_checkpoint(src)
    if ckpt is None or not ckpt.exists():
        raise ValueError(f"{src} holds no checkpoint: pass a run directory or a checkpoint")
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; choose a new --output directory")
    with written_whole(out) as partial:  # a failure, Ctrl-C or `kill` leaves nothing behind
        write_merged(ckpt, partial)
        if out.exists():
            out.rmdir()
    return out


def add_export_command(sub: Any) -> None:
    p = sub.add_parser("export", help="write a run's latest checkpoint as a merged HF model")
    p.add_argument("run_dir", help="run directory (or one checkpoint directory)")
    p.add_argument("--output", required=True, help="directory for the merged checkpoint")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    out = export(args.run_dir, args.output)
    print(f"merged checkpoint -> {out} (load it with --policy {out})")
    return 0
