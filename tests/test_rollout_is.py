"""Rollout importance sampling: the truncated weights pi_old / mu, by hand, and a batch sampled
by a known stale policy whose corrected gradient is the on-policy one worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from agentree.algorithms.loss import policy_loss, rollout_is_weights
from agentree.config import TrainConfig, load_config
from agentree.learner.update import PolicyUpdate
from agentree.tree import EndReason, Tree

F64 = torch.float64


def test_token_weights_are_the_capped_ratio_by_hand():
    old = torch.log(torch.tensor([[0.2, 0.5, 0.3, 0.9]], dtype=F64))
    mu = torch.log(torch.tensor([[0.5, 0.25, 0.25, 0.1]], dtype=F64))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64)
    w, st = rollout_is_weights(old, mu, mask, level="token", cap=1.5)
    # 0.2/0.5 = 0.4, 0.5/0.25 = 2 -> capped at 1.5, 0.3/0.25 = 1.2, off the mask 0
    assert w[0].tolist() == pytest.approx([0.4, 1.5, 1.2, 0.0])
    assert st["raw"][0].tolist() == pytest.approx([0.4, 2.0, 1.2, 0.0])
    assert st["clipped"][0].tolist() == [0.0, 1.0, 0.0, 0.0]
    # k3 of KL(mu || pi_old) per token: r - 1 - log r with r = pi_old / mu
    k3 = [r - 1 - math.log(r) for r in (0.4, 2.0, 1.2)]
    assert st["k3"][0, :3].tolist() == pytest.approx(k3)
    assert not w.requires_grad


def test_sequence_weights_are_the_capped_product_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.8, 0.7], [0.9, 0.6, 0.1]], dtype=F64))
    mu = torch.log(torch.tensor([[0.25, 0.4, 0.5], [0.3, 0.3, 0.5]], dtype=F64))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
    w, st = rollout_is_weights(old, mu, mask, level="sequence", cap=5.0)
    # row 0: (0.5/0.25) * (0.8/0.4) = 4 (its third token is off the mask and not counted)
    # row 1: (0.9/0.3) * (0.6/0.3) * (0.1/0.5) = 3 * 2 * 0.2 = 1.2
    assert w.flatten().tolist() == pytest.approx([4.0, 4.0, 0.0, 1.2, 1.2, 1.2])
    w, st = rollout_is_weights(old, mu, mask, level="sequence", cap=2.0)
    assert w.flatten().tolist() == pytest.approx([2.0, 2.0, 0.0, 1.2, 1.2, 1.2])
    assert st["clipped"].tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_weights_scale_the_policy_term_but_not_the_kl():
    logp = torch.log(torch.tensor([[0.5, 0.5]], dtype=F64))
    adv = torch.tensor([[1.0, -2.0]], dtype=F64)
    ref = torch.log(torch.tensor([[0.25, 0.5]], dtype=F64))
    mask = torch.ones(1, 2, dtype=F64)
    isw = torch.tensor([[0.5, 3.0]], dtype=F64)
    kw = {"eps_low": 0.2, "eps_high": 0.28, "agg": "token-mean", "ref_logprobs": ref}
    loss, _ = policy_loss(logp, logp, adv, mask, kl_coef=0.1, is_weights=isw, **kw)
    # ratio 1: per-token -w A + 0.1 k3; k3 = 0.5 - 1 - log 0.5 on token 0, 0 on token 1
    k3 = 0.5 - 1 - math.log(0.5)
    want = ((-0.5 * 1.0 + 0.1 * k3) + (-3.0 * -2.0)) / 2
    assert loss.item() == pytest.approx(want, abs=1e-12)


def test_bad_levels_and_caps_are_refused():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="token or sequence"):
        rollout_is_weights(x, x, x, level="none", cap=2.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        rollout_is_weights(x, x, x, level="token", cap=0.0)
    cfg = load_config(overrides=["train.rollout_is=sequence", "train.rollout_is_cap=4"])
    assert (cfg.train.rollout_is, cfg.train.rollout_is_cap) == ("sequence", 4.0)
    assert (TrainConfig().rollout_is, TrainConfig().rollout_is_cap) == ("none", 2.0)
    with pytest.raises(ValueError, match="rollout_is"):
        load_config(overrides=["train.rollout_is=geometric"])


# -- a one-step bandit sampled by a stale policy ---------------------------------------------
# The trainer's policy pi = softmax(theta) over actions 1, 2, 3 is (0.2, 0.5, 0.3); the batch was
# sampled by a stale policy mu = (0.5, 0.25, 0.25), four draws whose empirical distribution is
# mu exactly: actions 1, 1, 2, 3. Rewards r(1) = 1, r(2) = 0, r(3) = 1; Dr. GRPO advantages
# A = r - mean(r) = r - 0.75: A(1) = 0.25, A(2) = -0.75, A(3) = 0.25.
#
# On-policy, the gradient of the loss -E_pi[A] w.r.t. theta_j is
#   -sum_a pi(a) A(a) (1[a = j] - pi(j)) = -pi(j) (A(j) - sum_a pi(a) A(a)),
# and sum_a pi(a) A(a) = 0.05 - 0.375 + 0.075 = -0.25, so
#   grad = -(0.2 * 0.5, 0.5 * -0.5, 0.3 * 0.5) = (-0.1, 0.25, -0.15).
# Uncorrected, the batch estimates -sum_a mu(a) A(a) (1[a = j] - pi(j)) with sum_a mu A = 0:
#   grad = -(0.5 * 0.25, 0.25 * -0.75, 0.25 * 0.25) = (-0.125, 0.1875, -0.0625).
PI = (0.2, 0.5, 0.3)
MU = (0.5, 0.25, 0.25)
REWARD = {1: 1.0, 2: 0.0, 3: 1.0}
ON_POLICY_GRAD = (-0.1, 0.25, -0.15)
UNCORRECTED_GRAD = (-0.125, 0.1875, -0.0625)


class Bandit(torch.nn.Module):
    """A context-free policy: the same logits theta at every position (token 0 is the prompt;
    tokens 1-3 the actions; 4+ never drawn)."""

    def __init__(self) -> None:
        super().__init__()
        theta = torch.full((6,), -1e4)
        theta[1:4] = torch.log(torch.tensor(PI))
        self.theta = torch.nn.Parameter(theta)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
        logits = self.theta.expand(*input_ids.shape, -1)
        return type("Out", (), {"logits": logits})()


def stale_batch() -> tuple[list[Tree], list[list]]:
    tree = Tree("bandit")
    tree.add_root("pull", [0])
    for a in (1, 1, 2, 3):
        tree.add_child(
            0,
            action_ids=[a],
            logprobs=[math.log(MU[a - 1])],
            reward=REWARD[a],
            end_reason=EndReason.COMPLETED,
        )
    return [tree], [tree.trajectories()]


def gradient_of_one_update(tc: TrainConfig, *, stale: bool = False) -> tuple[list, dict]:
    model = Bandit()
    grads: list[torch.Tensor] = []
    model.theta.register_hook(lambda g: grads.append(g.detach().clone()))
    update = PolicyUpdate(model, tc)
    trees, groups = stale_batch()
    metrics = update(trees, groups, lr=1e-3, stale=stale)
    (g,) = grads
    return g[1:4].tolist(), metrics


def bandit_config(**kw) -> TrainConfig:
    base = {"adv_scale": "none", "kl_coef": 0.0, "packing": "padded", "micro_batch_size": 8}
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("stale", [False, True])
def test_corrected_gradient_is_the_on_policy_one_by_hand(stale):
    grad, m = gradient_of_one_update(
        bandit_config(rollout_is="token", rollout_is_cap=5.0), stale=stale
    )
    assert grad == pytest.approx(ON_POLICY_GRAD, abs=1e-6)
    # weights pi / mu: 0.4, 0.4, 2.0, 1.2
    assert m["train/rollout_is_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m["train/rollout_is_max"] == pytest.approx(2.0, abs=1e-6)
    assert m["train/rollout_is_min"] == pytest.approx(0.4, abs=1e-6)
    assert m["train/rollout_is_clipped_frac"] == 0.0
    assert m["train/rollout_is_ess"] == pytest.approx(1 / 1.44, abs=1e-6)  # 1 / mean(w^2)
    k3 = sum(r - 1 - math.log(r) for r in (0.4, 0.4, 2.0, 1.2)) / 4
    assert m["train/rollout_kl"] == pytest.approx(k3, abs=1e-6)


def test_without_correction_the_gradient_is_the_samplers():
    grad, m = gradient_of_one_update(bandit_config())
    assert grad == pytest.approx(UNCORRECTED_GRAD, abs=1e-6)
    assert "train/rollout_is_mean" not in m


def test_the_cap_truncates_the_largest_weight():
    grad, m = gradient_of_one_update(bandit_config(rollout_is="token", rollout_is_cap=1.5))
    # action 2's weight 2.0 becomes 1.5: its term -(1/4) w A (e_2 - pi) shrinks by 1.5 / 2
    full = [-(w * A) / 4 for w, A in ((0.4, 0.25), (0.4, 0.25), (1.5, -0.75), (1.2, 0.25))]
    actions = (1, 1, 2, 3)
    want = [
        sum(c * ((a == j) - PI[j - 1]) for c, a in zip(full, actions, strict=True))
        for j in (1, 2, 3)
    ]
    assert grad == pytest.approx(want, abs=1e-6)
    assert m["train/rollout_is_clipped_frac"] == pytest.approx(0.25)
    assert m["train/rollout_is_mean"] == pytest.approx((0.4 + 0.4 + 1.5 + 1.2) / 4, abs=1e-6)
