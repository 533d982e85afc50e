"""EPTree: the entropy-guided tree search of TreeRL (Hou et al., 2025), §3.1 and Algorithm 1.

An (M, N, L, T)-tree: M responses are sampled from the prompt, each the first chain of its own
tree. Then, L times, each tree's N most uncertain tokens become fork points, uncertainty being
the paper's token "entropy" H(y_t) = -log pi(y_t | x, y_<t) of the sampled token; from each fork
point T new responses are sampled from the prefix before that token (y_<t) to completion. A
prompt ends with M (1 + N L T) leaves, all of them its rollout group; the chains' shared
prefixes are stored once as tree nodes, which TreeRL's advantage estimator works on.

Masking (§3.1: "we mask tokens near the end of sequences, as the model is expected to explore
different reasoning paths rather than simply revisiting previous answers"): as in the released
code, every token after the one where an answer starts (its text contains a marker such as
'answer' or 'conclusion') cannot be a fork point; markers are matched on the response text, so
a marker split over several tokens counts too, and `\\boxed` is one (the math prompt's format).

Choices where the paper is silent: a fork point is used at most once (the proof of Theorem 1
draws new fork points each iteration; the released code could pick the same token again), ties
go to the earlier chain and position, and by default each continuation may generate
`max_tokens` new tokens like a fresh sample (the released code gives continuations the full
budget too), so one engine call serves every fork point of every prompt.

TreeRL's Theorem 1 (App. B: 4/3 to 12/5 times the leaves of independent sampling at equal
generated tokens) assumes fixed generation lengths: a continuation forked at relative position
x runs for the remaining 1 - x. `continuation: remaining` gives each continuation exactly the
tokens its forked response had left after the fork point (still one engine call, each budget in
its continuation's own params), so no leaf outgrows the response it forks from;
`theorem1_ratio` is the theorem's prediction.
"""

from __future__ import annotations

import functools
import heapq
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal

from pydantic import Field

from agentree.engines.base import Completion
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
)
from agentree.tree import Tree


class EPTreeConfig(ControllerConfig):
    M: int = Field(6, ge=1)
    """Trees per prompt, each grown from one sampled response (TreeRL's RL setting: 6)."""
    N: int = Field(2, ge=0)
    """Fork points per tree and iteration: the N highest -log p tokens (paper: 2)."""
    L: int = Field(1, ge=0)
    """Expansion iterations (paper: 1)."""
    T: int = Field(2, ge=1)
    """Continuations sampled from each fork point (paper: 2)."""
    answer_markers: list[str] = Field(default_factory=lambda: ["answer", "conclusion", "\\boxed"])
    """Answer-start markers (case-insensitive); no fork after them (code: answer, conclusion)."""
    continuation: Literal["full", "remaining"] = "full"
    """Continuation budget: max_tokens like a fresh sample (released code), or the tokens the
    forked response had left after the fork point (Theorem 1's fixed-length setting)."""


def answer_start(ids: Sequence[int], decode: Callable[[int], str], markers: Sequence[str]) -> int:
    """Index of the token that completes the first answer marker, or len(ids) if none does."""
    marks = [m.lower() for m in markers if m]
    longest = max((len(m) for m in marks), default=0)
    text = ""
    for i, t in enumerate(ids):
        piece = decode(t).lower()
        text += piece
        tail = text[-(len(piece) + longest) :]
        if any(m in tail for m in marks):
            return i
    return len(ids)


class EPTree(Controller):
    name = "eptree"
    Config = EPTreeConfig
    config: EPTreeConfig

    def group_size(self) -> int:
        c = self.config
        return c.M * (1 + c.N * c.L * c.T)

    def rollout(
        self, tasks: Sequence[Task], ctx: RolloutContext
    ) -> tuple[list[Tree], RolloutStats]:
        c = self.config
        stats = RolloutStats()
        t0 = time.perf_counter()
        roots = start_trees(tasks, ctx)
        search = _Forest(c, ctx, roots)
        with metered(ctx, stats):
            search.initial()
            for it in range(c.L):
                search.expand(it)
        for g, root in enumerate(roots):
            chains_to_tree(root.tree, search.chains[g], lambda ids: decode_segment(ctx, ids))
        step_leaves(roots, ctx, stats)
        for root in roots:
            finish_tree(stats, root.tree, self.group(root.tree))
        return self.finish([r.tree for r in roots], stats, t0)


