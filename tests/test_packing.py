"""Tree-packed updates: on real rollout trees the packed loss and every parameter gradient equal
the padded ones; shared tokens carry the summed weights of their trajectories (numbers by hand
from the token-mean / seq-mean aggregation of DAPO Eq. 8 / GRPO Eq. 2); tree attention never
lets a token see a sibling branch."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from small_policy import WARM_2_LAYERS

from agentree.algorithms.advantages import compute_advantages
from agentree.algorithms.loss import loss_normalizer, policy_loss
from agentree.algorithms.packing import (
    ATTN_PER_WIDTH,
    attention_break_even,
    batch_logprobs,
    choose_layout,
    make_batch,
    pack,
    packed_micro_batches,
    packed_token_logprobs,
    padded_micro_batches,
    token_weights,
    unpack,
)
from agentree.config import load_config
from agentree.envs.base import Task
from agentree.run.runtime import Runtime
from agentree.tree import EndReason, Tree

# Rollout settings kept small for CI; token-level samplers get loose thresholds so that the
# untrained tiny policy (top p ~ 0.04) still branches.
CASES = {
    "frozenlake_patr": (
        "frozenlake_patr",
        {},
        [*WARM_2_LAYERS, "engine.max_tokens=6", "env.max_turns=4", "rollout.K=2"],
    ),
    "countdown_latr": (
        None,
        {"env": "countdown", "rollout": "latr"},
        ["rollout.k=4", "rollout.tau_abs=0.01", "rollout.tau_rel=0.03", "engine.max_tokens=16"],
    ),
    "countdown_treepo": (
        None,
        {"env": "countdown", "rollout": "treepo"},
        ["rollout.w=4", "rollout.d=2", "rollout.l=8", "engine.max_tokens=16"],
    ),
    "countdown_eptree": (
        None,
        {"env": "countdown", "rollout": "eptree"},
        ["rollout.M=2", "rollout.N=2", "rollout.L=1", "rollout.T=2", "engine.max_tokens=16"],
    ),
}
TOL = {"rtol": 1e-4, "atol": 1e-6}  # fp32; packed and padded differ only in summation order


@pytest.fixture(scope="module", params=list(CASES))
def rollout(request, tmp_path_factory):
    """(runtime, trees, groups, advantages) from a real rollout of two tasks. The untrained
    policy mostly earns equal rewards (zero group advantages), so besides checking the real
    estimator runs, the advantages are random per (trajectory, token), of both signs: the most
    general input, where a shared token has different advantages in different trajectories."""
    os.environ.setdefault("AGENTREE_CACHE", str(tmp_path_factory.mktemp("cache")))
    name, select, overrides = CASES[request.param]
    cfg = load_config(name, select=select, overrides=overrides)
    rt = Runtime(cfg, log=lambda m: None)
    trees, _ = rt.rollouts.rollout(rt.load_tasks(2, split="train"))
    groups = [rt.controller.group(t) for t in trees]
    compute_advantages("grpo", trees, groups)
    g = torch.Generator().manual_seed(0)
    advs = [[torch.randn(len(t.token_ids), generator=g).tolist() for t in grp] for grp in groups]
    yield rt, trees, groups, advs
    rt.close()


def perturbed(model, scale: float, seed: int):
    """A copy of the policy with noisy weights: a stand-in for pi_old or the reference."""
    other = copy.deepcopy(model).requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return other


def loss_and_grads(model, micro, agg, old_model, ref_model):
    """Full-batch loss by gradient accumulation over `micro`, as `PolicyUpdate` computes it,
    with an off-policy pi_old (so the clip binds) and a KL term."""
    model.zero_grad(set_to_none=True)
    norm = sum(loss_normalizer(b.mask, agg) for b in micro)
    total = 0.0
    clipped = 0.0
    for b in micro:
        with torch.no_grad():
            old = batch_logprobs(old_model, b, 1.0)
            ref = batch_logprobs(ref_model, b, 1.0)
        lp = batch_logprobs(model, b, 1.0)
        loss, met = policy_loss(
            lp,
            old,
            b.adv,
            b.mask,
            eps_low=0.2,
            eps_high=0.28,
            agg=agg,
            ref_logprobs=ref,
            kl_coef=0.05,
            normalizer=norm,
        )
        loss.backward()
        total += float(loss.detach())
        clipped += met["train/clip_frac_low"] + met["train/clip_frac_high"]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return total, grads, clipped


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_packed_loss_and_gradients_equal_padded(rollout, agg):
    rt, _trees, groups, advs = rollout
    model = rt.model.float().train()
    old_model = perturbed(model, 0.1, 1)
    ref_model = perturbed(model, 0.02, 2)
    trajs = [t for g in groups for t in g]
    flat = [a for g in advs for a in g]
    # micro-batch size 3: several micro-batches on each side, so accumulation is exercised
    padded = padded_micro_batches(trajs, flat, 0, 3)
    packed = packed_micro_batches(groups, advs, 0, 3)
    assert len(padded) > 1
    l_pad, g_pad, clip_pad = loss_and_grads(model, padded, agg, old_model, ref_model)
    l_pack, g_pack, _ = loss_and_grads(model, packed, agg, old_model, ref_model)
    assert clip_pad > 0  # the clip binds somewhere, so the nonlinear case is covered
    assert l_pack == pytest.approx(l_pad, rel=1e-5, abs=1e-7)
    for n, g in g_pad.items():
        assert torch.allclose(g_pack[n], g, **TOL), (n, float((g_pack[n] - g).abs().max()))
    assert sum(b.forwarded_tokens for b in packed) < sum(b.ids.numel() for b in padded)


def test_packed_logprobs_equal_the_sampled_ones(rollout):
    rt, _trees, groups, advs = rollout
    for b in packed_micro_batches(groups, advs, 0, 8):
        with torch.no_grad():
            lp = batch_logprobs(rt.model, b, rt.cfg.engine.temperature)
        assert float(((lp - b.sampled_lp).abs() * b.mask).max()) < 1e-4


def test_a_sibling_branch_is_invisible(rollout):
    """Change one policy token that only some trajectories contain: log-probs of every target
    outside those trajectories' continuations stay the same."""
    rt, _trees, groups, advs = rollout
    b = pack(groups, advs, 0)
    with torch.no_grad():
        base = packed_token_logprobs(rt.model, b, 1.0)
    n_traj = b.index.shape[0]
    through = [set(b.index[i][b.mask[i] > 0].tolist()) for i in range(n_traj)]

    def continuation(k: int) -> set[int]:
        """Target k and every target after it in the trajectories that contain it."""
        out: set[int] = set()
        for i in range(n_traj):
            row = b.index[i].tolist()
            if k in row:
                out |= {x for x in row[row.index(k) :] if x < len(b.target)}
        return out

    # a target on a branch (in at least one trajectory but not in all of its group's) that has
    # tokens after it
    k = next(
        k
        for k in range(len(b.target))
        if 0 < sum(k in s for s in through) < len(groups[0]) and len(continuation(k)) > 1
    )
    affected = continuation(k)
    ids = b.ids.clone()
    f = int(b.target[k])
    ids.view(-1)[f] = (ids.view(-1)[f] + 1) % rt.model.config.vocab_size
    changed = copy.copy(b)
    changed.ids = ids
    with torch.no_grad():
        after = packed_token_logprobs(rt.model, changed, 1.0)
    others = [x for x in range(len(b.target)) if x not in affected]
    assert others and len(affected) > 1
    assert torch.allclose(after[others], base[others], atol=1e-6)
    assert not torch.allclose(after[sorted(affected)], base[sorted(affected)], atol=1e-4)


