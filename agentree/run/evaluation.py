"""Held-out evaluation for `agentree train` (every `eval_every` steps), `agentree eval` and
`agentree view`, with one success rule (`success`): a leaf that ended in an env error or a
timeout failed; otherwise the env's `success` flag at the leaf decides, else a return >= 1.

`agentree eval` runs trajectories on a task set and reports the success (resolved) rate.

The policy is either a model (sampled through the engine, `samples` trajectories per task) or a
scripted sanity policy the env provides (SWE's `gold` and `empty`). Every task counts: a task
that errors, times out or produces nothing is a failure, never silently dropped. Writes
`eval.json` (summary, per-task results, timings), `predictions.jsonl` when the env reports
SWE-bench style predictions, and the trees under `trees/`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agentree.config import ExperimentConfig
from agentree.envs.base import Env, ScriptedPolicy, Task, env_class
from agentree.rollout.turn.flat import FlatConfig, FlatGRPO
from agentree.rollout.turn.turns import scripted_episode
from agentree.run.outputs import EVAL_BLOCKS, claim, mark, write_whole
from agentree.run.runtime import Runtime
from agentree.tools import tool_schemas
from agentree.tree import EndReason, Tree, save_trees


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
    rt.engine.seed(seed)
    t0 = time.perf_counter()
    trees, stats = rt.rollouts.rollout(
        list(tasks),
        controller=FlatGRPO(FlatConfig(G=k)),
        temperature=cfg.eval.temperature,
        rng=random.Random(seed),
        progress=progress,
    )
    result = summarise(trees, cfg.policy.path, time.perf_counter() - t0, samples=k)
    return {**result, "trees": trees, "stats": stats}


BLOCK_SEED = 104_729
"""`agentree eval` samples its block k with seed `cfg.seed + BLOCK_SEED * k`: block 0 samples
at the config's seed, so an evaluation of one block is one batch, as training's evaluation is."""


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
    and saved under `blocks/` as it finishes. `resume` continues a stopped evaluation from its
    saved blocks, with the tasks, samples and weights it started with, so it ends with the
    results of an evaluation never stopped. The directory is claimed first (never a training
    run, a folder agentree did not write, or a stopped evaluation without `resume`)."""
    claim(out_dir, "eval", resume=resume)
    saved = SavedBlocks(out_dir)
    plan = saved.plan() if resume else None
    if resume and plan is None:
        if (out_dir / "eval.json").exists():
            raise ValueError(f"{out_dir} holds a finished evaluation: nothing to resume")
        log(f"nothing to resume in {out_dir} (no block saved yet): starting at the first task")
    if plan is not None:
        tasks = _as_saved("--tasks", tasks, plan["tasks"], out_dir)
        samples = _as_saved("--samples", samples, plan["samples"], out_dir)
    samples = 1 if samples is None else samples
    if samples < 1:
        raise ValueError(f"--samples {samples}: pass at least 1 trajectory per task")
    env_name, env_kwargs = cfg.component("env")
    cls = env_class(env_name)
    spec = tasks if tasks is not None else cfg.eval.tasks
    task_list = _eval_tasks(cls, spec, cfg.seed, plan, out_dir)
    cls.prepare_tasks(task_list, progress=log, **env_kwargs)
    probe = cls(**env_kwargs)  # envs construct cheaply; resources come with reset()
    tools = tool_schemas(probe.tools())
    probe.close()
    scripted = (
        cls.scripted_policy(cfg.policy.path, tools)
        if tools
        else cls.scripted_policy(cfg.policy.path)
    )
    t0 = time.perf_counter()
    n = cfg.eval.save_every
    blocks = [task_list[i : i + n] for i in range(0, len(task_list), n)]
    done = saved.finished(blocks) if plan is not None else {}
    earlier_s = sum(wall for _, wall in done.values())
    if done:
        log(f"resuming {out_dir}: {saved.count(blocks, done)} of {len(task_list)} tasks saved")
    rt: Runtime | None = None
    sha256 = plan["policy_sha256"] if plan is not None else None
    try:
        if scripted is not None:
            log(f"evaluating scripted policy '{cfg.policy.path}' on {len(task_list)} tasks")
        elif len(done) < len(blocks):
            rt = Runtime(cfg, log=log)
            log(f"evaluating {rt.policy_path} on {len(task_list)} tasks x {samples} samples")
            sha256 = _same_weights(rt, plan, out_dir)
        mark(out_dir, "eval")  # the inputs are valid, the policy loaded: the first file
        if plan is None:
            ids = [t.id for t in task_list]
            saved.start(cfg, {"tasks": spec, "samples": samples, "task_ids": ids}, sha256)
        for k, block in enumerate(blocks):
            if k in done:
                continue
            b0 = time.perf_counter()
            if rt is None:
                trees = run_scripted(cls, env_kwargs, scripted, block, cfg.engine.env_workers)
            else:
                seed = cfg.seed + BLOCK_SEED * k
                shown = _in_block(progress, k, len(blocks))
                trees = evaluate(rt, cfg, seed=seed, tasks=block, samples=samples, progress=shown)[
                    "trees"
                ]
            done[k] = (trees, time.perf_counter() - b0)
            saved.save(k, *done[k])
            if len(blocks) > 1:
                count = saved.count(blocks, done)
                log(f"block {k + 1} of {len(blocks)} saved: {count} of {len(task_list)} tasks")
    except KeyboardInterrupt:
        log(saved.interrupted(blocks, done))
        raise
    finally:
        if rt is not None:
            rt.close()
    trees = [tree for k in range(len(blocks)) for tree in done[k][0]]
    result = summarise(trees, cfg.policy.path, earlier_s + time.perf_counter() - t0)
    if sha256:  # the weights behind the figure: one recipe has built different ones
        result["summary"]["policy_sha256"] = sha256
    _write(out_dir, trees, result)
    saved.clear()
    return result


