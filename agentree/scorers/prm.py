"""Skywork-style process reward model as a branch scorer (PATR §4.2 "Pretrained PRM", Eq. 7).

Model: a Qwen2 causal LM whose last hidden state (after the final norm) feeds a value head
`v_head.summary = Linear(hidden, 1)`; the step reward is sigmoid(value) read at each step
separator. Checkpoint layout as released (Skywork-o1-Open-PRM-Qwen-2.5-*): the LM weights
and `v_head.summary.{weight,bias}` in the same safetensors (or .bin) files, single or sharded.
The LM is loaded without its vocabulary head (only hidden states are needed) and the value
head is read from the weight files directly, in float32 as the reference upcasts to it.

Input, exactly as Skywork's `prepare_input`: `encode(bos + problem + "\\n")`, then for each step
`encode(step) + [id of "\\n"]`, steps tokenized separately; a reward is read at every separator.
A branch becomes problem = the task prompt (root observation) and one step per recent turn
(paper: the last 10), `Step i: Action: ... | Observation: ... | Reward: r` on one line (newlines
inside are written as a literal backslash-n, so each turn is exactly one PRM step). Branch
score = last step's reward (paper), or mean / max / min / a last-mean blend.

Truncation to `max_length` (the released model has a 4k context): the problem keeps its first
`max_problem_tokens` tokens, then steps are added newest first while they fit; a newest step
that alone does not fit keeps its head and tail. What the model saw is decoded into
`Score.info["input"]`.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from safetensors import safe_open

from agentree.envs.base import Task
from agentree.prompts import render
from agentree.scorers.base import NodePath, Score, Scorer, ScorerConfig
from agentree.scorers.trajectory import clip_middle, one_line
from agentree.tools import readable_action

PAPER_PRM = "Skywork/Skywork-o1-Open-PRM-Qwen-2.5-7B"
V_HEAD_KEYS = ("v_head.summary.weight", "v_head.summary.bias")


class PRMConfig(ScorerConfig):
    """Settings of the PRM scorer (defaults: PATR appendix A)."""

    model: str = PAPER_PRM
    """Checkpoint directory, hub id, or `tiny` (a random tiny PRM built locally, for tests)."""
    steps: int = Field(10, ge=1)
    """Most recent interaction steps serialised for the PRM (paper: 10)."""
    aggregate: Literal["last", "mean", "max", "min", "weighted"] = "last"
    """f_agg of Eq. 7: last step's reward (paper), mean, max, min, or weighted last/mean."""
    last_weight: float = Field(0.5, ge=0.0, le=1.0)
    """For `weighted`: w * last + (1 - w) * mean."""
    max_length: int = Field(4096, ge=16)
    """Token budget of one input (the released Skywork PRMs: 4k)."""
    max_problem_tokens: int = Field(1536, ge=4)
    """Most tokens of the task prompt kept (its head), leaving the rest for recent steps."""
    max_action_chars: int = Field(1200, ge=16)
    """Each action is cut to this many characters (middle elided) before tokenizing."""
    max_observation_chars: int = Field(2000, ge=16)
    """Each observation is cut to this many characters (middle elided) before tokenizing."""
    batch_size: int = Field(8, ge=1)
    """Most branches per forward pass (sorted by length, right-padded)."""
    max_batch_tokens: int = Field(16384, ge=1)
    """Most padded tokens per forward pass (long inputs run in smaller batches)."""
    device: str = "auto"
    """auto (cuda when available), cpu, cuda, cuda:1, ..."""
    dtype: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16."""
    record_input: bool = True
    """Store the decoded model input in Score.info (large, but shows what was scored)."""
    backend: Literal["transformers", "vllm"] = "transformers"
    """transformers, or vllm (the Skywork architecture as a vLLM pooling model; docs/vllm.md)."""
    vllm: dict[str, Any] = Field(default_factory=dict)
    """With backend vllm: extra keyword arguments for vllm.LLM (e.g. gpu_memory_utilization)."""


class PRMScorer(Scorer):
    """Scores branches with a Skywork-layout PRM; see the module docstring."""

    name = "prm"
    Config = PRMConfig
    holds_model = True
    config: PRMConfig

    def __init__(self, config: PRMConfig | None = None) -> None:
        super().__init__(config)
        if self.config.backend == "vllm":
            # deferred: transformers takes seconds to import and prm_vllm imports vllm (the
            # optional [vllm] extra); validating a config that names this scorer imports it
            from transformers import AutoTokenizer

            from agentree.scorers.prm_vllm import VLLMPRM

            local = str(resolve_prm_path(self.config.model))
            self.tokenizer = AutoTokenizer.from_pretrained(local)
            self.model = VLLMPRM(local, dtype=self.config.dtype, **self.config.vllm)
            self.v_head = None  # inside the vLLM model
        else:
            self.model, self.v_head, self.tokenizer = load_prm(
                self.config.model, dtype=self.config.dtype, device=self.config.device
            )
        tok = self.tokenizer
        if tok.bos_token is None:
            raise ValueError(f"PRM tokenizer of {self.config.model!r} has no bos_token")
        self.separator_id: int = tok.encode("\n", add_special_tokens=False)[-1]
        self.pad_id: int = tok.pad_token_id if tok.pad_token_id is not None else 0
        # never feed more positions than the model has, whatever max_length says
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = min(self.config.max_length, positions or self.config.max_length)

    # -- input ---------------------------------------------------------------------------------
    def step_texts(self, branch: NodePath) -> list[str]:
        """One single-line text per interaction step (every node after the root)."""
        cfg = self.config
        out = []
        for i, node in enumerate(branch[1:], start=1):
            text = render(
                "prm/step.txt",
                index=i,
                action=one_line(
                    clip_middle(
                        readable_action(node.action, node.info).strip(), cfg.max_action_chars
                    )
                ),
                observation=one_line(
                    clip_middle((node.observation or "").strip(), cfg.max_observation_chars)
                ),
                reward=f"{node.reward + 0.0:g}",  # no "-0"
            )
            out.append(text.strip())
        return out

    def encode(self, problem: str, steps: Sequence[str]) -> tuple[list[int], list[int], dict]:
        """(input ids, separator positions, truncation info) for `problem` and `steps`."""
        cfg, tok = self.config, self.tokenizer
        prompt = tok.encode(tok.bos_token + problem + "\n", add_special_tokens=False)
        info: dict[str, Any] = {"problem_tokens": len(prompt), "truncated_problem": False}
        limit = min(cfg.max_problem_tokens, self.max_length - 2)
        if len(prompt) > limit:
            prompt = [*prompt[: limit - 1], self.separator_id]
            info["truncated_problem"] = True
        step_ids = [tok.encode(s, add_special_tokens=False) for s in steps[-cfg.steps :]]
        budget = self.max_length - len(prompt)
        kept: list[list[int]] = []
        for ids in reversed(step_ids):
            if len(ids) + 1 > budget:
                if not kept:  # the newest step alone is too long: keep its head and tail
                    head = (budget - 1) // 2
                    kept.append(ids[:head] + ids[len(ids) - (budget - 1 - head) :])
                    info["clipped_step"] = True
                break
            kept.append(ids)
            budget -= len(ids) + 1
        kept.reverse()
        info["steps_total"] = len(steps)
        info["steps_seen"] = len(kept)
        input_ids, flags = list(prompt), []
        for ids in kept:
            input_ids += [*ids, self.separator_id]
            flags.append(len(input_ids) - 1)
        return input_ids, flags, info

    # -- scoring -------------------------------------------------------------------------------
    def score(self, task: Task, branches: Sequence[NodePath]) -> list[Score]:
        encoded = []
        for b in branches:
            steps = self.step_texts(b)
            encoded.append(self.encode(b[0].observation or "", steps))
        rewards = self.step_rewards([(ids, flags) for ids, flags, _ in encoded])
        out = []
        for (ids, _, info), r in zip(encoded, rewards, strict=True):
            if not r:
                out.append(Score(None, {"error": "no steps to score", **info}))
                continue
            info.update(step_scores=[round(x, 6) for x in r], aggregate=self.config.aggregate)
            info["tokens"] = len(ids)
            if self.config.record_input:
                info["input"] = self.tokenizer.decode(ids)
            out.append(Score(self.aggregate(r), info))
        return out

    def aggregate(self, rewards: Sequence[float]) -> float:
        """f_agg of Eq. 7 over one branch's step rewards."""
        mean = sum(rewards) / len(rewards)
        match self.config.aggregate:
            case "last":
                return rewards[-1]
            case "mean":
                return mean
            case "max":
                return max(rewards)
            case "min":
                return min(rewards)
            case _:
                w = self.config.last_weight
                return w * rewards[-1] + (1 - w) * mean

    def step_rewards(self, inputs: Sequence[tuple[list[int], list[int]]]) -> list[list[float]]:
        """sigmoid(v_head(h)) at the flagged positions of each input, batched by length."""
        # deferred: torch takes seconds to import; validating a config that names this scorer
        # imports this module
        import torch

        if self.v_head is None:  # vLLM: it batches and schedules the inputs itself
            out: list[list[float]] = [[] for _ in inputs]
            rows = [i for i in range(len(inputs)) if inputs[i][1]]
            probs = self.model.token_probs([inputs[i][0] for i in rows])
            for i, p in zip(rows, probs, strict=True):
                out[i] = [float(p[k]) for k in inputs[i][1]]
            return out
        with torch.no_grad():
            return [
                torch.sigmoid(self.v_head(h).squeeze(-1)).cpu().tolist()
                for h in self.step_features(inputs)
            ]

    def step_features(self, inputs: Sequence[tuple[list[int], list[int]]]) -> list[Any]:
        """The base model's last hidden state (fp32, [flags, hidden]) at the flagged positions
        of each input, batched by length: what the value head reads (transformers backend)."""
        # deferred: torch takes seconds to import (see step_rewards)
        import torch

        device = self.v_head.weight.device
        out: list[Any] = [torch.zeros(0, self.v_head.in_features, device=device) for _ in inputs]
        for rows in self._batches([i for i in range(len(inputs)) if inputs[i][1]], inputs):
            width = max(len(inputs[i][0]) for i in rows)
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                seq = inputs[i][0]
                ids[r, : len(seq)] = torch.tensor(seq)
                mask[r, : len(seq)] = 1  # right padding: real tokens keep positions 0..n-1
            with torch.no_grad():
                hidden = self.model(
                    input_ids=ids.to(device), attention_mask=mask.to(device)
                ).last_hidden_state.float()
            for r, i in enumerate(rows):
                out[i] = hidden[r, inputs[i][1]]
        return out

    def _batches(self, rows: list[int], inputs: Sequence[tuple[list[int], list[int]]]):
        """Rows grouped shortest first, within `batch_size` and `max_batch_tokens` (padded)."""
        cfg = self.config
        batch: list[int] = []
        for i in sorted(rows, key=lambda i: len(inputs[i][0])):
            # sorted, so row i is the widest so far: the padded size is (rows + 1) * len(i)
            if batch and (
                len(batch) == cfg.batch_size
                or (len(batch) + 1) * len(inputs[i][0]) > cfg.max_batch_tokens
            ):
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def close(self) -> None:
        if self.config.backend == "vllm" and self.model is not None:
            self.model.close()
        self.model = self.v_head = None  # type: ignore[assignment]


