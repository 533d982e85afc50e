"""Training tensors from trajectories, and the log-probs the loss is computed on.

The padded layout: one right-padded row per root-to-leaf trajectory. Targets are shifted by
one (logits at position t predict token t+1), so `mask`, `adv` and `sampled_lp` describe the
predicted tokens 1..T-1 of each row.

Log-probs come from the full [tokens x vocab] logits, or with `chunk > 0` from slices of
`chunk` tokens through the output layer (`chunked_logprobs`): each slice's fp32 logits are
recomputed in the backward pass instead of kept, so at most one slice of them exists at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentree.algorithms.output_layer import chunked_logprobs
from agentree.tree import Trajectory


@dataclass
class Batch:
    """Right-padded training tensors for a list of trajectories."""

    ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    sampled_lp: torch.Tensor


def make_batch(trajs: Sequence[Trajectory], advs: Sequence[Sequence[float]], pad: int) -> Batch:
    n, length = len(trajs), max(len(t.token_ids) for t in trajs)
    ids = torch.full((n, length), pad, dtype=torch.long)
    attn = torch.zeros(n, length, dtype=torch.long)
    mask = torch.zeros(n, length)
    adv = torch.zeros(n, length)
    lp = torch.zeros(n, length)
    for i, (t, a) in enumerate(zip(trajs, advs, strict=True)):
        k = len(t.token_ids)
        ids[i, :k] = torch.tensor(t.token_ids)
        attn[i, :k] = 1
        mask[i, :k] = torch.tensor(t.loss_mask, dtype=torch.float)
        adv[i, :k] = torch.tensor(a, dtype=torch.float)
        lp[i, :k] = torch.tensor(t.logprobs, dtype=torch.float)
    # logits at position t predict token t+1: align targets by shifting left
    return Batch(ids, attn, mask[:, 1:], adv[:, 1:], lp[:, 1:])


def padded_micro_batches(
    trajs: Sequence[Trajectory], advs: Sequence[Sequence[float]], pad: int, size: int
) -> list[Batch]:
    """Micro-batches of `size` trajectories, sorted by length so padding stays small."""
    order = sorted(range(len(trajs)), key=lambda i: len(trajs[i].token_ids))
    return [
        make_batch(
            [trajs[i] for i in order[s : s + size]], [advs[i] for i in order[s : s + size]], pad
        )
        for s in range(0, len(order), size)
    ]


def token_logprobs(model: Any, b: Batch, temperature: float, chunk: int = 0) -> torch.Tensor:
    """log pi(token_t | tokens_<t) for t >= 1, under the sampling temperature."""
    dev = next(model.parameters()).device
    ids = b.ids.to(dev)
    if chunk:
        n, length = ids.shape
        rows = torch.arange(n * length, device=dev).view(n, length)[:, :-1].flatten()
        with chunked_logprobs(model, rows, ids[:, 1:].flatten(), temperature, chunk):
            out = model(input_ids=ids, attention_mask=b.attn.to(dev)).logits
        return out.view(n, length - 1)
    logits = model(input_ids=ids, attention_mask=b.attn.to(dev)).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
