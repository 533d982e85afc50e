"""The clipped policy loss against numbers worked out by hand, and its gradients by autograd."""

import math

import pytest
import torch

from agentree.algorithms.loss import (
    aggregate,
    k3_kl,
    loss_normalizer,
    masked_mean,
    masked_sum,
    policy_loss,
)

F64 = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def test_masked_helpers_ignore_masked_garbage():
    x = t([[1.0, 2.0, math.inf], [4.0, math.nan, 6.0]])
    m = t([[1, 1, 0], [1, 0, 1]])
    assert masked_sum(x, m).item() == 13.0
    assert masked_mean(x, m).item() == 13.0 / 4
    assert masked_mean(x, m, dim=-1).tolist() == [1.5, 5.0]
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


# -- clipping (PPO min with DAPO's asymmetric clip) ------------------------------------------
# eps_low = 0.2, eps_high = 0.28: the ratio may fall to 0.8 and rise to 1.28.
RATIOS = [1.5, 1.5, 0.5, 0.5, 1.25, 0.85]
ADVS = [1.0, -1.0, -1.0, 1.0, 1.0, -1.0]
# min(rho A, clip(rho) A) per token, by hand:
#   1.5,+1 -> min(1.5, 1.28) = 1.28    clipped high: no gradient
#   1.5,-1 -> min(-1.5, -1.28) = -1.5  unclipped
#   0.5,-1 -> min(-0.5, -0.8) = -0.8   clipped low: no gradient
#   0.5,+1 -> min(0.5, 0.8) = 0.5      unclipped
#   1.25,+1 -> 1.25 (inside 1.28; a symmetric eps of 0.2 would have clipped it)
#   0.85,-1 -> -0.85 (inside 0.8)
OBJ = [1.28, -1.5, -0.8, 0.5, 1.25, -0.85]
CLIPPED = [True, False, True, False, False, False]


def clip_case():
    old = torch.zeros(1, 6, dtype=F64)
    logp = torch.log(t([RATIOS])).requires_grad_()
    return logp, old, t([ADVS]), torch.ones(1, 6, dtype=F64)


def test_clip_values_and_gradients_on_both_sides():
    logp, old, adv, mask = clip_case()
    loss, metrics = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, agg="token-mean")
    assert loss.item() == pytest.approx(-sum(OBJ) / 6, abs=1e-12)
    assert loss.item() == pytest.approx(0.02, abs=1e-12)  # -(-0.12) / 6
    loss.backward()
    # d(-rho A)/d logp = -rho A on unclipped tokens (d rho / d logp = rho), 0 where clipped.
    want = [0.0 if c else -r * a / 6 for r, a, c in zip(RATIOS, ADVS, CLIPPED, strict=True)]
    assert logp.grad[0].tolist() == pytest.approx(want, abs=1e-12)
    assert [g == 0.0 for g in logp.grad[0].tolist()] == CLIPPED
    assert metrics["train/clip_frac_low"] == pytest.approx(1 / 6)
    assert metrics["train/clip_frac_high"] == pytest.approx(1 / 6)
    assert metrics["train/ratio_mean"] == pytest.approx(sum(RATIOS) / 6)
    # k3 of KL(old || new) per token: rho - 1 - log rho.
    approx_kl = sum(r - 1 - math.log(r) for r in RATIOS) / 6
    assert metrics["train/approx_kl"] == pytest.approx(approx_kl, abs=1e-12)


def test_symmetric_clip_would_clip_the_token_clip_higher_keeps():
    logp, old, adv, mask = clip_case()
    loss, metrics = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2, agg="token-mean")
    loss.backward()
    assert logp.grad[0, 4].item() == 0.0  # rho = 1.25 > 1.2 with A > 0
    assert metrics["train/clip_frac_high"] == pytest.approx(2 / 6)


# -- aggregation ----------------------------------------------------------------------------
def test_token_mean_and_seq_mean_differ_on_unequal_lengths():
    # rho = 1 everywhere, so each policy token contributes -A. Sequence 1: one token, A = +1.
    # Sequence 2: three tokens, A = -1.
    logp = torch.zeros(2, 3, dtype=F64)
    adv = t([[1.0, 5.0, 5.0], [-1.0, -1.0, -1.0]])  # masked advantages must not count
    mask = t([[1, 0, 0], [1, 1, 1]])
    kw = dict(eps_low=0.2, eps_high=0.2)
    token, _ = policy_loss(logp, logp, adv, mask, agg="token-mean", **kw)
    seq, _ = policy_loss(logp, logp, adv, mask, agg="seq-mean", **kw)
    assert token.item() == pytest.approx(-(1 - 1 - 1 - 1) / 4)  # 0.5
    assert seq.item() == pytest.approx(-(1 / 1 + (-3) / 3) / 2)  # 0.0
    assert token.item() != pytest.approx(seq.item())


