"""Held-out evaluation for `agentree train` (every `eval_every` steps), `agentree eval` and
`agentree view`, with one success rule (`success`): a leaf that ended in an env error or a
timeout failed; otherwise the env's `success` flag at the leaf decides, else a return >= 1.

`agentree eval` runs trajectories on a task set and reports the success (resolved) rate.

The policy is either a model (sampled through the engine, `samples` trajectories per task) or a
scripted sanity policy the env provides (SWE's `gold` and `empty`). Every task counts: a task
that errors, times out or produces nothing is a failure, never silently dropped. Writes
`eval.json` (summary, per-task results, timings and, for a model, what sampling cost: tokens
generated and prefilled, env steps, env errors), `predictions.jsonl` when the env reports
SWE-bench style predictions, and the trees under `trees/`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agentree.config import ExperimentConfig
from agentree.envs.base import Env, ScriptedPolicy, Task, env_class
from agentree.rollout.base import RolloutStats
from agentree.rollout.turn.flat import FlatConfig, FlatGRPO
from agentree.rollout.turn.turns import scripted_episode
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
from agentree.run.outputs import claim
from agentree.run.runtime import Runtime
from agentree.tools import tool_schemas
from agentree.tree import EndReason, Tree, save_trees


def samples_text(n: int) -> str:
    """'1 sample', '4 samples': how many trajectories each task gets, as the logs say it."""
    return f"{n} sample{'s' if n != 1 else ''}"


def evaluate(
    rt: Runtime,
    cfg: ExperimentConfig,
    *,
    seed: int,
    tasks: Sequence[Task] | None = None,
    samples: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Success rate on held-out tasks: `samples` independent trajectories per task, sampled at
    `eval.temperature` through the runtime's rollouts (in-process or on Ray)."""
    if tasks is None:
        tasks = rt.tasks.get("eval") or rt.load_tasks(cfg.eval.tasks, split="eval")
    k = samples or cfg.eval.samples
    rng = seeded(rt, seed)
    t0 = time.perf_counter()
    trees, stats = rt.rollouts.rollout(
        list(tasks),
        controller=FlatGRPO(FlatConfig(G=k)),
        temperature=cfg.eval.temperature,
        rng=rng,
        progress=progress,
    )
    result = summarise(trees, cfg.policy.path, time.perf_counter() - t0, samples=k)
    return {**result, "trees": trees, "stats": stats}


