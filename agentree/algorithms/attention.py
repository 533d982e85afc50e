"""The attention kernel the policy's model runs on (registered as transformers' `sdpa` when
a policy is loaded, `agentree.hub.load.load_policy`): transformers' own, except that on the CPU
grouped-query attention with a mask shares each KV head instead of copying it per query head.
It runs inside the model's forward, in generation and in the update alike."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def cpu_gqa_sdpa(
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
    # deferred: transformers takes seconds to import, and only a model's forward needs it
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