# -- loading -----------------------------------------------------------------------------------
def load_prm(path: str, *, dtype: str = "auto", device: str = "auto") -> tuple[Any, Any, Any]:
    """(base LM without vocab head, value head Linear(hidden, 1) in fp32, tokenizer)."""
    # deferred: torch, transformers and agentree.engines.hf (torch) take seconds to import (see
    # step_rewards)
    import torch
    from transformers import AutoModel, AutoTokenizer

    from agentree.hub.load import resolve_device_dtype

    local = resolve_prm_path(path)
    device, torch_dtype = resolve_device_dtype(device, dtype)
    tokenizer = AutoTokenizer.from_pretrained(local)
    with _quiet("transformers.modeling_utils", "transformers.distributed.tensor_parallel"):
        # The checkpoint also holds lm_head and v_head weights the base model does not use.
        model, loading = AutoModel.from_pretrained(
            local, dtype=torch_dtype, output_loading_info=True
        )
    if loading.get("missing_keys"):
        raise ValueError(
            f"PRM checkpoint {path!r} lacks weights of its base model: "
            f"{sorted(loading['missing_keys'])[:5]}"
        )
    weight, bias = read_value_head(local)
    head = torch.nn.Linear(weight.shape[-1], 1, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(weight.reshape(1, -1).float())
        head.bias.copy_(bias.reshape(1).float())
    model.to(device).eval()
    return model, head.to(device).eval(), tokenizer


def resolve_prm_path(path: str) -> Path:
    """A local directory for `path`: as given, the tiny PRM, or a hub snapshot."""
    if path == "tiny":
        # deferred: agentree.hub.tiny_prm imports torch (see step_rewards)
        from agentree.hub.tiny_prm import build_tiny_prm

        return build_tiny_prm()
    if Path(path).is_dir():
        return Path(path)
    try:
        # deferred: huggingface_hub takes ~0.5 s to import (see step_rewards)
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path))
    except Exception as e:
        raise ValueError(
            f"cannot load PRM {path!r}: not a local directory and the hub download failed "
            f"({type(e).__name__}); pass scorer.model=<checkpoint dir> or scorer.model=tiny"
        ) from None


def read_value_head(path: Path) -> tuple[Any, Any]:
    """`v_head.summary.weight` and `.bias` from the checkpoint's weight files."""
    # deferred: torch takes seconds to import (see step_rewards)
    import torch

    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [path / weight_map[k] for k in V_HEAD_KEYS if k in weight_map] or files
            break
    found: dict[str, Any] = {}
    for f in dict.fromkeys(files):
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as sf:
                names = set(sf.keys())  # safe_open has no `in`
                found.update({k: sf.get_tensor(k) for k in V_HEAD_KEYS if k in names})
        else:
            state = torch.load(f, map_location="cpu", weights_only=True)
            found.update({k: state[k] for k in V_HEAD_KEYS if k in state})
        if len(found) == len(V_HEAD_KEYS):
            return found[V_HEAD_KEYS[0]], found[V_HEAD_KEYS[1]]
    raise ValueError(
        f"{path} has no value head ({', '.join(V_HEAD_KEYS)}); a Skywork-layout PRM stores it "
        "next to the LM weights"
    )


@contextmanager
def _quiet(*names: str):
    """Silence transformers' load chatter about weights the base model does not use."""
    logs = [logging.getLogger(n) for n in names]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))
