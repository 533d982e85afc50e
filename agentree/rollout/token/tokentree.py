"""Shared machinery of the token-level tree samplers (latr, treepo, eptree).

The env is single-turn: `reset` gives the prompt, one `step(response)` gives the reward. A
sampler grows response trees token by token (LATR) or segment by segment (TreePO, EPTree); this
module turns them into `agentree.tree/1` trees with one node per response segment between
branch points, steps the env once per finished response (the leaf gets the reward), and fills
`RolloutStats` from the engine's counters.

A response tree is kept as `Chain`s while sampling: a chain owns the tokens from response
offset `start` on and shares the first `start` tokens with its parent chain. `chains_to_tree`
splits every chain at the offsets where children fork off it, so shared prefixes become shared
nodes and each trajectory is exactly the root-to-leaf concatenation of sampled ids.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from agentree.envs.base import Task, reset_task
from agentree.rollout.base import RolloutContext, RolloutStats, call_info
from agentree.tree import PRUNED, EndReason, Trajectory, Tree


@dataclass
class Root:
    """One task's tree and the prompt ids its responses continue."""

    task: Task
    tree: Tree
    prompt: list[int]
    max_new: int
    """Most response tokens: `sampling.max_tokens`, capped by the context budget."""


def start_trees(tasks: Sequence[Task], ctx: RolloutContext) -> list[Root]:
    """Reset the env once per task to get its prompt; the tree root holds the prompt ids."""
    env = ctx.env_factory()
    roots = []
    try:
        for task in tasks:
            obs, info = reset_task(env, task)
            prompt = ctx.chat.prompt_ids(obs, env.system_prompt, ctx.tools)
            tree = Tree(task.id, task.to_dict())
            tree.add_root(obs, prompt, {"env": info})
            max_new = min(ctx.sampling.max_tokens, ctx.max_context - len(prompt))
            if max_new <= 0:
                raise ValueError(
                    f"the prompt of task {task.id} has {len(prompt)} tokens, leaving no room "
                    f"for a response within max_context={ctx.max_context}"
                )
            roots.append(Root(task, tree, prompt, max_new))
    finally:
        env.close()
    return roots


def stop_ids(ctx: RolloutContext) -> frozenset[int]:
    """Token ids that end a response (the chat's end-of-turn and the engine's EOS)."""
    return frozenset(ctx.sampling.stop_token_ids) | frozenset(ctx.engine.eos_token_ids)


def response_ids(tree: Tree, node_id: int) -> list[int]:
    """The response tokens from the root (exclusive) down to `node_id`."""
    return [t for n in tree.path(node_id)[1:] for t in n.action_ids]


def decode_segment(ctx: RolloutContext, ids: Sequence[int]) -> str:
    return ctx.chat.tokenizer.decode(list(ids), skip_special_tokens=False)


# -- chains -> tree ----------------------------------------------------------------------------
@dataclass
class Chain:
    """A run of sampled tokens that shares its first `start` response tokens with `parent`."""

    id: int
    parent: int | None
    start: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    """Why sampling stopped: stop (a stop token), length (token budget), or a sampler reason."""
    end_reason: EndReason | None = None
    """Set for leaves that end without an env step (pruned); None means: step the env."""
    info: dict[str, Any] = field(default_factory=dict)
    """Branch-point data, written on the chain's first node."""
    end_info: dict[str, Any] = field(default_factory=dict)
    """How the chain ended (e.g. why it was pruned), written on its last node."""
    copy_of: int | None = None
    """Set on a copy of another chain's tokens (LATR padding): nothing was sampled for it."""

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def chains_to_tree(
    tree: Tree, chains: Sequence[Chain], decode: Callable[[list[int]], str]
) -> dict[int, int]:
    """Add the chains under the tree root as segment nodes; returns chain id -> leaf node id.

    Chains must be listed parents first. A chain is cut at every offset where a child forks
    off it; a child forking at the very start of its parent's own tokens hangs where the
    parent does.
    """
    by_id = {c.id: c for c in chains}
    cuts: dict[int, set[int]] = defaultdict(set)
    for c in chains:
        if c.parent is not None:
            if not by_id[c.parent].start <= c.start < by_id[c.parent].end:
                raise ValueError(f"chain {c.id} forks outside its parent {c.parent}")
            cuts[c.parent].add(c.start)
    attach: dict[int, int] = {}
    ends_at: dict[tuple[int, int], int] = {}  # (chain, offset) -> node whose tokens end there
    leaf: dict[int, int] = {}

    def anchor(cid: int, offset: int) -> int:
        c = by_id[cid]
        return attach[cid] if offset == c.start else ends_at[(cid, offset)]

    for c in chains:
        if not c.token_ids:
            raise ValueError(f"chain {c.id} has no tokens")
        node = 0 if c.parent is None else anchor(c.parent, c.start)
        attach[c.id] = node
        bounds = [*sorted(o for o in cuts[c.id] if o > c.start), c.end]
        prev, first = c.start, True
        for o in bounds:
            ids = c.token_ids[prev - c.start : o - c.start]
            lps = c.logprobs[prev - c.start : o - c.start]
            info = dict(c.info) if first else {}
            if c.copy_of is not None:
                info["copy_of"] = c.copy_of
            child = tree.add_child(
                node, turn=1, action=decode(ids), action_ids=ids, logprobs=lps, info=info
            )
            node, prev, first = child.id, o, False
            ends_at[(c.id, o)] = node
        leaf[c.id] = node
        tree.nodes[node].info.update({"finish": c.finish, **c.end_info})
        tree.nodes[node].end_reason = c.end_reason
    return leaf


