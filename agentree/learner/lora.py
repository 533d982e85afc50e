"""LoRA adapters (peft) for the policy, the base model as KL reference, and merged weights.

With LoRA the trainable update of a linear layer is W + (alpha / r) * B A; only A and B get
gradients and optimiser state. The reference policy of the KL term is the same module with
its adapters switched off (`disable_adapter()`), so no second copy of the weights exists.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from agentree.config import LoraSettings
from agentree.engines.base import LoraAdapter


def add_lora(model: Any, lc: LoraSettings) -> Any:
    """Wrap `model` in a peft model with fresh adapters; the base weights are frozen."""
    # deferred: peft is the optional [train] extra
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lc.r,
        lora_alpha=lc.alpha,
        lora_dropout=lc.dropout,
        target_modules=list(lc.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


class BaseModelView:
    """The policy with its adapters disabled: what `token_logprobs` needs of a reference."""

    def __init__(self, peft_model: Any) -> None:
        self.model = peft_model

    @property
    def config(self) -> Any:
        return self.model.config

    def parameters(self) -> Iterator[Any]:
        return self.model.parameters()

    def get_output_embeddings(self) -> Any:
        return self.model.get_output_embeddings()

    def __call__(self, **kwargs: Any) -> Any:
        with self.model.disable_adapter():
            return self.model(**kwargs)


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merged_state_dict(state: Mapping[str, Any], scaling: float) -> dict[str, Any]:
    """Hugging Face weight names and values of base + (alpha / r) * B A from a peft state dict.

    peft stores a wrapped layer as `<x>.base_layer.weight`, `<x>.lora_A.<adapter>.weight` and
    `<x>.lora_B.<adapter>.weight` under `base_model.model.`; the merged layer is `<x>.weight`.
    """
    lora: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for name, t in state.items():
        key = name.removeprefix("base_model.model.")
        if is_adapter_key(key):
            layer, _, rest = key.partition(".lora_")
            lora.setdefault(layer, {})[rest[0]] = t  # "A" or "B"
            continue
        out[key.replace(".base_layer.", ".")] = t
    for layer, ab in lora.items():
        w = out[f"{layer}.weight"]
        delta = (ab["B"].float() @ ab["A"].float()) * scaling
        out[f"{layer}.weight"] = (w.float() + delta).to(w.dtype)
    return out


def plain_state_dict(model: Any) -> dict[str, Any]:
    """The weights a model without adapters loads: a peft model's merged (base + (alpha / r)
    * B A, under the Hugging Face names), any other model's own state dict."""
    state = model.state_dict()
    adapters = getattr(model, "peft_config", None)
    if not adapters:
        return dict(state)
    (lc,) = adapters.values()  # add_lora makes one adapter
    return merged_state_dict(state, lc.lora_alpha / lc.r)


def lora_adapter(model: Any) -> LoraAdapter:
    """A peft model's adapters as an engine loads them unmerged (vLLM's LoRA): the A and B
    matrices and the adapter config, a small fraction of the model's bytes."""
    # deferred: peft is the optional [train] extra
    from peft import get_peft_model_state_dict

    (lc,) = model.peft_config.values()  # add_lora makes one adapter
    config = json.loads(json.dumps(lc.to_dict(), default=_jsonable))
    state = get_peft_model_state_dict(model)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    return LoraAdapter(tensors=tensors, config=config)


def _jsonable(value: Any) -> Any:
    """peft's config holds sets (target modules) and enums; adapter_config.json holds lists."""
    if isinstance(value, set | frozenset):
        return sorted(value)
    return str(value)
