"""Loading a policy checkpoint into a model and its tokenizer: the one `from_pretrained` path
that the engines, the learner, SFT and the benchmarks share. A named checkpoint
(`smollm2-135m`) or a GGUF file is fetched or converted first (`agentree.hub.pretrained`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

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
            f"--policy {path} does not exist; pass tiny, a model directory (such as a run's "
            "checkpoints/step_NNNNNN) or a hub id"
        )
    if p.is_dir() and not (p / "config.json").exists():
        raise FileNotFoundError(
            f"--policy {path} holds no model (no config.json); pass a directory written by "
            "save_pretrained, such as a run's checkpoints/step_NNNNNN"
        )


def _cpu_gqa_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa` attention, except that grouped-query attention on the CPU with a
    mask (every padded batch and tree-packed row) lets torch's kernel share each KV head
    (`enable_gqa`) instead of first copying it once per query head: transformers does that
    copy off CUDA, and at a few thousand cached tokens the copies cost more than the
    attention itself (benchmarks/real_model.py `long_context`). Same result to the bit; every
    other case goes to transformers' own function."""
    # deferred: transformers takes seconds to import; agentree.hub is imported by configs
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (
        getattr(module, "num_key_value_groups", 1) > 1
        and query.device.type == "cpu"
        and attention_mask is not None
        and kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
        and not kwargs.get("output_attentions", False)
    ):
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            enable_gqa=True,
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
    )


def load_policy(path: str | Path, *, dtype: str = "auto", device: str = "auto") -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer the ordinary way (`from_pretrained`); a named
    pretrained checkpoint (`smollm2-135m`) or a GGUF file is fetched or converted first."""
    # deferred: transformers takes seconds to import; agentree.hub is imported by configs
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    AttentionInterface.register("sdpa", _cpu_gqa_sdpa)
    # torch's CPU kernels split their work one way until set_num_threads is first called and
    # another afterwards, the same count or not; a warm-start build calls it (`one_thread`), so
    # without this a run that built its policy first and one that found it cached diverge
    # (the default run: gradients apart in the 7th digit at step 2, held-out 48.0% against
    # 30.1% after 100 steps)
    torch.set_num_threads(torch.get_num_threads())
    path = local_policy(str(path))
    check_policy_path(path)
    device, torch_dtype = resolve_device_dtype(device, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
    return model, tokenizer
