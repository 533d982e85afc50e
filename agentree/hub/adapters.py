"""A LoRA run's checkpoint as a plain model.

A checkpoint of a run with `train.lora.r` holds the adapter (`adapter/`, peft's format) beside
the tokenizer, not the weights: `--policy RUN/checkpoints/step_N` of such a run is merged into
the base weights its adapter config names, once, and cached by the adapter's sha256 under
`$AGENTREE_CACHE/merged/` (`agentree.hub.store.build_once`), so every command, `--policy` and
vLLM load it as any checkpoint. `agentree export` writes the same merge where the user says.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from agentree.hub.store import Log, build_once, cache_root, policy_record, write_policy_record

ADAPTER_DIR = "adapter"
"""Sub-directory of a checkpoint that holds the peft adapter."""


def is_adapter_checkpoint(path: Path) -> bool:
    """A checkpoint directory that holds an adapter and no weights of its own."""
    return (path / ADAPTER_DIR / "adapter_config.json").is_file() and not (
        path / "config.json"
    ).exists()


def adapter_base(ckpt: Path) -> str:
    """The base model (a directory or hub id) the adapter of `ckpt` was trained on."""
    config = json.loads((ckpt / ADAPTER_DIR / "adapter_config.json").read_text())
    return config["base_model_name_or_path"]


def write_merged(ckpt: Path, out: Path) -> None:
    """Save `ckpt` into `out` as a plain fp32 checkpoint with its tokenizer and policy record:
    the adapter merged into its base (W + (alpha / r) B A), or the weights as they are."""
    # deferred: torch and transformers take seconds to import; agentree.hub is imported by configs
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merge = is_adapter_checkpoint(ckpt)
    if not merge and not (ckpt / "config.json").exists():
        raise ValueError(f"{ckpt} holds neither a model (config.json) nor a LoRA adapter")
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    if merge:
        try:
            # deferred: peft is the optional [train] extra
            from peft import PeftModel
        except ImportError:
            raise ImportError(
                f"{ckpt} holds a LoRA adapter; merging it into its base needs peft: pip install "
                "'agentree[train]'"
            ) from None
        base = adapter_base(ckpt)
        if base.startswith("/") and not Path(base).exists():
            raise FileNotFoundError(
                f"{ckpt} holds a LoRA adapter of {base}, which no longer exists; rebuild that "
                "base (e.g. `agentree models build`) or point --policy at a merged checkpoint"
            )
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, ckpt / ADAPTER_DIR).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = policy_record(ckpt)
    if record:
        write_policy_record(out, record["tool_format"], record.get("action_format"))


def merged_checkpoint(ckpt: Path, log: Log | None) -> Path:
    """The merged form of the LoRA checkpoint `ckpt`, built once per adapter."""
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        digest.update((ckpt / ADAPTER_DIR / name).read_bytes())
    return build_once(
        cache_root() / "merged" / f"{ckpt.resolve().name}-{digest.hexdigest()[:12]}",
        lambda out: write_merged(ckpt, out),
        what=f"the LoRA checkpoint {ckpt} merged into its base",
        expected="seconds for a small model, about a minute per billion parameters",
        log=log,
    )
