"""Loading a policy checkpoint into a model and its tokenizer: the one `from_pretrained` path
that the engines, the learner, SFT and the benchmarks share. A named checkpoint
(`smollm2-135m`) or a GGUF file is fetched or converted first (`agentree.hub.pretrained`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from agentree.algorithms.attention import cpu_gqa_sdpa
from agentree.hub.pretrained import local_policy


def resolve_device_dtype(device: str = "auto", dtype: str = "auto") -> tuple[str, torch.dtype]:
    """`auto` means CUDA with bf16 when available, else CPU with fp32."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        return device, torch.bfloat16 if device.startswith("cuda") else torch.float32
    return device, getattr(torch, dtype)


def check_policy_path(path: str | Path) -> None:
    """A local path that is not a model directory fails here, before transformers reads it as
    a hub id (a path that does not exist) or asks for a tokenizer converter (an empty dir)."""
    p = Path(path).expanduser()
    looks_local = p.is_absolute() or str(path).startswith((".", "~")) or len(p.parts) > 2
    if not p.exists() and looks_local:
        raise FileNotFoundError(
            f"--policy {path} does not exist; pass a name that `agentree models list` shows, a "
            "model directory (such as a run's checkpoints/step_NNNNNN) or a hub id"
        )
    if p.is_dir() and not (p / "config.json").exists():
        raise FileNotFoundError(
            f"--policy {path} holds no model (no config.json); pass a directory written by "
            "save_pretrained, such as a run's checkpoints/step_NNNNNN"
        )


def load_policy(path: str | Path, *, dtype: str = "auto", device: str = "auto") -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer the ordinary way (`from_pretrained`); a named
    pretrained checkpoint (`smollm2-135m`) or a GGUF file is fetched or converted first."""
    # deferred: transformers takes seconds to import; agentree.hub is imported by configs
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    AttentionInterface.register("sdpa", cpu_gqa_sdpa)
    # torch's CPU kernels split their work one way until set_num_threads is first called and
    # another afterwards, the same count or not; a warm-start build calls it (`one_thread`), so
    # without this a run that built its policy first and one that found it cached diverge
    # (the default run: gradients apart in the 7th digit at step 2, held-out 48.0% against
    # 30.1% after 100 steps)
    torch.set_num_threads(torch.get_num_threads())
    path = local_policy(str(path))
    check_policy_path(path)
    device, torch_dtype = resolve_device_dtype(device, dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as e:  # a hub id the hub could not give (offline, a typo, a private repo)
        if Path(path).expanduser().exists():
            raise
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OSError(
            f"--policy {path} is neither a local directory nor a name that `agentree models list` "
            f"shows, and the Hugging Face hub could not provide it: {reason}"
        ) from e
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
    return model, tokenizer
