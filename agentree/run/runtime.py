"""Assembles what an experiment needs from its config, in an order that fails fast: the rollout
side (env class, controller, scorer) and the task sources first, then the policy and its
engine, then the `Rollouts` that make trees (in this process, or on Ray workers). `agentree
train`, `rollout` and `eval` all start here; nothing here runs a rollout or an update.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from agentree.config import ExperimentConfig
from agentree.envs.base import Task
from agentree.hub.store import weights_sha256
from agentree.policy import build_engine, resolve_policy
from agentree.rollouts import LocalRollouts, Rollouts, rollout_parts


class Runtime:
    """The assembled parts. `tasks` maps a split ("train", "eval") to its task source; each is
    loaded and checked before any model is built, so a bad task file costs no model load."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        log: Callable[[str], None] = print,
        *,
        tasks: Mapping[str, str | int | None] | None = None,
    ) -> None:
        self.cfg = cfg
        ray = cfg.distributed.backend == "ray"
        parts = rollout_parts(cfg, remote_scorer=ray)
        self.env_cls, self.env_kwargs = parts.env_cls, parts.env_kwargs
        self.controller = parts.controller
        self.tasks = {split: self.load_tasks(spec, split) for split, spec in (tasks or {}).items()}
        self.policy_path = resolve_policy(cfg, log)
        self.policy_sha256 = weights_sha256(self.policy_path)
        """The sha256 of the policy's weights (`weights_sha256`): what names the starting point
        of a result, since one recipe key has built different weights on different machines.
        None for a hub id or a checkpoint without safetensors weights."""
        if self.policy_sha256:
            log(f"policy weights: sha256 {self.policy_sha256} ({self.policy_path})")
        self.engine, self.model, self.tokenizer = build_engine(cfg, self.policy_path)
        self.rollouts: Rollouts
        if ray:
            # deferred: ray is the optional [ray] extra, loaded only for distributed.backend=ray
            from agentree.distributed.scheduler import RayRollouts

            try:
                self.rollouts = RayRollouts(cfg, parts, self.engine, self.model, log=log)
            except BaseException:
                parts.scorer.close()
                self.engine.close()
                raise
        else:
            self.rollouts = LocalRollouts(cfg, parts, self.engine, self.tokenizer)

    def load_tasks(self, spec: str | int | None, split: str = "train") -> list[Task]:
        tasks = self.env_cls.load_tasks(spec, seed=self.cfg.seed, split=split)
        if not tasks:
            raise ValueError(f"task source {spec!r} produced no tasks")
        return tasks

    def close(self) -> None:
        self.rollouts.close()
