"""Checkpoints of a run directory: `checkpoints/step_NNNNNN/` holds the learner's part (`dcp/`:
trainable weights, optimiser, reference; plus the Hugging Face weights or LoRA adapter, so
`--policy DIR` loads it: `agentree.learner.base`), the tokenizer and `trainer_state.pt` (step, RNG
states, task cursor). A checkpoint is written under a temporary name
and renamed when complete, and a replaced or pruned one is renamed away before it is deleted,
so every `step_*` directory is complete; `checkpoints/latest` names the newest one and is
itself replaced atomically. A kill at any point leaves a checkpoint that loads.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def begin_checkpoint(run_dir: Path, step: int) -> Path:
    """An empty temporary directory to write the checkpoint of `step` into."""
    tmp = run_dir / "checkpoints" / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def finish_checkpoint(run_dir: Path, step: int, keep: int) -> Path:
    """Publish the temporary directory of `step` as `step_NNNNNN`, prune old checkpoints."""
    root = run_dir / "checkpoints"
    ckpt = root / f"step_{step:06d}"
    _remove(ckpt)
    (root / f".tmp_step_{step:06d}").rename(ckpt)
    pointer = root / ".latest.tmp"
    pointer.write_text(ckpt.name)
    os.replace(pointer, root / "latest")
    kept = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in kept[:-keep]:
        _remove(old)
    return ckpt


def _remove(path: Path) -> None:
    """Delete a checkpoint directory without ever leaving a partial `step_*` behind."""
    if path.exists():
        trash = path.with_name(f".trash_{path.name}")
        shutil.rmtree(trash, ignore_errors=True)
        path.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names; the newest complete one if a kill left it missing."""
    root = run_dir / "checkpoints"
    latest = root / "latest"
    name = latest.read_text().strip() if latest.exists() else ""
    if name.startswith("step_") and (root / name).is_dir():
        return root / name
    done = sorted(p for p in root.glob("step_*") if (p / "trainer_state.pt").exists())
    return done[-1] if done else None
