"""Resuming a training run (stopping it safely is `agentree.signals.StopSignals`).

- `resume_config`: `--resume` continues the run exactly as saved in its `config.yaml`; a flag
  that would change it is an error, except `--steps`, which is logged.
- `trim_metrics`: drops the `metrics.jsonl` rows written after the checkpoint a run resumes
  from, so each step appears once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentree.config import load_config, validate_config
from agentree.run.outputs import write_whole

RESUME_OVERRIDES = ("train.world_size", "train.fsdp", "train.micro_batch_size")
"""Keys `--resume --set` may change: they reshape the work, not the run (every learner writes
and reads one checkpoint format, which reshards onto another world size; micro-batching leaves
gradients exact)."""


def _get(cfg: Any, dotted: str) -> Any:
    node: Any = cfg
    for k in dotted.split("."):
        node = node[k] if isinstance(node, dict) else getattr(node, k)
    return node


def resume_config(
    run_dir: Path,
    *,
    config: str | None,
    select: dict[str, str | None],
    overrides: list[str],
    steps: int | None,
    log: Callable[[str], None],
) -> Any:
    """The saved config of `run_dir`; flags that would change it are an error naming them."""
    saved_path = run_dir / "config.yaml"
    if not saved_path.exists():
        raise ValueError(f"{saved_path} not found: {run_dir} is not an agentree run directory")
    saved = load_config(str(saved_path))
    reference = _comparable(saved)
    flags: list[tuple[str, str, dict[str, str | None], list[str]]] = []
    if config is not None:
        flags.append((f"--config {config}", config, {}, []))
    for key, value in select.items():
        if value is not None and key != "output":
            flags.append((f"--{key} {value}", str(saved_path), {key: value}, []))
    safe: list[str] = []
    for item in overrides:
        if item.partition("=")[0].strip() in RESUME_OVERRIDES:
            safe.append(item)
        else:
            flags.append((f"--set {item}", str(saved_path), {}, [item]))
    conflicts = []
    for text, base, sel, over in flags:
        try:
            same = _comparable(load_config(base, select=sel, overrides=over)) == reference
        except ValueError:
            same = False
        if not same:
            conflicts.append(text)
    if conflicts:
        raise ValueError(
            f"--resume continues the run in {run_dir} with its saved config.yaml, and "
            f"{', '.join(conflicts)} would change it; drop "
            f"{'that flag' if len(conflicts) == 1 else 'those flags'}, or start a new run "
            "with another --output"
        )
    saved.output = str(run_dir)  # the directory may have moved since it was saved
    if safe:
        before = {k: _get(saved, k) for k in (i.partition("=")[0].strip() for i in safe)}
        saved = load_config(str(saved_path), overrides=safe)
        saved.output = str(run_dir)
        for key, value in before.items():
            if _get(saved, key) != value:
                log(f"--set {key}={_get(saved, key)} overrides {key}={value} of the saved run")
    if steps is not None and steps != saved.train.steps:
        log(f"--steps {steps} overrides train.steps={saved.train.steps} of the saved run")
        data = saved.model_dump()
        data["train"]["steps"] = steps
        saved = validate_config(data)
    return saved


def _comparable(cfg: Any) -> dict[str, Any]:
    data = cfg.model_dump()
    data.pop("output", None)
    return data


def trim_metrics(path: Path, step: int | None) -> int:
    """Keep the rows of `path` up to checkpoint `step` (none when there is no checkpoint, or
    it is from before the first step); also drops a last line cut off by a kill. Returns the
    number of rows dropped. Rewritten atomically."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if step and row.get("step", 0) <= step:
            kept.append(line)
        else:
            dropped += 1
    write_whole(path, "".join(x + "\n" for x in kept))
    return dropped
