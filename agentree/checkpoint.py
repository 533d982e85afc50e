"""Checkpoints of a run directory: `checkpoints/step_NNNNNN/` holds the weights and tokenizer
as a Hugging Face checkpoint (so `--policy DIR` loads it) plus `trainer_state.pt` (optimiser,
reference weights, RNG states, task cursor). A checkpoint is written under a temporary name
and renamed when complete; `checkpoints/latest` names the newest one.
"""

from __future__ import annotations

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
    shutil.rmtree(ckpt, ignore_errors=True)
    (root / f".tmp_step_{step:06d}").rename(ckpt)
    (root / "latest").write_text(ckpt.name)
    kept = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in kept[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return ckpt


def latest_checkpoint(run_dir: Path) -> Path | None:
    latest = run_dir / "checkpoints" / "latest"
    if not latest.exists():
        return None
    return run_dir / "checkpoints" / latest.read_text().strip()


def load_checkpoint(ckpt: Path, model: Any) -> dict[str, Any]:
    """Load the weights into `model`; return the trainer state."""
    from safetensors.torch import load_file

    weights = load_file(str(ckpt / "model.safetensors"))
    model.load_state_dict(weights, strict=False)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return torch.load(ckpt / "trainer_state.pt", weights_only=False)
