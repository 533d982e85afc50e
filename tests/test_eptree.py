"""EPTree against hand-set policies (fork points worked out by hand from §3.1 and Algorithm 1),
and end to end with the tiny policy on the math env."""

from __future__ import annotations

import math
import os
import random

import pytest
from tiny_setup import check_group, tiny_context, tiny_engine
from toy_policy import EOS, PROMPT, ToyEngine, toy_context

from agentree.config import load_config
from agentree.engines.base import Completion, per_prompt
from agentree.envs.base import Task
from agentree.rollout.token.eptree import (
    THEOREM1_BOUNDS,
    EPTree,
    EPTreeConfig,
    answer_start,
    theorem1_phi,
    theorem1_ratio,
)
from agentree.rollout.token.tokentree import response_ids
from agentree.run.trainer import Trainer

LN2, LN4 = math.log(2), math.log(4)


def two_uncertain(resp):
    """One-hot except pos 2 (2 tokens, -log p = ln 2) and pos 5 (4 tokens, ln 4); 8 tokens."""
    n = len(resp)
    if n >= 8:
        return {EOS: 1.0}
    if n == 2:
        return {5: 0.5, 6: 0.5}
    if n == 5:
        return {7: 0.25, 8: 0.25, 9: 0.25, 1: 0.25}
    return {3: 1.0} if n == 4 and resp[2] == 6 else {4: 1.0}


def run(dist, **cfg):
    ctx, engine = toy_context(dist)
    ep = EPTree(EPTreeConfig(**cfg))
    trees, stats = ep.rollout([Task("t", 0)], ctx)
    return ep, trees[0], stats, engine


def forks(tree):
    """(tree index, fork offset, -log p) of every continuation, from its first node."""
    out = []
    for n in tree.nodes:
        ep = n.info.get("eptree", {})
        if "iteration" in ep:
            out.append((ep["tree"], len(response_ids(tree, n.parent)), ep["neglogp"]))
    return sorted(out)


def originals(tree) -> dict[int, list[int]]:
    """Tree index -> the response first sampled from the prompt for that tree."""
    out = {}
    for leaf in tree.leaves():
        path = tree.path(leaf.id)[1:]
        if not any("iteration" in n.info.get("eptree", {}) for n in path):
            out[path[0].info["eptree"]["tree"]] = response_ids(tree, leaf.id)
    return out


def test_answer_start_finds_markers_split_over_tokens():
    pieces = {1: "The", 2: " ans", 3: "wer", 4: " is", 5: " 4", 6: "\\box", 7: "ed{"}
    assert answer_start([1, 2, 3, 4, 5], pieces.get, ["answer"]) == 2
    assert answer_start([1, 4, 5], pieces.get, ["answer"]) == 3  # none: nothing masked
    assert answer_start([1, 6, 7], pieces.get, ["answer", "\\boxed"]) == 2
    assert answer_start([1, 2, 3], lambda t: pieces[t].upper(), ["Answer"]) == 2


def test_forks_at_the_top_n_highest_neglogp_tokens():
    ep, tree, _, _ = run(two_uncertain, M=2, N=1, L=1, T=1, answer_markers=[])
    assert [f[:2] for f in forks(tree)] == [(0, 5), (1, 5)]
    assert all(abs(f[2] - LN4) < 1e-5 for f in forks(tree))
    ep, tree, _, _ = run(two_uncertain, M=2, N=2, L=1, T=1, answer_markers=[])
    assert [f[:2] for f in forks(tree)] == [(0, 2), (0, 5), (1, 2), (1, 5)]
    assert len(ep.group(tree)) == 2 * (1 + 2) == ep.group_size()


def test_no_fork_after_the_answer_starts():
    # Token 3 (the "answer" here) follows a 6 at pos 2: in such chains pos 5 is masked and
    # the single fork goes to pos 2 instead; chains that drew 5 at pos 2 still fork at pos 5.
    _, tree, _, _ = run(two_uncertain, M=4, N=1, L=1, T=1, answer_markers=["3"])
    chains = originals(tree)
    assert len(chains) == 4 and len(forks(tree)) == 4
    for tree_idx, offset, _ in forks(tree):
        assert offset == (2 if chains[tree_idx][2] == 6 else 5)


