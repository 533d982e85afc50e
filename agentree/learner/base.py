"""The learner: the trainable weights, the optimiser, one update, and how trained weights reach
rank 0's engine. The training loop (`agentree.run.trainer`) calls one interface; the config picks
the implementation (`make_learner`):

- `SharedLearner`: one process, all weights in fp32, trained in place in the engine's own model
  (no second copy; publishing the weights only drops the engine's stale prefix cache).
- `ShardedLearner`: a separate trainable copy: FSDP2 over `train.world_size` ranks (launched on
  this machine, by torchrun or as Ray actors: `agentree.learner.launch`,
  `agentree.distributed.ranks`), LoRA adapters, bf16 mixed precision, activation checkpointing
  (`agentree.learner.sharding`). Rank 0 gathers the trained weights (adapters only, with LoRA) into
  its engine's model; the engine runs the same adapters in place (transformers), receives the
  adapters alone and applies them unmerged (vLLM with LoRA enabled, a new adapter id per sync),
  or receives base + B A merged (an engine without adapter support).

Both write one checkpoint format (`save`, `load`): `dcp/` is a distributed checkpoint of the
trainable weights (adapters only, with LoRA), the optimiser and a separate KL reference, which
any learner on any world size loads; rank 0 adds the Hugging Face weights (or the peft adapter
in `adapter/`) so `--policy DIR` and `agentree export` read the checkpoint directly.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from agentree.config import ExperimentConfig, TrainConfig
from agentree.hub.adapters import ADAPTER_DIR
from agentree.learner.lora import add_lora, lora_adapter, plain_state_dict
from agentree.learner.sharding import (
    ShardedUpdate,
    broadcast_object,
    build_trainable,
    init_distributed,
    release_distributed,
    use_cuda,
)
from agentree.learner.update import PolicyUpdate
from agentree.tree import Trajectory, Tree


def needs_separate_copy(tc: TrainConfig) -> bool:
    """Whether the trainable model must be a copy separate from the engine's."""
    return tc.fsdp or tc.lora.r > 0 or tc.gradient_checkpointing or tc.world_size > 1


