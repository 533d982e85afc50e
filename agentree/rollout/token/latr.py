"""LATR: Lookahead Tree-Based Rollouts (Xing et al., 2025), Algorithm 1 with §3.3.

Per prompt, k_LATR = round(eta * k) responses come from one search tree and the other
k - k_LATR from ordinary stochastic sampling (hybrid rollout, Eq. 9), with the share annealed
over training steps, eta = eta0 * gamma^step (Eq. 10). The tree is decoded step by step in one
engine decode session, one token per live branch per step:

1. Branching (Eq. 5-6). Every branch is extended by its most probable token. Each other
   candidate c with p(c) > tau_abs and p(top) - p(c) < tau_rel opens a child branch while the
   tree holds fewer than k branches; when candidates compete for the last places, the more
   probable ones win.
2. Lookahead pruning (Eq. 7-8). A child that has generated exactly r tokens since its birth, for
   each r in `r` ({20, 30, 50}), is compared with its parent over those r positions; if the
   normalised token edit distance is below tau_ed, the child and its descendants are removed.
   They stay in the tree as leaves ending `pruned_similar` and are left out of the group.
3. Early stopping (§3.3). Once the tree holds k branches and none still awaits a lookahead
   check, every branch continues by ordinary stochastic sampling.
4. Padding. A tree that ends with fewer than k branches is padded with copies of its first
   (greedy) branch.

Where the paper leaves details open, this follows the authors' released code: p is the
untempered next-token distribution (recorded log-probs are still those of the sampling
temperature, as every engine records them); finished branches keep counting towards the width;
a window includes the branching token, and a check is skipped when either window holds a stop
token; the switch to sampling waits until no branch can still be pruned; padding copies the
first branch. Eq. 5 is used as printed (the released code tests p(top) - p(c) > tau_rel).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field, field_validator

from agentree.engines.hf import sample_next
from agentree.envs.base import Task
from agentree.rollout.base import Controller, ControllerConfig, RolloutContext, RolloutStats
from agentree.rollout.token.tokentree import (
    Chain,
    Root,
    chains_to_tree,
    decode_segment,
    finish_tree,
    metered,
    start_trees,
    step_leaves,
    stop_ids,
)
from agentree.tree import EndReason, Trajectory, Tree


class LATRConfig(ControllerConfig):
    k: int = Field(8, ge=1)
    """Rollout number per prompt: the tree's maximum width and the group size (paper: 8)."""
    tau_abs: float = Field(0.25, ge=0.0, le=1.0)
    """Absolute branching threshold: a candidate needs p(c) > tau_abs (Eq. 5; paper: 0.25)."""
    tau_rel: float = Field(0.15, ge=0.0, le=1.0)
    """Relative branching threshold: p(top) - p(c) < tau_rel (Eq. 5; paper: 0.15)."""
    tau_ed: float = Field(0.4, ge=0.0, le=1.0)
    """Pruning threshold on the normalised edit distance to the parent (Eq. 7; paper: 0.4)."""
    r: list[int] = Field(default_factory=lambda: [20, 30, 50])
    """Lookahead windows; a branch is kept only if it diverges over every one (paper: 20/30/50)."""
    eta0: float = Field(1.0, ge=0.0, le=1.0)
    """Initial LATR share of each group (Eq. 10; paper: 1.0)."""
    gamma: float = Field(0.985, gt=0.0, le=1.0)
    """Per-training-step decay of the share (Eq. 10; paper: 0.985 Countdown, 0.995 math)."""

    @field_validator("r")
    @classmethod
    def _windows(cls, r: list[int]) -> list[int]:
        if not r or min(r) < 1:
            raise ValueError("r needs at least one lookahead window, each >= 1 token")
        return sorted(set(r))