def test_a_position_is_forked_at_most_once():
    # L=2: iteration 1 takes pos 5 (ln 4). The continuation's first token sits at the same
    # prefix, so iteration 2 cannot take it again and forks at pos 2 (ln 2).
    ep, tree, _, _ = run(two_uncertain, M=1, N=1, L=2, T=1, answer_markers=[])
    assert [(f[1], round(f[2], 4)) for f in forks(tree)] == [(2, round(LN2, 4)), (5, round(LN4, 4))]
    assert len(ep.group(tree)) == 1 * (1 + 1 * 2 * 1)


def test_continuations_are_sampled_from_the_prefix_before_the_fork_token():
    ep, tree, stats, engine = run(two_uncertain, M=3, N=2, L=1, T=2, answer_markers=[])
    assert len(ep.group(tree)) == 3 * (1 + 2 * 2) == stats.trajectories
    firsts = list(originals(tree).values())
    # The second engine call asks for T=2 completions of prompt + y_<t for each fork point.
    conts = engine.prompts_seen[1:]
    assert sorted(len(c) - len(PROMPT) for c in conts) == [2, 2, 2, 5, 5, 5]
    for c in conts:
        assert any(c[len(PROMPT) :] == f[: len(c) - len(PROMPT)] for f in firsts)
    for leaf in ep.group(tree):
        assert len(leaf.token_ids) == len(PROMPT) + 9  # every response is 8 tokens + EOS


def test_eptree_on_math_with_the_tiny_policy(tmp_path_factory):
    engine = tiny_engine("math", tmp_path_factory.mktemp("cache"))
    ctx = tiny_context(engine, "math", max_tokens=24)
    ep = EPTree(EPTreeConfig(M=2, N=2, L=1, T=1))
    trees, stats = ep.rollout([Task("a", 1), Task("b", 2)], ctx)
    assert stats.trajectories == 12
    for tree in trees:
        group = ep.group(tree)
        assert len(group) == 6
        check_group(tree, group, ctx)
    assert stats.policy_tokens_cached > 0  # continuations reuse the chains' cached KV


