"""Log-probs of chosen tokens straight from a causal LM's output layer, in slices.

`chunked_logprobs` makes the output layer return log pi(target) at chosen positions instead of
the [tokens x vocab] logits, `chunk` positions at a time, each slice's fp32 logits recomputed in
the backward pass instead of kept. The RL update uses it to bound memory (`train.logits_chunk`);
SFT uses it to compute logits only where there is a target token (an agent's tool outputs, most
of a SWE trajectory, have none).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def chunked_logprobs(
    model: Any, rows: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int
) -> Iterator[None]:
    """Inside, the model's output layer returns log pi(targets[i]) at flattened position
    rows[i] (a [len(rows)] tensor, in `model(...).logits`) instead of the logits.

    The slices run inside the model's own forward, where FSDP has gathered the output layer's
    weight, so the same code serves sharded and unsharded models."""
    head = model.get_output_embeddings()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.flatten(0, -2)[rows]
        parts = []
        for s in range(0, h.shape[0], chunk):
            args = (h[s : s + chunk], head.weight, head.bias, targets[s : s + chunk], temperature)
            if torch.is_grad_enabled():
                # keep only the slice's hidden states; its logits are recomputed in backward
                parts.append(torch.utils.checkpoint.checkpoint(_slice, *args, use_reentrant=False))
            else:
                parts.append(_slice(*args))
        return torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # back to the class's forward: plain logits


def _slice(
    h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor, temp: float
) -> torch.Tensor:
    logits = torch.nn.functional.linear(h, w, bias).float()
    if temp > 0 and temp != 1.0:
        logits = logits / temp
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
