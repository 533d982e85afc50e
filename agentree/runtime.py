"""Assembles the parts an experiment needs from its config: policy, engine, chat format, env
factory, controller and scorer. `agentree train`, `rollout` and `eval` all start here.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from agentree.chat import ChatFormat
from agentree.config import ExperimentConfig
from agentree.engines.base import SamplingParams
from agentree.envs.base import Env, Task, env_class
from agentree.rollout.base import Controller, RolloutContext, RolloutStats, make_controller
from agentree.rollout.flat import FlatConfig, FlatGRPO
from agentree.scorers.base import NoScorer, make_scorer, scorer_class
from agentree.tree import Trajectory, Tree


class Runtime:
    """With `distributed.backend=ray`, `rollout`/`submit` run the same controller on Ray rollout
    workers (`agentree.distributed`); each worker builds its own local `Runtime`, passing the
    shared engine replicas' client as `engine`."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        log: Callable[[str], None] = print,
        *,
        engine: Any = None,
        scorer: Any = None,
    ) -> None:
        self.cfg = cfg
        self.log = log
        env_name, self.env_kwargs = cfg.component("env")
        self.env_name = env_name
        self.env_cls = env_class(env_name)
        rollout_name, rollout_kwargs = cfg.component("rollout")
        self.controller = make_controller(rollout_name, **rollout_kwargs)
        if self.controller.requires_fork and self.env_cls.snapshot is Env.snapshot:
            raise ValueError(
                f"--rollout {rollout_name} forks environments, but {self.env_cls.__name__} does "
                "not implement snapshot()/restore(); use --rollout grpo or implement them"
            )
        self.scorer = scorer or NoScorer()
        if self.controller.uses_scorer and scorer is None:
            scorer_name, scorer_kwargs = cfg.component("scorer")
            if cfg.distributed.backend != "ray" or not scorer_class(scorer_name).holds_model:
                self.scorer = make_scorer(scorer_name, **scorer_kwargs)
            # else: loaded once, in the Ray scorer actor (below)
        probe = self.make_env()  # envs construct cheaply; resources come with reset()
        try:
            self.env_stop = tuple(probe.stop_sequences)
        finally:
            probe.close()
        self.policy_path = resolve_policy(cfg, log)
        if engine is None:
            self.engine, self.model, self.tokenizer = build_engine(cfg, self.policy_path)
        else:
            self.engine, self.model, self.tokenizer = engine, None, engine.tokenizer
        self.chat = ChatFormat(self.tokenizer)
        self.rng = random.Random(cfg.seed)
        self._snapshot: Any = None
        self.cluster: Any = None
        if cfg.distributed.backend == "ray":
            from agentree.distributed.scheduler import RayRollouts

            try:
                self.cluster = RayRollouts(cfg, self.model, log=log)
            except BaseException:
                self.engine.close()
                raise
            if self.cluster.scorer_client is not None:
                self.scorer = self.cluster.scorer_client

    def make_env(self) -> Env:
        return self.env_cls(**self.env_kwargs)

    def load_tasks(self, spec: str | int | None, split: str = "train") -> list[Task]:
        tasks = self.env_cls.load_tasks(spec, seed=self.cfg.seed, split=split)
        if not tasks:
            raise ValueError(f"task source {spec!r} produced no tasks")
        return tasks

    def sampling(self, temperature: float | None = None) -> SamplingParams:
        e = self.cfg.engine
        return SamplingParams(
            max_tokens=e.max_tokens,
            temperature=e.temperature if temperature is None else temperature,
            top_p=e.top_p,
            top_k=e.top_k,
            stop_token_ids=self.chat.stop_token_ids,
            stop=tuple(e.stop) + self.env_stop,
        )

    def context(
        self, *, step: int = 0, temperature: float | None = None, progress: Any = None
    ) -> RolloutContext:
        return RolloutContext(
            engine=self.engine,
            chat=self.chat,
            sampling=self.sampling(temperature),
            env_factory=self.make_env,
            scorer=self.scorer,
            max_context=min(self.cfg.engine.max_context, self.engine.max_model_len),
            rng=self.rng,
            env_workers=self.cfg.engine.env_workers,
            progress=progress,
            step=step,
        )

    def rollout(
        self,
        tasks: Sequence[Task],
        *,
        step: int = 0,
        progress: Any = None,
        controller: Controller | None = None,
        temperature: float | None = None,
        rng: random.Random | None = None,
    ) -> tuple[list[Tree], RolloutStats]:
        """One tree per task, here or on the Ray rollout workers; not a single trajectory
        among them is an error saying why."""
        controller = controller or self.controller
        if self.cluster is not None:
            seed = (rng or self.rng).getrandbits(63)
            pending = self.cluster.submit(tasks, controller, step, temperature, seed)
            trees, stats = pending.result(progress)
        else:
            ctx = self.context(step=step, temperature=temperature, progress=progress)
            if rng is not None:
                ctx.rng = rng
            trees, stats = controller.rollout(tasks, ctx)
        if trees and not any(controller.group(tree) for tree in trees):
            raise ValueError(f"no trajectory could be produced: {self.why_empty(trees)}")
        return trees, stats

    def why_empty(self, trees: Sequence[Tree]) -> str:
        """Why `trees` hold not a single trajectory, in words a user can act on."""
        e, model_len = self.cfg.engine, self.engine.max_model_len
        longest = max(trees, key=lambda t: len(t.root.obs_ids) if t.nodes else 0)
        n = len(longest.root.obs_ids) if longest.nodes else 0
        if n > min(e.max_context, model_len) - e.max_tokens:
            if e.max_context <= model_len:
                limit, fix = f"engine.max_context={e.max_context}", "raise engine.max_context"
            else:
                limit, fix = f"the policy's context of {model_len}", "use a longer-context policy"
            return (
                f"the prompt of task {longest.task_id} has {n} tokens, more than {limit} allows "
                f"with engine.max_tokens={e.max_tokens}; {fix} or shorten the task"
            )
        ended = [node for t in trees for node in t.nodes if node.end_reason is not None]
        reasons = Counter(str(node.end_reason) for node in ended)
        errors = [node.info["error"] for node in ended if "error" in node.info]
        detail = f"; first error: {errors[0]}" if errors else ""
        return (
            f"every branch of {len(trees)} task(s) ended before the policy acted "
            f"(end reasons: {dict(reasons)}){detail}"
        )

    def submit(self, tasks: Sequence[Task], *, step: int = 0) -> Any:
        """Start a rollout without waiting; `.result()` returns (trees, stats). In-process the
        rollout runs on a thread against `self.engine` (see `agentree.distributed.local`)."""
        if self.cluster is not None:
            seed = self.rng.getrandbits(63)
            return self.cluster.submit(tasks, self.controller, step, None, seed)
        from agentree.distributed.local import ThreadRollout

        return ThreadRollout(self, tasks, step)

    def snapshot_engine(self) -> Any:
        """A second local engine over a copy of the policy, for rollouts that overlap updates."""
        if self._snapshot is None:
            import copy

            from agentree.engines.hf import HFEngine

            if not isinstance(self.engine, HFEngine):
                raise ValueError(
                    "train.async_steps=1 in-process needs engine.backend=transformers; "
                    "use distributed.backend=ray for other engines"
                )
            e = self.cfg.engine
            model = copy.deepcopy(self.model).eval().requires_grad_(False)
            self._snapshot = HFEngine(
                model,
                self.tokenizer,
                prefix_cache_mb=e.prefix_cache_mb,
                max_batch_size=e.max_batch_size,
                seed=self.cfg.seed + 1,
            )
        return self._snapshot

    def sync_weights(self, model: Any) -> None:
        """Give every engine (the local one, its snapshot and the Ray replicas) the weights."""
        self.engine.sync_weights(model)
        if self._snapshot is not None:
            self._snapshot.sync_weights(model)
        if self.cluster is not None:
            self.cluster.sync_weights(model)

    @staticmethod
    def success(tree: Tree, traj: Trajectory) -> bool:
        """The env's `success` flag at the leaf, else reward >= 1."""
        info = tree.nodes[traj.leaf].info.get("env", {})
        return bool(info.get("success", traj.reward >= 1.0))

    def close(self) -> None:
        try:
            if self.cluster is not None:
                self.cluster.close()
        finally:
            self.scorer.close()
            self.engine.close()


