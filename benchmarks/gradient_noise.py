"""Is a training step limited by the noise in its gradient? The gradient noise scale of a run.

McCandlish et al. (2018, "An Empirical Model of Large-Batch Training") predict how much a larger
batch buys from one number, the simple noise scale B = tr(Sigma) / |G|^2: G is the gradient of
the expected loss, Sigma the covariance of one sample's gradient. A batch of b samples gives a
gradient whose cosine with G is about 1 / sqrt(1 + B / b), and the steps needed to reach a given
loss scale as 1 + B / b: where b is well above B, a larger batch points the step the same way and
buys little per step; where b is at or below B, doubling it buys up to half the steps.

Here one sample is one task's group (its trajectories, flat or a tree), since a group's
trajectories share their advantage baseline and, in a tree, their prefixes; B is in tasks, the
unit of `train.tasks_per_step`. For each of `--batches` batches, drawn as the run draws its
steps (its config, task order and rollout, `Trainer.collect`), at the weights of step 0 or of
`--checkpoint`, each task i's term g_i of the update's gradient is computed with the update's
own advantages, micro-batches, normaliser and loss (`PolicyUpdate.batches`, `micro_loss`), so
that the g_i add up to the gradient of the whole batch at the weights it was sampled from (the
first optimiser step's when `train.minibatches` is 1; the test checks it against the update).
With x_i = n g_i over the n tasks (so their mean is that gradient):

    tr(Sigma) ~ sum_i |x_i - mean x|^2 / (n - 1)        |G|^2 ~ |mean x|^2 - tr(Sigma) / n

(both unbiased), and B = mean tr(Sigma) / mean |G|^2 over the batches, a ratio of means as the
paper advises (its Appendix A), with a leave-one-batch-out jackknife standard error. A model-free
check beside it: the cosine between the gradients of each batch's two halves (even and odd
tasks), about 1 / (1 + 2 B / n) when B is right. Tasks whose rewards are all equal give no
gradient under group-relative advantages; they count in n, as they count in a step's batch.

    python benchmarks/gradient_noise.py RUN_DIR --batches 10 --out noise.json
    python benchmarks/gradient_noise.py RUN_DIR --checkpoint RUN_DIR/checkpoints/step_000040 \\
        --batches 10 --out noise_end.json
    python benchmarks/gradient_noise.py frozenlake_patr --rollout grpo --set rollout.G=5 \\
        --batches 10 --out noise.json                           # a config instead of a run

A run directory's `config.yaml` is the config (`--rollout` switches its controller and `--set`
overrides settings, as with `agentree train`); the run itself is
not touched: the trainer writes into a temporary directory, removed afterwards. Writes `--out`
(JSON): the per-batch figures (`batches`), `noise_scale` and `noise_scale_se`, `signal`
(mean |G|^2) with `signal_se` and `noise` (mean tr(Sigma)), `noise_scale_lower` (the B of the
mean signal plus two standard errors: where the signal is too small for the batches measured
to resolve, B is None or unstable and this lower bound is the finding), `cos_to_gradient` at
the batch size and at twice it, `steps_at_twice` (the steps twice the tasks a step need, as a
share of the steps at the batch size: (1 + B / 2n) / (1 + B / n)), and `cos_halves` (with its
standard error) measured and predicted. `--pool FILE...` summarises the batches of several
measurements of one setting, e.g. one per `--set seed=S`, so a long measurement runs and
resumes seed by seed; with `--against FILE...`, measurements of another setting on the same
batches (another advantage estimator on the same seeds samples the same rollouts), it adds
`paired`: each side's |G|^2 / tr(Sigma) = 1 / B and their difference, jackknifed block by block,
and `cos_expected`, the cosine between the two settings' expected gradients (from the pairs of
tasks in different blocks): whether they point the same way, which B does not say. With
`--versus FILE...`, measurements of another setting on batches of its own (another controller
samples other rollouts), it adds `unpaired`: each side's 1 / B with its own jackknife, and their
difference with the standard errors combined in quadrature.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from agentree.algorithms.loss import loss_normalizer, rollout_is_weights
from agentree.algorithms.packing import batch_logprobs
from agentree.config import ExperimentConfig, load_config
from agentree.run.trainer import Trainer
from agentree.signals import interrupt_on_sigterm
from agentree.tree import Trajectory, Tree


def task_gradients(
    updater: Any, trees: Sequence[Tree], groups: Sequence[Sequence[Trajectory]]
) -> Iterator[torch.Tensor]:
    """Each task's term of the update's gradient on this batch, flattened over the trainable
    parameters, in task order; the terms add up to the gradient of the whole batch."""
    tc = updater.tc
    model = updater.model
    params = [p for p in model.parameters() if p.requires_grad]
    trees, groups = list(trees), [list(g) for g in groups]
    advs = updater.advantages(trees, groups)  # over the whole batch, as the update has them
    per_task = [
        updater.batches([tree], [group], [adv])
        for tree, group, adv in zip(trees, groups, advs, strict=True)
    ]
    norm = sum(
        loss_normalizer(b.mask, tc.loss_agg, b.seq_tokens) for micro in per_task for b in micro
    )
    dev = params[0].device
    model.train()
    for micro in per_task:
        model.zero_grad(set_to_none=True)
        for b in micro:
            lp = batch_logprobs(model, b, updater.temperature, tc.logits_chunk)
            old = lp.detach()  # on-policy: pi_old is the weights the batch was sampled from
            ref = None
            if updater.ref is not None:
                with torch.no_grad():
                    ref = batch_logprobs(updater.ref, b, updater.temperature, tc.logits_chunk)
                ref = ref.to(dev)
            is_w = None
            if tc.rollout_is != "none":
                mask = b.mask.to(dev)
                lvl, cap = tc.rollout_is, tc.rollout_is_cap
                is_w, _ = rollout_is_weights(old, b.sampled_lp.to(dev), mask, level=lvl, cap=cap)
            loss, _ = updater.micro_loss(b, lp, old, ref, norm, is_w)
            loss.backward()
        yield torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        ).double()
    model.zero_grad(set_to_none=True)


def batch_stats(grads: Sequence[torch.Tensor]) -> dict[str, float]:
    """The noise and signal of one batch from its n tasks' gradient terms g_i (x_i = n g_i):
    `noise` tr(Sigma), `signal` |G|^2 (both unbiased), `grad_sq` |sum g_i|^2 and `cos_halves`,
    the cosine between the sums over the even and the odd tasks (None where a half has no
    gradient: no informative group in it), and `task_norms`, each |g_i| (ascending): how heavy
    the tail of the tasks' terms is, which B, a ratio of means, does not show."""
    n = len(grads)
    if n < 2:
        raise ValueError(f"a batch needs at least 2 tasks to estimate a covariance, got {n}")
    total = torch.zeros_like(grads[0])
    even = torch.zeros_like(grads[0])
    sq = 0.0
    norms = []
    for i, g in enumerate(grads):
        total += g
        if i % 2 == 0:
            even += g
        g_sq = float(g @ g)
        sq += g_sq * n * n
        norms.append(math.sqrt(g_sq))
    odd = total - even
    mean_sq = float(total @ total)  # |mean x|^2, the batch's gradient
    noise, signal = _pair_estimator([total * n], [sq], [n])([0])  # the pairs inside the batch
    denom = float(even.norm() * odd.norm())
    return {
        "tasks": n,
        "noise": noise,
        "signal": signal,
        "grad_sq": mean_sq,
        "sum_sq": sq,
        "cos_halves": float(even @ odd) / denom if denom > 0 else None,
        "task_norms": sorted(norms),
    }


