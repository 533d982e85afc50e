"""The clipped policy-gradient objective with an optional KL penalty, as a loss to minimise.

Per policy token (GRPO Eq. 2 / PATR Eq. 2, with DAPO's clip-higher):

    l_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t) + kl_coef * k3_t
    rho_t = exp(logp_t - old_logp_t),   k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1

Off-policy safety (verl's defaults), for data sampled by an older policy (several epochs or
minibatches per rollout, asynchronous rollouts):

    log-ratio clamp:  rho_t = exp(clamp(logp_t - old_logp_t, -log_ratio_clamp, +log_ratio_clamp))
    dual-clip (A_t < 0 only):  l_t = min(l_t, -c A_t) = min(l_t, c |A_t|)

The clamp keeps exp() finite when pi_old is far off; dual-clip (Ye et al., 2020) bounds the
loss of a negative-advantage token at c |A_t| however large its ratio grows, where the PPO
bound alone is unbounded. Both are inert on on-policy data (rho_t = 1 < c).

aggregated as `token-mean` (DAPO Eq. 8, TreePO Eq. 1: sum over every policy token of the batch
divided by their number) or `seq-mean` (GRPO/PATR Eq. 2: mean over each trajectory's tokens,
then over trajectories). Tensors are [batch, seq]; `mask` is 1 on policy tokens. A row is a
whole trajectory, or under a history window one turn of one (`packing.turn_samples`):
`seq_tokens` gives each row the policy tokens of the trajectory it belongs to, so that under
seq-mean a token weighs 1 / (its trajectory's tokens x trajectories) in both layouts, and a
row counts in the normaliser as its share of a trajectory. Without it a row is its own
trajectory.

Rollout importance sampling (`rollout_is_weights`): the engine that sampled (vLLM in bf16, or
the weights of one update ago) is not exactly pi_old, the policy the trainer recomputes. As
verl's rollout IS / truncated importance sampling (TIS) does, each token's policy-gradient term
can be weighted by the truncated ratio between the two, a constant of the objective:

    token:     w_t = min(pi_old(y_t) / mu(y_t), cap)
    sequence:  w_t = min(prod_s pi_old(y_s) / mu(y_s), cap)    (the same for every token of y)
    l_t = w_t * l_t^PPO + kl_coef * k3_t

with mu the behaviour (sampling) policy whose log-probs the tree stores. Under a sample of y ~ mu
and no truncation the weighted gradient is the on-policy one, E_mu[w grad] = E_pi_old[grad].

Gradient accumulation: pass `normalizer` = `loss_normalizer(mask, agg, seq_tokens)` summed over
all the micro-batches of one optimiser step (and over the data-parallel ranks). Each
micro-batch loss is then its share of the full-batch loss, and summing their gradients gives
exactly the full-batch gradient.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token-mean", "seq-mean"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean")
RolloutIS = Literal["none", "token", "sequence"]
ROLLOUT_IS_LEVELS: tuple[str, ...] = ("none", "token", "sequence")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of x where mask is 1 (masked entries may hold inf/nan; they are never read)."""
    x = torch.where(mask.bool(), x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x where mask is 1; 0 where there is nothing to average."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def k3_kl(log_ratio: Tensor) -> Tensor:
    """Per-sample k3 estimate of KL(q || p): exp(d) - d - 1, with d = log p(x) - log q(x), x ~ q.

    Unbiased and never negative (e^d >= 1 + d), which is why GRPO uses it for the reference
    penalty (q = pi_theta, p = pi_ref, d = ref_logp - logp).
    """
    return torch.exp(log_ratio) - log_ratio - 1


def loss_normalizer(mask: Tensor, agg: Aggregation, seq_tokens: Tensor | None = None) -> float:
    """The denominator of `agg` for this mask: policy tokens (token-mean) or trajectories
    (seq-mean), each row counting as its share of its trajectory's `seq_tokens` policy tokens
    (a whole trajectory: 1, a turn under a history window: its tokens / the trajectory's).
    Additive over micro-batches and ranks."""
    _check_agg(agg)
    if agg == "token-mean":
        return float(mask.sum())
    return float((mask.sum(-1) / row_tokens(mask, seq_tokens)).sum())


def row_tokens(mask: Tensor, seq_tokens: Tensor | None) -> Tensor:
    """Policy tokens of the trajectory each row belongs to (its own when `seq_tokens` is None);
    at least 1, so that a row without policy tokens divides 0 by 1."""
    own = mask.sum(-1) if seq_tokens is None else seq_tokens.to(mask.device, mask.dtype)
    if own.shape != mask.shape[:-1]:
        raise ValueError(f"seq_tokens has shape {tuple(own.shape)}, rows {mask.shape[:-1]}")
    return own.clamp(min=1)


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    agg: Aggregation,
    normalizer: float | None = None,
    seq_tokens: Tensor | None = None,
) -> Tensor:
    """Reduce a [batch, seq] per-token loss with `agg`; `normalizer` defaults to this batch's,
    `seq_tokens` (seq-mean) to each row's own policy tokens."""
    _check_agg(agg)
    if normalizer is None:
        normalizer = loss_normalizer(mask, agg, seq_tokens)
    if agg == "token-mean":
        total = masked_sum(per_token, mask)
    else:  # each row's sum over the policy tokens of its trajectory, summed over rows
        own = row_tokens(mask, seq_tokens).to(per_token.dtype)
        total = (masked_sum(per_token, mask, dim=-1) / own).sum()
    return total / max(normalizer, 1.0)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    agg: Aggregation,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    normalizer: float | None = None,
    entropy: Tensor | None = None,
    clip_ratio_c: float | None = 3.0,
    log_ratio_clamp: float | None = 20.0,
    is_weights: Tensor | None = None,
    seq_tokens: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped-ratio policy loss with asymmetric clip, dual-clip, log-ratio clamp and optional
    k3 KL; see the module doc. `clip_ratio_c` or `log_ratio_clamp` None turns that one off.
    `is_weights` (from `rollout_is_weights`) scale each token's policy-gradient term, not its KL.
    `seq_tokens` ([batch]): the policy tokens of each row's trajectory, for seq-mean.

    Returns the scalar loss (differentiable w.r.t. `logprobs` only: old log-probs, advantages
    and the reference are constants of the objective) and detached metrics averaged over this
    batch's policy tokens: clip fractions on each side (tokens whose gradient the clip zeroes),
    approx KL(pi_old || pi_theta) (k3), mean ratio, the dual-clip fraction (negative-advantage
    tokens whose loss the dual-clip bound replaces), KL to the reference and entropy if given.
    """
    shapes = {t.shape for t in (logprobs, old_logprobs, advantages, mask)}
    for extra in (ref_logprobs, is_weights):
        if extra is not None:
            shapes.add(extra.shape)
    if len(shapes) != 1:
        raise ValueError(
            f"logprobs, old_logprobs, advantages, mask, ref, is_weights differ in shape: {shapes}"
        )
    if not 0.0 <= eps_low < 1.0 or eps_high < 0.0:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (verl: 3.0) or None, got {clip_ratio_c}")
    if log_ratio_clamp is not None and log_ratio_clamp <= 0.0:
        raise ValueError(f"log_ratio_clamp must be > 0 (verl: 20) or None, got {log_ratio_clamp}")
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef is set but ref_logprobs is None; pass the reference log-probs")
    on = mask.bool()
    zero = torch.zeros_like(logprobs)
    # Padding may hold garbage log-probs: mask before exp() so 0 * inf never makes a nan, in the
    # loss or in its gradient.
    log_ratio = torch.where(on, logprobs - old_logprobs.detach(), zero)
    if log_ratio_clamp is not None:
        log_ratio = torch.clamp(log_ratio, -log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    adv = torch.where(on, advantages.detach().to(logprobs.dtype), zero)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # PPO pessimistic bound
    dual = torch.zeros_like(on)
    if clip_ratio_c is not None:
        bound = -clip_ratio_c * adv  # c |A| where A < 0
        dual = (adv < 0) & (per_token > bound)
        per_token = torch.where(dual, bound, per_token)
    if is_weights is not None:
        per_token = per_token * torch.where(on, is_weights.detach().to(logprobs.dtype), zero)
    kl = None
    if ref_logprobs is not None:
        kl = k3_kl(torch.where(on, ref_logprobs.detach() - logprobs, zero))
        if kl_coef:
            per_token = per_token + kl_coef * kl
    loss = aggregate(per_token, mask, agg, normalizer, seq_tokens)

    with torch.no_grad():
        metrics = {
            # The clip binds (zero gradient) only on the side where it lowers the objective.
            "train/clip_frac_low": masked_mean(((ratio < 1 - eps_low) & (adv < 0)).float(), on),
            "train/clip_frac_high": masked_mean(((ratio > 1 + eps_high) & (adv > 0)).float(), on),
            "train/approx_kl": masked_mean(k3_kl(log_ratio), on),  # KL(pi_old || pi_theta)
            "train/ratio_mean": masked_mean(ratio, on),
            "train/dual_clip_frac": masked_mean(dual.float(), on),
        }
        if kl is not None:
            metrics["train/kl"] = masked_mean(kl, on)
        if entropy is not None:
            metrics["train/entropy"] = masked_mean(entropy, on)
    return loss, {k: float(v) for k, v in metrics.items()}


def rollout_is_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    level: RolloutIS,
    cap: float,
    log_ratio_clamp: float = 20.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights pi_old / mu per token (`level` token) or per sequence
    (`sequence`, broadcast over its tokens), capped at `cap`; see the module doc.

    The log-ratio is clamped at +-`log_ratio_clamp` before exp() (verl's safety bound), so a
    token the sampler found nearly impossible cannot overflow. Returns the [batch, seq] weights
    (0 off the mask, no gradient) and per-token statistics for the logs: `w` (the weights used),
    `raw` (before the cap), `clipped` (1 where the cap binds) and `k3` (a k3 estimate of
    KL(mu || pi_old) from samples of mu), all zero off the mask.
    """
    if level not in ROLLOUT_IS_LEVELS or level == "none":
        raise ValueError(f"rollout IS level must be token or sequence, got {level!r}")
    if cap <= 0.0:
        raise ValueError(f"the rollout IS cap must be > 0 (verl: 2), got {cap}")
    on = mask.bool()
    # at least fp32: bf16 log-probs would round the ratio before the cap
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    zero = torch.zeros_like(old_logprobs, dtype=dtype)
    with torch.no_grad():
        log_ratio = torch.where(on, old_logprobs.to(dtype) - rollout_logprobs.to(dtype), zero)
        k3 = torch.where(on, k3_kl(log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)), zero)
        if level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
        raw = torch.exp(log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp))
        w = torch.where(on, raw.clamp(max=cap), zero)
        stats = {
            "w": w,
            "raw": torch.where(on, raw, zero),
            "clipped": torch.where(on, (raw > cap).float(), zero),
            "k3": k3,
        }
    return w, stats


def _check_agg(agg: str) -> None:
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {AGGREGATIONS}")
