"""Training tensors from trajectories, padded or tree-packed, and the log-probs the loss is
computed on.

**Padded rows.** One right-padded row per root-to-leaf trajectory (`make_batch`,
`padded_micro_batches`). Targets are shifted by one (logits at position t predict token t+1),
so `mask`, `adv` and `sampled_lp` describe the predicted tokens 1..T-1 of each row.

**Tree-packed rows: every shared prefix is forwarded once.** A rollout group is a tree, but
padded rows give each root-to-leaf trajectory its own row, so a prefix shared by k leaves is
forwarded and back-propagated k times. Packing merges the group's trajectories into a prefix
trie over their token ids (nodes of the rollout tree share their tokens, and so do siblings
that sampled the same tokens), each trie node becomes one token of a packed row, and the model
runs once over the rows with

- tree attention: a 4D mask in which each token attends to itself and its ancestors in the
  trie (never to a sibling branch, never to another tree in the same row);
- position ids = the token's depth, its index in every trajectory through it,

so every token is conditioned on exactly the context it had in its trajectory and its log-prob
equals the padded one. An index map then gathers the packed log-probs back into the padded
[trajectory, position] layout, and `agentree.algorithms.loss.policy_loss` runs on those tensors
unchanged. This keeps the objective exact, clip included (min(rho A, clip(rho) A) is not linear in
A, so a shared token cannot just carry a summed advantage): the surrogate is evaluated per
(trajectory, token) pair on the shared log-prob, and the gather's backward sums the pairs'
gradients into the shared token. A token shared by k trajectories thus receives the sum of
their loss weights (advantage x aggregation weight; `token_weights` computes them), its k3 KL
to the reference likewise, and pi_old / reference log-probs are computed once per token.

Attention goes through the model's ordinary forward with a boolean 4D mask, which SDPA takes
as is (transformers passes a 4D mask through unchanged). FlexAttention's block masks would skip
the masked blocks, but it has no backward on CPU (torch 2.13), so the dense mask is what runs
here: a packed row of length L pays for all L^2 query-key pairs, while a padded row without
padding takes SDPA's causal path and pays for about half.

Which layout a batch uses (`train.packing`): `tree`, `padded`, or `auto`, which picks the
layout with the smaller `layout_cost`: per row, `L * (1 + L / kappa)` for a packed row and
`L * (1 + L / (2 kappa))` for a padded one (linear layers grow with the row's tokens,
attention with their square), kappa = `ATTN_PER_WIDTH[device type] * hidden_size`.

Log-probs come from the full [tokens x vocab] logits, or with `chunk > 0` from slices of
`chunk` tokens through the output layer (`chunked_logprobs`): each slice's fp32 logits are
recomputed in the backward pass instead of kept, so at most one slice of them exists at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentree.algorithms.loss import Aggregation, row_tokens
from agentree.algorithms.output_layer import chunked_logprobs
from agentree.tree import Trajectory, Tree


@dataclass
class Batch:
    """Right-padded training tensors for a list of trajectories (or turns of them, under a
    history window). `seq_tokens` [rows]: the policy tokens of each row's whole trajectory, the
    denominator seq-mean weighs its tokens by (`agentree.algorithms.loss.loss_normalizer`)."""

    ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    sampled_lp: torch.Tensor
    seq_tokens: torch.Tensor


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
    mask = mask[:, 1:]
    seq = mask.sum(-1)  # a whole trajectory is its own sequence
    for i, t in enumerate(trajs):
        if t.trajectory_tokens is not None:  # a turn: its trajectory's policy tokens
            seq[i] = t.trajectory_tokens
    return Batch(ids, attn, mask, adv[:, 1:], lp[:, 1:], seq)


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


ATTN_PER_WIDTH = {"cpu": 3.0, "cuda": 13.0}
"""kappa / hidden_size by device type, where kappa is the row length at which a dense-masked
row's attention costs as much as the rest of its forward and backward. CPU: the 2-core machine
with the tiny Qwen2 (hidden 128), 4096 tokens as 16 x 256 vs 1 x 4096 rows take 1 : 7.4, kappa
~ 400. CUDA: `benchmarks/packing_break_even.py` on an H200 with the Qwen2.5-0.5B shape (hidden
896, bf16 autocast), 8192 tokens as 32 x 256 vs 1 x 8192 take 1 : 1.67, kappa ~ 11800 (shorter
totals are launch-bound and give 13-18 x hidden or no penalty at all). Other device types take
the CPU's figure."""