def hand_tree() -> Tree:
    """Prompt [5, 6, 7]; node 1 = policy [8, 9] + obs [10], with leaves 2 (policy [11]) and
    3 (policy [12]); leaf 4 = policy [13] straight after the prompt."""
    t = Tree("hand")
    t.add_root("p", [5, 6, 7])
    t.add_child(0, action_ids=[8, 9], logprobs=[-1.0, -1.0], obs_ids=[10])
    for parent, tok in ((1, 11), (1, 12), (0, 13)):
        t.add_child(parent, action_ids=[tok], logprobs=[-1.0], end_reason=EndReason.COMPLETED)
    return t


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        # token-mean: N = 3 + 3 + 1 policy tokens; each (trajectory, token) pair weighs A_i / N
        ("token-mean", {8: 2 / 7, 9: 2 / 7, 11: 1 / 7, 12: 1 / 7, 13: -0.5 / 7}),
        # seq-mean: 3 sequences of 3, 3 and 1 policy tokens; a pair weighs A_i / (len_i * 3)
        ("seq-mean", {8: 2 / 9, 9: 2 / 9, 11: 1 / 9, 12: 1 / 9, 13: -0.5 / 3}),
    ],
)
def test_a_token_shared_by_k_trajectories_carries_k_weights(agg, expected):
    tree = hand_tree()
    group = tree.trajectories()
    advantage = {11: 1.0, 12: 1.0, 13: -0.5}
    advs = [[advantage[t.token_ids[-1]]] * len(t.token_ids) for t in group]
    b = pack([group], [advs], 0)
    assert b.forwarded_tokens == 9  # 5 6 7 8 9 10 11 12 13, each once
    tokens = b.ids.view(-1)[b.target].tolist()
    assert sorted(tokens) == [8, 9, 11, 12, 13]  # policy targets, each once
    norm = loss_normalizer(b.mask, agg)
    w = token_weights(b, agg, norm)
    assert dict(zip(tokens, w.tolist(), strict=True)) == pytest.approx(expected)
    # On-policy (rho = 1) the loss gradient w.r.t. each shared log-prob is minus its weight.
    lp = torch.full((len(tokens),), -1.0, requires_grad=True)
    loss, _ = policy_loss(
        unpack(b, lp),
        unpack(b, lp).detach(),
        b.adv,
        b.mask,
        eps_low=0.2,
        eps_high=0.28,
        agg=agg,
        normalizer=norm,
    )
    loss.backward()
    assert torch.allclose(lp.grad, -w, atol=1e-7)
    # And the padded layout weighs the same pairs the same.
    pad = make_batch(group, advs, 0)
    assert torch.equal(pad.mask, b.mask) and torch.equal(pad.adv, b.adv)


