"""Experiment trackers: TensorBoard event files and Weights & Biases, next to `metrics.jsonl`.

`Tracker.log(row)` receives every row the trainer writes to `metrics.jsonl` and forwards its
numeric, namespaced values (`train/loss`, `eval/success_rate`, ...) at the row's step. With
W&B, the tree viewer's page (`agentree view`) is rendered and logged as an artifact each time
the trainer saved a step's trees (every `train.trees_every` steps). Neither tracker is imported
unless enabled; W&B honours `WANDB_MODE` (`offline` writes the run under RUN_DIR/wandb).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from agentree.config import LogConfig
from agentree.viewer.pages import write_view


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in row.items()
        if "/" in k
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(float(v))
    }


class Tracker:
    """Forwards metrics rows to the enabled trackers; a no-op when none is."""

    def __init__(
        self, cfg: LogConfig, run_dir: Path, config: dict[str, Any], trees_every: int = 0
    ) -> None:
        self.cfg = cfg
        self.dir = Path(run_dir)
        self.trees_every = trees_every
        self.tb = None
        self.wandb = None
        if cfg.tensorboard:
            try:
                # deferred: tensorboard is the optional [view] extra
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "log.tensorboard=true needs the tensorboard package: "
                    "pip install 'agentree[view]'"
                ) from e
            self.tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"))
        if cfg.wandb.project:
            try:
                # deferred: wandb is the optional [view] extra
                import wandb
            except ImportError as e:
                raise ImportError(
                    "log.wandb.project needs the wandb package: pip install 'agentree[view]'"
                ) from e
            self.wandb = wandb.init(
                project=cfg.wandb.project,
                entity=cfg.wandb.entity,
                name=cfg.wandb.name or self.dir.resolve().name,
                dir=str(self.dir),
                config=config,
                resume="allow",
            )

    @property
    def enabled(self) -> bool:
        return self.tb is not None or self.wandb is not None

    def log(self, row: dict[str, Any]) -> None:
        step = int(row.get("step", 0))
        values = _scalars(row)
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(values, step=step)
            trained = any(k.startswith("train/") for k in values)
            if (
                self.cfg.wandb.trees
                and trained
                and self.trees_every
                and step % self.trees_every == 0
                and any((self.dir / "trees").glob(f"step{step:06d}_*.json"))
            ):
                self.log_trees(step)

    def log_trees(self, step: int) -> Path:
        """Render the run's trees with `agentree view` and log the page as a W&B artifact."""
        # deferred: wandb is the optional [view] extra
        import wandb

        page, _ = write_view(self.dir, self.dir / "view.html")
        art = wandb.Artifact(f"trees-{self.wandb.id}", type="tree-view")
        art.add_file(str(page), name="view.html")
        self.wandb.log_artifact(art, aliases=[f"step-{step}", "latest"])
        return page

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
