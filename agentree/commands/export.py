"""`agentree export RUN_DIR --output DIR`: the latest checkpoint of a run as a plain Hugging Face
checkpoint (LoRA adapters merged into the base weights), loadable by `--policy DIR` and vLLM.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from agentree.hub.store import policy_record, write_policy_record
from agentree.learner.lora import ADAPTER_DIR
from agentree.run.checkpoint import latest_checkpoint


def export(run_or_ckpt: str | Path, output: str | Path) -> Path:
    """Write the merged model and tokenizer of a run's latest checkpoint (or of a checkpoint
    directory) to `output`; return `output`."""
    # deferred: torch and transformers take seconds to import; the CLI imports this module at start
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(run_or_ckpt)
    ckpt = src if (src / "trainer_state.pt").exists() else latest_checkpoint(src)
    if ckpt is None or not ckpt.exists():
        raise ValueError(f"{src} holds no checkpoint: pass a run directory or a checkpoint")
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; choose a new --output directory")
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    adapter = ckpt / ADAPTER_DIR
    if adapter.is_dir():
        # deferred: peft is the optional [train] extra
        from peft import PeftConfig, PeftModel

        base = PeftConfig.from_pretrained(adapter).base_model_name_or_path
        model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(ckpt)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    record = policy_record(ckpt)
    if record:
        write_policy_record(tmp, record["tool_format"], record.get("action_format"))
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def add_export_command(sub: Any) -> None:
    p = sub.add_parser("export", help="write a run's latest checkpoint as a merged HF model")
    p.add_argument("run_dir", help="run directory (or one checkpoint directory)")
    p.add_argument("--output", required=True, help="directory for the merged checkpoint")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    out = export(args.run_dir, args.output)
    print(f"merged checkpoint -> {out} (load it with --policy {out})")
    return 0