def resolve_policy(cfg: ExperimentConfig, log: Callable[[str], None]) -> str:
    """A loadable directory for `policy.path`: `tiny` and `warm`/`tiny-warm` are built (once,
    cached), named pretrained checkpoints fetched and converted, anything else is passed on."""
    path = cfg.policy.path
    if path not in ("tiny", "tiny-warm", "warm"):
        from agentree.models.pretrained import local_policy

        return local_policy(path, log)
    from agentree.models.tiny import tiny_policy_for_env
    from agentree.models.warm import WARM_ENVS, warm_policy_for_env

    env_name, env_kwargs = cfg.component("env")
    warm = cfg.policy.warm
    if path == "tiny-warm" and warm.base != "tiny":
        raise ValueError(
            f"policy.path tiny-warm fine-tunes the tiny policy, but policy.warm.base is "
            f"{warm.base}; set policy.path: warm to fine-tune {warm.base}"
        )
    t0 = time.perf_counter()
    if path != "tiny" and env_name not in WARM_ENVS:
        # the default config's policy meets a user env: there is no scripted expert to warm
        # it up with, so start from the untrained base and say so
        start = "the tiny policy" if warm.base == "tiny" else warm.base
        log(
            f"{path} has a scripted expert for {', '.join(WARM_ENVS)} only; {env_name} starts "
            f"from {start} (fine-tune one with agentree sft and pass --policy DIR)"
        )
        if warm.base != "tiny":
            from agentree.models.pretrained import local_policy

            return local_policy(warm.base, log)
        path = "tiny"
    if path == "tiny":
        out = tiny_policy_for_env(env_name, env_kwargs, cfg.policy.tiny, log=log)
    else:
        out = warm_policy_for_env(env_name, env_kwargs, cfg.policy.tiny, warm, log)
    log(f"{path} policy for {env_name}: {out} ({time.perf_counter() - t0:.1f}s)")
    return str(out)


