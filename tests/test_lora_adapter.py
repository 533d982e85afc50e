"""The LoRA adapters an engine receives instead of merged weights: exact bytes, peft's on-disk
layout (what vLLM's LoRA loader reads), and the engine arguments for a trainer's rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agentree.config import LoraSettings
from agentree.learner.lora import add_lora, lora_adapter, plain_state_dict
from agentree.policy import vllm_lora_kwargs


def test_adapter_bytes_by_hand_and_peft_reloads_what_it_saves(
    tiny_frozenlake: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(tiny_frozenlake, dtype=torch.float32)

    torch.manual_seed(0)
    model = add_lora(base(), LoraSettings(r=4))
    with torch.no_grad():  # B = 0 at the start; give it values so the adapters do something
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    adapter = lora_adapter(model)
    c = json.loads((tiny_frozenlake / "config.json").read_text())
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
    # A is r x in, B is out x r: r (in + out) fp32 parameters per adapted Linear
    assert adapter.nbytes == 4 * layers * sum(4 * (i + o) for i, o in shapes)
    assert len(adapter.tensors) == 2 * 7 * layers
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in adapter.tensors)
    full = sum(t.numel() * t.element_size() for t in plain_state_dict(model).values())
    assert adapter.nbytes < full / 10

    saved = adapter.save(tmp_path / "adapter")
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == sorted(
        LoraSettings().target_modules
    )
    reloaded = PeftModel.from_pretrained(base(), saved).eval()
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(want, base()(input_ids=ids).logits, atol=1e-3)


def test_vllm_lora_arguments_reserve_the_next_rank_vllm_serves() -> None:
    assert vllm_lora_kwargs(8) == {
        "enable_lora": True,
        "max_lora_rank": 8,
        "max_loras": 1,
        "max_cpu_loras": 2,
    }
    assert vllm_lora_kwargs(12)["max_lora_rank"] == 16
    assert vllm_lora_kwargs(1)["max_lora_rank"] == 1
    with pytest.raises(ValueError, match="up to 512"):
        vllm_lora_kwargs(600)