def test_normalizer_counts_tokens_or_nonempty_sequences():
    mask = t([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    assert loss_normalizer(mask, "token-mean") == 4.0
    assert loss_normalizer(mask, "seq-mean") == 2.0
    with pytest.raises(ValueError, match="aggregation"):
        loss_normalizer(mask, "sum")
    # An all-empty micro-batch gives a zero loss, not a nan.
    assert aggregate(torch.ones(1, 3), torch.zeros(1, 3), "token-mean").item() == 0.0


def test_seq_mean_weighs_a_trajectory_split_into_turns_as_one_sequence():
    """Under a history window a trajectory's turns are separate rows; `seq_tokens` gives each
    row its trajectory's policy tokens. Trajectory 1: turns of 1 and 2 tokens (3 in all),
    A = +1; trajectory 2: one turn of 2 tokens, A = -1. At rho = 1 each token's loss is -A, so
    Eq. 2 gives -((1 + 1 + 1) / 3 + (-1 - 1) / 2) / 2 = 0, where weighing the three rows alike
    would give -(1 + 1 - 1) / 3."""
    logp = torch.zeros(3, 2, dtype=F64)
    adv = t([[1.0, 0.0], [1.0, 1.0], [-1.0, -1.0]])
    mask = t([[1, 0], [1, 1], [1, 1]])
    seq = t([3, 3, 2])
    kw = dict(eps_low=0.2, eps_high=0.2, agg="seq-mean")
    eq2, _ = policy_loss(logp, logp, adv, mask, seq_tokens=seq, **kw)
    rows, _ = policy_loss(logp, logp, adv, mask, **kw)
    assert eq2.item() == pytest.approx(0.0)
    assert rows.item() == pytest.approx(-1 / 3)
    # each row counts as its share of its trajectory: 1/3 + 2/3 + 2/2 = 2 trajectories
    assert loss_normalizer(mask, "seq-mean", seq) == pytest.approx(2.0)
    assert loss_normalizer(mask, "seq-mean") == 3.0
    # the gradient on each token is -A / (its trajectory's tokens x trajectories)
    x = logp.clone().requires_grad_()
    policy_loss(x, logp, adv, mask, seq_tokens=seq, **kw)[0].backward()
    want = t([[-1 / 6, 0.0], [-1 / 6, -1 / 6], [1 / 4, 1 / 4]])
    torch.testing.assert_close(x.grad, want, rtol=0, atol=1e-15)
    # split across micro-batches (or ranks), the shares add up to the same normaliser
    parts = [slice(0, 1), slice(1, 3)]
    norm = sum(loss_normalizer(mask[c], "seq-mean", seq[c]) for c in parts)
    total = sum(
        policy_loss(logp[c], logp[c], adv[c], mask[c], seq_tokens=seq[c], normalizer=norm, **kw)[
            0
        ].item()
        for c in parts
    )
    assert norm == pytest.approx(2.0) and total == pytest.approx(0.0, abs=1e-15)
    with pytest.raises(ValueError, match="seq_tokens"):
        loss_normalizer(mask, "seq-mean", t([3, 2]))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_micro_batch_accumulation_equals_the_full_batch_gradient(agg):
    g = torch.Generator().manual_seed(0)
    b, s = 6, 7
    logp0 = -torch.rand(b, s, generator=g, dtype=F64) * 2
    old = logp0 + 0.3 * torch.randn(b, s, generator=g, dtype=F64)
    ref = logp0 + 0.3 * torch.randn(b, s, generator=g, dtype=F64)
    adv = torch.randn(b, s, generator=g, dtype=F64)
    lengths = [1, 7, 3, 5, 2, 6]  # unequal on purpose
    mask = t([[1.0] * n + [0.0] * (s - n) for n in lengths])
    kw = dict(eps_low=0.2, eps_high=0.28, agg=agg, kl_coef=0.05)

    full = logp0.clone().requires_grad_()
    loss, _ = policy_loss(full, old, adv, mask, ref_logprobs=ref, **kw)
    loss.backward()

    chunks = [slice(0, 1), slice(1, 4), slice(4, 6)]
    norm = sum(loss_normalizer(mask[c], agg) for c in chunks)
    assert norm == loss_normalizer(mask, agg)
    micro = logp0.clone().requires_grad_()
    naive = logp0.clone().requires_grad_()
    total = 0.0
    for c in chunks:
        args = (old[c], adv[c], mask[c])
        part, _ = policy_loss(micro[c], *args, ref_logprobs=ref[c], normalizer=norm, **kw)
        part.backward()
        total += part.item()
        # Without the full-batch normalizer each micro-batch is averaged on its own.
        bad, _ = policy_loss(naive[c], *args, ref_logprobs=ref[c], **kw)
        (bad / len(chunks)).backward()
    assert total == pytest.approx(loss.item(), abs=1e-12)
    torch.testing.assert_close(micro.grad, full.grad, rtol=0, atol=1e-12)
    assert not torch.allclose(naive.grad, full.grad)


# -- KL to the reference (k3) ---------------------------------------------------------------
def test_k3_values_by_hand_and_non_negative():
    # exp(d) - d - 1: d = ln 2 -> 2 - ln 2 - 1; d = -1 -> e^-1 + 1 - 1; d = 0 -> 0.
    d = t([math.log(2), -1.0, 0.0])
    want = [1 - math.log(2), math.exp(-1), 0.0]
    assert k3_kl(d).tolist() == pytest.approx(want, abs=1e-12)
    assert k3_kl(d)[0].item() == pytest.approx(0.3068528194, abs=1e-9)
    many = torch.linspace(-20, 20, 4001, dtype=F64)
    assert (k3_kl(many) >= 0).all()


def test_kl_penalty_value_and_gradient():
    # A = 0 isolates the penalty. ref - logp = [ln 2, -1]; loss = kl_coef * mean(k3).
    logp = t([[-1.0, -2.0]]).requires_grad_()
    ref = t([[-1.0 + math.log(2), -3.0]])
    zero = torch.zeros(1, 2, dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    loss, metrics = policy_loss(
        logp,
        logp.detach(),
        zero,
        mask,
        eps_low=0.2,
        eps_high=0.2,
        agg="token-mean",
        ref_logprobs=ref,
        kl_coef=0.1,
    )
    k3 = [2 - math.log(2) - 1, math.exp(-1) + 1 - 1]
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2, abs=1e-12)
    assert metrics["train/kl"] == pytest.approx(sum(k3) / 2, abs=1e-12)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp): 1 - 2 = -1 and 1 - e^-1.
    want = [0.1 * (1 - 2) / 2, 0.1 * (1 - math.exp(-1)) / 2]
    assert logp.grad[0].tolist() == pytest.approx(want, abs=1e-12)


def test_padding_garbage_never_reaches_loss_or_gradient():
    logp = t([[-0.5, -math.inf]]).requires_grad_()
    old = t([[-0.5, math.nan]])
    ref = t([[-0.5, 3.0]])
    loss, metrics = policy_loss(
        logp,
        old,
        t([[1.0, 1.0]]),
        t([[1, 0]]),
        eps_low=0.2,
        eps_high=0.2,
        agg="seq-mean",
        ref_logprobs=ref,
        kl_coef=0.1,
        entropy=t([[0.7, math.nan]]),
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    assert torch.isfinite(logp.grad).all()
    assert metrics["train/entropy"] == pytest.approx(0.7)
    assert all(math.isfinite(v) for v in metrics.values())


def test_policy_loss_rejects_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape"):
        policy_loss(x, x, torch.zeros(2, 4), x, eps_low=0.2, eps_high=0.2, agg="token-mean")
    with pytest.raises(ValueError, match="eps_low"):
        policy_loss(x, x, x, x, eps_low=1.5, eps_high=0.2, agg="token-mean")
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(x, x, x, x, eps_low=0.2, eps_high=0.2, agg="seq-sum")
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(x, x, x, x, eps_low=0.2, eps_high=0.2, agg="token-mean", kl_coef=0.1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(x, x, x, x, eps_low=0.2, eps_high=0.2, agg="token-mean", clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        policy_loss(x, x, x, x, eps_low=0.2, eps_high=0.2, agg="token-mean", log_ratio_clamp=0.0)


# -- off-policy safety: dual-clip (Ye et al., 2020; verl clip_ratio_c = 3) and the log-ratio
# clamp (verl: +-20) ------------------------------------------------------------------------
# eps 0.2/0.28, c = 3. PPO loss -min(rho A, clip(rho) A), then for A < 0: min(that, c |A|).
DUAL_RATIOS = [5.0, 2.5, 5.0, 0.5, 4.0]
DUAL_ADVS = [-1.0, -1.0, 1.0, -2.0, -0.5]
#   5,-1   -> PPO 5 (unclipped: rho A < clip(rho) A), c|A| = 3 -> 3, no gradient
#   2.5,-1 -> 2.5 < 3: PPO loss kept, gradient -rho A = 2.5
#   5,+1   -> -1.28 (clipped high); positive A: dual-clip never applies
#   0.5,-2 -> -min(-1, -1.6) = 1.6 (clipped low) < c|A| = 6: kept, no gradient
#   4,-0.5 -> PPO 2, c|A| = 1.5 -> 1.5, no gradient
DUAL_LOSS = [3.0, 2.5, -1.28, 1.6, 1.5]
DUAL_GRAD = [0.0, 2.5, 0.0, 0.0, 0.0]


def test_dual_clip_caps_negative_advantage_losses_at_c_times_abs_a():
    old = torch.zeros(1, 5, dtype=F64)
    logp = torch.log(t([DUAL_RATIOS])).requires_grad_()
    adv, mask = t([DUAL_ADVS]), torch.ones(1, 5, dtype=F64)
    kw = {"eps_low": 0.2, "eps_high": 0.28, "agg": "token-mean"}
    loss, metrics = policy_loss(logp, old, adv, mask, clip_ratio_c=3.0, **kw)
    assert loss.item() == pytest.approx(sum(DUAL_LOSS) / 5, abs=1e-12)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([g / 5 for g in DUAL_GRAD], abs=1e-12)
    assert metrics["train/dual_clip_frac"] == pytest.approx(2 / 5)
    # without dual-clip the first and last tokens keep their PPO losses 5 and 2
    off, _ = policy_loss(logp.detach(), old, adv, mask, clip_ratio_c=None, **kw)
    assert off.item() == pytest.approx((5 + 2.5 - 1.28 + 1.6 + 2) / 5, abs=1e-12)


def test_dual_clip_is_inert_on_policy():
    logp = torch.tensor([[-0.3, -1.2, -2.0]], dtype=F64, requires_grad=True)
    adv, mask = t([[-3.0, 2.0, -0.5]]), torch.ones(1, 3, dtype=F64)
    kw = {"eps_low": 0.2, "eps_high": 0.28, "agg": "token-mean"}
    a, _ = policy_loss(logp, logp.detach(), adv, mask, **kw)  # defaults c = 3, clamp 20
    b, _ = policy_loss(
        logp, logp.detach(), adv, mask, clip_ratio_c=None, log_ratio_clamp=None, **kw
    )
    assert a.item() == b.item() == pytest.approx(-(-3.0 + 2.0 - 0.5) / 3, abs=1e-12)


def test_log_ratio_clamp_keeps_stale_ratios_finite():
    # log(pi/pi_old) = 30 and 1000: clamped to 20 before exp, so rho = e^20 for both.
    logp = t([[30.0, 1000.0]]).requires_grad_()
    old, adv, mask = torch.zeros(1, 2, dtype=F64), t([[-1.0, -1.0]]), torch.ones(1, 2, dtype=F64)
    kw = {"eps_low": 0.2, "eps_high": 0.28, "agg": "token-mean", "clip_ratio_c": None}
    loss, metrics = policy_loss(logp, old, adv, mask, log_ratio_clamp=20.0, **kw)
    assert loss.item() == pytest.approx(math.exp(20), rel=1e-12)  # mean of e^20 and e^20
    assert metrics["train/ratio_mean"] == pytest.approx(math.exp(20), rel=1e-12)
    loss.backward()
    assert logp.grad[0].tolist() == [0.0, 0.0]  # outside the clamp: no gradient
    unclamped, _ = policy_loss(logp.detach(), old, adv, mask, log_ratio_clamp=None, **kw)
    assert math.isinf(unclamped.item())
    # with the default dual-clip too, each stale negative token costs exactly c |A| = 3
    both, _ = policy_loss(
        logp.detach(), old, adv, mask, eps_low=0.2, eps_high=0.28, agg="token-mean"
    )
    assert both.item() == pytest.approx(3.0, abs=1e-12)
