"""Long sampling commands (`agentree eval`, `agentree rollout`) in blocks of tasks, each saved as
it finishes, so a stop loses at most the block in flight and `--resume` continues.

The tasks are cut into blocks of `n`; block k is sampled as one batch at seed
`cfg.seed + BLOCK_SEED * k` (`block_seed`), so block 0 samples at the config's seed and a
command of one block is the one batch it was before blocks existed. A resumed command samples
only the missing blocks, with the seeds an uninterrupted one uses, so it ends with the same
trees. What a command started with (its task ids, its flags, the weights' sha256) is its plan;
`--resume` refuses anything that would change it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

from agentree.config import ExperimentConfig
from agentree.envs.base import Env, Task
from agentree.rollout.base import RolloutStats
from agentree.run.outputs import BLOCKS, WHAT, mark, write_whole
from agentree.run.runtime import Runtime
from agentree.tree import Tree, save_trees

BLOCK_SEED = 104_729
"""Block k samples with seed `cfg.seed + BLOCK_SEED * k`: block 0 at the config's seed, so a
command of one block is one batch, as training's evaluation is."""


def block_seed(seed: int, k: int) -> int:
    return seed + BLOCK_SEED * k


class Block(NamedTuple):
    """A finished block: its trees, its sampling time in seconds and (a rollout's) counters."""

    trees: list[Tree]
    wall_s: float
    stats: RolloutStats | None = None


Finished = dict[int, Block]
"""Block index -> the finished block."""


