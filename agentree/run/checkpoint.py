"""Checkpoints of a run directory: `checkpoints/step_NNNNNN/` holds the learner's part (`dcp/`:
trainable weights, optimiser, reference; plus the Hugging Face weights or LoRA adapter, so
`--policy DIR` loads it: `agentree.learner.base`), the tokenizer and `trainer_state.pt` (step, RNG
states, task cursor). A checkpoint is written under a temporary name
and renamed when complete, and a replaced or pruned one is renamed away before it is deleted,
so every `step_*` directory is complete; `checkpoints/latest` names the newest one and is
itself replaced atomically. A kill at any point leaves a checkpoint that loads.

Renaming is atomic, but a crash of the machine or a full disk can still leave a published file
short. So the last file written into the temporary directory is `manifest.json`: the size and
CRC-32 of every other file, each flushed to disk first. `latest_checkpoint` verifies it and
falls back to the newest checkpoint that is complete, saying which one it skipped and why.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

from agentree.run.outputs import write_whole

MANIFEST = "manifest.json"


def begin_checkpoint(run_dir: Path, step: int) -> Path:
    """An empty temporary directory to write the checkpoint of `step` into."""
    tmp = run_dir / "checkpoints" / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def finish_checkpoint(run_dir: Path, step: int, keep: int) -> Path:
    """Publish the temporary directory of `step` as `step_NNNNNN` (with its manifest), prune
    old checkpoints."""
    root = run_dir / "checkpoints"
    ckpt = root / f"step_{step:06d}"
    _write_manifest(root / f".tmp_step_{step:06d}")
    _remove(ckpt)
    (root / f".tmp_step_{step:06d}").rename(ckpt)
    write_whole(root / "latest", ckpt.name)
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


def latest_checkpoint(run_dir: Path, log: Callable[[str], None] | None = None) -> Path | None:
    """The newest complete checkpoint: the one `latest` names, else (a kill left it missing,
    or it fails verification) the newest `step_*` that verifies. `log` hears one line per
    checkpoint skipped."""
    root = run_dir / "checkpoints"
    latest = root / "latest"
    name = latest.read_text().strip() if latest.exists() else ""
    found = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    if name.startswith("step_") and (root / name).is_dir():
        found.remove(root / name)
        found.insert(0, root / name)
    for ckpt in found:
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt
        if log is not None:
            log(f"skipping checkpoint {ckpt.name}: {problem}")
    return None


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why `ckpt` is not complete (a missing, short or altered file), or None if it is."""
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        # written before manifests: trainer_state.pt, its last file, says the rest is there
        return None if (ckpt / "trainer_state.pt").exists() else "trainer_state.pt is missing"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST} is unreadable"
    for rel, (size, crc) in sorted(manifest.items()):
        path = ckpt / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != size:
            return f"{rel} has {path.stat().st_size} bytes, {size} were written"
        if _crc32(path) != crc:
            return f"{rel} does not match the checksum it was written with"
    return None


def _write_manifest(tmp: Path) -> None:
    """Size and CRC-32 of every file under `tmp`, each flushed to disk, then the manifest."""
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        files[str(path.relative_to(tmp))] = [path.stat().st_size, _crc32(path, sync=True)]
    out = tmp / MANIFEST
    with open(out, "w") as f:
        json.dump({"files": files}, f)
        f.flush()
        os.fsync(f.fileno())


def _crc32(path: Path, sync: bool = False) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
        if sync:
            os.fsync(f.fileno())
    return crc
