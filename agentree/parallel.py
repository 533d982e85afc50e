"""Training on several ranks with FSDP2, and the trainable-copy features: LoRA, bf16 mixed
precision, activation checkpointing, distributed checkpoints.

SPMD: every rank runs the training loop. Rank 0 owns the rollout side (engine, envs,
controller, scorer) exactly as the single-process trainer does; each step it broadcasts the
step's trees and groups, every rank builds the same micro-batches from them and keeps its share
(micro-batch i goes to rank i mod W). A rank short of micro-batches gets an all-masked copy, so
every rank runs the same number of forwards and backwards, which FSDP's collectives require.
The loss normaliser is summed over ranks and FSDP's gradient averaging is off (divide factor 1),
so the gradient is that of the whole batch, as in one process.

The update runs on a trainable copy of the policy (fp32 master weights), sharded with
`fully_shard` per decoder layer and at the root; rank 0's engine keeps its own unsharded model.
Only rank 0 reads the checkpoint: the other ranks build the model on the meta device and
receive their shards from rank 0 (`fill_from_rank0`). With LoRA and `train.dtype=bf16` the
frozen base is kept in bf16 (it has no gradient, so no fp32 master copy), adapters in fp32.
After each update rank 0 gathers the weights (`get_model_state_dict(full_state_dict=True,
cpu_offload=True)`, which materialises them once, on rank 0 only) into the engine's model. With
LoRA only the adapter is gathered: the engine's model carries the same adapters (transformers
engine, in place) or receives base + B A merged (vLLM).

Checkpoints: `dcp/` is a distributed checkpoint of the model (adapters only, with LoRA) and
optimiser shards that loads onto any world size; rank 0 adds the Hugging Face weights (full
fine-tuning) or the peft adapter in `adapter/` (LoRA), the tokenizer and the trainer state.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentree.batching import Batch
from agentree.checkpoint import begin_checkpoint, finish_checkpoint, latest_checkpoint
from agentree.config import ExperimentConfig, LogConfig, TrainConfig
from agentree.lora import ADAPTER_DIR, BaseModelView, add_lora, lora_scaling, merged_state_dict
from agentree.packing import PackedBatch
from agentree.resume import StopSignals
from agentree.runtime import Runtime
from agentree.tracking import Tracker
from agentree.trainer import Trainer
from agentree.tree import Trajectory, Tree
from agentree.update import PolicyUpdate


def check_train_config(tc: TrainConfig) -> None:
    """Reject combinations this trainer cannot run, with the fix."""
    if tc.world_size > 1 and not tc.fsdp:
        raise ValueError("train.world_size > 1 needs train.fsdp=true (ranks shard the model)")
    if tc.dtype == "bf16" and not tc.fsdp and not tc.lora.r:
        raise ValueError(
            "train.dtype=bf16 needs train.fsdp=true (FSDP2's mixed precision keeps the fp32 "
            "master weights; world_size 1 is fine) or LoRA (train.lora.r > 0: a bf16 frozen base)"
        )
    if tc.async_steps and needs_parallel_trainer(tc):
        raise ValueError(
            "train.async_steps=1 runs with the single-process trainer only; drop it, or drop "
            "train.fsdp / train.lora / train.gradient_checkpointing / train.world_size"
        )


def needs_parallel_trainer(tc: TrainConfig) -> bool:
    """Whether the trainable model must be a copy separate from the engine's."""
    return tc.fsdp or tc.lora.r > 0 or tc.gradient_checkpointing or tc.world_size > 1


def make_trainer(cfg: ExperimentConfig, run_dir: Path, log: Callable[[str], None] = print):
    check_train_config(cfg.train)
    if needs_parallel_trainer(cfg.train):
        return ParallelTrainer(cfg, run_dir, log=log)
    return Trainer(cfg, run_dir, log=log)


# -- process group ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_cuda(cfg: ExperimentConfig) -> bool:
    return torch.cuda.is_available() and cfg.policy.device != "cpu"


