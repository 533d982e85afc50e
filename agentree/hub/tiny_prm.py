"""A tiny process reward model in the Skywork-o1-Open-PRM checkpoint layout, built locally.

Same layout as the released Skywork PRMs, so the PRM scorer loads it through the very code path
a real checkpoint takes: a Qwen2 causal LM saved with `save_pretrained` (`config.json` with
`architectures: ["Qwen2ForPrmModel"]`, `model.safetensors`), the value head stored in the same
safetensors file under `v_head.summary.weight` [1, hidden] and `v_head.summary.bias` [1], and a
Qwen2 tokenizer whose BOS is `<|im_start|>`, EOS `<|im_end|>` and pad `<|endoftext|>` (as in
Skywork's `special_tokens_map.json`). Weights are random: the scores mean nothing, the maths and
the plumbing are real. Nothing is downloaded; builds are cached by content hash.
`write_value_head` stores a value head in that layout (`agentree models prm` uses it too).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from agentree.hub.store import build_once, cache_root, content_key
from agentree.hub.tiny import TinyModelConfig, _random_model, train_tokenizer

# Every UTF-8 lead/continuation byte appears in this alphabet, so the byte-level tokenizer can
# encode any text (a tokenizer trained on a small corpus would otherwise drop unseen bytes).
_ALPHABET = (
    "".join(chr(c) for c in range(1, 0x80))
    + "".join(chr(c) for c in [*range(0x80, 0xC0), *range(0xC0, 0x800, 0x40)])
    + "".join(chr(max(k * 0x1000, 0x800) + 0x41) for k in range(16))
    + "".join(chr(max(k * 0x40000, 0x10000) + 0x41) for k in range(5))
)
_CORPUS = [
    "Step 1: run the tests. Action: grep -rn def src/ Observation: <returncode>0</returncode>",
    'Traceback (most recent call last): File "/testbed/pkg/mod.py", line 3, in f ValueError',
    "sed -i 's/old/new/' pkg/mod.py && python -m pytest tests/test_mod.py -q ===== 3 passed",
    "P__G\n_O__\n____\nAction: ```Up``` Observation: reward 0.0",
]


def build_tiny_prm(
    out_dir: Path | str | None = None,
    cfg: TinyModelConfig | None = None,
    corpus: list[str] | None = None,
) -> Path:
    """Build (or reuse) a tiny Skywork-layout PRM and return its directory.

    With `out_dir=None` it is cached under `$AGENTREE_CACHE/tiny-prm/<hash>`.
    """
    cfg = cfg or TinyModelConfig(
        vocab_size=512,
        min_frequency=2,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
    )
    texts = [*(corpus or _CORPUS), _ALPHABET]
    key = content_key({"corpus": texts, "cfg": cfg.model_dump(), "v": 1})
    target = Path(out_dir) if out_dir is not None else cache_root() / "tiny-prm" / key
    return build_once(
        target, lambda tmp: _write_prm(tmp, texts, cfg), what="tiny PRM", expected="seconds"
    )


def _write_prm(path: Path, texts: list[str], cfg: TinyModelConfig) -> None:
    tokenizer = train_tokenizer(texts, cfg)
    tokenizer.bos_token = "<|im_start|>"
    tokenizer.save_pretrained(path)
    model = _random_model(tokenizer, cfg)
    model.config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen2ForPrmModel"]  # what the released config.json says
    (path / "config.json").write_text(json.dumps(config, indent=2))
    # The value head: Linear(hidden, 1) as in Skywork's ValueHead, its weights next to the
    # LM's in model.safetensors under the keys the released checkpoint uses.
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed + 1)
        head = torch.nn.Linear(cfg.hidden_size, 1)
        torch.nn.init.normal_(head.weight, std=0.5)
        torch.nn.init.normal_(head.bias, std=0.1)
    write_value_head(path, head.weight.detach(), head.bias.detach())


def write_value_head(path: Path, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """Store `v_head.summary.{weight,bias}` beside the LM's weights, as Skywork's checkpoints
    do: inside `model.safetensors`, or in a file of its own listed in a sharded index."""
    head = {
        "v_head.summary.weight": weight.detach().float().reshape(1, -1).contiguous(),
        "v_head.summary.bias": bias.detach().float().reshape(1).contiguous(),
    }
    index = path / "model.safetensors.index.json"
    if index.exists():
        save_file(head, path / "v_head.safetensors", metadata={"format": "pt"})
        data = json.loads(index.read_text())
        data["weight_map"].update({k: "v_head.safetensors" for k in head})
        index.write_text(json.dumps(data, indent=2))
        return
    single = path / "model.safetensors"
    weights = load_file(single)
    weights.update(head)
    tmp = single.with_suffix(".tmp")
    save_file(weights, tmp, metadata={"format": "pt"})
    shutil.move(tmp, single)
