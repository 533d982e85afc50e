"""`agentree rollout`: the trees of the configured controller on a task set, without training.

Writes `trees/`, `config.yaml` and `rollout_stats.json` (the controller's counters summed over the
tasks, the success rate of the trajectories it groups, the share of well-formed actions). The
tasks run in blocks of `save_every`, each saved as it finishes (`agentree.run.blocks`), so a
rollout of hundreds of SWE tasks stopped by Ctrl-C, `kill` or a closed terminal continues with
`--resume` and ends with the trees of one never stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentree.config import ExperimentConfig
from agentree.envs.base import Task, env_class
from agentree.rollout.base import RolloutStats, action_format, make_controller
from agentree.run.blocks import (
    SavedBlocks,
    as_saved,
    block_seed,
    cut,
    in_block,
    joined,
    planned_tasks,
    seeded,
)
from agentree.run.outputs import claim, write_whole
from agentree.run.runtime import Runtime
from agentree.tree import Tree, save_trees

RESULTS = ("rollout_stats.json", "trees", "view.html")
"""A finished rollout's outputs (and `agentree view`'s page of them), which a new rollout into
its folder removes first."""
TASKS = "8"
"""The tasks of a rollout without --tasks."""
SAVE_EVERY = 64
"""Tasks a block by default: every figure documented for `agentree rollout` is of one block."""


def run_rollout(
    cfg: ExperimentConfig,
    out_dir: Path,
    *,
    tasks: str | None = None,
    save_every: int | None = None,
    resume: bool = False,
    log: Callable[[str], None] = print,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Tree], dict[str, Any]]:
    """Roll out `cfg`'s controller on `tasks` (the training split; the env's default when
    None) and write `out_dir`; the trees and the stats written to `rollout_stats.json`.

    `resume` continues a stopped rollout from its saved blocks with the tasks, block size and
    weights it started with. The directory is claimed first (never a training run, a folder
    agentree did not write, or a stopped rollout without `resume`)."""
    claim(out_dir, "rollout", resume=resume)
    saved = SavedBlocks(out_dir, "rollout", RESULTS)
    plan = saved.resumed_plan(resume, log)
    if plan is not None:
        tasks = as_saved("--tasks", tasks, plan["tasks"], out_dir)
        save_every = as_saved("--save-every", save_every, plan["save_every"], out_dir)
    tasks = TASKS if tasks is None else tasks
    save_every = SAVE_EVERY if save_every is None else save_every
    if save_every < 1:
        raise ValueError(f"--save-every {save_every}: save a block every 1 task or more")
    env_name, env_kwargs = cfg.component("env")
    cls = env_class(env_name)
    task_list = planned_tasks(cls, tasks, seed=cfg.seed, split="train", plan=plan, out_dir=out_dir)
    blocks = cut(task_list, save_every)
    cls.prepare_tasks(task_list, progress=log, **env_kwargs)

    def runtime() -> Runtime:
        rt = Runtime(cfg, log=log)
        log(f"agentree rollout {cfg.rollout['name']} on {len(task_list)} {env_name} tasks")
        return rt

    def sample(rt: Runtime | None, k: int, block: Sequence[Task]) -> tuple[list[Tree], Any]:
        assert rt is not None
        rng = seeded(rt, block_seed(cfg.seed, k))
        return rt.rollouts.rollout(block, rng=rng, progress=in_block(progress, k, len(blocks)))

    flags = {"tasks": tasks, "save_every": save_every}
    finished, _, _ = saved.sample(cfg, blocks, plan, flags, runtime, sample, log)
    trees, stats = joined(finished)
    assert stats is not None  # every block was sampled by the controller
    summary = summarise(cfg, trees, stats)
    save_trees(trees, out_dir / "trees")
    write_whole(out_dir / "rollout_stats.json", json.dumps(summary, indent=1))
    saved.clear()
    return trees, summary


def summarise(cfg: ExperimentConfig, trees: list[Tree], stats: RolloutStats) -> dict[str, Any]:
    """`stats` with the tasks, the success rate of the trajectories the controller groups (the
    ones a training step would learn from) and the share of well-formed actions."""
    name, kwargs = cfg.component("rollout")
    controller = make_controller(name, **kwargs)
    wins = n = 0
    for tree in trees:
        for t in controller.group(tree):
            wins += tree.success(t.leaf)
            n += 1
    well, judged = action_format(trees)
    return {
        **stats.to_dict(),
        "tasks": len(trees),
        "success_rate": wins / max(n, 1),
        "well_formed_actions": well / judged if judged else None,
    }