def init_distributed(cfg: ExperimentConfig) -> tuple[int, int]:
    """(rank, world size); joins the group described by torchrun's variables, or makes a
    one-rank group when FSDP runs in this process alone."""
    if not cfg.train.fsdp:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if use_cuda(cfg) else "gloo"
        if use_cuda(cfg):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ:
            world = int(os.environ["WORLD_SIZE"])
            if world != cfg.train.world_size:
                raise ValueError(
                    f"{world} ranks were started but train.world_size is "
                    f"{cfg.train.world_size}; pass --set train.world_size={world}"
                )
            dist.init_process_group(backend)
        else:
            if cfg.train.world_size != 1:
                raise ValueError("launch ranks with `agentree train` or torchrun")
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
    return dist.get_rank(), dist.get_world_size()


def spawn_ranks(world_size: int, argv: Sequence[str]) -> int:
    """Run `agentree <argv>` as `world_size` local ranks (as torchrun would); 0 if all succeed."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.start_processes(
        _rank_entry, args=(world_size, port, list(argv)), nprocs=world_size, join=False,
        start_method="spawn",
    )  # fmt: skip
    try:
        while not ctx.join():
            pass
    except mp.ProcessExitedException as e:
        return int(e.exit_code or 1)
    return 0


def _rank_entry(rank: int, world_size: int, port: int, argv: list[str]) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from agentree.cli import main

    code = main(argv)
    if code:
        sys.exit(code)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# -- the trainable policy -----------------------------------------------------------------------
def build_trainable(
    path: str, cfg: ExperimentConfig, device: torch.device
) -> tuple[Any, Any]:  # fmt: skip
    """(trainable model, KL reference or None) from the checkpoint at `path`.

    Under FSDP only rank 0 reads the checkpoint; the other ranks build the model on the meta
    device (no memory), shard it, and receive their shards from rank 0, so no rank but 0 ever
    holds the full model. With LoRA and bf16 the frozen base is loaded in bf16: it gets no
    gradient, so it needs no fp32 master copy (peft keeps the adapters in fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tc = cfg.train
    dtype = torch.bfloat16 if tc.dtype == "bf16" and tc.lora.r else torch.float32
    loads = not tc.fsdp or dist.get_rank() == 0
    if loads:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    if tc.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    ref = None
    if tc.lora.r:
        torch.manual_seed(cfg.seed)  # every rank draws the same initial adapters
        model = add_lora(model, tc.lora)
    elif tc.kl_coef > 0:
        ref = copy.deepcopy(model).eval().requires_grad_(False)
    if tc.fsdp:
        base = model.get_base_model() if tc.lora.r else model
        full = base.state_dict() if loads else {}  # rank 0's full weights, adapters included
        for m in (base, ref):
            if m is not None:
                shard(m, tc, device)
                fill_from_rank0(m, dict(full), device)  # the call consumes its dict
        del full
    else:
        model.to(device)
        if ref is not None:
            ref.to(device)
    if tc.lora.r and tc.kl_coef > 0:
        ref = BaseModelView(model)
    return model, ref


def fill_from_rank0(model: Any, full: dict[str, torch.Tensor], device: torch.device) -> None:
    """Give every rank its shards of rank 0's `full` state dict (one tensor broadcast at a
    time), and rank 0's buffers: the non-persistent ones (rotary frequencies) are in no state
    dict and are still on the meta device on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if dist.get_world_size() == 1:
        return
    if dist.get_rank() != 0:
        # real (uninitialised) shards, swapped into the same parameter objects: tied weights
        # (embeddings = output layer) stay one parameter, and the load below copies in place
        model.to_empty(device=device)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=opts)
    for m in model.modules():
        for name, buf in list(m._buffers.items()):
            if buf is None:
                continue
            t = buf.to(device) if dist.get_rank() == 0 else torch.empty_like(buf, device=device)
            dist.broadcast(t, src=0)
            m._buffers[name] = t


def shard(model: Any, tc: TrainConfig, device: torch.device) -> None:
    """FSDP2 over all ranks: one unit per decoder layer plus the root (embeddings, head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy()
    if tc.dtype == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in list(model.modules()):
        if type(m).__name__.endswith("DecoderLayer"):
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # each rank's loss is already divided by the global normaliser: sum, don't average
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


class ShardedUpdate(PolicyUpdate):
    """`PolicyUpdate` on this rank's share of the micro-batches, with global sums."""

    def __init__(self, *args: Any, rank: int, world: int, device: torch.device, **kw: Any):
        super().__init__(*args, **kw)
        self.rank, self.world, self.device = rank, world, device

    def global_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t)
        return t.tolist()

    def batches(self, trees: list[Tree], groups: list[list[Trajectory]]) -> list[Batch]:
        micro = super().batches(trees, groups)
        if self.world == 1:
            return micro
        pad = [_blank(micro[i % len(micro)]) for i in range(-len(micro) % self.world)]
        return (micro + pad)[self.rank :: self.world]


def _blank(b: Batch | PackedBatch) -> Batch | PackedBatch:
    """`b` with no policy token: contributes nothing to loss, gradient or normaliser."""
    return dataclasses.replace(b, mask=torch.zeros_like(b.mask), adv=torch.zeros_like(b.adv))


class _Weights:
    """A state dict where an engine expects a model (`engine.sync_weights` reads state_dict())."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state


# -- the trainer --------------------------------------------------------------------------------
class ParallelTrainer(Trainer):
    """`Trainer` whose update runs on a separate (sharded, LoRA, mixed-precision) policy copy."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, log: Callable[[str], None] = print):
        self.cfg, self.dir = cfg, run_dir
        tc = cfg.train
        self.rank, self.world = init_distributed(cfg)
        self.log = log if self.rank == 0 else _quiet
        self.lora = tc.lora.r > 0
        self.step = 0
        self.rng = random.Random(cfg.seed)
        self.rt: Runtime | None = None
        self.engine_adapter: Any = None
        self._engine_stale = True
        info = None
        if self.rank == 0:
            self.rt = Runtime(cfg, log=log)
            info = (self.rt.policy_path, self.rt.tokenizer.pad_token_id or 0)
        path, pad = broadcast_object(info)
        self.device = torch.device("cpu")
        if use_cuda(cfg):
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        self.model, self.ref = build_trainable(path, cfg, self.device)
        if self.rt is not None and self.lora:
            # the engine runs the same adapters in place; each sync copies only A and B
            torch.manual_seed(cfg.seed)
            self.engine_adapter = add_lora(self.rt.model, tc.lora)
        self.updater = ShardedUpdate(
            self.model,
            tc,
            ref=self.ref,
            temperature=cfg.engine.temperature,
            pad_id=pad,
            rng=self.rng,
            rank=self.rank,
            world=self.world,
            device=self.device,
        )
        self.opt = self.updater.opt
        self.train_tasks = self.rt.load_tasks(cfg.tasks, split="train") if self.rt else []
        self._order: list[int] = []
        self._cursor = 0
        self.stop = StopSignals()
        self._step_start: dict[str, Any] | None = None
        self._pending: tuple[Any, int] | None = None
        log_cfg = cfg.log if self.rank == 0 else LogConfig()  # one rank reports
        self.tracker = Tracker(log_cfg, run_dir, cfg.model_dump(), tc.trees_every)
        self.sync_engine()

    # -- loop ---------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        tc = self.cfg.train
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        payload = None
        if self.rt is not None:
            self._step_start = self._loop_state()
            trees, trajs, stats, dropped, _ = self._collect()
            metrics = self._rollout_metrics(trees, trajs, stats)
            metrics["train/groups_dropped"] = dropped
            metrics["time/rollout_s"] = time.perf_counter() - t0
            if tc.trees_every and (self.step + 1) % tc.trees_every == 0:
                self.save_trees(trees)
            usable = [(tree, ts) for tree, ts in zip(trees, trajs, strict=True) if ts]
            payload = ([u[0] for u in usable], [u[1] for u in usable])
        trees, groups = broadcast_object(payload)
        self.stop.hold()  # an interrupted update would checkpoint half-updated weights
        if trees:
            t1 = time.perf_counter()
            metrics.update(self.update(trees, groups))
            metrics["time/update_s"] = time.perf_counter() - t1
        self.sync_engine()
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    def update(self, trees: list[Tree], groups: list[list[Trajectory]]) -> dict[str, float]:
        self._engine_stale = True
        return super().update(trees, groups)

    def evaluate(self, log: bool = True) -> dict[str, float]:
        return super().evaluate(log) if self.rt is not None else {}

    def write_metrics(self, metrics: dict[str, float]) -> None:
        if self.rank == 0:
            super().write_metrics(metrics)

    def sync_engine(self) -> None:
        """Gather the trained weights (adapters only, with LoRA) into rank 0's engine."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        t0 = time.perf_counter()
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state = get_model_state_dict(self.model, options=opts)  # collective under FSDP
        self._engine_stale = False
        if self.rt is None:
            return
        from agentree.engines.hf import HFEngine

        if self.lora:
            # strict=False: the state holds only the adapters, not the frozen base
            self.engine_adapter.load_state_dict(state, strict=False)
            if isinstance(self.rt.engine, HFEngine):
                self.rt.engine.sync_weights(self.rt.model)  # same module: drops stale KV only
            else:
                merged = merged_state_dict(
                    self.engine_adapter.state_dict(), lora_scaling(self.cfg.train.lora)
                )
                self.rt.engine.sync_weights(_Weights(merged))
        else:
            self.rt.model.load_state_dict(state)
            self.rt.engine.sync_weights(self.rt.model)
        self.last_sync_s = time.perf_counter() - t0

    # -- checkpoints --------------------------------------------------------------------------
    def _dcp_state(self) -> tuple[dict[str, Any], Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_state_dict,
        )

        # with LoRA only the adapters are saved; the frozen base comes from the policy path
        opts = StateDictOptions(ignore_frozen_params=self.lora, strict=not self.lora)
        msd, osd = get_state_dict(self.model, self.opt, options=opts)
        state: dict[str, Any] = {"model": msd, "optim": osd}
        if self.ref is not None and not self.lora:
            state["ref"] = get_model_state_dict(self.ref)
        return state, opts

    def save(self) -> Path:
        import torch.distributed.checkpoint as dcp

        if self._engine_stale:  # rank 0 writes the weights its engine holds
            self.sync_engine()
        tmp = begin_checkpoint(self.dir, self.step) if self.rank == 0 else None
        tmp = Path(broadcast_object(str(tmp)))
        state, _ = self._dcp_state()
        dcp.save(state, checkpoint_id=tmp / "dcp", no_dist=not dist.is_initialized())
        ckpt = self.dir / "checkpoints" / f"step_{self.step:06d}"
        if self.rt is not None:
            # rank 0's engine model holds the weights of the last sync: no extra gather
            if self.lora:
                self.engine_adapter.save_pretrained(tmp / ADAPTER_DIR)
            else:
                self.rt.model.save_pretrained(tmp)
            self.rt.tokenizer.save_pretrained(tmp)
            trainer_state = {
                "step": self.step,
                **(self._step_start or self._loop_state()),
                "policy": self.rt.policy_path,
                "lora": self.cfg.train.lora.model_dump() if self.lora else None,
            }
            torch.save(trainer_state, tmp / "trainer_state.pt")
            ckpt = finish_checkpoint(self.dir, self.step, self.cfg.train.keep_checkpoints)
        barrier()
        return ckpt

    def resume(self) -> bool:
        """Load the latest checkpoint (written with any world size)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        ckpt = latest_checkpoint(self.dir)
        if ckpt is None:
            return False
        if not (ckpt / "dcp").is_dir():
            raise ValueError(
                f"{ckpt} was written by the single-process trainer; resume it without "
                "train.fsdp / train.lora / train.gradient_checkpointing"
            )
        state, opts = self._dcp_state()
        dcp.load(state, checkpoint_id=ckpt / "dcp", no_dist=not dist.is_initialized())
        set_state_dict(
            self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
            options=opts,
        )  # fmt: skip
        if "ref" in state:
            set_model_state_dict(self.ref, state["ref"])
        self._restore_loop_state(torch.load(ckpt / "trainer_state.pt", weights_only=False))
        self.sync_engine()
        return True

    def close(self) -> None:
        self.tracker.close()
        if self.rt is not None:
            self.rt.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _quiet(msg: str) -> None:
    pass