def run_eval(
    cfg: ExperimentConfig,
    out_dir: Path,
    *,
    tasks: str | None = None,
    samples: int | None = None,
    resume: bool = False,
    log: Callable[[str], None] = print,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Evaluate `cfg`'s policy and write `out_dir` (`eval.json`, `config.yaml`, `trees/`).

    The tasks run in blocks of `eval.save_every`, each sampled as one batch with its own seed
    and saved under `blocks/` as it finishes (`agentree.run.blocks`). `resume` continues a
    stopped evaluation from its saved blocks, with the tasks, samples and weights it started
    with, so it ends with the results of an evaluation never stopped. The directory is claimed
    first (never a training run, a folder agentree did not write, or a stopped evaluation
    without `resume`)."""
    claim(out_dir, "eval", resume=resume)
    saved = SavedBlocks(out_dir, "eval", RESULTS)
    plan = saved.resumed_plan(resume, log)
    if plan is not None:
        tasks = as_saved("--tasks", tasks, plan["tasks"], out_dir)
        samples = as_saved("--samples", samples, plan["samples"], out_dir)
    samples = 1 if samples is None else samples
    if samples < 1:
        raise ValueError(f"--samples {samples}: pass at least 1 trajectory per task")
    env_name, env_kwargs = cfg.component("env")
    cls = env_class(env_name)
    spec = tasks if tasks is not None else cfg.eval.tasks
    task_list = planned_tasks(cls, spec, seed=cfg.seed, split="eval", plan=plan, out_dir=out_dir)
    cls.prepare_tasks(task_list, progress=log, **env_kwargs)
    probe = cls(**env_kwargs)  # envs construct cheaply; resources come with reset()
    tools = tool_schemas(probe.tools())
    probe.close()
    scripted = (
        cls.scripted_policy(cfg.policy.path, tools)
        if tools
        else cls.scripted_policy(cfg.policy.path)
    )
    blocks = cut(task_list, cfg.eval.save_every)

    def runtime() -> Runtime | None:
        if scripted is not None:
            log(f"evaluating scripted policy '{cfg.policy.path}' on {len(task_list)} tasks")
            return None
        rt = Runtime(cfg, log=log)
        log(f"evaluating {rt.policy_path} on {len(task_list)} tasks x {samples_text(samples)}")
        return rt

    def sample(
        rt: Runtime | None, k: int, block: Sequence[Task]
    ) -> tuple[list[Tree], RolloutStats | None]:
        if rt is None:
            return run_scripted(cls, env_kwargs, scripted, block, cfg.engine.env_workers), None
        seed, shown = block_seed(cfg.seed, k), in_block(progress, k, len(blocks))
        out = evaluate(rt, cfg, seed=seed, tasks=block, samples=samples, progress=shown)
        return out["trees"], out["stats"]

    flags = {"tasks": spec, "samples": samples}
    finished, sha256, wall_s = saved.sample(cfg, blocks, plan, flags, runtime, sample, log)
    trees, stats = joined(finished)
    result = summarise(trees, cfg.policy.path, wall_s)
    if sha256:  # the weights behind the figure: one recipe has built different ones
        result["summary"]["policy_sha256"] = sha256
    if stats is not None:  # a model sampled every block
        result["rollout_stats"] = stats.to_dict()
    _write(out_dir, trees, result)
    saved.clear()
    return result


RESULTS = ("eval.json", "predictions.jsonl", "trees", "view.html")
"""A finished evaluation's outputs (and `agentree view`'s page of them), which a new evaluation
into its folder removes first."""


def run_scripted(
    cls: type[Env],
    env_kwargs: dict[str, Any],
    policy: ScriptedPolicy,
    tasks: Sequence[Task],
    workers: int,
) -> list[Tree]:
    """One episode per task with a scripted policy; envs always closed, errors recorded.

    On Ctrl-C every running episode stops after its current step and closes its env before the
    interrupt propagates, so nothing is left running.
    """
    stop = threading.Event()

    def episode(task: Task) -> Tree:
        tree = Tree(task.id, task.to_dict())
        env = cls(**env_kwargs)
        t0 = time.perf_counter()
        try:
            scripted_episode(env, task, policy, tree=tree, stop=stop)
        except Exception as e:  # the task fails; the evaluation goes on (Ctrl-C propagates)
            if not tree.nodes:
                tree.add_root("", [], {})
            leaf = tree.nodes[-1] if len(tree.nodes) > 1 else tree.add_child(0)
            leaf.end_reason = EndReason.ENV_ERROR
            leaf.info["error"] = repr(e)
        finally:
            env.close()
        tree.meta["wall_s"] = round(time.perf_counter() - t0, 3)
        return tree

    pool = ThreadPoolExecutor(max_workers=max(1, min(workers, len(tasks))))
    try:
        futures = [pool.submit(episode, t) for t in tasks]
        return [f.result() for f in futures]
    except KeyboardInterrupt:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def summarise(
    trees: Sequence[Tree], policy: str, wall_s: float, samples: int | None = None
) -> dict[str, Any]:
    """Per-task results and the summary (success rate, pass@k, mean return) of `trees`."""
    per_task = []
    predictions = []
    for tree in trees:
        leaves = tree.finished_leaves()
        wins = [tree.success(leaf.id) for leaf in leaves]
        item: dict[str, Any] = {
            "task_id": tree.task_id,
            "success": sum(wins) / len(wins) if wins else 0.0,
            "solved": any(wins),
            "samples": len(leaves),
            "rewards": [sum(n.reward for n in tree.path(leaf.id)) for leaf in leaves],
            "end_reasons": [str(leaf.end_reason) for leaf in leaves],
            "turns": [leaf.turn for leaf in leaves],
            "wall_s": tree.meta.get("wall_s"),
        }
        errors = [leaf.info["error"] for leaf in leaves if "error" in leaf.info]
        if errors:
            item["errors"] = errors
        for leaf in leaves:
            pred = leaf.info.get("env", {}).get("prediction")
            if pred is not None:
                predictions.append({**pred, "model_name_or_path": policy})
                if "grading" in leaf.info.get("env", {}):
                    item["grading"] = leaf.info["env"]["grading"]
        per_task.append(item)
    n = max(len(per_task), 1)
    rate = sum(p["success"] for p in per_task) / n
    summary: dict[str, Any] = {
        "success_rate": rate,
        "pass_at_k": sum(p["solved"] for p in per_task) / n,
        "reward_mean": sum(sum(p["rewards"]) / max(len(p["rewards"]), 1) for p in per_task) / n,
        "tasks": len(per_task),
        "samples": samples or max((p["samples"] for p in per_task), default=0),
        "policy": policy,
        "wall_s": round(wall_s, 2),
        "metric": "success_rate",
    }
    if predictions:
        # SWE-bench convention: unresolved, empty, errored and missing all count as failures
        summary["resolved_rate"] = rate
        summary["metric"] = "resolved_rate"
    return {"summary": summary, "per_task": per_task, "predictions": predictions}


def _write(out_dir: Path, trees: Sequence[Tree], result: dict[str, Any]) -> None:
    save_trees(trees, out_dir / "trees")
    body = {"summary": result["summary"], "per_task": result["per_task"]}
    if "rollout_stats" in result:  # what sampling cost: tokens, env steps, env errors
        body["rollout_stats"] = result["rollout_stats"]
    (out_dir / "eval.json").write_text(json.dumps(body, indent=1))
    if result["predictions"]:
        with open(out_dir / "predictions.jsonl", "w") as f:
            for p in result["predictions"]:
                f.write(json.dumps(p) + "\n")
