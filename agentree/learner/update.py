"""One policy update on a batch of rollout groups: advantages, micro-batches, clipped loss,
gradient accumulation, optimiser steps.

The objective is `agentree.algorithms.loss.policy_loss` (see `agentree.run.trainer` for the
formula). With `epochs == minibatches == 1` the update is fully on-policy: pi_old equals the
current weights, so its log-probs are the detached ones of the training forward and need no extra
pass. Otherwise pi_old is recomputed once before the first optimiser step, as verl does. For stale
data (`stale=True`: sampled by weights older than the current ones, `train.async_steps=1`)
pi_old is the behaviour policy itself, i.e. the sampling log-probs stored in the tree, so the
ratio corrects for the staleness instead of hiding it. With `train.rollout_is` on, pi_old is
the trainer's own (recomputed for stale data too, as decoupled PPO does) and the gap to the
sampler is corrected instead by the truncated importance weights of
`agentree.algorithms.loss.rollout_is_weights`, whose statistics are logged every step
(`train/rollout_is_mean`, `_max`, `_min`, `_clipped_frac`, `_ess`, `train/rollout_kl`). The loss
normaliser of each optimiser step is computed over all of its micro-batches, so gradient
accumulation gives the gradient of the whole minibatch. Micro-batches are padded rows or
tree-packed rows (`train.packing`, `agentree.algorithms.packing`); both give the loss the same
tensors.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import torch

from agentree.algorithms.advantages import advantage_estimator
from agentree.algorithms.loss import loss_normalizer, policy_loss, rollout_is_weights
from agentree.algorithms.packing import (
    Batch,
    PackedBatch,
    attention_break_even,
    batch_logprobs,
    choose_layout,
    turn_samples,
)
from agentree.config import TrainConfig
from agentree.tree import Trajectory, Tree


class PolicyUpdate:
    """Holds the trainable model, the frozen reference (when KL is on) and the optimiser."""

    def __init__(
        self,
        model: Any,
        tc: TrainConfig,
        *,
        ref: Any = None,
        temperature: float = 1.0,
        pad_id: int = 0,
        rng: random.Random | None = None,
    ) -> None:
        self.model = model
        self.tc = tc
        self.ref = ref
        self.temperature = temperature
        self.pad_id = pad_id
        self.rng = rng or random.Random(0)
        self.advantages = advantage_estimator(tc.advantage, tc.advantage_kwargs())
        self.opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=tc.lr,
            weight_decay=tc.weight_decay,
            betas=(0.9, 0.999),
        )

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def global_sum(self, values: list[float]) -> list[float]:
        """Sums over the data-parallel ranks; one process holds the whole batch."""
        return values

    def global_max(self, values: list[float]) -> list[float]:
        """Maxima over the data-parallel ranks; one process holds the whole batch."""
        return values

    def batches(
        self,
        trees: list[Tree],
        groups: list[list[Trajectory]],
        advs: list[list[list[float]]] | None = None,
    ) -> list[Batch] | list[PackedBatch]:
        """Advantages per token (`advs`, when these trees are part of a batch whose advantages
        were computed together), then micro-batches: padded rows or tree-packed rows."""
        tc = self.tc
        if advs is None:
            advs = self.advantages(trees, groups)
        # with a history window each turn is trained on the prompt it was sampled against
        samples, advs = turn_samples(trees, groups, advs)
        kappa = attention_break_even(self.model)
        return choose_layout(samples, advs, self.pad_id, tc.micro_batch_size, tc.packing, kappa)

    def __call__(
        self,
        trees: list[Tree],
        groups: list[list[Trajectory]],
        lr: float | Callable[[], float],
        stale: bool = False,
        commit: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """Optimiser steps on this batch. `commit` is called once, just before the first step
        changes the weights: until then the update can be abandoned and the weights, the
        optimiser and the learning rate are as they were."""
        tc = self.tc
        temp = self.temperature
        lc = tc.logits_chunk  # tokens per output-layer slice (0: all at once)
        micro = self.batches(trees, groups)
        on_policy = tc.epochs == 1 and tc.minibatches == 1 and not stale
        correct = tc.rollout_is != "none"  # pi_old is the trainer's; weights bridge to mu
        old: list[torch.Tensor | None] = []
        ref: list[torch.Tensor | None] = []
        with torch.no_grad():
            self.model.eval()
            for b in micro:
                if stale and not correct:
                    old.append(b.sampled_lp.float())
                else:
                    old.append(None if on_policy else batch_logprobs(self.model, b, temp, lc).cpu())
                ref.append(
                    None if self.ref is None else batch_logprobs(self.ref, b, temp, lc).cpu()
                )
        (n_tok,) = self.global_sum([float(sum(b.mask.sum() for b in micro))])
        drift = 0.0
        sums: dict[str, float] = {}
        is_sums = dict.fromkeys(("w", "w2", "clipped", "k3"), 0.0)
        is_max = [0.0, -math.inf]  # largest raw weight, and minus the smallest
        self.model.train()
        dev = next(self.model.parameters()).device
        for epoch in range(tc.epochs):
            idx = list(range(len(micro)))
            self.rng.shuffle(idx)
            per = math.ceil(len(idx) / tc.minibatches)
            for s in range(0, len(idx), per):
                chunk = idx[s : s + per]
                # the normaliser of the whole optimiser step, over all ranks: exact gradients
                (norm,) = self.global_sum(
                    [
                        sum(
                            loss_normalizer(micro[i].mask, tc.loss_agg, micro[i].seq_tokens)
                            for i in chunk
                        )
                    ]
                )
                self.opt.zero_grad(set_to_none=True)
                for i in chunk:
                    b = micro[i]
                    lp = batch_logprobs(self.model, b, temp, lc)
                    old_i = old[i]
                    old_lp = lp.detach() if old_i is None else old_i.to(dev)
                    if epoch == 0:  # stale data: drift of the current weights from the sampler
                        cur = (lp.detach() if stale else old_lp).cpu()
                        drift += float(((cur - b.sampled_lp).abs() * b.mask).sum())
                    is_w = None
                    if correct:
                        is_w, st = rollout_is_weights(
                            old_lp,
                            b.sampled_lp.to(dev),
                            b.mask.to(dev),
                            level=tc.rollout_is,
                            cap=tc.rollout_is_cap,
                        )
                        if epoch == 0:
                            _add_is_stats(is_sums, is_max, st, b.mask.to(dev))
                    ref_i = ref[i]
                    ref_lp = None if ref_i is None else ref_i.to(dev)
                    loss, met = self.micro_loss(b, lp, old_lp, ref_lp, norm, is_w)
                    loss.backward()
                    w = float(b.mask.sum())
                    sums["train/loss"] = sums.get("train/loss", 0.0) + float(loss.detach())
                    for k, v in met.items():
                        sums[k] = sums.get(k, 0.0) + float(v) * w
                gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
                gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn  # sharded grads
                sums["train/grad_norm"] = sums.get("train/grad_norm", 0.0) + float(gn)
                if commit is not None:
                    commit()
                    commit = None
                self.set_lr(lr() if callable(lr) else lr)
                self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        keys = sorted(k for k in sums if k != "train/grad_norm")  # the norm is already global
        sums.update(zip(keys, self.global_sum([sums[k] for k in keys]), strict=True))
        (drift,) = self.global_sum([drift])
        steps = tc.epochs * math.ceil(len(micro) / math.ceil(len(micro) / tc.minibatches))
        scalar = ("train/loss", "train/grad_norm")
        out = {k: v / float(n_tok) / tc.epochs for k, v in sums.items() if k not in scalar}
        out["train/loss"] = sums.get("train/loss", 0.0) / steps
        out["train/grad_norm"] = sums.get("train/grad_norm", 0.0) / steps
        out["train/logprob_drift"] = float(drift / max(float(n_tok), 1.0))
        out["train/policy_tokens"] = float(n_tok)
        out["train/forward_tokens"] = float(sum(b.ids.numel() for b in micro))
        out["train/packed"] = float(isinstance(micro[0], PackedBatch))
        out["train/lr"] = self.opt.param_groups[0]["lr"]
        if correct:
            out.update(self._is_metrics(is_sums, is_max, float(n_tok)))
        return out

    def micro_loss(
        self,
        b: Batch | PackedBatch,
        lp: torch.Tensor,
        old_lp: torch.Tensor,
        ref_lp: torch.Tensor | None,
        normalizer: float,
        is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Micro-batch `b`'s term of an optimiser step's objective: its log-probs `lp` under
        the weights being trained, `old_lp` under pi_old, `ref_lp` under the KL reference,
        divided by `normalizer`, the whole step's (so the terms of its micro-batches add up to
        its loss, and their gradients to its gradient)."""
        tc = self.tc
        dev = lp.device
        return policy_loss(
            lp,
            old_lp,
            b.adv.to(dev),
            b.mask.to(dev),
            eps_low=tc.eps_low,
            eps_high=tc.eps_high,
            agg=tc.loss_agg,
            ref_logprobs=ref_lp,
            kl_coef=tc.kl_coef,
            normalizer=normalizer,
            clip_ratio_c=tc.clip_ratio_c,
            log_ratio_clamp=tc.log_ratio_clamp,
            is_weights=is_weights,
            seq_tokens=b.seq_tokens,
        )

    def _is_metrics(
        self, sums: dict[str, float], top: list[float], n_tok: float
    ) -> dict[str, float]:
        """The rollout IS weights of this batch over all ranks: mean, extremes before the cap,
        the share of tokens the cap binds, the effective sample size mean(w)^2 / mean(w^2)
        (1: uniform weights) and the k3 estimate of KL(mu || pi_old)."""
        w, w2, clipped, k3 = self.global_sum([sums[k] for k in ("w", "w2", "clipped", "k3")])
        hi, neg_lo = self.global_max(top)
        n = max(n_tok, 1.0)
        return {
            "train/rollout_is_mean": w / n,
            "train/rollout_is_max": hi,
            "train/rollout_is_min": -neg_lo if n_tok else 0.0,
            "train/rollout_is_clipped_frac": clipped / n,
            "train/rollout_is_ess": (w / n) ** 2 / (w2 / n) if w2 else 1.0,
            "train/rollout_kl": k3 / n,
        }


def _add_is_stats(
    sums: dict[str, float], top: list[float], st: dict[str, torch.Tensor], mask: torch.Tensor
) -> None:
    """Accumulate one micro-batch's rollout IS statistics (sums over its policy tokens)."""
    on = mask.bool()
    sums["w"] += float(st["w"].sum())
    sums["w2"] += float((st["w"] ** 2).sum())
    sums["clipped"] += float(st["clipped"].sum())
    sums["k3"] += float(st["k3"].sum())
    if on.any():
        top[0] = max(top[0], float(st["raw"][on].max()))
        top[1] = max(top[1], float(-st["raw"][on].min()))