@dataclass
class PackedBatch:
    """Packed rows for a set of trees plus the padded-layout loss tensors of their trajectories.

    `mask`, `adv`, `sampled_lp`, `seq_tokens` are those of `make_batch` on the same
    trajectories (targets shifted by one), so the loss and its normaliser are computed exactly
    as for a `Batch`.
    """

    ids: torch.Tensor  # [rows, L] packed token ids (pad where a row is shorter)
    position_ids: torch.Tensor  # [rows, L] depth of each token in its trajectories
    tree_mask: torch.Tensor  # [rows, L, L] bool: query token may attend to key token
    prev: torch.Tensor  # [n_targets] flat index (row * L + col) of each target's parent token
    target: torch.Tensor  # [n_targets] flat index of each target token
    index: torch.Tensor  # [n_traj, T-1] target number of token t+1 (n_targets off the mask)
    mask: torch.Tensor
    adv: torch.Tensor
    sampled_lp: torch.Tensor
    seq_tokens: torch.Tensor

    @property
    def forwarded_tokens(self) -> int:
        """Tokens the model runs over (row padding included)."""
        return int(self.ids.numel())


@dataclass
class _Trie:
    """A prefix trie over token ids: node k holds one token, its parent and its depth."""

    token: list[int]
    parent: list[int]
    depth: list[int]
    path: list[list[int]]  # per trajectory, the trie node of each of its tokens


def build_trie(seqs: Sequence[Sequence[int]]) -> _Trie:
    """Merge token sequences into a trie; node ids are in insertion order (parents first)."""
    token: list[int] = []
    parent: list[int] = []
    depth: list[int] = []
    children: list[dict[int, int]] = []
    roots: dict[int, int] = {}
    paths: list[list[int]] = []
    for seq in seqs:
        path: list[int] = []
        kids, up = roots, -1
        for d, tok in enumerate(seq):
            node = kids.get(tok)
            if node is None:
                node = len(token)
                token.append(tok)
                parent.append(up)
                depth.append(d)
                children.append({})
                kids[tok] = node
            path.append(node)
            kids, up = children[node], node
        paths.append(path)
    return _Trie(token, parent, depth, paths)


def _fill_rows(lengths: Sequence[int]) -> list[list[int]]:
    """First-fit decreasing: trees into rows no longer than the longest tree, so several short
    trees share a row instead of each being padded to the longest."""
    cap = max(lengths)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(cap - lengths[i])
    return rows