def _in_block(
    progress: Callable[[str], None] | None, k: int, blocks: int
) -> Callable[[str], None] | None:
    """`progress` naming block k of `blocks` (as is when there is one)."""
    if progress is None or blocks == 1:
        return progress
    return lambda msg: progress(f"block {k + 1} of {blocks}: {msg}")


def _as_saved(flag: str, value: Any, saved: Any, out_dir: Path) -> Any:
    """The value a resumed evaluation started with; a flag that would change it is an error."""
    if value is not None and str(value) != str(saved):
        raise ValueError(
            f"--resume continues the evaluation in {out_dir} with {flag} {saved}, and {flag} "
            f"{value} would change it; drop that flag, or evaluate with another --output"
        )
    return saved


def _same_weights(rt: Runtime, plan: dict[str, Any] | None, out_dir: Path) -> str | None:
    """The sha256 of the policy's weights, which a resumed evaluation must have started with."""
    if plan is not None and rt.policy_sha256 != plan["policy_sha256"]:
        raise ValueError(
            f"{rt.policy_path} holds other weights than those {out_dir} started with (sha256 "
            f"{plan['policy_sha256']}); evaluate them with another --output"
        )
    return rt.policy_sha256


def _eval_tasks(
    cls: type[Env], spec: int | str, seed: int, plan: dict[str, Any] | None, out_dir: Path
) -> list[Task]:
    """The held-out tasks `spec` selects: some, and (resuming) those the evaluation started on."""
    task_list = cls.load_tasks(spec, seed=seed, split="eval")
    if not task_list:
        raise ValueError(
            f"--tasks {spec} selects no tasks; pass a count of at least 1 or a task file with "
            "at least one record"
        )
    if plan is not None and [t.id for t in task_list] != plan["task_ids"]:
        raise ValueError(
            f"--tasks {spec} now selects other tasks than when {out_dir} started (the task "
            "file changed?); evaluate them with another --output"
        )
    return task_list


Finished = dict[int, tuple[list[Tree], float]]
"""Block index -> (its trees, its sampling time in seconds)."""


class SavedBlocks:
    """What `agentree eval` keeps in `DIR/blocks/` until its last block is done: `plan.json`
    (the tasks, samples and weights it started with) and one `block_K/` per finished block,
    each written aside and renamed, so a stop at any moment leaves only whole blocks."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.dir = out_dir / EVAL_BLOCKS

    def plan(self) -> dict[str, Any] | None:
        path = self.dir / "plan.json"
        return json.loads(path.read_text()) if path.exists() else None

    def start(self, cfg: ExperimentConfig, plan: dict[str, Any], sha256: str | None) -> None:
        """Begin a new evaluation: an earlier one's results go (none of them is this one's)."""
        for name in ("eval.json", "predictions.jsonl"):
            (self.out_dir / name).unlink(missing_ok=True)
        for path in (self.out_dir / "trees", self.dir):
            shutil.rmtree(path, ignore_errors=True)
        (self.out_dir / "config.yaml").write_text(cfg.to_yaml())
        self.dir.mkdir(parents=True)
        write_whole(self.dir / "plan.json", json.dumps({**plan, "policy_sha256": sha256}))

    def block(self, k: int) -> Path:
        return self.dir / f"block_{k:05d}"

    def save(self, k: int, trees: Sequence[Tree], wall_s: float) -> None:
        final = self.block(k)
        tmp = final.with_name(f".{final.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_trees(trees, tmp / "trees")
        meta = {"wall_s": wall_s, "task_ids": [t.task_id for t in trees]}
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
                raise ValueError(f"{path} does not hold the tasks of block {k}; evaluate again")
            out[k] = (trees, float(meta["wall_s"]))
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
            f"{self.out_dir}; continue with: agentree eval --output {self.out_dir} --resume"
        )

    def clear(self) -> None:
        shutil.rmtree(self.dir)


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
    (out_dir / "eval.json").write_text(json.dumps(body, indent=1))
    if result["predictions"]:
        with open(out_dir / "predictions.jsonl", "w") as f:
            for p in result["predictions"]:
                f.write(json.dumps(p) + "\n")