class SavedBlocks:
    """What a command keeps in `DIR/blocks/` until its last block is done: `plan.json` (the
    tasks, flags and weights it started with) and one `block_K/` per finished block, each
    written aside and renamed, so a stop at any moment leaves only whole blocks.

    `results` are the names in DIR of a finished run's outputs, which a new run removes first
    (none of them is its own)."""

    def __init__(self, out_dir: Path, command: str, results: Sequence[str]) -> None:
        self.out_dir = out_dir
        self.command = command
        self.results = tuple(results)
        self.dir = out_dir / BLOCKS

    def plan(self) -> dict[str, Any] | None:
        path = self.dir / "plan.json"
        return json.loads(path.read_text()) if path.exists() else None

    def start(self, cfg: ExperimentConfig, plan: dict[str, Any], sha256: str | None) -> None:
        """Begin a new run: an earlier one's results go."""
        for name in (*self.results, BLOCKS):
            path = self.out_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        (self.out_dir / "config.yaml").write_text(cfg.to_yaml())
        self.dir.mkdir(parents=True)
        write_whole(self.dir / "plan.json", json.dumps({**plan, "policy_sha256": sha256}))

    def block(self, k: int) -> Path:
        return self.dir / f"block_{k:05d}"

    def save(self, k: int, block: Block) -> None:
        final = self.block(k)
        tmp = final.with_name(f".{final.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_trees(block.trees, tmp / "trees")
        meta = {"wall_s": block.wall_s, "task_ids": [t.task_id for t in block.trees]}
        if block.stats is not None:
            meta["stats"] = asdict(block.stats)
        (tmp / "block.json").write_text(json.dumps(meta))  # the block is renamed whole below
        os.replace(tmp, final)

    def finished(self, blocks: Sequence[Sequence[Task]]) -> Finished:
        """The saved blocks, each checked to hold its tasks' trees in order."""
        out: Finished = {}
        for k, tasks in enumerate(blocks):
            path = self.block(k)
            if not path.is_dir():
                continue
            meta = json.loads((path / "block.json").read_text())
            files = sorted((path / "trees").glob("*.json"), key=lambda f: int(f.name.split("_")[0]))
            trees = [Tree.load(f) for f in files]
            if [t.task_id for t in trees] != meta["task_ids"] or meta["task_ids"] != [
                t.id for t in tasks
            ]:
                raise ValueError(
                    f"{path} does not hold the tasks of block {k}; run agentree {self.command} "
                    "again with another --output"
                )
            stats = RolloutStats(**meta["stats"]) if "stats" in meta else None
            out[k] = Block(trees, float(meta["wall_s"]), stats)
        return out

    @staticmethod
    def count(blocks: Sequence[Sequence[Task]], done: Finished) -> int:
        return sum(len(blocks[k]) for k in done)

    def interrupted(self, blocks: Sequence[Sequence[Task]], done: Finished) -> str:
        total = sum(len(b) for b in blocks)
        if self.plan() is None:
            return f"interrupted before the first task: nothing written to {self.out_dir}"
        return (
            f"interrupted with {self.count(blocks, done)} of {total} tasks saved in "
            f"{self.out_dir}; continue with: agentree {self.command} --output {self.out_dir} "
            "--resume"
        )

    def resumed_plan(self, resume: bool, log: Callable[[str], None]) -> dict[str, Any] | None:
        """The plan a resumed run continues (None: start at the first task). Resuming a
        finished run is an error; resuming one stopped before its first block starts it."""
        plan = self.plan() if resume else None
        if resume and plan is None:
            if (self.out_dir / self.results[0]).exists():
                what = WHAT[self.command]
                raise ValueError(f"{self.out_dir} holds a finished {what}: nothing to resume")
            log(
                f"nothing to resume in {self.out_dir} (no block saved yet): starting at the "
                "first task"
            )
        return plan

    def sample(
        self,
        cfg: ExperimentConfig,
        blocks: Sequence[Sequence[Task]],
        plan: dict[str, Any] | None,
        flags: dict[str, Any],
        runtime: Callable[[], Runtime | None],
        sample_block: Callable[[Runtime | None, int, Sequence[Task]], tuple[list[Tree], Any]],
        log: Callable[[str], None],
    ) -> tuple[list[Block], str | None, float]:
        """Every block, in order, the sha256 of the weights that sampled them, and the seconds
        spent (building the runtime and sampling, summed over the runs that saved blocks).

        The blocks saved under `plan` are read back; `runtime()` builds what samples the others
        (None for a scripted policy), whose weights must be those the plan started with; the
        directory is marked, a new plan (`flags` and the task ids) written, and each missing
        block sampled (`sample_block(rt, k, tasks)`) and saved as it finishes. A stop says how many
        tasks are saved and how to continue."""
        t0 = time.perf_counter()
        done = self.finished(blocks) if plan is not None else {}
        earlier_s = sum(b.wall_s for b in done.values())
        total = sum(len(b) for b in blocks)
        if done:
            log(f"resuming {self.out_dir}: {self.count(blocks, done)} of {total} tasks saved")
        rt: Runtime | None = None
        sha256 = plan["policy_sha256"] if plan is not None else None
        try:
            if len(done) < len(blocks):
                rt = runtime()
                if rt is not None:
                    sha256 = same_weights(rt, plan, self.out_dir)
            mark(self.out_dir, self.command)  # the inputs are valid, the policy loaded
            if plan is None:
                ids = [t.id for b in blocks for t in b]
                self.start(cfg, {**flags, "task_ids": ids}, sha256)
            for k, tasks in enumerate(blocks):
                if k in done:
                    continue
                b0 = time.perf_counter()
                trees, stats = sample_block(rt, k, tasks)
                block = Block(trees, time.perf_counter() - b0, stats)
                self.save(k, block)
                done[k] = block  # counted as saved only once it is
                if len(blocks) > 1:
                    count = self.count(blocks, done)
                    log(f"block {k + 1} of {len(blocks)} saved: {count} of {total} tasks")
        except KeyboardInterrupt:
            log(self.interrupted(blocks, done))
            raise
        finally:
            if rt is not None:
                rt.close()
        wall_s = earlier_s + time.perf_counter() - t0
        return [done[k] for k in range(len(blocks))], sha256, wall_s

    def clear(self) -> None:
        shutil.rmtree(self.dir)


def joined(blocks: Sequence[Block]) -> tuple[list[Tree], RolloutStats | None]:
    """The blocks' trees in order, and their counters summed (None unless every block has
    them: a scripted policy counts nothing)."""
    trees = [tree for block in blocks for tree in block.trees]
    counted = [block.stats for block in blocks if block.stats is not None]
    if not counted or len(counted) < len(blocks):
        return trees, None
    stats = RolloutStats()
    for block_stats in counted:
        stats.add(block_stats)
    return trees, stats


def cut(tasks: Sequence[Task], n: int) -> list[list[Task]]:
    """`tasks` in blocks of `n` (the last one shorter)."""
    return [list(tasks[i : i + n]) for i in range(0, len(tasks), n)]


def in_block(
    progress: Callable[[str], None] | None, k: int, blocks: int
) -> Callable[[str], None] | None:
    """`progress` naming block k of `blocks` (as is when there is one)."""
    if progress is None or blocks == 1:
        return progress
    return lambda msg: progress(f"block {k + 1} of {blocks}: {msg}")


def seeded(rt: Runtime, seed: int) -> random.Random:
    """Seed the runtime's engine with `seed` and return the controller's draws from it."""
    rt.engine.seed(seed)
    return random.Random(seed)


def as_saved(flag: str, value: Any, saved: Any, out_dir: Path) -> Any:
    """The value a resumed run started with; a flag that would change it is an error."""
    if value is not None and str(value) != str(saved):
        raise ValueError(
            f"--resume continues the run in {out_dir} with {flag} {saved}, and {flag} "
            f"{value} would change it; drop that flag, or start again with another --output"
        )
    return saved


def same_weights(rt: Runtime, plan: dict[str, Any] | None, out_dir: Path) -> str | None:
    """The sha256 of the policy's weights, which a resumed run must have started with."""
    if plan is not None and rt.policy_sha256 != plan["policy_sha256"]:
        raise ValueError(
            f"{rt.policy_path} holds other weights than those {out_dir} started with (sha256 "
            f"{plan['policy_sha256']}); run them with another --output"
        )
    return rt.policy_sha256


def planned_tasks(
    cls: type[Env],
    spec: int | str | None,
    *,
    seed: int,
    split: str,
    plan: dict[str, Any] | None,
    out_dir: Path,
) -> list[Task]:
    """The tasks `spec` selects: some, and (resuming) those the run started on."""
    tasks = cls.load_tasks(spec, seed=seed, split=split)
    if not tasks:
        raise ValueError(
            f"--tasks {spec} selects no tasks; pass a count of at least 1 or a task file with "
            "at least one record"
        )
    if plan is not None and [t.id for t in tasks] != plan["task_ids"]:
        raise ValueError(
            f"--tasks {spec} now selects other tasks than when {out_dir} started (the task "
            "file changed?); run them with another --output"
        )
    return tasks
