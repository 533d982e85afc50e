"""Peak memory per training rank (RSS on CPU): 1 rank vs 2 FSDP2 ranks, full weights vs LoRA,
LoRA on an fp32 or a bf16 frozen base.

Each configuration runs in fresh processes: every rank builds the trainable policy exactly as
`agentree train` does (`agentree.learner.sharding.build_trainable`: rank 0 loads, the other ranks
build on the meta device, `fully_shard`, shards sent from rank 0, LoRA) and runs
one update (`ShardedUpdate`: its share of the micro-batches, AdamW step) on a synthetic batch of
`--trajectories` sequences of `--seq-len` tokens (random ids, half the tokens policy tokens,
rewards alternating so the advantages are non-zero). Reported per rank: peak RSS (VmHWM)
once the model is loaded and sharded, peak RSS after the step, RSS after the step, and the
bytes of the rank's own parameters and AdamW state (its shards
under FSDP), which the allocator's retained pages do not blur. Only the trainer side is
measured: rank 0's rollout engine adds its own copy of the weights on top.

Models: `tiny` (the 2-layer, 128-wide FrozenLake policy) and `100m`, a ~110M-parameter
Qwen2-architecture model (12 layers, 768 wide, 32k vocabulary) built here with random weights
and saved/loaded through `save_pretrained`/`from_pretrained` like the tiny policy.

    python benchmarks/train_memory.py --models tiny 100m --ranks 1 2 --lora 0 16 --dtype fp32 bf16

bf16 rows are LoRA only (a bf16 frozen base); `--logits-chunk N` sets `train.logits_chunk`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

import torch

from agentree.signals import interrupt_on_sigterm


def build_100m(out: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    conf = Qwen2Config(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=True,
        max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(conf).save_pretrained(out)
    return out


def tiny_path() -> Path:
    from agentree.hub.tiny import TinyModelConfig, tiny_policy_for_env

    return tiny_policy_for_env("frozenlake", {}, TinyModelConfig(vocab_size=160))


def synthetic_batch(n: int, length: int, vocab: int, group: int = 4):
    from agentree.tree import EndReason, Trajectory, Tree

    rng = random.Random(0)
    trees, groups = [], []
    for g in range(0, n, group):
        tree = Tree(f"t{g}")
        tree.add_root("", [])
        trajs = []
        for i in range(min(group, n - g)):
            ids = [rng.randrange(vocab) for _ in range(length)]
            mask = [0] * (length // 2) + [1] * (length - length // 2)
            trajs.append(
                Trajectory(
                    task_id=tree.task_id, leaf=0, nodes=[tree.root.id], token_ids=ids,
                    loss_mask=mask, logprobs=[0.0] * length, node_of_token=[0] * length,
                    reward=float(i % 2), end_reason=EndReason.COMPLETED, num_turns=1,
                )
            )  # fmt: skip
        trees.append(tree)
        groups.append(trajs)
    return trees, groups


def state_bytes(model, opt) -> int:
    """Bytes of this rank's own parameters and optimiser state (its shards under FSDP)."""

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    n = sum(local(p).numel() * p.element_size() for p in model.parameters())
    for st in opt.state.values():
        n += sum(local(v).numel() * v.element_size() for v in st.values() if v.dim() > 0)
    return n


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM). Not ru_maxrss: on Linux that keeps the peak of the
    process it was forked from (the launcher, which built the model) across exec."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def reset_peak_rss() -> None:
    """Start `peak_rss_mib` again from the current RSS (Linux `clear_refs` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rank(world: int, spec: dict, out: str) -> None:
    """One rank, started by `spawn_ranks` (which sets RANK, WORLD_SIZE and the master's port)."""
    torch.set_num_threads(1)
    from transformers import AutoConfig

    from agentree.config import load_config
    from agentree.learner.sharding import ShardedUpdate, build_trainable, init_distributed

    overrides = [
        f"train.world_size={world}", f"train.fsdp={str(spec['fsdp']).lower()}",
        f"train.lora.r={spec['lora']}", f"train.micro_batch_size={spec['micro_batch']}",
        "train.kl_coef=0", "policy.device=cpu", f"train.dtype={spec['dtype']}",
        f"train.logits_chunk={spec['logits_chunk']}",
    ]  # fmt: skip
    cfg = load_config("frozenlake_patr", overrides=overrides)
    rank, world = init_distributed(cfg)
    before = rss_mib()
    model, ref = build_trainable(spec["path"], cfg, torch.device("cpu"))
    load_peak = peak_rss_mib()
    upd = ShardedUpdate(model, cfg.train, ref=ref, rank=rank, world=world, device="cpu")
    vocab = AutoConfig.from_pretrained(spec["path"]).vocab_size
    trees, groups = synthetic_batch(spec["trajectories"], spec["seq_len"], vocab)
    upd(trees, groups, lr=1e-5)
    peak = peak_rss_mib()
    row = {
        "rank": rank, "start_mib": before, "load_peak_mib": load_peak, "peak_mib": peak,
        "after_mib": rss_mib(),
        "state_mib": state_bytes(model, upd.opt) / 2**20,
    }  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(row))
    if world > 1 or cfg.train.fsdp:
        import torch.distributed as dist

        dist.destroy_process_group()