@dataclass(eq=False)
class _Branch:
    """A live or finished branch of one prompt's search: its chain plus decoding state."""

    chain: Chain
    root: int
    """Index of the prompt (tree) in the rollout batch."""
    tokens: list[int]
    """The whole response so far (shared prefix included)."""
    parent: _Branch | None = None
    in_tree: bool = True
    """False for the hybrid share's independent stochastic samples."""
    children: list[_Branch] = field(default_factory=list)
    done: bool = False
    pruned: bool = False

    @property
    def birth(self) -> int:
        return self.chain.start


def edit_distance(a: Sequence[int], b: Sequence[int]) -> int:
    """Levenshtein distance between two token-id sequences."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


class LATR(Controller):
    name = "latr"
    Config = LATRConfig
    config: LATRConfig

    def group_size(self) -> int:
        return self.config.k

    def tree_share(self, step: int) -> int:
        """k_LATR = round(eta * k) with eta = eta0 * gamma^step (Eq. 9-10), half rounded up."""
        c = self.config
        return min(c.k, math.floor(c.eta0 * c.gamma**step * c.k + 0.5))

    def rollout(
        self, tasks: Sequence[Task], ctx: RolloutContext
    ) -> tuple[list[Tree], RolloutStats]:
        stats = RolloutStats()
        t0 = time.perf_counter()
        roots = start_trees(tasks, ctx)
        k_tree = self.tree_share(ctx.step)
        search = _Search(self.config, ctx, roots, k_tree, self.config.k - k_tree)
        with metered(ctx, stats):
            search.run()
        for i, root in enumerate(roots):
            chains = search.chains(i)
            chains_to_tree(root.tree, chains, lambda ids: decode_segment(ctx, ids))
            root.tree.meta.update(search.meta[i])
        step_leaves(roots, ctx, stats)
        for root in roots:
            finish_tree(stats, root.tree, self.group(root.tree))
        stats.extra["padded"] = float(sum(m["padded"] for m in search.meta))
        return self.finish([r.tree for r in roots], stats, t0)

    def group(self, tree: Tree) -> list[Trajectory]:
        """Survivors, padding and the stochastic share; pruned branches are not rollouts."""
        return tree.trajectories(include_pruned=False)


class _Search:
    """The step-wise decode of every prompt's LATR tree and its stochastic share."""

    def __init__(
        self, cfg: LATRConfig, ctx: RolloutContext, roots: list[Root], k_tree: int, k_std: int
    ) -> None:
        self.cfg, self.ctx, self.roots, self.k_tree = cfg, ctx, roots, k_tree
        self.stop = stop_ids(ctx)
        self.all: list[_Branch] = []
        self.rows: list[_Branch] = []  # session row i decodes self.rows[i]
        kinds = [True] * (k_tree > 0) + [False] * k_std
        for i in range(len(roots)):
            self.rows += [self._new(i, None, [], in_tree=kind) for kind in kinds]
        self.width = [int(k_tree > 0)] * len(roots)
        self.sampling = [k_tree == 0] * len(roots)
        self.meta: list[dict[str, Any]] = [
            {"k_latr": k_tree, "k_std": k_std, "saturation": None, "padded": 0} for _ in roots
        ]
        self.generator: torch.Generator | None = None

    def _new(
        self, root: int, parent: _Branch | None, tokens: list[int], *, in_tree: bool = True
    ) -> _Branch:
        start = len(tokens)
        chain = Chain(len(self.all), None if parent is None else parent.chain.id, start)
        b = _Branch(chain, root, list(tokens), parent, in_tree)
        if parent is not None:
            parent.children.append(b)
        self.all.append(b)
        return b

    def chains(self, root: int) -> list[Chain]:
        return [b.chain for b in self.all if b.root == root]

    # -- the decode loop -------------------------------------------------------------------------
    def run(self) -> None:
        if not self.rows:
            return
        # One row per prompt is prefilled; the group's other rows copy its KV (never recomputed).
        session = self.ctx.engine.open_session([r.prompt for r in self.roots], temperature=1.0)
        try:
            first = [b.root for b in self.rows]
            if first != list(range(len(self.roots))):
                session.fork(first)
            pos = 0
            while self.rows:
                self._maybe_switch(pos)
                src, tokens, rows = self._step(session.next_logprobs(), pos)
                if not rows:
                    break
                if src != list(range(len(self.rows))):
                    session.fork(src)
                session.append(tokens)
                self.rows = rows
                pos += 1
        finally:
            session.close()
        self._pad()

    def _maybe_switch(self, pos: int) -> None:
        """§3.3: a full tree with no lookahead check pending continues by sampling."""
        last = self.cfg.r[-1]
        for g, sampling in enumerate(self.sampling):
            if sampling or self.width[g] < self.k_tree:
                continue
            pending = any(
                b.root == g and b.in_tree and b.parent is not None and pos - b.birth < last
                for b in self.rows
            )
            if not pending:
                self.sampling[g] = True
                self.meta[g]["saturation"] = pos

    def _step(self, raw: torch.Tensor, pos: int) -> tuple[list[int], list[int], list[_Branch]]:
        """Choose each row's token and new children; returns (source rows, tokens, branches)."""
        chosen = self._sample(raw)
        children = self._branch(raw, chosen)
        picks = [(i, chosen[i]) for i in range(len(self.rows))]
        picks += [(i, t) for i, kids in children.items() for t, _, _ in kids]
        temp = self.ctx.sampling.temperature
        logp = raw if temp <= 0 or temp == 1.0 else torch.log_softmax(raw / temp, dim=-1)
        rows_idx = torch.tensor([i for i, _ in picks], device=raw.device)
        toks_idx = torch.tensor([t for _, t in picks], device=raw.device)
        lp = dict(zip(picks, logp[rows_idx, toks_idx].tolist(), strict=True))  # one gather
        src: list[int] = []
        tokens: list[int] = []
        rows: list[_Branch] = []
        fed: list[_Branch] = []
        for i, b in enumerate(self.rows):
            self._feed(b, chosen[i], lp[(i, chosen[i])], pos)
            family = [b]
            for t, p, p_top in children.get(i, []):
                child = self._new(b.root, b, b.tokens[:pos])
                child.chain.info["latr"] = {
                    "birth": pos,
                    "p": round(p, 6),
                    "p_top": round(p_top, 6),
                    # the branch point's two tokens as text, for `agentree view`
                    "token": decode_segment(self.ctx, [t]),
                    "top_token": decode_segment(self.ctx, [chosen[i]]),
                }
                self._feed(child, t, lp[(i, t)], pos)
                family.append(child)
            fed += family
            for c in family:
                if not c.done:
                    src.append(i)
                    tokens.append(c.tokens[-1])
                    rows.append(c)
        self._prune(fed, pos)
        live = [j for j, c in enumerate(rows) if not c.pruned]
        return [src[j] for j in live], [tokens[j] for j in live], [rows[j] for j in live]

    def _branch(
        self, raw: torch.Tensor, chosen: dict[int, int]
    ) -> dict[int, list[tuple[int, float, float]]]:
        """Greedy rows take their top token (into `chosen`); returns row -> [(token, p, p_top)]
        of the children Eq. 5-6 open, within each tree's width k."""
        greedy = [i for i in range(len(self.rows)) if i not in chosen]
        if not greedy:
            return {}
        top_p, top_i = self._top(raw[greedy])
        per_root: dict[int, list[tuple[float, int, int, float]]] = {}
        for j, i in enumerate(greedy):
            ps, ts = top_p[j], top_i[j]
            chosen[i] = ts[0]
            for p, t in zip(ps[1:], ts[1:], strict=True):
                if p > self.cfg.tau_abs and ps[0] - p < self.cfg.tau_rel:  # Eq. 5
                    per_root.setdefault(self.rows[i].root, []).append((p, i, t, ps[0]))
        children: dict[int, list[tuple[int, float, float]]] = {}
        for g, cands in per_root.items():
            cands.sort(key=lambda c: -c[0])  # most probable first (§3.1)
            for p, i, t, p_top in cands:
                if self.width[g] >= self.k_tree:
                    break
                self.width[g] += 1
                children.setdefault(i, []).append((t, p, p_top))
        return children

    def _sample(self, raw: torch.Tensor) -> dict[int, int]:
        """Ordinary stochastic sampling for the hybrid share and for trees past saturation."""
        idx = [i for i, b in enumerate(self.rows) if not b.in_tree or self.sampling[b.root]]
        if not idx:
            return {}
        if self.generator is None:
            seed = self.ctx.rng.getrandbits(63)
            self.generator = torch.Generator(device=raw.device).manual_seed(seed)
        # `raw` is a log-softmax at temperature 1; sample_next applies the sampling temperature
        # (and top-p/top-k) to it exactly as it would to the logits.
        token, _, _, _ = sample_next(raw[idx], self.ctx.sampling, self.generator)
        return dict(zip(idx, token.tolist(), strict=True))

    def _top(self, raw: torch.Tensor) -> tuple[list[list[float]], list[list[int]]]:
        """Per row, the top token and every token that could pass tau_abs, most probable first."""
        vocab = raw.shape[-1]
        tau = self.cfg.tau_abs
        n = vocab if tau <= 0 else min(vocab, math.floor(1 / tau) + 1)
        probs, ids = raw.exp().topk(n, dim=-1)
        return probs.tolist(), ids.tolist()

    def _feed(self, b: _Branch, token: int, logprob: float, pos: int) -> None:
        b.tokens.append(token)
        b.chain.token_ids.append(token)
        b.chain.logprobs.append(logprob)
        if token in self.stop:
            b.done, b.chain.finish = True, "stop"
        elif pos + 1 >= self.roots[b.root].max_new:
            b.done, b.chain.finish = True, "length"

    def _prune(self, fed: list[_Branch], pos: int) -> None:
        """Eq. 7-8: children r tokens old that stayed too close to their parent are removed."""
        for b in fed:
            r = pos - b.birth + 1
            if b.pruned or b.parent is None or r not in self.cfg.r:
                continue
            mine = b.tokens[b.birth : pos + 1]
            theirs = b.parent.tokens[b.birth : pos + 1]
            if len(theirs) < r or self.stop.intersection(mine + theirs):
                continue  # a window that holds the end of a response is not compared
            dist = edit_distance(mine, theirs) / r
            if dist < self.cfg.tau_ed:
                b.chain.end_info["pruned"] = {
                    "window": r,
                    "edit_distance": round(dist, 4),
                    "parent_chain": b.parent.chain.id,
                }
                self._remove(b)

    def _remove(self, b: _Branch) -> None:
        """Remove a pruned branch with its descendants; they stay in the tree as pruned leaves."""
        stack = [b]
        while stack:
            c = stack.pop()
            if c.pruned:
                continue
            c.pruned, c.done = True, True
            c.chain.end_reason = EndReason.PRUNED_SIMILAR
            c.chain.finish = c.chain.finish or "pruned"
            self.width[c.root] -= 1
            stack.extend(c.children)

    def _pad(self) -> None:
        """Pad each tree to k_LATR responses with copies of its first branch (Alg. 1, line 31)."""
        for g in range(len(self.roots)):
            tree = [b for b in self.all if b.root == g and b.in_tree]
            if not tree:
                continue
            first = tree[0]
            missing = self.k_tree - sum(1 for b in tree if not b.pruned)
            # The copy forks where the first branch's last segment starts, so it becomes a
            # sibling of that segment with the same tokens.
            start = max((c.birth for c in first.children), default=0)
            for _ in range(missing):
                pad = self._new(g, first if start else None, first.tokens[:start])
                pad.chain.token_ids = first.tokens[start:]
                pad.chain.logprobs = first.chain.logprobs[start:]
                pad.chain.finish = first.chain.finish
                pad.chain.copy_of = first.chain.id
                pad.tokens = list(first.tokens)
                pad.done = True
            self.meta[g]["padded"] = max(missing, 0)