def test_trie_shares_tokens_and_positions_are_depths():
    b = pack([hand_tree().trajectories()], [[[0.0] * 7, [0.0] * 7, [0.0] * 4]], 0)
    ids = b.ids[0].tolist()
    pos = dict(zip(ids, b.position_ids[0].tolist(), strict=True))
    assert pos == {5: 0, 6: 1, 7: 2, 8: 3, 9: 4, 10: 5, 11: 6, 12: 6, 13: 3}
    col = {t: c for c, t in enumerate(ids)}
    sees = {t: {ids[c] for c in range(len(ids)) if b.tree_mask[0, col[t], c]} for t in ids}
    assert sees[12] == {5, 6, 7, 8, 9, 10, 12}  # its ancestors and itself, not sibling 11
    assert sees[13] == {5, 6, 7, 13}


def test_auto_layout_picks_the_packed_rows_for_a_shared_prefix():
    group = hand_tree().trajectories()
    advs = [[[1.0] * len(t.token_ids) for t in group]]
    assert type(choose_layout([group], advs, 0, 8, "auto")[0]).__name__ == "PackedBatch"
    assert type(choose_layout([group], advs, 0, 8, "padded")[0]).__name__ == "Batch"
    with pytest.raises(ValueError, match=r"train\.packing"):
        choose_layout([group], advs, 0, 8, "sometimes")


def test_break_even_is_the_model_devices_figure_times_its_width():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = Qwen2ForCausalLM(cfg)
    assert attention_break_even(model) == ATTN_PER_WIDTH["cpu"] * 48
    if torch.cuda.is_available():
        assert attention_break_even(model.cuda()) == ATTN_PER_WIDTH["cuda"] * 48


def test_policy_update_packed_equals_padded(tmp_path, monkeypatch):
    """One full `PolicyUpdate` (advantages, KL to a reference, accumulation over micro-batches,
    AdamW step) moves the weights the same with tree-packed and padded rows."""
    from agentree.learner.update import PolicyUpdate

    monkeypatch.setenv("AGENTREE_CACHE", os.environ.get("AGENTREE_CACHE", str(tmp_path)))
    name, select, overrides = CASES["frozenlake_patr"]
    cfg = load_config(name, select=select, overrides=[*overrides, "train.micro_batch_size=2"])
    rt = Runtime(cfg, log=lambda m: None)
    # Goal next to the start: groups mix wins and losses, so advantages are not all zero.
    trees, _ = rt.rollouts.rollout(
        [Task(f"easy{i}", None, {"desc": ["SGF", "FFF", "FFF"]}) for i in (0, 1)]
    )
    groups = [rt.controller.group(t) for t in trees]
    assert len({t.reward for g in groups for t in g}) > 1
    ref = perturbed(rt.model, 0.02, 3)
    moved, stats = {}, {}
    for packing in ("tree", "padded"):
        model = copy.deepcopy(rt.model).float()
        tc = cfg.train.model_copy(update={"packing": packing, "lr": 1e-3, "kl_coef": 0.05})
        upd = PolicyUpdate(model, tc, ref=ref, pad_id=0)
        assert type(upd.batches(trees, groups)[0]).__name__ == (
            "PackedBatch" if packing == "tree" else "Batch"
        )
        stats[packing] = upd(trees, groups, lr=1e-3)
        assert stats[packing]["train/logprob_drift"] < 1e-4
        moved[packing] = [p.detach() for p in model.parameters()]
    start = list(rt.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(moved["tree"], start, strict=True))
    assert stats["tree"]["train/packed"] == 1.0 and stats["padded"]["train/packed"] == 0.0
    assert stats["tree"]["train/forward_tokens"] < stats["padded"]["train/forward_tokens"]
    for key in ("train/loss", "train/grad_norm", "train/kl", "train/policy_tokens"):
        assert stats["tree"][key] == pytest.approx(stats["padded"][key], rel=1e-4)
    # Adam's first step is lr * g / (|g| + eps): entries with |g| near eps turn fp32 rounding
    # of g into up to a few percent of lr, hence the weights compare at 5% of one step.
    for a, b in zip(moved["tree"], moved["padded"], strict=True):
        assert torch.allclose(a, b, rtol=0, atol=0.05 * 1e-3)
    rt.close()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_logprobs_with_each_attention_implementation(impl, tiny_frozenlake):
    from transformers import AutoModelForCausalLM

    from agentree.algorithms.packing import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(
        tiny_frozenlake, dtype=torch.float32, attn_implementation=impl
    )
    group = hand_tree().trajectories()
    advs = [[1.0] * len(t.token_ids) for t in group]
    with torch.no_grad():
        packed = batch_logprobs(model, pack([group], [advs], 0), 1.0)
        padded = token_logprobs(model, make_batch(group, advs, 0), 1.0)
    mask = make_batch(group, advs, 0).mask
    assert torch.allclose(packed * mask, padded * mask, atol=1e-5)