# -- env reward at the leaves --------------------------------------------------------------------
def step_leaves(
    roots: Sequence[Root], ctx: RolloutContext, stats: RolloutStats, *, prune_too: bool = False
) -> None:
    """Step the env once per finished response; the leaf gets the reward and its end reason.

    Leaves whose end reason is already set (pruned branches) are not stepped, except those
    with `prune_too` (TreePO keeps repetition-stopped paths in its group and scores them).
    A leaf the env neither terminated nor truncated after its one step ends as max_turns: a
    token-level sampler gives every episode one turn.
    """
    env = ctx.env_factory()
    try:
        for r in roots:
            for node in r.tree.leaves():
                stepped = node.end_reason is None or (prune_too and node.end_reason in PRUNED)
                if not stepped or node.info.get("env") is not None:
                    continue
                text = ctx.chat.decode_action(response_ids(r.tree, node.id))
                # an env with tools gets the calls parsed in the policy's format, as a turn does
                action = ctx.chat.parse_action(text, ctx.tools)
                node.info.update(call_info(action))
                try:
                    env.reset(seed=r.task.seed, options=r.task.options)
                    obs, reward, terminated, truncated, info = env.step(action)
                except Exception as e:  # the leaf ends; the rollout goes on
                    stats.env_errors += 1
                    node.info["error"] = repr(e)
                    node.end_reason = EndReason.ENV_ERROR
                    continue
                stats.env_steps += 1
                stats.count_calls(action, info)
                node.observation = obs
                node.reward = float(reward)
                node.terminated, node.truncated = bool(terminated), bool(truncated)
                node.info["env"] = info
                if node.end_reason is None:
                    node.end_reason = EndReason.COMPLETED if terminated else EndReason.MAX_TURNS
    finally:
        env.close()


# -- accounting --------------------------------------------------------------------------------
@contextmanager
def metered(ctx: RolloutContext, stats: RolloutStats) -> Iterator[None]:
    """Add the engine's prefill/cache/forward counts made inside the block to `stats`.

    Generated tokens are counted by the samplers from what they sampled: a decode session never
    feeds a response's last token back, so the engine does not see it.
    """
    before = ctx.engine.stats.snapshot()
    try:
        yield
    finally:
        after = ctx.engine.stats.snapshot()
        stats.policy_tokens_prefilled += after["tokens_prefilled"] - before["tokens_prefilled"]
        stats.policy_tokens_cached += after["tokens_cached"] - before["tokens_cached"]
        stats.policy_tokens_evicted += after["tokens_evicted"] - before["tokens_evicted"]
        forward = after["tokens_forward"] - before["tokens_forward"]
        stats.extra["policy_tokens_forward"] = stats.extra.get("policy_tokens_forward", 0) + forward


def finish_tree(stats: RolloutStats, tree: Tree, group: Sequence[Trajectory]) -> None:
    """Record the rollout group's leaves in the tree and count the tree into `stats`:
    sampled tokens, branch points (`expanded`) and branches, pruned leaves.

    Copies (LATR padding) were not sampled and open no branch, so they are not counted.
    """
    tree.meta["group"] = [t.leaf for t in group]
    sampled = [n for n in tree.nodes[1:] if "copy_of" not in n.info]
    stats.policy_tokens_generated += sum(len(n.action_ids) for n in sampled)
    fanout = [sum(1 for c in n.children if "copy_of" not in tree.nodes[c].info) for n in tree.nodes]
    stats.expanded += sum(1 for f in fanout if f > 1)
    stats.extra["branches"] = stats.extra.get("branches", 0) + sum(f - 1 for f in fanout if f > 1)
    stats.pruned += sum(1 for n in tree.leaves() if n.end_reason in PRUNED)