def _ancestor_mask(parent: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: node k attends to node j iff j is k or one of its ancestors."""
    n = len(parent)
    block = torch.zeros(n, n, dtype=torch.bool)
    # Nodes are numbered parent-first, so one pass builds each row from its parent's row.
    for k, p in enumerate(parent):
        if p >= 0:
            block[k] = block[p]
        block[k, k] = True
    return block


def _targets(
    tries: Sequence[_Trie], flat_of: Sequence[Sequence[int]], mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prev, target, index) of `PackedBatch`: each distinct policy token once, and for each
    (trajectory, position) of `mask` its target number (len(target) off the mask)."""
    prev: list[int] = []
    target: list[int] = []
    number: dict[int, int] = {}  # flat index of a target token -> its target number
    on = mask.bool().tolist()
    index = [[-1] * len(r) for r in on]
    i = 0
    for g, tr in enumerate(tries):
        flat = flat_of[g]
        for path in tr.path:
            # Only policy tokens are targets: the loss never reads the others.
            for t in range(1, len(path)):
                if not on[i][t - 1]:
                    continue
                f = flat[path[t]]
                if f not in number:
                    number[f] = len(target)
                    target.append(f)
                    prev.append(flat[path[t - 1]])
                index[i][t - 1] = number[f]
            i += 1
    idx = torch.tensor(index, dtype=torch.long).reshape(mask.shape)
    idx[idx < 0] = len(target)
    return torch.tensor(prev, dtype=torch.long), torch.tensor(target, dtype=torch.long), idx


def pack(
    groups: Sequence[Sequence[Any]],
    advs: Sequence[Sequence[Sequence[float]]],
    pad: int,
) -> PackedBatch:
    """Pack groups of trajectories (one trie per group) into rows; see the module doc."""
    trajs = [t for g in groups for t in g]
    base = make_batch(trajs, [a for g in advs for a in g], pad)
    tries = [build_trie([t.token_ids for t in g]) for g in groups]
    rows = _fill_rows([len(tr.token) for tr in tries])
    width = max(sum(len(tries[i].token) for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    tree_mask = torch.zeros(len(rows), width, width, dtype=torch.bool)
    tree_mask[:, range(width), range(width)] = True  # padding attends to itself: no empty rows
    flat_of: list[list[int]] = [[] for _ in tries]  # trie node -> flat packed index
    for r, row in enumerate(rows):
        off = 0
        for g in row:
            tr = tries[g]
            n = len(tr.token)
            ids[r, off : off + n] = torch.tensor(tr.token)
            pos[r, off : off + n] = torch.tensor(tr.depth)
            tree_mask[r, off : off + n, off : off + n] = _ancestor_mask(tr.parent)
            flat_of[g] = [r * width + off + k for k in range(n)]
            off += n
    prev, target, idx = _targets(tries, flat_of, base.mask)
    return PackedBatch(
        ids=ids,
        position_ids=pos,
        tree_mask=tree_mask,
        prev=prev,
        target=target,
        index=idx,
        mask=base.mask,
        adv=base.adv,
        sampled_lp=base.sampled_lp,
        seq_tokens=base.seq_tokens,
    )


def packed_micro_batches(
    groups: Sequence[Sequence[Any]],
    advs: Sequence[Sequence[Sequence[float]]],
    pad: int,
    size: int,
) -> list[PackedBatch]:
    """Micro-batches of whole groups (a tree is never split), each holding about `size`
    trajectories; a group larger than `size` forms a micro-batch of its own."""
    out: list[PackedBatch] = []
    cur: list[int] = []
    count = 0
    for g in range(len(groups)):
        if cur and count + len(groups[g]) > size:
            out.append(pack([groups[i] for i in cur], [advs[i] for i in cur], pad))
            cur, count = [], 0
        cur.append(g)
        count += len(groups[g])
    if cur:
        out.append(pack([groups[i] for i in cur], [advs[i] for i in cur], pad))
    return out


def attention_mask(model: Any, tree_mask: torch.Tensor) -> torch.Tensor:
    """The tree mask as the model's attention implementation takes a custom 4D mask:
    boolean for SDPA, additive float (0 / -inf-like) for eager."""
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    mask = tree_mask.unsqueeze(1)  # [rows, 1 head (broadcast), L, L]
    if impl == "sdpa":
        return mask
    if impl == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    raise ValueError(
        f"tree packing needs attn_implementation 'sdpa' or 'eager', not {impl!r}; "
        "set train.packing=padded"
    )


def packed_token_logprobs(
    model: Any, b: PackedBatch, temperature: float, chunk: int = 0
) -> torch.Tensor:
    """log pi of every distinct target token, once: [n_targets], in `b.target` order."""
    dev = next(model.parameters()).device
    inputs = {
        "input_ids": b.ids.to(dev),
        "attention_mask": attention_mask(model, b.tree_mask).to(dev),
        "position_ids": b.position_ids.to(dev),
    }
    if chunk:
        tokens = b.ids.flatten()[b.target].to(dev)
        with chunked_logprobs(model, b.prev.to(dev), tokens, temperature, chunk):
            return model(**inputs).logits
    out = model(**inputs)
    # A target's logits are those of its parent token (the previous token of its trajectory,
    # which in a packed row need not be the previous column).
    logits = out.logits.flatten(0, 1)[b.prev.to(dev)].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    tokens = b.ids.flatten()[b.target].to(dev)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def unpack(b: PackedBatch, per_target: torch.Tensor) -> torch.Tensor:
    """Per-target values in the padded [trajectory, position] layout of `b.mask`. The backward
    of this gather sums the gradients of all trajectories through a token; pairs off the
    loss mask read a trailing 0."""
    padded = torch.cat([per_target, per_target.new_zeros(1)])
    return padded[b.index.to(per_target.device)]


def token_weights(b: PackedBatch, agg: Aggregation, normalizer: float) -> torch.Tensor:
    """Each packed target's loss weight: the sum over the trajectories through it of
    advantage x aggregation weight (token-mean: 1/N; seq-mean: 1/(len_i * n_seq), len_i the
    policy tokens of the trajectory the row belongs to). On-policy (rho = 1) the loss gradient
    w.r.t. the target's log-prob is minus this weight."""
    per_pair = b.mask / max(normalizer, 1.0)
    if agg == "seq-mean":
        per_pair = per_pair / row_tokens(b.mask, b.seq_tokens).unsqueeze(-1)
    w = torch.zeros(len(b.target) + 1)
    w.index_add_(0, b.index.flatten(), (per_pair * b.adv).flatten())
    return w[:-1]


def batch_logprobs(
    model: Any, b: Batch | PackedBatch, temperature: float, chunk: int = 0
) -> torch.Tensor:
    """log pi of each trajectory's tokens in the padded [trajectory, position] layout, from
    either layout's forward; `chunk` > 0 slices the output layer (`chunked_logprobs`)."""
    if isinstance(b, PackedBatch):
        return unpack(b, packed_token_logprobs(model, b, temperature, chunk))
    return token_logprobs(model, b, temperature, chunk)


def forward_cost(rows: int, length: int, kappa: float, *, dense: bool) -> float:
    """Relative forward/backward cost of `rows` rows of `length` tokens (see the module doc);
    `dense`: a full 4D mask (packed rows) rather than SDPA's causal path."""
    return rows * length * (1.0 + length / (kappa if dense else 2.0 * kappa))


def layout_cost(micro: Sequence[Batch | PackedBatch], kappa: float) -> float:
    """Summed `forward_cost` of a list of micro-batches."""
    return sum(forward_cost(*b.ids.shape, kappa, dense=isinstance(b, PackedBatch)) for b in micro)


def attention_break_even(model: Any) -> float:
    """kappa of the `auto` rule for this model on its device (the tiny policy's width if it has
    no config)."""
    params = getattr(model, "parameters", None)
    device = next(params()).device.type if params is not None else "cpu"
    width = float(getattr(getattr(model, "config", None), "hidden_size", 128))
    return ATTN_PER_WIDTH.get(device, ATTN_PER_WIDTH["cpu"]) * width


def choose_layout(
    groups: Sequence[Sequence[Any]],
    advs: Sequence[Sequence[Sequence[float]]],
    pad: int,
    size: int,
    packing: str,
    kappa: float = 384.0,
) -> list[Batch] | list[PackedBatch]:
    """Micro-batches in the layout `packing` asks for (`auto`: the cheaper by `layout_cost`
    with break-even row length `kappa`)."""
    if packing not in ("auto", "tree", "padded"):
        raise ValueError(f"unknown train.packing {packing!r}; choose auto, tree or padded")
    trajs = [t for g in groups for t in g]
    flat = [a for g in advs for a in g]
    padded = None if packing == "tree" else padded_micro_batches(trajs, flat, pad, size)
    packed = None if packing == "padded" else packed_micro_batches(groups, advs, pad, size)
    if padded is None or (
        packed is not None and layout_cost(packed, kappa) < layout_cost(padded, kappa)
    ):
        assert packed is not None
        return packed
    return padded
