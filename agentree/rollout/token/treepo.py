"""TreePO tree-based sampling (Li et al., 2025): Algorithm 1 with the heuristics of §2.2.

Responses grow as a tree of fixed-length segments. Each round, every active path of every
prompt gets one more segment of at most l tokens from a single `engine.generate` call; copies of
a path share its context, which the engine prefills once (and its prefix cache holds the rest),
so a shared prefix is computed once. After its segment a path either goes on or becomes a leaf:
a stop token, a complete answer (the paper stops at a boxed answer), the token budget, depth d,
or a repeated substring inside the new segment (early stop, `pruned_repetition`). Leaves of
every kind are the rollout group (Alg. 1, line 9 puts failed nodes in the output too).

- Branching budget transfer: a prompt's budget for the next depth is b per path that reached
  this depth (b^d for a b-ary tree that never stops early; paths stopped this round hand theirs
  over), capped by the w - finished places left and spread evenly over its active paths, each
  getting at least one. So a prompt never has more than w leaves.
- Depth-first fallback: only when a prompt has no active path and fewer than w leaves, new paths
  start from a finished path that ended with a stop token or an answer, at a random segment
  boundary at most `fallback_window` segments above its leaf (token-aligned, §4.2), b copies per
  chosen path until w is reached; with no such path, from the prompt.

Details from the authors' released code, where the paper gives none: the repetition test (a
`rep_chars`-character substring seen `rep_count` times in the segment), the fallback window, and
the budget formula above. One deliberate change: a budget that does not divide evenly gives its
remainder one extra copy each to the first paths ("evenly"), not all to the last.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pydantic import Field, field_validator

from agentree.envs.base import Task
from agentree.rollout.base import Controller, ControllerConfig, RolloutContext, RolloutStats
from agentree.rollout.token.tokentree import (
    Root,
    decode_segment,
    finish_tree,
    metered,
    response_ids,
    start_trees,
    step_leaves,
)
from agentree.tree import EndReason, Tree

BOXED_OR_ANSWER = r"\\boxed\{(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*\}|</answer>"
"""A closed \\boxed{...} (two levels of nested braces) or a closed <answer> tag."""

_FALLBACK_FINISH = ("stop", "answer")


class TreePOConfig(ControllerConfig):
    w: int = Field(16, ge=1)
    """Tree width: trajectories per prompt (paper: 16, the sequential baseline's group size)."""
    d: int = Field(14, ge=1)
    """Maximum depth in segments (paper: 14 x 512 was best of 7 x 1024, 14 x 512, 28 x 256)."""
    l: int = Field(512, ge=1)  # noqa: E741 - the paper's name
    """Segment length in tokens (paper: 512)."""
    b: int = Field(2, ge=1)
    """Branches per path and depth; b^d is the budget at depth d (paper: 2, a binary tree)."""
    fallback_window: int = Field(3, ge=0)
    """Fallback restarts at most this many segments above a leaf; 0: anywhere (code: 3)."""
    rep_chars: int = Field(32, ge=1)
    """Early stop: length of the repeated substring, in characters (released code: 32)."""
    rep_count: int = Field(8, ge=2)
    """Early stop: occurrences of one substring in a segment that stop the path (code: 8)."""
    answer_pattern: str = BOXED_OR_ANSWER
    """A response matching this regex has its answer and stops (paper: boxed answer as EOS)."""

    @field_validator("answer_pattern")
    @classmethod
    def _regex(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"answer_pattern is not a valid regex: {e}") from None
        return pattern


def has_repetition(text: str, chars: int, count: int) -> bool:
    """Whether some `chars`-long substring occurs at least `count` times (overlaps count)."""
    seen: dict[str, int] = {}
    for i in range(len(text) - chars + 1):
        s = text[i : i + chars]
        seen[s] = seen.get(s, 0) + 1
        if seen[s] >= count:
            return True
    return False


def spread_budget(active: int, stopped_now: int, finished: int, w: int, b: int) -> list[int]:
    """Copies of each active path for the next depth (branching budget transfer).

    The budget is b per path that reached this depth (`active` going on plus `stopped_now`
    that just became leaves), capped by the w - finished places left, and at least one per
    active path so none is dropped.
    """
    if active == 0:
        return []
    total = min(max(w - finished, 0), b * (active + stopped_now))
    total = max(total, active)
    q, rem = divmod(total, active)
    return [q + (i < rem) for i in range(active)]


@dataclass
class _Path:
    root: int
    node: int
    depth: int
    """Segments from the root to `node`."""


class TreePO(Controller):
    name = "treepo"
    Config = TreePOConfig
    config: TreePOConfig

    def group_size(self) -> int:
        return self.config.w

    def rollout(
        self, tasks: Sequence[Task], ctx: RolloutContext
    ) -> tuple[list[Tree], RolloutStats]:
        c = self.config
        stats = RolloutStats()
        t0 = time.perf_counter()
        roots = start_trees(tasks, ctx)
        search = _Search(c, ctx, roots)
        queue = [_Path(g, 0, 0) for g in range(len(roots)) for _ in range(min(c.b, c.w))]
        with metered(ctx, stats):
            while queue:
                active, stopped = search.grow(queue)
                queue = []
                for g in range(len(roots)):
                    mine = [p for p in active if p.root == g]
                    done = len(search.leaves[g])
                    copies = spread_budget(len(mine), stopped[g], done, c.w, c.b)
                    queue += [p for p, n in zip(mine, copies, strict=True) for _ in range(n)]
                    if not mine and done < c.w:
                        queue += search.fallback(g, c.w - done)
        step_leaves(roots, ctx, stats, prune_too=True)
        for root in roots:
            finish_tree(stats, root.tree, self.group(root.tree))
        stats.extra["fallback_paths"] = float(search.fallbacks)
        return self.finish([r.tree for r in roots], stats, t0)


class _Search:
    """Every prompt's segment tree during one rollout call."""

    def __init__(self, cfg: TreePOConfig, ctx: RolloutContext, roots: list[Root]) -> None:
        self.cfg, self.ctx, self.roots = cfg, ctx, roots
        self.answer = re.compile(cfg.answer_pattern)
        self.leaves: list[list[int]] = [[] for _ in roots]
        self.fallbacks = 0

    def grow(self, queue: list[_Path]) -> tuple[list[_Path], list[int]]:
        """One segment for every queued path; returns (paths going on, leaves made per root)."""
        c, ctx, roots = self.cfg, self.ctx, self.roots
        params = []  # one engine call, each path with what its response has left
        for p in queue:
            used = len(response_ids(roots[p.root].tree, p.node))
            left = min(c.l, roots[p.root].max_new - used)
            params.append(replace(ctx.sampling, max_tokens=left, n=1))
        contexts = [roots[p.root].tree.context_ids(p.node) for p in queue]
        segments = [comps[0] for comps in ctx.engine.generate(contexts, params)]
        active: list[_Path] = []
        stopped = [0] * len(roots)
        for p, comp in zip(queue, segments, strict=True):
            tree = roots[p.root].tree
            ids = list(comp.token_ids)
            node = tree.add_child(
                p.node,
                turn=1,
                action=decode_segment(ctx, ids),
                action_ids=ids,
                logprobs=list(comp.logprobs),
                info={"depth": p.depth + 1},
            )
            finish = self._finish(roots[p.root], node.id, p.depth + 1, comp.finish_reason)
            if finish is None:
                active.append(_Path(p.root, node.id, p.depth + 1))
                continue
            node.info["finish"] = finish
            if finish == "repetition":
                node.end_reason = EndReason.PRUNED_REPETITION
            self.leaves[p.root].append(node.id)
            stopped[p.root] += 1
        return active, stopped

    def _finish(self, root: Root, node: int, depth: int, reason: str) -> str | None:
        """Why the path ending at `node` stops, or None if it goes on."""
        c = self.cfg
        resp = response_ids(root.tree, node)
        if reason == "stop":
            return "stop"
        if self.answer.search(self.ctx.chat.decode_action(resp)):
            return "answer"
        if len(resp) >= root.max_new:
            return "length"
        if depth >= c.d:
            return "max_depth"
        segment = root.tree.nodes[node].action or ""
        if has_repetition(segment, c.rep_chars, c.rep_count):
            return "repetition"
        return None

    def fallback(self, g: int, places: int) -> list[_Path]:
        """Depth-first fallback: restart paths from segment boundaries of finished paths."""
        c, rng = self.cfg, self.ctx.rng
        tree = self.roots[g].tree
        done = [n for n in self.leaves[g] if tree.nodes[n].info["finish"] in _FALLBACK_FINISH]
        rng.shuffle(done)
        out: list[_Path] = []
        for leaf in done:
            if places <= 0:
                break
            above = tree.path(leaf)[:-1]
            if c.fallback_window:
                above = above[-c.fallback_window :]
            node = rng.choice(above)
            n = min(c.b, places)
            out += [_Path(g, node.id, len(tree.path(node.id)) - 1) for _ in range(n)]
            places -= n
        if not done:
            out = [_Path(g, 0, 0) for _ in range(min(c.b, places))]
        for p in out:
            tree.nodes[p.node].info["fallbacks"] = tree.nodes[p.node].info.get("fallbacks", 0) + 1
        self.fallbacks += len(out)
        return out