class Learner:
    """What the training loop needs from whoever holds the trainable weights."""

    model: Any
    """This rank's trainable model (sharded under FSDP, peft-wrapped under LoRA)."""
    ref: Any
    """The frozen KL reference, or None."""
    updater: PolicyUpdate
    rank: int = 0
    world: int = 1
    lora: bool = False

    @property
    def opt(self) -> torch.optim.Optimizer:
        return self.updater.opt

    def update(
        self,
        trees: list[Tree],
        groups: list[list[Trajectory]],
        *,
        lr: float,
        stale: bool,
        commit: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """`PolicyUpdate.__call__`: `commit` runs just before the weights first change."""
        return self.updater(trees, groups, lr=lr, stale=stale, commit=commit)

    def publish(self) -> Any:
        """Put the trained weights into rank 0's engine model (a collective under FSDP). Rank 0
        returns what the engines load (`.state_dict()`), the other ranks None."""
        raise NotImplementedError

    def export(self, tmp: Path) -> None:
        """Rank 0: the Hugging Face weights (or the peft adapter) into checkpoint dir `tmp`."""
        raise NotImplementedError

    # -- checkpoints: one format for every learner --------------------------------------------
    def _dcp_state(self, optim: bool = True) -> tuple[dict[str, Any], StateDictOptions]:
        # with LoRA only the adapters are saved; the frozen base comes from the policy path
        opts = StateDictOptions(ignore_frozen_params=self.lora, strict=not self.lora)
        if optim:
            msd, osd = get_state_dict(self.model, self.opt, options=opts)
            state: dict[str, Any] = {"model": msd, "optim": osd}
        else:
            state = {"model": get_model_state_dict(self.model, options=opts)}
        if self.ref is not None and not self.lora:
            state["ref"] = get_model_state_dict(self.ref)
        return state, opts

    def save(self, tmp: Path) -> None:
        """This rank's part of the checkpoint in `tmp` (every rank calls it)."""
        # An optimiser that has not stepped yet (a checkpoint at step 0) is saved as absent:
        # `get_state_dict` would initialise it with a zero-gradient step, and a run resumed
        # from it would count its first real step as the second (Adam's bias correction),
        # unlike the uninterrupted run.
        state, _ = self._dcp_state(optim=bool(self.opt.state))
        with _one_process_ok():
            dcp.save(state, checkpoint_id=tmp / "dcp", no_dist=not dist.is_initialized())
        if self.rank == 0:
            self.export(tmp)

    def load(self, ckpt: Path) -> None:
        """Weights, optimiser moments and reference of `ckpt`, written by any learner."""
        if not (ckpt / "dcp").is_dir():
            raise ValueError(
                f"{ckpt} has no dcp/ directory: it was written by an older agentree; start a new "
                "run, or load its weights with --policy " + str(ckpt)
            )
        saved = dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
        optim = any(k.startswith("optim.") for k in saved)
        state, opts = self._dcp_state(optim=optim)
        with _one_process_ok():
            dcp.load(state, checkpoint_id=ckpt / "dcp", no_dist=not dist.is_initialized())
        if optim:
            set_state_dict(
                self.model, self.opt, model_state_dict=state["model"],
                optim_state_dict=state["optim"], options=opts,
            )  # fmt: skip
        else:  # saved before the first step: the optimiser stays as fresh as it was
            set_model_state_dict(self.model, state["model"], options=opts)
        if "ref" in state:
            set_model_state_dict(self.ref, state["ref"])

    def close(self) -> None:
        pass


class SharedLearner(Learner):
    """One process trains the engine's own model in place."""

    def __init__(self, cfg: ExperimentConfig, rt: Any, rng: random.Random) -> None:
        tc = cfg.train
        self.model = rt.model
        self.ref = None
        if tc.kl_coef > 0:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.updater = PolicyUpdate(
            self.model,
            tc,
            ref=self.ref,
            temperature=cfg.engine.temperature,
            pad_id=rt.tokenizer.pad_token_id or 0,
            rng=rng,
        )

    def publish(self) -> Any:
        return self.model

    def export(self, tmp: Path) -> None:
        self.model.save_pretrained(tmp)


class ShardedLearner(Learner):
    """A trainable copy: FSDP2 ranks, LoRA, bf16, activation checkpointing."""

    def __init__(self, cfg: ExperimentConfig, rt: Any, rng: random.Random) -> None:
        tc = cfg.train
        self.cfg = cfg
        self.rank, self.world = init_distributed(cfg)
        self.rt = rt if self.rank == 0 else None
        self.lora = tc.lora.r > 0
        self.engine_adapter: Any = None
        info = (rt.policy_path, rt.tokenizer.pad_token_id or 0) if self.rt is not None else None
        path, pad = broadcast_object(info)
        self.device = torch.device("cpu")
        if use_cuda(cfg):
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        self.model, self.ref = build_trainable(path, cfg, self.device)
        if self.rt is not None and self.lora:
            # the engine runs the same adapters in place; each publish copies only A and B
            torch.manual_seed(cfg.seed)
            self.engine_adapter = add_lora(self.rt.model, tc.lora)
        self.updater = ShardedUpdate(
            self.model,
            tc,
            ref=self.ref,
            temperature=cfg.engine.temperature,
            pad_id=pad,
            rng=rng,
            rank=self.rank,
            world=self.world,
            device=self.device,
        )
        self._stale = True

    def update(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self._stale = True  # the engine model no longer holds the trained weights
        return super().update(*args, **kwargs)

    def publish(self) -> Any:
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state = get_model_state_dict(self.model, options=opts)  # collective under FSDP
        self._stale = False
        if self.rt is None:
            return None
        if not self.lora:
            self.rt.model.load_state_dict(state)
            return self.rt.model
        # strict=False: the state holds only the adapters, not the frozen base
        self.engine_adapter.load_state_dict(state, strict=False)
        if type(self.rt.engine).__name__ == "HFEngine":
            return self.rt.model  # the engine's own module, adapters in place
        if getattr(self.rt.engine, "accepts_adapters", False):
            return lora_adapter(self.engine_adapter)  # A and B only, applied unmerged
        return _Weights(plain_state_dict(self.engine_adapter))

    def save(self, tmp: Path) -> None:
        if self._stale:  # rank 0 exports the weights its engine model holds
            self.publish()
        super().save(tmp)

    def export(self, tmp: Path) -> None:
        # rank 0's engine model holds the weights of the last publish: no extra gather
        if self.lora:
            self.engine_adapter.save_pretrained(tmp / ADAPTER_DIR)
        else:
            self.rt.model.save_pretrained(tmp)

    def load(self, ckpt: Path) -> None:
        super().load(ckpt)
        self._stale = True

    def close(self) -> None:
        release_distributed()


@contextlib.contextmanager
def _one_process_ok() -> Iterator[None]:
    """Silence DCP's notice that it runs without a process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class _Weights:
    """A state dict where an engine expects a model (`engine.sync_weights` reads state_dict())."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state


def make_learner(cfg: ExperimentConfig, rt: Any, rng: random.Random) -> Learner:
    """The learner the config asks for; `rt` is rank 0's runtime (None on the other ranks)."""
    if needs_separate_copy(cfg.train):
        return ShardedLearner(cfg, rt, rng)
    return SharedLearner(cfg, rt, rng)