def noise_scale(rows: Sequence[dict[str, float]]) -> tuple[float | None, float | None]:
    """B = mean noise / mean signal over the batches, and its leave-one-batch-out jackknife
    standard error; None where the mean signal is not above zero (no gradient these batches
    can tell from noise)."""

    def ratio(rs: Sequence[dict[str, float]]) -> float | None:
        signal = sum(r["signal"] for r in rs) / len(rs)
        return sum(r["noise"] for r in rs) / len(rs) / signal if signal > 0 else None

    b = ratio(rows)
    k = len(rows)
    if b is None or k < 2:
        return b, None
    loo = [ratio([r for j, r in enumerate(rows) if j != i]) for i in range(k)]
    if any(x is None for x in loo):
        return b, None
    return b, _jackknife([float(x) for x in loo if x is not None])


def summarise(rows: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The batches' figures and what B predicts at n tasks a step and at 2n. `signal_se` is
    the standard error of the mean signal over batches, and `noise_scale_lower` the B that the
    mean signal plus two of them gives: a one-sided bound that holds when the signal is too
    small for these batches to resolve (then `noise_scale` is None or unstable)."""
    k = len(rows)
    b, se = noise_scale(rows)
    signal = sum(r["signal"] for r in rows) / k
    noise = sum(r["noise"] for r in rows) / k
    signal_se = _se([r["signal"] for r in rows]) or 0.0
    upper = signal + 2 * signal_se
    cos = [c for r in rows if (c := r["cos_halves"]) is not None and math.isfinite(c)]
    out: dict[str, Any] = {
        "tasks_per_step": n,
        "batches": rows,
        "noise_scale": b,
        "noise_scale_se": se,
        "noise_scale_lower": noise / upper if upper > 0 else None,
        "signal": signal,
        "signal_se": signal_se,
        "noise": noise,
        "cos_halves": sum(cos) / len(cos) if cos else None,
        "cos_halves_se": _se(cos),
        "cos_halves_batches": len(cos),
        "informative": sum(r["informative"] for r in rows) / k,
    }
    out.update(predictions(b, n))
    tails = task_tails(rows)
    if tails is not None:
        out["task_tails"] = tails
    return out


def task_tails(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """How heavy-tailed the tasks' gradient terms are, over the batches that record them
    (`task_norms`): the quantiles of |g_i| over the tasks with a gradient (a group whose rewards
    are all equal has none) and, per batch, the largest task's share of sum |g_i|^2; `dominated`
    counts the batches in which one task carries more than half of it. None when no batch
    records them (measurements written before they were)."""
    kept = [r["task_norms"] for r in rows if r.get("task_norms")]
    norms = sorted(x for batch in kept for x in batch if x > 0)
    if not norms:
        return None
    shares = [batch[-1] ** 2 / s for batch in kept if (s := sum(x * x for x in batch)) > 0]

    def quantile(q: float) -> float:
        return norms[min(len(norms) - 1, int(q * len(norms)))]

    return {
        "batches": len(kept),
        "median": quantile(0.5),
        "p90": quantile(0.9),
        "p99": quantile(0.99),
        "max": norms[-1],
        "largest_share": sum(shares) / len(shares) if shares else None,
        "dominated": sum(share > 0.5 for share in shares),
    }


def _se(values: Sequence[float]) -> float | None:
    """The standard error of the mean of `values` (None for fewer than two)."""
    k = len(values)
    if k < 2:
        return None
    mean = sum(values) / k
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (k - 1) / k)


class Blocks:
    """Sums of x_i over the tasks of each block of batches (batch k goes to block k mod m),
    kept so that the signal can be estimated from every pair of tasks measured, not only the
    pairs inside one batch (`across_batches`). Memory: m vectors of the trainable parameters
    (float32)."""

    def __init__(self, m: int) -> None:
        self.m = m
        self.sums: list[torch.Tensor | None] = [None] * m
        self.sq = [0.0] * m
        self.tasks = [0] * m

    def add(self, k: int, grads: Sequence[torch.Tensor], row: dict[str, Any]) -> None:
        b = k % self.m
        n = len(grads)
        total = torch.stack(list(grads)).sum(0) * n  # sum of x_i = n g_i
        cur = self.sums[b]
        self.sums[b] = total.float() if cur is None else cur + total.float()
        self.sq[b] += row["sum_sq"]
        self.tasks[b] += n

    def payload(self) -> dict[str, Any]:
        kept = [i for i in range(self.m) if self.sums[i] is not None]
        return {
            "sums": [self.sums[i] for i in kept],
            "sq": [self.sq[i] for i in kept],
            "tasks": [self.tasks[i] for i in kept],
        }


def across_batches(
    sums: Sequence[torch.Tensor], sq: Sequence[float], tasks: Sequence[int], n: int
) -> dict[str, Any]:
    """The signal and noise from every pair of the N tasks measured, at the same weights:
    with S = sum x_i and Q = sum |x_i|^2, |G|^2 ~ (|S|^2 - Q) / (N (N - 1)) (the mean of
    x_i . x_j over all pairs i != j) and tr(Sigma) ~ (Q - |S|^2 / N) / (N - 1), both unbiased;
    the within-batch estimate uses only the pairs inside each batch, so this one's standard
    error is far smaller when the signal is small. Standard errors: leave-one-block-out
    jackknife over the blocks (of batches, or of files when pooled)."""
    m = len(sums)
    estimate = _pair_estimator(sums, sq, tasks)
    noise, signal = estimate(range(m))
    out: dict[str, Any] = {
        "blocks": m,
        "tasks": sum(tasks),
        "signal": signal,
        "noise": noise,
        "noise_scale": noise / signal if signal > 0 else None,
    }
    loo = [estimate([j for j in range(m) if j != i]) for i in range(m)] if m > 1 else []
    signal_se = _jackknife([x[1] for x in loo])
    scales = [x[0] / x[1] for x in loo if x[1] > 0]
    out["signal_se"] = signal_se
    out["noise_scale_se"] = (
        _jackknife(scales) if out["noise_scale"] is not None and len(scales) == m else None
    )
    upper = signal + 2 * (signal_se or 0.0)
    out["noise_scale_lower"] = noise / upper if upper > 0 else None
    return out | predictions(out["noise_scale"], n)


def _gram(
    sums: Sequence[torch.Tensor],
    other: Sequence[torch.Tensor] | None = None,
    chunk: int = 1 << 16,
) -> torch.Tensor:
    """The dot products of the blocks' sums with `other`'s (with each other by default), every
    pair, in float64: one matrix product a slice of the parameters at a time (thirty seeds of
    eight blocks pool in seconds, not minutes)."""
    rows = len(sums)
    cols = rows if other is None else len(other)
    gram = torch.zeros(rows, cols, dtype=torch.float64)
    for start in range(0, sums[0].numel(), chunk):
        part = torch.stack([x.reshape(-1)[start : start + chunk] for x in sums]).double()
        if other is None:
            gram += part @ part.T
        else:
            part_b = torch.stack([x.reshape(-1)[start : start + chunk] for x in other]).double()
            gram += part @ part_b.T
    return gram


def _cross_blocks(gram: torch.Tensor, tasks: Sequence[int], keep: Sequence[int]) -> float:
    """G_a . G_b from the pairs of tasks in different blocks of `keep` (independent batches):
    sum over blocks k != l of S_a,k . S_b,l over sum of n_k n_l, unbiased for two estimators'
    terms on the same tasks as for one estimator's (gram = its own)."""
    idx = torch.as_tensor(list(keep), dtype=torch.long)
    g = gram[idx][:, idx]
    n = torch.as_tensor([tasks[i] for i in keep], dtype=torch.float64)
    return float((g.sum() - g.diagonal().sum()) / (n.sum() ** 2 - (n**2).sum()))


def expected_cosine(
    a: dict[str, Any], b: dict[str, Any], grams: tuple[torch.Tensor, torch.Tensor] | None = None
) -> dict[str, Any]:
    """The cosine between two settings' expected gradients, measured on the same batches block
    by block: G_a . G_b / (|G_a| |G_b|), each product from the pairs of tasks in different
    blocks, with a leave-one-block-out jackknife. 1 when the two expected steps point the same
    way, whatever their noise; None where a signal is not above zero. `grams`: each side's own
    Gram matrix (`_gram`), where the caller has them already."""
    every = list(range(len(a["sums"])))
    g_aa, g_bb = grams if grams is not None else (_gram(a["sums"]), _gram(b["sums"]))
    g_ab = _gram(a["sums"], b["sums"])

    def cos(keep: Sequence[int]) -> float | None:
        aa, bb = _cross_blocks(g_aa, a["tasks"], keep), _cross_blocks(g_bb, b["tasks"], keep)
        if aa <= 0 or bb <= 0:
            return None
        return _cross_blocks(g_ab, a["tasks"], keep) / math.sqrt(aa * bb)

    loo = [cos([j for j in every if j != i]) for i in every]
    full = cos(every)
    resolved = full is not None and all(c is not None for c in loo)
    return {
        "cos_expected": full,
        "cos_expected_se": _jackknife([c for c in loo if c is not None]) if resolved else None,
    }


def _pair_estimator(
    sums: Sequence[torch.Tensor],
    sq: Sequence[float],
    tasks: Sequence[int],
    gram: torch.Tensor | None = None,
) -> Any:
    """(tr(Sigma), |G|^2) from every pair of the tasks of the blocks kept, for any subset
    (`gram`: the sums' `_gram`, where the caller has it already)."""
    gram = _gram(sums) if gram is None else gram

    def estimate(keep: Sequence[int]) -> tuple[float, float]:
        idx = torch.as_tensor(list(keep), dtype=torch.long)
        s2 = float(gram[idx][:, idx].sum())
        q = sum(sq[i] for i in keep)
        n = sum(tasks[i] for i in keep)
        return (q - s2 / n) / (n - 1), (s2 - q) / (n * (n - 1))

    return estimate


def paired(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two settings measured on the same batches block by block (e.g. two advantage estimators
    on one seed's rollouts, which are identical): each one's signal-to-noise ratio |G|^2 /
    tr(Sigma) = 1 / B (scale-free, and defined when the signal is not resolved) and their
    difference, with a jackknife that leaves the same block out of both, so that what the
    shared batches make alike cancels."""
    m = len(a["sums"])
    if len(b["sums"]) != m or list(a["tasks"]) != list(b["tasks"]):
        raise SystemExit(
            "--against needs the same blocks on both sides (same files in the same order, "
            f"the same tasks per block): {a['tasks']} against {b['tasks']}"
        )
    grams = (_gram(a["sums"]), _gram(b["sums"]))  # each side's, for both figures below
    snr_a, se_a, loo_a = _snr(a, grams[0])
    snr_b, se_b, loo_b = _snr(b, grams[1])
    return {
        "blocks": m,
        "snr": snr_a,
        "snr_se": se_a,
        "snr_against": snr_b,
        "snr_against_se": se_b,
        "snr_diff": snr_a - snr_b,
        "snr_diff_se": _jackknife([x - y for x, y in zip(loo_a, loo_b, strict=True)]),
    } | expected_cosine(a, b, grams)


def unpaired(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two settings measured on batches of their own (e.g. two controllers, each sampling its
    own rollouts): each one's |G|^2 / tr(Sigma) = 1 / B with its own leave-one-block-out
    jackknife, and their difference with the two standard errors combined in quadrature (the
    two sides share no batch, so nothing cancels)."""
    snr_a, se_a, _ = _snr(a)
    snr_b, se_b, _ = _snr(b)
    diff_se = None if se_a is None or se_b is None else math.hypot(se_a, se_b)
    return {
        "blocks": len(a["sums"]),
        "blocks_versus": len(b["sums"]),
        "snr": snr_a,
        "snr_se": se_a,
        "snr_versus": snr_b,
        "snr_versus_se": se_b,
        "snr_diff": snr_a - snr_b,
        "snr_diff_se": diff_se,
    }


def _snr(
    x: dict[str, Any], gram: torch.Tensor | None = None
) -> tuple[float, float | None, list[float]]:
    """A setting's |G|^2 / tr(Sigma) over all its blocks, its jackknife standard error, and
    the leave-one-block-out values the error comes from."""
    est = _pair_estimator(x["sums"], x["sq"], x["tasks"], gram)

    def snr(keep: Sequence[int]) -> float:
        noise, signal = est(keep)
        return signal / noise

    every = range(len(x["sums"]))
    loo = [snr([j for j in every if j != i]) for i in every]
    return snr(every), _jackknife(loo), loo


def _jackknife(values: Sequence[float]) -> float | None:
    """The jackknife standard error from m leave-one-out estimates, sqrt((m - 1) / m * sum of
    squared deviations): m - 1 times their own standard error of the mean."""
    se = _se(values)
    return None if se is None else (len(values) - 1) * se


def blocks_path(out: Path) -> Path:
    """Where a measurement written to `out` keeps its block sums (for `--pool`)."""
    return out.with_suffix(".blocks.pt")


def load_blocks(paths: Sequence[Path]) -> dict[str, list[Any]] | None:
    """The block sums of these measurements, in order (None if one has none)."""
    if not all(blocks_path(Path(p)).exists() for p in paths):
        return None
    blocks = [torch.load(blocks_path(Path(p))) for p in paths]
    return {key: [x for b in blocks for x in b[key]] for key in ("sums", "sq", "tasks")}


def pool(paths: Sequence[Path]) -> dict[str, Any]:
    """The batches of several measurements of one setting (e.g. one per `--set seed=S`, each
    an independent draw of tasks and samples) summarised together."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    for key in ("tasks_per_step", "checkpoint"):
        seen = {json.dumps(part.get(key)) for part in parts}
        if len(seen) > 1:
            raise SystemExit(f"cannot pool measurements with different {key}: {sorted(seen)}")
    out = summarise([r for part in parts for r in part["batches"]], parts[0]["tasks_per_step"])
    blocks = load_blocks(paths)
    if blocks is not None:
        out["across_batches"] = across_batches(
            blocks["sums"], blocks["sq"], blocks["tasks"], out["tasks_per_step"]
        )
    out["pooled"] = [str(p) for p in paths]
    out["checkpoint"] = parts[0].get("checkpoint")
    return out


def measure(
    cfg: ExperimentConfig,
    batches: int,
    checkpoint: Path | None = None,
    log: Any = print,
    blocks: int = 8,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Roll out `batches` batches as the run would, at step 0's weights or `checkpoint`'s,
    and measure each one's per-task gradients: the summary, and the block sums that
    `across_batches` (and `--pool`) read. The trainer lives in a temporary directory.

    Ctrl-C or SIGTERM stops it as they stop a run (the trainer closed, the directory removed):
    with two batches or more measured, the summary is of those (`stopped_after` says how many
    of `batches`), so a long measurement loses only the batch in flight; with fewer, the stop
    goes on up as `KeyboardInterrupt`."""
    rows: list[dict[str, float]] = []
    sums = Blocks(min(blocks, batches))
    stopped = False
    # SIGTERM unwinds (removing the directory) from the start, not only once the trainer's own
    # stop handling is installed after it is built
    with interrupt_on_sigterm(), tempfile.TemporaryDirectory(prefix="agentree-noise-") as tmp:
        cfg = cfg.model_copy(deep=True)
        cfg.output = tmp
        trainer = Trainer(cfg, Path(tmp), log=print)  # a warm start's build reports progress
        trainer.stop.install()  # SIGINT and SIGTERM raise KeyboardInterrupt, as in a run
        try:
            if checkpoint is not None:
                trainer.learner.load(checkpoint)
                trainer.publish()
            for k in range(batches):
                t0 = time.perf_counter()
                trees, groups, _, _, _ = trainer.collect()
                usable = [(t, g) for t, g in zip(trees, groups, strict=True) if g]
                kept_trees, kept_groups = [u[0] for u in usable], [u[1] for u in usable]
                grads = list(task_gradients(trainer.updater, kept_trees, kept_groups))
                row = batch_stats(grads)
                row["informative"] = sum(len({t.reward for t in g}) > 1 for g in kept_groups)
                trainer.stop.hold()  # a batch counts in both the rows and the blocks, or neither
                rows.append(row)
                sums.add(k, grads, row)
                trainer.stop.release()
                cos = "-" if row["cos_halves"] is None else f"{row['cos_halves']:+.2f}"
                log(
                    f"batch {k + 1}/{batches}: {row['informative']} of {row['tasks']} groups "
                    f"informative, |G|^2 {row['signal']:.3g}, tr(Sigma) {row['noise']:.3g}, "
                    f"halves' cosine {cos} "
                    f"({time.perf_counter() - t0:.0f} s)"
                )
        except KeyboardInterrupt as stop:
            if len(rows) < 2:
                raise
            stopped = True
            by = f" by {stop.args[0]}" if stop.args else ""
            log(f"stopped{by} after {len(rows)} of {batches} batches: summarising those")
        finally:
            trainer.stop.uninstall()
            trainer.close()
    out = summarise(rows, cfg.train.tasks_per_step)
    if stopped:
        out["stopped_after"] = len(rows)
        out["batches_requested"] = batches
    payload = sums.payload()
    out["across_batches"] = across_batches(
        payload["sums"], payload["sq"], payload["tasks"], out["tasks_per_step"]
    )
    return out, payload


def config_of(source: str, overrides: list[str], rollout: str | None = None) -> ExperimentConfig:
    """A run directory's `config.yaml`, or a config name or file, with another controller
    (`rollout`) and `--set` overrides."""
    path = Path(source)
    if path.is_dir():
        if not (path / "config.yaml").exists():
            raise SystemExit(f"{path} has no config.yaml: give a run directory or a config")
        source = str(path / "config.yaml")
    return load_config(source, select={"rollout": rollout}, overrides=overrides)


def predictions(b: float | None, n: int) -> dict[str, Any]:
    """What noise scale `b` predicts at n tasks a step and at 2n (nothing when b is None)."""
    if b is None:
        return {}
    return {
        "cos_to_gradient": {str(m): 1 / math.sqrt(1 + b / m) for m in (n, 2 * n)},
        "steps_at_twice": (1 + b / (2 * n)) / (1 + b / n),
        "cos_halves_predicted": 1 / (1 + 2 * b / n),
    }


def _scale_text(est: dict[str, Any], n: int) -> str:
    b, se, lower = est["noise_scale"], est.get("noise_scale_se"), est.get("noise_scale_lower")
    bound = "no bound" if lower is None else f"B >= {lower:.0f}"
    if b is None:
        return f"no gradient above the noise (|G|^2 <= 0); {bound} tasks"
    pred = predictions(b, n)
    return (
        f"B = {b:.1f}" + (f" ± {se:.1f}" if se is not None else "") + f" tasks ({bound} from "
        f"the signal + 2 SE): a step points at cos {pred['cos_to_gradient'][str(n)]:.2f} to "
        f"the expected gradient ({pred['cos_to_gradient'][str(2 * n)]:.2f} at {2 * n} tasks); "
        f"twice the tasks need {pred['steps_at_twice']:.2f} of the steps"
    )


def report(result: dict[str, Any]) -> str:
    """B and what it predicts, or the bound where the signal is not resolved: from the pairs
    inside each batch, and from every pair of tasks measured."""
    n, k = result["tasks_per_step"], len(result["batches"])
    cos, cos_se = result["cos_halves"], result.get("cos_halves_se")
    halves = "-" if cos is None else f"{cos:+.2f}" + (f" ± {cos_se:.2f}" if cos_se else "")
    lines = [
        f"{k} batches of {n} tasks ({result['informative']:.1f} informative a batch); "
        f"halves' cosine {halves}",
        "  within batches: " + _scale_text(result, n),
    ]
    tails = result.get("task_tails")
    if tails is not None:
        lines.append(
            f"  gradient norms of the tasks with one, over {tails['batches']} batches: median "
            f"{tails['median']:.3g}, 99th percentile {tails['p99']:.3g}, max {tails['max']:.3g}; "
            f"one task carries over half of a batch's sum |g_i|^2 in {tails['dominated']}"
        )
    across = result.get("across_batches")
    if across is not None:
        lines.append(
            f"  across batches (all pairs of {across['tasks']} tasks, {across['blocks']} "
            "blocks): " + _scale_text(across, n)
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "config", nargs="?", help="a run directory (its config.yaml), a config name or a file"
    )
    ap.add_argument("--rollout", help="another controller, with its defaults (as in train)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--checkpoint", type=Path, help="measure at these weights (default: step 0)")
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument(
        "--pool", type=Path, nargs="+", help="summarise these measurements' batches together"
    )
    ap.add_argument(
        "--against",
        type=Path,
        nargs="+",
        help="with --pool: measurements of another setting on the same batches, in the same "
        "order; adds `paired` (signal-to-noise ratios and their difference, block by block)",
    )
    ap.add_argument(
        "--versus",
        type=Path,
        nargs="+",
        help="with --pool: measurements of another setting on batches of its own (another "
        "controller); adds `unpaired` (signal-to-noise ratios and their difference)",
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.pool:
        result = pool(args.pool)
        for flag, other, compare in (
            ("--against", args.against, paired),
            ("--versus", args.versus, unpaired),
        ):
            if other:
                a, b = load_blocks(args.pool), load_blocks(other)
                if a is None or b is None:
                    raise SystemExit(
                        f"{flag} needs the block sums of every measurement on both sides"
                    )
                key = "paired" if compare is paired else "unpaired"
                result[key] = compare(a, b) | {flag[2:]: [str(x) for x in other]}
    else:
        if args.config is None:
            raise SystemExit("give a run directory or a config to measure, or --pool FILES")
        if args.batches < 2:
            raise SystemExit("--batches must be at least 2 (the standard error is over batches)")
        cfg = config_of(args.config, args.set, args.rollout)
        try:
            result, payload = measure(cfg, args.batches, args.checkpoint)
        except KeyboardInterrupt as stop:
            by = f" by {stop.args[0]}" if stop.args else ""
            print(f"stopped{by} before two batches were measured: nothing written")
            return 130
        args.out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(payload, blocks_path(args.out))
        result["config"] = args.config
        result["rollout"] = args.rollout
        result["set"] = args.set
        result["checkpoint"] = None if args.checkpoint is None else str(args.checkpoint)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(report(result))
    if "paired" in result:
        pr = result["paired"]
        print(
            f"  paired over {pr['blocks']} blocks: |G|^2 / tr(Sigma) {pr['snr']:.2e} ± "
            f"{pr['snr_se']:.1e} against {pr['snr_against']:.2e} ± {pr['snr_against_se']:.1e}; "
            f"difference {pr['snr_diff']:+.2e} ± {pr['snr_diff_se']:.1e}"
        )
        if pr["cos_expected"] is not None:
            se = pr["cos_expected_se"]
            print(
                f"  the two expected gradients' cosine {pr['cos_expected']:+.3f}"
                + ("" if se is None else f" ± {se:.3f}")
            )
    if "unpaired" in result:
        up = result["unpaired"]
        print(
            f"  unpaired, {up['blocks']} blocks against {up['blocks_versus']}: |G|^2 / tr(Sigma) "
            f"{up['snr']:.2e} ± {up['snr_se']:.1e} against {up['snr_versus']:.2e} ± "
            f"{up['snr_versus_se']:.1e}; difference {up['snr_diff']:+.2e} ± {up['snr_diff_se']:.1e}"
        )
    print(f"wrote {args.out}")
    return 130 if "stopped_after" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())