def build_engine(cfg: ExperimentConfig, path: str) -> tuple[Any, Any, Any]:
    """(engine, trainable model, tokenizer). The transformers engine shares the model."""
    import torch

    from agentree.engines.hf import HFEngine, load_policy

    torch.manual_seed(cfg.seed)
    model, tokenizer = load_policy(path, dtype=cfg.policy.dtype, device=cfg.policy.device)
    e = cfg.engine
    if e.backend == "transformers":
        engine = HFEngine(
            model,
            tokenizer,
            prefix_cache_mb=e.prefix_cache_mb,
            max_batch_size=e.max_batch_size,
            seed=cfg.seed,
        )
    else:
        from agentree.engines.vllm import VLLMEngine

        # Sample in the trainer's dtype (vLLM's "auto" may pick bfloat16 for a float32
        # checkpoint), so sampled and recomputed log-probs agree.
        kwargs = {"dtype": str(model.dtype).removeprefix("torch."), **e.vllm}
        engine = VLLMEngine(path, tokenizer, seed=cfg.seed, **kwargs)
    return engine, model, tokenizer


def evaluate(
    rt: Runtime,
    cfg: ExperimentConfig,
    *,
    seed: int,
    tasks: Sequence[Task] | None = None,
    samples: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Success rate on held-out tasks: `samples` independent trajectories per task."""
    tasks = list(tasks) if tasks is not None else rt.load_tasks(cfg.eval.tasks, split="eval")
    k = samples or cfg.eval.samples
    rt.engine.seed(seed)
    t0 = time.perf_counter()
    controller = FlatGRPO(FlatConfig(G=k))
    trees, stats = rt.rollout(
        tasks,
        controller=controller,
        temperature=cfg.eval.temperature,
        rng=random.Random(seed),
        progress=progress,
    )
    per_task = []
    for tree in trees:
        trajs = controller.group(tree)
        wins = [rt.success(tree, t) for t in trajs]
        per_task.append(
            {
                "task_id": tree.task_id,
                "success": sum(wins) / max(len(wins), 1),
                "solved": any(wins),
                "rewards": [t.reward for t in trajs],
                "turns": [t.num_turns for t in trajs],
                "end_reasons": [str(t.end_reason) for t in trajs],
            }
        )
    n = max(len(per_task), 1)
    summary = {
        "success_rate": sum(p["success"] for p in per_task) / n,
        "pass_at_k": sum(p["solved"] for p in per_task) / n,
        "reward_mean": sum(sum(p["rewards"]) / max(len(p["rewards"]), 1) for p in per_task) / n,
        "tasks": len(per_task),
        "samples": k,
        "wall_s": time.perf_counter() - t0,
    }
    return {"summary": summary, "per_task": per_task, "trees": trees, "stats": stats}
