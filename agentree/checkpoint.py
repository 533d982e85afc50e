"""Checkpoints of a run directory: `checkpoints/step_NNNNNN/` holds the weights and tokenizer
as a Hugging Face checkpoint (so `--policy DIR` loads it) plus `trainer_state.pt` (optimiser,
reference weights, RNG states, task cursor). A checkpoint is written under a temporary name
and renamed when complete, and a replaced or pruned one is renamed away before it is deleted,
so every `step_*` directory is complete; `checkpoints/latest` names the newest one and is
itself replaced atomically. A kill at any point leaves a checkpoint that loads.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(
    run_dir: Path, step: int, model: Any, tokenizer: Any, state: dict[str, Any], keep: int
) -> Path:
    tmp = begin_checkpoint(run_dir, step)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({"step": step, **state}, tmp / "trainer_state.pt")
    return finish_checkpoint(run_dir, step, keep)


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


def load_checkpoint(ckpt: Path, model: Any) -> dict[str, Any]:
    """Load the weights into `model`; return the trainer state."""
    from safetensors.torch import load_file

    weights = load_file(str(ckpt / "model.safetensors"))
    model.load_state_dict(weights, strict=False)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return torch.load(ckpt / "trainer_state.pt", weights_only=False)
