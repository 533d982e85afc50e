"""The Skywork-o1-Open-PRM architecture (`Qwen2ForPrmModel`) as a vLLM pooling model.

vLLM has no model for Skywork's value head: its `Qwen2ForProcessRewardModel` is
Qwen2.5-Math-PRM's two-layer, two-class head. This one is the Skywork layout the PRM scorer
reads with transformers: a Qwen2 backbone whose last hidden state (after the final norm) feeds
`v_head.summary = Linear(hidden, 1)`, upcast to float32, through a sigmoid. It runs as a
token-classification pooler over every position (`llm.encode(..., pooling_task="token_classify")`
returns one probability per token); the scorer reads the step separators.

vLLM learns the architecture through its plugin entry point (`vllm.general_plugins`, declared in
agentree's pyproject), which runs in every vLLM process, the spawned engine workers included.
Imported only by vLLM itself or by `PRMScorer` with `backend: vllm`: importing agentree never
imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from vllm import ModelRegistry
from vllm.config import VllmConfig
from vllm.inputs import TokensPrompt
from vllm.model_executor.layers.pooler.tokwise import pooler_for_token_classify
from vllm.model_executor.layers.pooler.tokwise.methods import AllPool
from vllm.model_executor.models.qwen2 import Qwen2Model
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix
from vllm.sequence import IntermediateTensors

from agentree.engines.vllm import start_llm, stop_llm

ARCHITECTURE = "Qwen2ForPrmModel"


class _ValueHead(nn.Module):
    """`v_head.summary`, named as in the released checkpoints; float32 as in the reference."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.summary = nn.Linear(hidden, 1, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden.float())


class Qwen2ForPrmModel(nn.Module):
    """Skywork PRM: per-token sigmoid(v_head(h)) from a vLLM Qwen2 backbone."""

    is_pooling_model = True
    default_seq_pooling_type = "LAST"
    default_tok_pooling_type = "ALL"
    hf_to_vllm_mapper = Qwen2Model.hf_to_vllm_mapper
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = Qwen2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.v_head = _ValueHead(config.hidden_size)
        pooler_config = vllm_config.model_config.pooler_config
        assert pooler_config is not None
        # The value head runs on the pooled positions only; every position is kept (AllPool)
        # because a step separator's id also occurs inside the problem text.
        self.pooler = pooler_for_token_classify(
            pooler_config, pooling=AllPool(), classifier=self.v_head, act_fn=torch.sigmoid
        )
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # the released checkpoints also hold the LM's vocabulary head, unused here
        loader = AutoWeightsLoader(self, ignore_unexpected_prefixes=["lm_head."])
        return loader.load_weights(weights)


def register() -> None:
    """vLLM plugin hook: make `Qwen2ForPrmModel` checkpoints loadable (runner: pooling)."""
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:Qwen2ForPrmModel")


class VLLMPRM:
    """A PRM checkpoint served by vLLM: one step probability per input token."""

    def __init__(self, path: str, *, dtype: str = "auto", **llm_kwargs: Any) -> None:
        register()  # this process resolves the architecture; the plugin hook covers workers
        kwargs: dict[str, Any] = {"runner": "pooling"}
        if dtype != "auto":
            kwargs["dtype"] = dtype
        kwargs.update(llm_kwargs)
        self.llm = start_llm(path, **kwargs)
        self.config = self.llm.llm_engine.model_config.hf_config

    def token_probs(self, inputs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """sigmoid(v_head(h)) at every position of each token-id input (vLLM batches them)."""
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in inputs]
        outs = self.llm.encode(prompts, pooling_task="token_classify", use_tqdm=False)
        return [o.outputs.data.float().reshape(-1).cpu() for o in outs]

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            stop_llm(llm)
