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
from agentree.tree import Trajectory, Tree


@dataclass
class Batch:
    """Right-padded training tensors for a list of trajectories."""

    ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    sampled_lp: torch.Tensor


def turn_samples(
    trees: Sequence[Tree],
    groups: Sequence[Sequence[Trajectory]],
    advs: Sequence[Sequence[Sequence[float]]],
) -> tuple[list[list[Trajectory]], list[list[list[float]]]]:
    """The sequences an update trains, with their per-token advantages, per tree.

    A tree without a history window trains each trajectory as one sequence (returned as
    given). With one (`Tree.history`), every turn of a trajectory is its own sequence
    (`Tree.turn_trajectories`): its action ids get the advantages the estimator gave those
    ids in the whole trajectory, its prompt ids none (they carry no loss)."""
    out_groups: list[list[Trajectory]] = []
    out_advs: list[list[list[float]]] = []
    for tree, group, group_advs in zip(trees, groups, advs, strict=True):
        if tree.history is None:
            out_groups.append(list(group))
            out_advs.append([list(a) for a in group_advs])
            continue
        samples: list[Trajectory] = []
        sample_advs: list[list[float]] = []
        for traj, adv in zip(group, group_advs, strict=True):
            by_node: dict[int, list[float]] = {}
            for owner, m, a in zip(traj.node_of_token, traj.loss_mask, adv, strict=True):
                if m:
                    by_node.setdefault(owner, []).append(a)
            for turn in tree.turn_trajectories(traj):
                action = by_node[turn.nodes[-1]]
                samples.append(turn)
                sample_advs.append([0.0] * (len(turn.token_ids) - len(action)) + action)
        out_groups.append(samples)
        out_advs.append(sample_advs)
    return out_groups, out_advs


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
