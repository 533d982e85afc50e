"""The `train.packing: auto` rule's break-even row length kappa, measured on this device.

    python benchmarks/packing_break_even.py [--device cuda|cpu] [--out FILE.json]

`agentree.algorithms.packing.forward_cost` prices a row of L tokens at L * (1 + L / kappa) with
the dense 4D mask of a packed row and L * (1 + L / (2 kappa)) on SDPA's causal path. For each
total T, this times one policy-update forward and backward (bf16 autocast over fp32 weights, as
the learner runs it) of the same T tokens laid out two ways, on `gpu_check`'s model (the
Qwen2.5-0.5B shape on a GPU, its small shape on CPU):

- rows: T / L rows of L tokens with a 2D mask of ones (the padded layout without padding);
- dense: one row of T tokens with a boolean causal 4D mask, as `packing.attention_mask` builds
  for a packed row (a chain is the tree with no branches: the same mask shape and cost).

and solves the cost model for kappa: r = t_dense / t_rows = (1 + T/kappa) / (1 + L/(2 kappa)),
kappa = (T - r L / 2) / (r - 1) (null when the dense row is no slower: attention never
outweighs the tokens saved). Times are medians of `--repeats` after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gpu_check import build_model, device_label, emit, sync

from agentree.algorithms.packing import attention_mask

TOTALS = {"cuda": (1024, 2048, 4096, 8192), "cpu": (512, 1024)}
ROW = {"cuda": 256, "cpu": 64}


def fwd_bwd(model: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> None:
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits.float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)


def median_wall(fn: Any, device: torch.device, repeats: int) -> float:
    fn()
    walls = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def point(model: Any, total: int, length: int, repeats: int, gen: torch.Generator) -> dict:
    """Both layouts of `total` random tokens timed, and the kappa they imply."""
    device = next(model.parameters()).device
    ids = torch.randint(10, 500, (1, total), generator=gen).to(device)
    rows = ids.view(total // length, length)
    ones = torch.ones_like(rows)
    row_pos = torch.arange(length, device=device).expand_as(rows)
    causal = torch.ones(total, total, dtype=torch.bool).tril().unsqueeze(0)
    dense_mask = attention_mask(model, causal).to(device)
    dense_pos = torch.arange(total, device=device).unsqueeze(0)
    t_rows = median_wall(lambda: fwd_bwd(model, rows, ones, row_pos), device, repeats)
    t_dense = median_wall(lambda: fwd_bwd(model, ids, dense_mask, dense_pos), device, repeats)
    r = t_dense / t_rows
    # None: the dense row was no slower, so no finite kappa fits (attention never outweighs)
    kappa = (total - r * length / 2) / (r - 1) if r > 1 else None
    hidden = model.config.hidden_size
    return {
        "total_tokens": total,
        "rows_s": round(t_rows, 4),
        "dense_s": round(t_dense, 4),
        "ratio": round(r, 3),
        "kappa": None if kappa is None else round(kappa, 1),
        "kappa_per_width": None if kappa is None else round(kappa / hidden, 3),
    }


def run(device_name: str, repeats: int) -> dict[str, Any]:
    device = torch.device(device_name)
    model = build_model(device, torch.float32)
    gen = torch.Generator().manual_seed(0)
    length = ROW[device.type]
    out: dict[str, Any] = {
        "device": device_label(device),
        "torch": torch.__version__,
        "hidden_size": model.config.hidden_size,
        "row_tokens": length,
        "points": [],
    }
    for total in TOTALS[device.type]:
        out["points"].append(point(model, total, length, repeats, gen))
        print(out["points"][-1], file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    summary = run(args.device, args.repeats)
    emit(summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
