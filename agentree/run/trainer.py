"""GRPO/DAPO training on tree-structured rollout groups.

Each step rolls out one tree per task with the configured controller, takes every tree's
rollout group (PATR Eq. 6: all finished leaves, pruned ones included), and minimises

    L = agg_t[ -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t) + beta * k3_t ]

over the policy tokens of every trajectory (`agentree.algorithms.loss.policy_loss`), where
rho_t = pi_theta / pi_old, A_t is the group-normalised outcome advantage of the trajectory
(PATR Eq. 9; or TreePO / TreeRL per-segment advantages), k3_t the KL estimate to the initial
policy, and agg is DAPO's token-mean or GRPO's sequence-mean.

Differences from the papers, on purpose:
- pi_old is recomputed with the current weights before the update, as verl does; the sampling
  log-probs are kept to measure drift (`train/logprob_drift`), which stays ~0 because
  trajectories are the exact sampled ids (no re-tokenisation), and, with `train.rollout_is`,
  to weight each token by the truncated ratio pi_old / pi_sampler (verl's rollout IS) where
  the sampling engine differs from the trainer (vLLM in bf16, stale weights).
- DAPO dynamic sampling (optional) drops groups whose rewards are all equal and refills the
  batch with fresh tasks, for at most `max_refill_rounds` extra rollouts per step.
- For off-policy data, verl's dual-clip (`train.clip_ratio_c`) and log-ratio clamp
  (`train.log_ratio_clamp`) are on by default; on-policy (one epoch, one minibatch) they are
  inert. `configs/frozenlake_patr_eq2.yaml` turns them off and is PATR Eq. 2 as printed.

This file is the one loop (roll out, update, publish weights, evaluate, save) for every
combination the config allows. It talks to two seams and does not know which implementation
sits behind either:
- `agentree.rollouts.Rollouts` makes the trees: in this process, on a thread ahead of the update
  (`train.async_steps=1`), or on Ray rollout workers;
- `agentree.learner.base.Learner` holds the trainable weights: one process training the engine's own
  model, or a separate copy (FSDP2 ranks, LoRA, bf16). Every rank runs this loop; rank 0 rolls
  out and broadcasts the batch (`agentree.learner.sharding`), every rank updates.
The update itself is `agentree.learner.update` (advantages, micro-batches, loss, optimiser steps);
the run directory's checkpoints are `agentree.run.checkpoint` plus the learner's weights.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agentree.algorithms.packing import Batch, make_batch, token_logprobs
from agentree.config import ExperimentConfig, LogConfig
from agentree.envs.base import Task
from agentree.hub.store import write_policy_record
from agentree.learner.base import Learner, make_learner
from agentree.learner.sharding import barrier, broadcast_object, init_distributed
from agentree.rollout.base import RolloutStats, action_format
from agentree.rollouts import PendingRollout
from agentree.run.checkpoint import begin_checkpoint, finish_checkpoint, latest_checkpoint
from agentree.run.evaluation import evaluate, samples_text
from agentree.run.resume import trim_metrics
from agentree.run.runtime import Runtime
from agentree.run.tracking import Tracker
from agentree.signals import StopSignals
from agentree.tree import EndReason, Trajectory, Tree, save_trees

__all__ = ["Batch", "Trainer", "lr_at", "make_batch", "token_logprobs"]


class Trainer:
    """The training loop of one rank: rank 0 also owns the runtime (rollouts, engine, tasks)
    and the run directory."""

    progress: Callable[[str], None] | None = None
    """Receives the rollout's live progress (per worker on Ray) while a step rolls out."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        run_dir: Path,
        log: Callable[[str], None] = print,
        runtime: Runtime | None = None,
    ):
        self.cfg = cfg
        self.dir = run_dir
        tc = cfg.train
        self.rank, self.world = init_distributed(cfg)
        self.log = log if self.rank == 0 else _quiet
        self.step = 0
        self.rng = random.Random(cfg.seed)
        self.rt: Runtime | None = None
        if self.rank == 0:
            tasks = {"train": cfg.tasks, "eval": cfg.eval.tasks}
            self.rt = runtime or Runtime(cfg, log=log, tasks=tasks)
        self.learner: Learner = make_learner(cfg, self.rt, self.rng)
        self.train_tasks: list[Task] = []
        if self.rt is not None:
            self.train_tasks = self.rt.tasks.get("train") or self.rt.load_tasks(cfg.tasks)
        self._order: list[int] = []
        self._cursor = 0
        self.stop = StopSignals()
        self._step_start: dict[str, Any] | None = None
        self._eval_start: dict[str, Any] | None = None
        """The loop state before the held-out evaluation due after a step: what a checkpoint
        taken until it is written holds, marked so that the resumed run evaluates again."""
        self._warned_cut = False  # `_warn_cut` speaks once a run
        self._warned_evicted = False  # and `_warn_evicted`
        self._finished = False
        """Restored from a checkpoint written after the run's final evaluation."""
        self._trained_s = 0.0
        """Seconds spent training so far (rollouts, updates, checkpoints; not evaluation)."""
        log_cfg = cfg.log if self.rank == 0 else LogConfig()  # one rank reports
        self.tracker = Tracker(log_cfg, run_dir, cfg.model_dump(), tc.trees_every)
        self._pending: tuple[PendingRollout, int] | None = None
        """async_steps=1: the next step's rollout in flight, and the weight version it samples."""
        self._weights: Any = self.learner.publish()  # a collective under FSDP
        """What the engines were last given (rank 0)."""

    @property
    def model(self) -> Any:
        return self.learner.model

    @property
    def updater(self) -> Any:
        return self.learner.updater

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.learner.opt

    # -- tasks -------------------------------------------------------------------------------
    def next_tasks(self, n: int) -> list[Task]:
        """Cycle through the training tasks in a seeded shuffled order."""
        out = []
        for _ in range(n):
            if self._cursor >= len(self._order):
                self._order = list(range(len(self.train_tasks)))
                self.rng.shuffle(self._order)
                self._cursor = 0
            out.append(self.train_tasks[self._order[self._cursor]])
            self._cursor += 1
        return out

    # -- main loop ---------------------------------------------------------------------------
    def fit(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> dict:
        tc = self.cfg.train
        history: dict[str, Any] = {}
        if self.step == 0:  # a stop during it checkpoints the state from before it, as below
            self._eval_start = self._loop_state()
            history["eval_before"] = self.evaluate()
        elif self._eval_start is not None and self.step < tc.steps:  # cut before its evaluation
            self._evaluate_after_step()
        self._eval_start = None
        while self.step < tc.steps:
            t0 = time.monotonic()
            metrics = self.train_step()
            self.step += 1
            self._trained_s += time.monotonic() - t0
            metrics["time/trained_min"] = self._trained_s / 60
            self.write_metrics(metrics)
            self._step_start = None
            last = self.step >= tc.steps or self._out_of_time()
            due = bool(tc.eval_every) and self.step % tc.eval_every == 0 and not last
            if due:  # from here a stop checkpoints the state before the evaluation
                self._eval_start = self._loop_state()
            self.stop.release()  # a stop requested during the update takes effect here
            if due:
                metrics.update(self._evaluate_after_step())
            if on_step is not None:
                on_step(self.step, metrics)
            if tc.save_every and self.step % tc.save_every == 0:
                t0 = time.monotonic()
                self.save()
                self._trained_s += time.monotonic() - t0
            if last:
                break
        if self.step < tc.steps:
            self.log(
                f"train.max_minutes={tc.max_minutes:g} reached after step {self.step} "
                f"({self._trained_s / 60:.1f} min of training): stopping"
            )
        history["eval_after"] = self.evaluate()
        self.save(finished=True)
        self.tracker.close()
        return history

    def _out_of_time(self) -> bool:
        """Rank 0's clock decides for every rank, so all ranks stop at the same step."""
        limit = self.cfg.train.max_minutes
        return bool(limit) and bool(broadcast_object(self._trained_s >= 60 * limit))

    def _evaluate_after_step(self) -> dict[str, float]:
        """The periodic held-out evaluation, `_eval_start` set. A run stopped before it is
        written checkpoints the state from before it and evaluates again when resumed, so the
        curve keeps the point and the resumed run draws what the uninterrupted one drew."""
        metrics = self.evaluate()
        self._eval_start = None
        return metrics

    def evaluate(self, log: bool = True) -> dict[str, float]:
        if self.rt is None:
            return {}
        result = evaluate(self.rt, self.cfg, seed=self.cfg.seed + 7919 * (self.step + 1))
        summary = result["summary"]
        metrics = {f"eval/{k}": v for k, v in summary.items() if isinstance(v, int | float)}
        self.write_metrics(metrics)
        if log:
            s = result["summary"]
            self.log(
                f"held-out success rate at step {self.step}: {100 * s['success_rate']:.1f}% "
                f"({s['tasks']} tasks x {samples_text(s['samples'])}, pass@{s['samples']} "
                f"{100 * s['pass_at_k']:.1f}%)"
            )
        return metrics

    def train_step(self) -> dict[str, float]:
        """Roll out (rank 0), update (every rank), publish the weights. With `async_steps=1`
        the rollout of step t+1 is started (on the weights of step t) before step t's update
        and collected at step t+1, so every batch is at most one update stale and its pi_old
        is the sampling log-probs."""
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        payload = None
        if self.rt is not None:
            metrics, payload = self._rollout_step()
        trees, groups, stale = broadcast_object(payload)
        # A checkpoint must never hold weights half-way through an update, so a stop is held
        # from the first optimiser step to the end of the step. Before that step nothing has
        # changed: one synchronous process honours a stop at once and checkpoints the state
        # from before this step's rollout. Ranks (which must stop together) and a rollout in
        # flight for the next step hold it from here.
        if self.world > 1 or self._pending is not None:
            self.stop.hold()
        if trees:
            t1 = time.perf_counter()
            metrics.update(self.update(trees, groups, stale=stale, commit=self.stop.hold))
            metrics["time/update_s"] = time.perf_counter() - t1
        self.stop.hold()
        self.publish()
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    def _rollout_step(self) -> tuple[dict[str, float], Any]:
        """Rank 0: this step's batch (and the next step's rollout started, when async)."""
        assert self.rt is not None
        tc = self.cfg.train
        t0 = time.perf_counter()
        self._step_start = self._loop_state()  # what a checkpoint holds if the rollout is cut
        trees, trajs, stats, dropped, version = self.collect()
        t_roll = time.perf_counter() - t0
        staleness = self.step - version
        if tc.async_steps and self.step + 1 < tc.steps:
            pending = self.rt.rollouts.submit(
                self.next_tasks(tc.tasks_per_step), step=self.step + 1
            )
            self._pending = (pending, self.step)
        metrics = self._rollout_metrics(trees, trajs, stats)
        self._warn_cut(metrics)
        self._warn_evicted(metrics)
        metrics["train/groups_dropped"] = dropped
        # groups whose rewards differ: the only ones a group-relative advantage learns from
        metrics["train/groups_informative"] = sum(len({t.reward for t in ts}) > 1 for ts in trajs)
        metrics["train/staleness"] = float(staleness)
        metrics["time/rollout_s"] = t_roll
        if tc.trees_every and (self.step + 1) % tc.trees_every == 0:
            self.save_trees(trees)
        usable = [(tree, ts) for tree, ts in zip(trees, trajs, strict=True) if ts]
        return metrics, ([u[0] for u in usable], [u[1] for u in usable], staleness > 0)

    def publish(self) -> None:
        """The learner's weights into the engines (a collective under FSDP). Engines sampling
        a pending rollout keep their weights until it is collected."""
        weights = self.learner.publish()
        if self.rt is not None:
            self._weights = weights
            self.rt.rollouts.sync_weights(weights, busy=self._pending is not None)

    def _first_round(self, n: int) -> tuple[list[Tree], RolloutStats, int]:
        """The prefetched rollout (async) or a fresh one; and the weight version it sampled."""
        assert self.rt is not None
        if self._pending is None:
            return *self.rt.rollouts.rollout(
                self.next_tasks(n), step=self.step, progress=self.progress
            ), self.step
        pending, version = self._pending
        self._pending = None
        trees, st = pending.result()
        # engines were left on the old weights while that rollout ran; catch them up now
        self.rt.rollouts.sync_weights(self._weights)
        return trees, st, version

    def collect(self) -> tuple[list[Tree], list[list[Trajectory]], RolloutStats, int, int]:
        """Roll out this step's batch (rank 0): its trees, each tree's group, the rollout
        counts, the groups dropped and the weight version sampled. With dynamic sampling,
        uninformative groups are replaced. Trajectories that ended in an env error (a crashed
        env or a lost worker) are not the policy's doing and stay out of the loss."""
        assert self.rt is not None
        tc = self.cfg.train
        stats = RolloutStats()
        keep_trees: list[Tree] = []
        keep_trajs: list[list[Trajectory]] = []
        dropped = 0
        need = tc.tasks_per_step
        rounds = 0
        version = self.step
        while need > 0:
            if rounds == 0:
                trees, st, version = self._first_round(need)
            else:
                trees, st = self.rt.rollouts.rollout(
                    self.next_tasks(need), step=self.step, progress=self.progress
                )
            stats.add(st)
            for tree in trees:
                group = self.rt.controller.group(tree)
                group = [t for t in group if t.end_reason != EndReason.ENV_ERROR]
                informative = len({t.reward for t in group}) > 1
                if tc.dynamic_sampling and not informative and rounds < tc.max_refill_rounds:
                    dropped += 1
                    continue
                keep_trees.append(tree)
                keep_trajs.append(group)
            need = tc.tasks_per_step - len(keep_trees)
            rounds += 1
            if not tc.dynamic_sampling:
                break
        return keep_trees, keep_trajs, stats, dropped, version

    def _warn_cut(self, metrics: dict[str, float]) -> None:
        """Said once a run: the env-step budget cut more trajectories than it let finish, so
        the groups trained on are mostly the short episodes (on an env whose failures run to
        the turn limit, mostly the successes)."""
        cut, done = metrics.get("rollout/budget_cut", 0.0), metrics["rollout/trajectories"]
        if cut > done and not self._warned_cut:
            self._warned_cut = True
            self.log(
                f"warning: rollout.env_step_budget cut {cut:.0f} trajectories this step and "
                f"let {done:.0f} finish: the groups hold mostly short episodes (where failures "
                f"run to the turn limit, mostly successes); rollout.budget_reserve=true starts "
                f"only what the budget can finish"
            )

    def _warn_evicted(self, metrics: dict[str, float]) -> None:
        """Said once a run: the engine's prefix cache is too small for the branches the
        rollout keeps live, so it dropped KV that their next turns needed and computed it again
        (more than a tenth of the prompt tokens prefilled): the rollout is slower, and what it
        samples differs only by float rounding."""
        lost = metrics.get("rollout/policy_tokens_evicted", 0.0)
        prefilled = metrics.get("rollout/policy_tokens_prefilled", 0.0)
        if lost > 0.1 * prefilled and not self._warned_evicted:
            self._warned_evicted = True
            self.log(
                f"warning: the prefix cache had held {lost:,.0f} of the {prefilled:,.0f} prompt "
                f"tokens this step computed and dropped them for room, so the rollout computed "
                f"them again: raise engine.prefix_cache_mb ({self.cfg.engine.prefix_cache_mb} "
                f"MiB now)"
            )

    def _rollout_metrics(
        self, trees: list[Tree], trajs: list[list[Trajectory]], stats: RolloutStats
    ) -> dict[str, float]:
        flat = [t for ts in trajs for t in ts]
        n = max(len(flat), 1)
        d = stats.to_dict()
        m: dict[str, float] = {
            k if k.startswith("distributed/") else f"rollout/{k}": float(v)
            for k, v in d.items()
            if isinstance(v, int | float)
        }
        m["scorer/calls"] = float(stats.scorer_calls)
        m["scorer/fallbacks"] = float(stats.scorer_fallbacks)
        m["train/reward_mean"] = sum(t.reward for t in flat) / n
        wins = [tree.success(t.leaf) for tree, ts in zip(trees, trajs, strict=True) for t in ts]
        m["train/success_rate"] = sum(wins) / n
        m["train/group_size"] = len(flat) / max(len(trajs), 1)
        m["train/turns_mean"] = sum(t.num_turns for t in flat) / n
        m["train/response_tokens_mean"] = sum(t.num_policy_tokens for t in flat) / n
        m["train/pruned_frac"] = sum(t.pruned for t in flat) / n
        well, judged = action_format(trees)
        m["rollout/actions_judged"], m["rollout/actions_well_formed"] = judged, well
        return m

    # -- update ------------------------------------------------------------------------------
    def update(
        self,
        trees: list[Tree],
        groups: list[list[Trajectory]],
        stale: bool = False,
        commit: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        lr = lr_at(self.cfg.train, self.step)
        return self.learner.update(trees, groups, lr=lr, stale=stale, commit=commit)

    # -- run directory -----------------------------------------------------------------------
    def write_metrics(self, metrics: dict[str, float]) -> None:
        if self.rank != 0:
            return
        row = {"step": self.step, "time": round(time.time(), 3), **metrics}
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        self.tracker.log(row)

    def save_trees(self, trees: list[Tree]) -> None:
        save_trees(trees, self.dir / "trees", prefix=f"step{self.step + 1:06d}_")

    def save(self, finished: bool = False) -> Path:
        """A checkpoint of this step (every rank takes part); the same format for every
        learner, so any learner on any world size resumes it. `finished`: the run's last
        checkpoint, after its final evaluation."""
        tmp = begin_checkpoint(self.dir, self.step) if self.rank == 0 else None
        tmp = Path(broadcast_object(str(tmp)))
        self.learner.save(tmp)
        ckpt = self.dir / "checkpoints" / f"step_{self.step:06d}"
        if self.rt is not None:
            self.rt.tokenizer.save_pretrained(tmp)
            write_policy_record(tmp, self.cfg.policy.tool_format, self.cfg.env.get("action_format"))
            lora = self.cfg.train.lora
            state = {
                "step": self.step,
                **(self._step_start or self._eval_start or self._loop_state()),
                "eval_due": self._eval_start is not None,
                "finished": finished,
                "policy": self.rt.policy_path,
                "lora": lora.model_dump() if lora.r else None,
            }
            torch.save(state, tmp / "trainer_state.pt")
            ckpt = finish_checkpoint(self.dir, self.step, self.cfg.train.keep_checkpoints)
        barrier()
        return ckpt

    def _restore_loop_state(self, state: dict[str, Any]) -> None:
        """The step, task order and RNGs of a checkpoint's trainer state."""
        self.step = state["step"]
        self.rng.setstate(state["rng"])
        self._order, self._cursor = state["order"], state["cursor"]
        torch.set_rng_state(state["torch_rng"])
        self._trained_s = state.get("trained_s", 0.0)
        if self.rt is not None and "rollouts" in state:  # absent in older checkpoints
            self.rt.rollouts.load_state(state["rollouts"])
        self._eval_start = self._loop_state() if state.get("eval_due") else None
        self._finished = bool(state.get("finished"))

    def _loop_state(self) -> dict[str, Any]:
        return {
            "rng": self.rng.getstate(),
            "order": list(self._order),
            "cursor": self._cursor,
            "torch_rng": torch.get_rng_state(),
            "trained_s": self._trained_s,
            **({"rollouts": self.rt.rollouts.state()} if self.rt is not None else {}),
        }

    @property
    def trained_s(self) -> float:
        """Seconds spent in training steps and checkpoints over the whole run, every process
        that resumed it included (evaluations not counted)."""
        return self._trained_s

    @property
    def complete(self) -> bool:
        """Resumed from the final checkpoint of a run that trained all its steps."""
        return self._finished and self.step >= self.cfg.train.steps

    def resume(self) -> Path | None:
        """Load the newest complete checkpoint of the run directory (written by any learner on
        any world size; an incomplete one is skipped, with a line saying why), if any, and
        drop the metrics rows written after it (all of them when there is none: the run
        starts over). Returns the checkpoint loaded."""
        ckpt = latest_checkpoint(self.dir, log=self.log)
        if ckpt is None:
            if self.rank == 0:
                trim_metrics(self.dir / "metrics.jsonl", None)
            return None
        self.learner.load(ckpt)
        self._restore_loop_state(torch.load(ckpt / "trainer_state.pt", weights_only=False))
        self.publish()
        if self.rank == 0:
            trim_metrics(self.dir / "metrics.jsonl", self.step)
        return ckpt

    def close(self) -> None:
        self.tracker.close()
        try:
            if self.rt is not None:
                self.rt.close()
        finally:
            self.learner.close()


def _quiet(msg: str) -> None:
    pass


def lr_at(tc: Any, step: int) -> float:
    """Learning rate for optimiser step `step` (0-based): linear warm-up, then the schedule."""
    if tc.warmup_steps and step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    if tc.lr_schedule == "constant":
        return tc.lr
    span = max(tc.steps - tc.warmup_steps - 1, 1)
    progress = min(1.0, (step - tc.warmup_steps) / span)
    floor = tc.lr * tc.lr_min_ratio
    return floor + (tc.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