def measure(spec: dict, world: int) -> list[dict]:
    from agentree.learner.launch import spawn_ranks

    with tempfile.TemporaryDirectory(prefix="train-memory-") as out:
        # a failed rank, Ctrl-C or `kill` (also while they start): spawn_ranks stops the rest
        code = spawn_ranks(world, _rank, (world, spec, out))
        if code:
            raise RuntimeError(f"a rank exited with code {code}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    # glibc returns freed blocks over 64 KiB to the OS instead of raising its threshold and
    # keeping them, so RSS follows live memory rather than the allocator's high-water mark
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "100m"], choices=["tiny", "100m"])
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    p.add_argument("--lora", nargs="+", type=int, default=[0, 16], help="LoRA ranks (0: full)")
    p.add_argument("--dtype", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    p.add_argument("--logits-chunk", type=int, default=0, help="train.logits_chunk")
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="train-memory-model-") as tmp:
        paths = {
            "tiny": lambda: tiny_path(),
            "100m": lambda: build_100m(Path(tmp) / "qwen2-100m"),
        }
        for name in args.models:
            path = str(paths[name]())
            from transformers import AutoConfig, AutoModelForCausalLM

            with torch.device("meta"):
                n = sum(
                    q.numel()
                    for q in AutoModelForCausalLM.from_config(
                        AutoConfig.from_pretrained(path)
                    ).parameters()
                )
            runs = [
                (w, r, d)
                for w in args.ranks
                for r in args.lora
                for d in args.dtype
                if d == "fp32" or r  # bf16 full fine-tuning needs fp32 master weights
            ]
            for world, r, dtype in runs:
                spec = {
                    "path": path, "fsdp": world > 1, "lora": r, "dtype": dtype,
                    "micro_batch": args.micro_batch, "trajectories": args.trajectories,
                    "seq_len": args.seq_len, "logits_chunk": args.logits_chunk,
                }  # fmt: skip
                per_rank = measure(spec, world)
                row = {
                    "model": name, "params_m": round(n / 1e6, 1), "ranks": world,
                    "fsdp": world > 1, "lora": r, "dtype": dtype,
                    "load_avg": round(os.getloadavg()[0], 1),
                    "load_peak_mib": [round(x.get("load_peak_mib", 0)) for x in per_rank],
                "peak_mib": [round(x["peak_mib"]) for x in per_rank],
                    "after_mib": [round(x["after_mib"]) for x in per_rank],
                    "start_mib": [round(x["start_mib"]) for x in per_rank],
                    "state_mib": [round(x["state_mib"]) for x in per_rank],
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(
        "| model | params | ranks | mode | peak RSS after loading (MiB) | peak RSS (MiB) "
        "| RSS after step (MiB) | own weights + AdamW state (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        mode = (
            ("FSDP2" if r["fsdp"] else "1 process")
            + (f" + LoRA r={r['lora']}" if r["lora"] else "")
            + (" (bf16 base)" if r["dtype"] == "bf16" else "")
        )
        print(
            f"| {r['model']} | {r['params_m']}M | {r['ranks']} | {mode} | "
            f"{' / '.join(map(str, r['load_peak_mib']))} | {' / '.join(map(str, r['peak_mib']))} | "
            f"{' / '.join(map(str, r['after_mib']))} | "
            f"{' / '.join(map(str, r['state_mib']))} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    with interrupt_on_sigterm():  # `kill` stops the ranks and removes the directories
        main()
