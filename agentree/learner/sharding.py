"""FSDP2 ranks for the learner: the process group, the sharded trainable copy, and the update
on a rank's share of the micro-batches.

SPMD: every rank runs the training loop (`agentree.run.trainer`). Rank 0 owns the rollout side and
broadcasts each step's trees and groups; every rank builds the same micro-batches from them and
keeps its share (micro-batch i goes to rank i mod W). A rank short of micro-batches gets an
all-masked copy, so every rank runs the same number of forwards and backwards, which FSDP's
collectives require. The loss normaliser is summed over ranks and FSDP's gradient averaging is
off (divide factor 1), so the gradient is that of the whole batch, as in one process.

Only rank 0 reads the checkpoint: the other ranks build the model on the meta device and
receive their shards from rank 0 (`fill_from_rank0`). With LoRA and `train.dtype=bf16` the
frozen base is kept in bf16 (it has no gradient, so no fp32 master copy), adapters in fp32.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from agentree.algorithms.packing import Batch, PackedBatch
from agentree.config import ExperimentConfig, TrainConfig
from agentree.learner.launch import free_port
from agentree.learner.lora import BaseModelView, add_lora
from agentree.learner.update import PolicyUpdate
from agentree.tree import Trajectory, Tree


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
            # a launched rank's group lives as long as its process: every trainer the process
            # builds joins it (re-forming it on the same rendezvous port can deadlock)
            atexit.register(release_distributed, force=True)
        else:
            if cfg.train.world_size != 1:
                raise ValueError("launch ranks with `agentree train` or torchrun")
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
    return dist.get_rank(), dist.get_world_size()


def release_distributed(force: bool = False) -> None:
    """End the one-rank group this process made for itself (a launched rank's group stays
    until the process exits, unless `force`)."""
    if dist.is_initialized() and (force or "RANK" not in os.environ):
        dist.destroy_process_group()


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
    # deferred: transformers takes seconds to import; only loading a model needs it, not
    # importing the trainer (which imports this module)
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

    def global_max(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def batches(
        self,
        trees: list[Tree],
        groups: list[list[Trajectory]],
        advs: list[list[list[float]]] | None = None,
    ) -> list[Batch]:
        micro = super().batches(trees, groups, advs)
        if self.world == 1:
            return micro
        pad = [_blank(micro[i % len(micro)]) for i in range(-len(micro) % self.world)]
        return (micro + pad)[self.rank :: self.world]


def _blank(b: Batch | PackedBatch) -> Batch | PackedBatch:
    """`b` with no policy token: contributes nothing to loss, gradient or normaliser."""
    return dataclasses.replace(b, mask=torch.zeros_like(b.mask), adv=torch.zeros_like(b.adv))
