"""`agentree train --dry-run`: the resolved config, where each rank and the engine run, and a
per-rank memory estimate computed from the model's architecture without loading weights.

The parameter count comes from instantiating the architecture on the meta device (no memory,
no weights). The architecture is that of the policy `policy.path` starts from
(`agentree.policy.base_policy`: `tiny-warm` is the tiny policy fine-tuned, so its settings):
the tiny policy's settings, a local checkpoint's `config.json` (a named checkpoint such as
`smollm2-135m` once fetched), or a built-in table of the models the shipped recipes use when
the path is a hub id or a named checkpoint not fetched yet (nothing is downloaded or built).

Per rank, with P parameters, T trainable ones (T = P, or the LoRA A/B matrices), W ranks:
  weights      4P/W bytes under FSDP (fp32 master shards), 4P unsharded; with LoRA and bf16
               the frozen base is 2 bytes a parameter
  gathered     the largest FSDP unit (a decoder layer) unsharded in the compute dtype, twice
               (the one computing plus the one prefetched)
  gradients    4T/W      optimiser (AdamW m and v)   8T/W
  activations  one micro-batch of N tokens (N = micro_batch_size * engine.max_context, the
               worst case): see `activation_bytes`
The engines are listed apart (`engines`): the transformers engine of a local run samples from
rank 0's own weights; a vLLM engine, an engine replica or a rollout worker's engine on Ray holds
a copy of the weights in the policy's dtype, and vLLM adds its KV cache on top.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentree.config import ExperimentConfig
from agentree.distributed.cluster import engine_replicas
from agentree.hub.adapters import adapter_base, is_adapter_checkpoint
from agentree.hub.pretrained import cached_path, find_pretrained, kv_shape
from agentree.policy import base_policy, resolve_backend

KNOWN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": {
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
        "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-0.5B-Instruct": {
        "model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
        "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "Qwen/Qwen3-4B": {
        "model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 9728,
        "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "Qwen/Qwen3-8B": {
        "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 12288,
        "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
    },
}  # fmt: skip
"""Architectures (from the models' published config.json) for estimates without a download."""
KNOWN_ARCHITECTURES["Qwen/Qwen2.5-0.5B"] = KNOWN_ARCHITECTURES["Qwen/Qwen2.5-0.5B-Instruct"]

GIB = 1024**3


def model_config(cfg: ExperimentConfig) -> tuple[Any, str]:
    """(transformers config, where it came from) for the policy, without weights."""
    # deferred: transformers takes seconds to import; the CLI imports this module at start
    from transformers import AutoConfig, Qwen2Config

    path = base_policy(cfg)
    if is_adapter_checkpoint(Path(path).expanduser()):
        path = adapter_base(Path(path).expanduser())  # a LoRA run's checkpoint: its base's
    if path == "tiny":
        t = cfg.policy.tiny
        conf = Qwen2Config(
            vocab_size=t.vocab_size, hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size, num_hidden_layers=t.num_layers,
            num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
            tie_word_embeddings=True,
        )  # fmt: skip
        return conf, "policy.tiny settings (vocab_size is an upper bound)"
    if (Path(path) / "config.json").exists():
        return AutoConfig.from_pretrained(path), f"{path}/config.json"
    spec = find_pretrained(path)
    if spec is not None:
        found = cached_path(spec)
        if found is not None:
            return AutoConfig.from_pretrained(found), f"{found}/config.json"
        path = spec.hub_id
    if path in KNOWN_ARCHITECTURES:
        d = dict(KNOWN_ARCHITECTURES[path])
        return AutoConfig.for_model(d.pop("model_type"), **d), (
            f"built-in architecture table for {path} (hub id; weights not needed or downloaded)"
        )
    raise ValueError(
        f"cannot estimate memory for {path!r}: it is neither a local checkpoint nor one of "
        f"{', '.join(sorted(KNOWN_ARCHITECTURES))}; pass a directory holding its config.json"
    )


def count_parameters(conf: Any, target_modules: list[str], r: int) -> dict[str, int]:
    """Parameters of the architecture (meta device: nothing allocated) and of LoRA rank r."""
    # deferred: torch and transformers take seconds to import; the CLI imports this module at start
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    total = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    layer = max(
        (m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")),
        key=lambda m: sum(p.numel() for p in m.parameters()),
    )
    lora = 0
    if r:
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and name.rpartition(".")[2] in target_modules:
                lora += r * (m.in_features + m.out_features)
    return {"total": total, "layer": sum(p.numel() for p in layer.parameters()), "lora": lora}


def activation_bytes(
    conf: Any, tokens: int, checkpointing: bool, act_bytes: int, logits_chunk: int = 0
) -> int:
    """Activations kept for backward in one micro-batch of `tokens` tokens.

    A decoder layer keeps about (10h + 2*kv + 3i) values per token (norm inputs and outputs,
    q/k/v, attention output, o_proj input, gate/up/act outputs) with a fused attention kernel;
    with checkpointing only each layer's input (h per token) is kept, plus one layer's
    activations while it is recomputed. The logits and their log-softmax are fp32, for all
    tokens at once or, with `train.logits_chunk`, for one slice of that many tokens.
    """
    h, i = conf.hidden_size, conf.intermediate_size
    kv_heads, head_dim = kv_shape(conf)
    kv = kv_heads * head_dim
    per_layer = (10 * h + 2 * kv + 3 * i) * tokens * act_bytes
    layers = conf.num_hidden_layers
    body = (h * tokens * act_bytes * layers + per_layer) if checkpointing else per_layer * layers
    return body + 8 * min(tokens, logits_chunk or tokens) * conf.vocab_size


def estimate(cfg: ExperimentConfig) -> dict[str, Any]:
    tc = cfg.train
    conf, source = model_config(cfg)
    n = count_parameters(conf, list(tc.lora.target_modules), tc.lora.r)
    w = tc.world_size if tc.fsdp else 1
    trainable = n["lora"] if tc.lora.r else n["total"]
    compute = 2 if tc.dtype == "bf16" else 4
    tokens = tc.micro_batch_size * cfg.engine.max_context
    per_rank = {
        "weights": 4 * n["total"] / w,
        "gathered layers": (2 * compute * n["layer"]) if tc.fsdp and w > 1 else 0,
        "gradients": 4 * trainable / w,
        "optimizer": 8 * trainable / w,
        "activations": activation_bytes(
            conf, tokens, tc.gradient_checkpointing, compute, tc.logits_chunk
        ),
    }
    if tc.lora.r:  # a bf16 frozen base has no fp32 master copy; adapters stay fp32
        per_rank["weights"] = compute * n["total"] / w + 4 * n["lora"] / w
    if tc.kl_coef > 0 and not tc.lora.r:
        per_rank["reference"] = 4 * n["total"] / w
    return {
        "source": source,
        "config": conf,
        "params": n,
        "tokens": tokens,
        "per_rank": per_rank,
        "per_rank_total": sum(per_rank.values()),
    }


def engines(cfg: ExperimentConfig) -> tuple[str, str, int]:
    """(backend, where the engines run, how many of them hold a copy of the weights), as the
    run places them: locally one engine on rank 0, which with the transformers backend samples
    from the weights the trainer updates; on Ray `distributed.engine_replicas` replicas, or an
    engine in each rollout worker (`auto` on a cluster with GPUs: one replica where
    `distributed.engine_gpus` reserves a GPU for it)."""
    backend = resolve_backend(cfg.engine.backend)
    dc = cfg.distributed
    if dc.backend != "ray":
        return backend, "rank 0", 0 if backend == "transformers" else 1
    replicas = engine_replicas(dc, cluster_gpus=dc.engine_gpus)
    if replicas:
        return backend, f"{replicas} engine replica{'s' if replicas > 1 else ''}", replicas
    workers = dc.rollout_workers
    return backend, f"each of the {workers} rollout worker{'s' if workers > 1 else ''}", workers


def kv_bytes_per_token(conf: Any, width: int) -> int:
    """One token's keys and values over every layer, at `width` bytes a value."""
    kv_heads, head_dim = kv_shape(conf)
    return 2 * conf.num_hidden_layers * kv_heads * head_dim * width


def engine_memory(cfg: ExperimentConfig, conf: Any, params: int) -> str:
    """The engines' memory beside the training ranks': their copies of the weights (none for
    a local transformers engine) and the KV cache each keeps (the transformers engine's, in
    tokens of this model's KV: it should hold the histories a rollout keeps live)."""
    backend, where, copies = engines(cfg)
    dtype = cfg.policy.dtype
    width = 4 if dtype in ("float32", "fp32") else 2
    if not copies:  # the trainer's weights, in the trainer's dtype
        width = 2 if cfg.train.dtype == "bf16" else 4
    mb, per = cfg.engine.prefix_cache_mb, kv_bytes_per_token(conf, width)
    kv = (
        "vLLM adds its KV cache (engine.vllm.gpu_memory_utilization)"
        if backend == "vllm"
        else f"cached prefix KV up to engine.prefix_cache_mb ({mb} MiB: "
        f"{mb * 2**20 // per:,} tokens of {per / 1024:.1f} KiB)"
    )
    if not copies:
        return f"  engine on {where}: samples from the trainer's weights (no copy); {kv}"
    shown = "auto, bf16 on a GPU" if dtype == "auto" else dtype
    own = "its own copy" if copies == 1 else "each its own copy"
    return f"  engine weights ({shown}): {width * params / GIB:.2f} GiB on {where}, {own}; {kv}"


def placement(cfg: ExperimentConfig) -> list[str]:
    # deferred: torch takes seconds to import; the CLI imports this module at start
    import torch

    tc = cfg.train
    cuda = torch.cuda.is_available() and cfg.policy.device != "cpu"
    lines = []
    for r in range(tc.world_size):
        dev = f"cuda:{r}" if cuda else "cpu"
        local = r == 0 and cfg.distributed.backend != "ray"
        role = " + rollout (engine, envs, controller, scorer)" if local else ""
        lines.append(f"  rank {r}: {dev}, trains its 1/{tc.world_size} of the batch{role}")
    backend = "nccl" if cuda else "gloo"
    launch = "torch multiprocessing (or torchrun)" if tc.world_size > 1 else "this process"
    if tc.world_size > 1 and cfg.distributed.backend == "ray":
        launch = "Ray actors, one per rank (or torchrun)"
    mode = "FSDP2" if tc.fsdp else "unsharded"
    lines.append(f"  process group: {backend}, {mode}, launched by {launch}")
    if cfg.distributed.backend == "ray":
        n = cfg.distributed.rollout_workers
        lines.append(f"  rollout: {n} Ray rollout worker{'s' if n > 1 else ''} (envs, controllers)")
    backend, where, _copies = engines(cfg)
    if where == "rank 0":
        where = f"rank 0 ({'cuda:0' if cuda else 'cpu'})"
    lines.append(
        f"  engine: {backend} on {where}, weights synced from the trainer after every update"
    )
    if not cuda:
        lines.append("  (no GPU visible here: the same config places rank r on cuda:r)")
    return lines


def dry_run(cfg: ExperimentConfig) -> str:
    """Text report: config, placement, memory estimate. Loads no weights."""
    tc = cfg.train
    est = estimate(cfg)
    n = est["params"]
    out = ["# resolved config", cfg.to_yaml().rstrip(), "", "# placement", *placement(cfg)]
    lora = f"LoRA r={tc.lora.r}: {n['lora'] / 1e6:.3f}M trainable" if tc.lora.r else "full"
    out += [
        "",
        "# memory estimate per training rank (weights not loaded)",
        f"  architecture: {est['source']}",
        f"  parameters: {n['total'] / 1e6:.2f}M ({lora}); largest layer {n['layer'] / 1e6:.2f}M",
        f"  dtype {tc.dtype}, gradient checkpointing {tc.gradient_checkpointing}, "
        f"micro-batch {est['tokens']} tokens (micro_batch_size x engine.max_context: every "
        "sequence at full context, rarely reached)",
    ]
    out += [f"  {k:<16} {v / GIB:10.3f} GiB" for k, v in est["per_rank"].items()]
    out.append(f"  {'total':<16} {est['per_rank_total'] / GIB:10.3f} GiB")
    out.append(engine_memory(cfg, est["config"], n["total"]))
    return "\n".join(out)