def test_train_step_with_eptree_and_treerl_advantage(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTREE_CACHE", os.environ.get("AGENTREE_CACHE", str(tmp_path)))
    cfg = load_config(
        None,
        select={"env": "math", "rollout": "eptree"},
        overrides=[
            "rollout.M=2",
            "rollout.N=1",
            "engine.max_tokens=16",
            "train.tasks_per_step=2",
            "train.advantage=treerl",
            "train.kl_coef=0",
        ],
    )
    metrics = Trainer(cfg, tmp_path, log=lambda m: None).train_step()
    assert metrics["rollout/trajectories"] == 2 * 2 * (1 + 1 * 1 * 2)
    assert metrics["train/policy_tokens"] > 0 and "train/loss" in metrics


# -- TreeRL Theorem 1 (App. B) -------------------------------------------------------------
def test_theorem1_ratio_by_hand():
    # l = 1: R = (1 + nt) / (1 + nt/2); R(1, 1) = 2 / 1.5 = 4/3, R(2, 2) = 5 / 3
    assert theorem1_ratio(1, 1, 1) == pytest.approx(4 / 3)
    assert theorem1_ratio(2, 2, 1) == pytest.approx(5 / 3)
    assert theorem1_ratio(1000, 1, 1) < 2.0
    # phi(1, 1) = int_0^1 (1 + u^2) / (2 (1 + u)) du = ln 2 - 1/4 (App. B)
    assert theorem1_phi(1, 1) == pytest.approx(LN2 - 0.25, abs=2e-3)
    assert 1 / 3 < theorem1_phi(40, 1) < theorem1_phi(4, 1) < theorem1_phi(1, 1)
    # l = 2, n = t = 1: R = 3 / (1 + 1/2 + phi) = 6 / (3 + 2 (ln 2 - 1/4)) ~ 1.544, the l = 2
    # lower bound
    assert theorem1_ratio(1, 1, 2) == pytest.approx(6 / (3 + 2 * (LN2 - 0.25)), abs=2e-3)
    assert theorem1_ratio(1, 1, 2) == pytest.approx(1.544, abs=2e-3)
    low, high = THEOREM1_BOUNDS
    for n in (1, 2, 3, 8):
        for t in (1, 2, 4):
            for iters in (1, 2):
                assert low - 1e-9 <= theorem1_ratio(n, t, iters) < high
    assert theorem1_ratio(2, 2, 3) is None  # the theorem covers l <= 2 only


LENGTH = 60


class EndlessEngine(ToyEngine):
    """A policy with two tokens, a fresh random split at every step and no end token: -log p
    of the sampled token is i.i.d. over positions, so the top-N fork points are uniform (the
    theorem's first assumption), and a response runs until its budget is spent. Sampled in
    plain Python so that the thousands of tokens the statistics need take a fraction of a
    second."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(lambda resp: {}, seed)
        self.rng = random.Random(seed)

    def generate(self, prompts, params):
        self.stats.calls += 1
        out = []
        for sp in per_prompt(prompts, params):
            comps = []
            for _ in range(sp.n):
                toks, lps = [], []
                for _ in range(sp.max_tokens):
                    u = self.rng.uniform(0.05, 0.95)
                    first = self.rng.random() < u
                    toks.append(1 if first else 2)
                    lps.append(math.log(u if first else 1 - u))
                self.stats.tokens_generated += len(toks)
                comps.append(Completion(toks, lps, "length"))
            out.append(comps)
        return out


def leaf_ratio(continuation, m, n, iters, t, prompts=20, max_context=4096):
    """Leaves per tree over independent chains of the same length at equal generated tokens,
    the leaves' lengths, and the engine calls made."""
    ctx, _ = toy_context(lambda resp: {}, max_tokens=LENGTH)
    ctx.max_context = max_context
    ctx.engine = EndlessEngine()
    ep = EPTree(EPTreeConfig(M=m, N=n, L=iters, T=t, answer_markers=[], continuation=continuation))
    trees, stats = ep.rollout([Task(f"t{i}", i) for i in range(prompts)], ctx)
    lengths = [len(leaf.token_ids) - len(PROMPT) for tree in trees for leaf in ep.group(tree)]
    leaves = len(lengths) / (prompts * m)
    chains = stats.policy_tokens_generated / (prompts * m) / LENGTH
    return leaves / chains, lengths, ctx.engine.stats.calls


@pytest.mark.parametrize(("n", "iters", "t"), [(2, 1, 2), (1, 2, 1), (2, 2, 1)])
def test_eptree_leaves_match_theorem1_at_fixed_length(n, iters, t):
    """The sampler itself, under the theorem's assumptions (uniform fork points, fixed lengths
    through `continuation: remaining`), gives the leaf ratio Theorem 1 predicts, within its
    bounds. Positions are discrete (a continuation from offset k has LENGTH - k tokens, mean
    1/2 + 1/(2 LENGTH) of a chain), so the match is to a few percent."""
    ratio, lengths, calls = leaf_ratio("remaining", 8, n, iters, t, prompts=50)
    assert set(lengths) == {LENGTH}  # every leaf is exactly as long as a chain
    assert calls == 1 + iters  # the chains, then one call an iteration whatever the budgets
    assert ratio == pytest.approx(theorem1_ratio(n, t, iters), rel=0.05)
    low, high = THEOREM1_BOUNDS
    assert low <= ratio < high


def test_full_budget_continuations_break_the_fixed_length_assumption():
    # Each continuation spends a whole chain's budget: tokens grow as fast as leaves, so the
    # tree has exactly as many leaves as independent chains would at equal tokens.
    ratio, lengths, _ = leaf_ratio("full", 4, 2, 1, 2, prompts=4)
    assert ratio == pytest.approx(1.0)
    assert max(lengths) > LENGTH


def test_each_continuation_has_the_room_its_own_context_leaves():
    """Full-budget continuations near the context limit: each stops where its own context
    fills up (a late fork point leaves less room than an early one), not where the deepest
    fork of its round would."""
    limit = LENGTH + 30  # response tokens that fit after the prompt
    _, lengths, _ = leaf_ratio("full", 4, 4, 1, 1, prompts=8, max_context=len(PROMPT) + limit)
    # a fork at offset k continues min(LENGTH, limit - k) tokens: a leaf of min(k + LENGTH,
    # limit), never shorter than a chain (the deepest fork's room, 31, would leave k + 31)
    assert min(lengths) == LENGTH and max(lengths) == limit
    assert any(LENGTH < n < limit for n in lengths)