class _Forest:
    """The M trees of every prompt, kept as chains until they become tree nodes."""

    def __init__(self, cfg: EPTreeConfig, ctx: RolloutContext, roots: list[Root]) -> None:
        self.cfg, self.ctx, self.roots = cfg, ctx, roots
        self.chains: list[list[Chain]] = [[] for _ in roots]
        self.tree_of: list[dict[int, int]] = [{} for _ in roots]  # chain id -> tree index
        self.forked: list[set[tuple[int, int]]] = [set() for _ in roots]
        self.limit: list[dict[int, int]] = [{} for _ in roots]  # chain id -> last forkable index
        self._pieces: dict[int, str] = {}

    def _decode(self, token: int) -> str:
        if token not in self._pieces:
            self._pieces[token] = self.ctx.chat.tokenizer.decode([token])
        return self._pieces[token]

    def _add(
        self, g: int, tree: int, parent: Chain | None, start: int, comp: Completion, **info: Any
    ) -> None:
        chain = Chain(
            id=len(self.chains[g]),
            parent=None if parent is None else parent.id,
            start=start,
            token_ids=list(comp.token_ids),
            logprobs=list(comp.logprobs),
            finish=comp.finish_reason,
            info={"eptree": {"tree": tree, **info}},
        )
        self.chains[g].append(chain)
        self.tree_of[g][chain.id] = tree
        markers = self.cfg.answer_markers
        self.limit[g][chain.id] = answer_start(chain.token_ids, self._decode, markers)

    def initial(self) -> None:
        """Y^(i) ~ pi(. | x) for i = 1..M: one chain per tree."""
        params = replace(self.ctx.sampling, n=self.cfg.M)
        outs = self.ctx.engine.generate([r.prompt for r in self.roots], params)
        for g, comps in enumerate(outs):
            for i, comp in enumerate(comps):
                self._add(g, i, None, 0, comp)

    def _key(self, g: int, chain: Chain, offset: int) -> tuple[int, int]:
        """A position's identity is its prefix: a chain's first token shares its parent's."""
        while offset == chain.start and chain.parent is not None:
            chain = self.chains[g][chain.parent]
        return chain.id, offset

    def _response(self, g: int, chain: Chain, offset: int) -> list[int]:
        """The first `offset` response tokens on the way to `chain`."""
        parts: list[list[int]] = []
        while True:
            parts.append(chain.token_ids[: offset - chain.start])
            if chain.parent is None:
                break
            offset, chain = chain.start, self.chains[g][chain.parent]
        return [t for p in reversed(parts) for t in p]

    def fork_points(self, g: int, tree: int) -> list[tuple[Chain, int]]:
        """Top-N unforked, unmasked positions of one tree by -log p of the sampled token."""
        cands = []
        for chain in self.chains[g]:
            if self.tree_of[g][chain.id] != tree:
                continue
            for j in range(min(len(chain.token_ids), self.limit[g][chain.id] + 1)):
                off = chain.start + j
                if self._key(g, chain, off) not in self.forked[g]:
                    cands.append((-chain.logprobs[j], -chain.id, -off, chain.id))
        best = heapq.nlargest(self.cfg.N, cands)
        return [(self.chains[g][cid], -neg_off) for _, _, neg_off, cid in best]

    def expand(self, it: int) -> None:
        """One iteration: fork every tree at its top-N points, T continuations each."""
        jobs: list[tuple[int, int, Chain, int]] = []
        for g in range(len(self.roots)):
            for tree in range(self.cfg.M):
                for chain, off in self.fork_points(g, tree):
                    self.forked[g].add(self._key(g, chain, off))
                    jobs.append((g, tree, chain, off))
        if not jobs:
            return
        contexts = [self.roots[g].prompt + self._response(g, ch, off) for g, _, ch, off in jobs]
        # each continuation has the room its own context leaves
        budgets = [
            max(1, min(self.ctx.max_context - len(x), self.ctx.sampling.max_tokens))
            for x in contexts
        ]
        if self.cfg.continuation == "remaining":
            # the forked response is chain.start + len(chain.token_ids) tokens long
            budgets = [
                max(1, min(cap, ch.start + len(ch.token_ids) - off))
                for cap, (_, _, ch, off) in zip(budgets, jobs, strict=True)
            ]
        # one engine call, each job with its own budget
        params = [replace(self.ctx.sampling, n=self.cfg.T, max_tokens=b) for b in budgets]
        outs = self.ctx.engine.generate(contexts, params)
        for (g, tree, chain, off), comps in zip(jobs, outs, strict=True):
            neglogp = -chain.logprobs[off - chain.start]
            for comp in comps:
                self._add(g, tree, chain, off, comp, iteration=it + 1, neglogp=round(neglogp, 6))


# -- TreeRL Theorem 1 (App. B) -------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def theorem1_phi(n: int, t: int, draws: int = 20000, seed: int = 0) -> float:
    """Monte-Carlo phi(n, t) = E[(1/2 + t/2 sum (1 - x_i)^2) / (1 + t sum (1 - x_i))],
    x ~ U(0,1)^n: the expected length of a second-iteration continuation (App. B, case l = 2).
    phi(1, 1) = ln 2 - 1/4; phi decreases towards 1/3 as n grows."""
    rng = random.Random(seed)
    acc = 0.0
    for _ in range(draws):
        rest = [1.0 - rng.random() for _ in range(n)]  # 1 - x_i
        acc += (0.5 + t / 2 * sum(r * r for r in rest)) / (1 + t * sum(rest))
    return acc / draws


def theorem1_ratio(n: int, t: int, iterations: int) -> float | None:
    """Leaves of one EPTree / leaves of independent chains at equal generated tokens, as
    Theorem 1 derives it: (1 + nt) / (1 + nt/2) for l = 1, (1 + 2nt) / (1 + (1/2 + phi) nt)
    for l = 2 (the theorem covers l <= 2 only; None beyond)."""
    if iterations == 1:
        return (1 + n * t) / (1 + n * t / 2)
    if iterations == 2:
        return (1 + 2 * n * t) / (1 + (0.5 + theorem1_phi(n, t)) * n * t)
    return None


THEOREM1_BOUNDS = (4 / 3, 12 / 5)
"""Theorem 1: the ratio lies in [4/3, 12/5) for l <= 2."""
