"""Tiny policies built locally: a BPE tokenizer trained on an env's own text plus a small
Qwen2-architecture model with random weights, saved with `save_pretrained` and loaded back
through the same `from_pretrained` path a real checkpoint takes. Nothing is downloaded.

The tokenizer is a real Qwen2 tokenizer (byte-level BPE with Qwen2's pre-tokenizer; transformers
loads every Qwen2 checkpoint through `Qwen2Tokenizer`), trained on the env's own text with a
small merge budget. It is deliberately small, and the env's well-formed actions (e.g. ```Up```)
are added as single tokens: an untrained model samples roughly uniformly over the vocabulary,
so this gives RL a usable signal from the first step. Builds are cached by content hash.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from agentree.envs.base import Env, env_class, validate_env_kwargs
from agentree.hub.store import Log, build_once, cache_root, content_key, to_stderr
from agentree.prompts import render
from agentree.tools import example_calls, tool_schemas, written_format

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML without the system message. A model trained from scratch gains nothing from
# instructions, and they can cost it the task: FrozenLake's instructions name the map's symbols
# (P, G, O, _) with the map's own tokens. Fine-tuned on the BFS expert's first moves, 32 a step
# (`benchmarks/warm_probe.py --demos 8000 --first-turn --max-steps 300`), the 2-layer policy's
# first-move accuracy on held-out 4x4 maps stayed at chance (31%) for 300 steps with the
# instructions in the prompt, and reached 69% by step 100 and 74% by step 200 without them.
# Being in the template, the choice travels with every checkpoint fine-tuned from a tiny policy.
CHATML_TEMPLATE = (
    "{% for message in messages if message['role'] != 'system' %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TinyModelConfig(BaseModel):
    """Shape of a locally built tiny policy."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(96, ge=16)
    """Upper bound on the trained vocabulary (specials + byte symbols seen + merges)."""
    min_frequency: int = Field(8, ge=1)
    """A pair must occur this often in the corpus to become a merged token."""
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 4
    """Key/value heads (fewer than num_heads gives Qwen2's grouped-query attention; equal
    avoids the key/value repeat that costs time on CPU at this size)."""
    intermediate_size: int = 512
    """MLP width."""
    max_position_embeddings: int = 4096
    """Context length the model accepts."""
    corpus_tasks: int = 64
    """Tasks the env renders to build the tokenizer corpus."""
    seed: int = 0
    """Seed for the random weights."""


def build_tiny_policy(
    corpus: Sequence[str],
    cfg: TinyModelConfig,
    atomic: Sequence[str] = (),
    out_dir: Path | None = None,
    *,
    what: str = "tiny policy",
    log: Log | None = to_stderr,
) -> Path:
    """Train the tokenizer on `corpus`, create the model, save both; return the directory.

    Strings in `atomic` become single (non-special) tokens.
    With `out_dir=None` the result is cached under `$AGENTREE_CACHE/tiny/<hash>` and reused.
    """
    key = content_key(
        {"corpus": list(corpus), "atomic": list(atomic), "cfg": cfg.model_dump(), "v": 3}
    )
    target = out_dir or cache_root() / "tiny" / key

    def write(tmp: Path) -> None:
        tokenizer = train_tokenizer(corpus, cfg, atomic)
        tokenizer.save_pretrained(tmp)
        _random_model(tokenizer, cfg).save_pretrained(tmp)
        (tmp / "agentree_tiny.json").write_text(json.dumps(cfg.model_dump(), indent=1))

    return build_once(target, write, what=what, expected="a few seconds", log=log)


def train_tokenizer(corpus: Sequence[str], cfg: TinyModelConfig, atomic: Sequence[str] = ()):
    """Byte-level BPE trained with Qwen2's normaliser and pre-tokenizer, as a Qwen2Tokenizer."""
    # deferred: transformers takes seconds to import (tokenizers is kept with it); config,
    # which the CLI imports at start, imports this module
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    # Keep newlines as tokens of their own: a line-structured observation (a grid) then always
    # tokenizes to the same layout, so each cell sits at a fixed offset a small model can find.
    merges = [m if isinstance(m, list) else m.split(" ") for m in model["merges"]]
    merges = [m for m in merges if "\u010a" not in "".join(m) or set("".join(m)) == {"\u010a"}]
    produced = {"".join(m) for m in merges}
    model["vocab"] = {
        t: i
        for t, i in model["vocab"].items()
        if len(t) == 1 or t in produced or t in SPECIAL_TOKENS
    }
    model["vocab"] = {t: i for i, t in enumerate(sorted(model["vocab"], key=model["vocab"].get))}
    qwen = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(m) for m in merges],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=cfg.max_position_embeddings,
    )
    qwen.add_tokens([AddedToken(a, special=False, normalized=False) for a in atomic])
    qwen.chat_template = CHATML_TEMPLATE
    return qwen


def _random_model(tokenizer, cfg: TinyModelConfig):
    # deferred: torch and transformers take seconds to import (see train_tokenizer)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        return Qwen2ForCausalLM(config)


def tiny_policy_for_env(
    env_name: str,
    env_kwargs: dict,
    cfg: TinyModelConfig,
    log: Log | None = to_stderr,
    tool_format: str = "text",
) -> Path:
    """Build (or reuse) the tiny policy whose tokenizer is trained on `env_name`'s text, and
    where the env has tools on its calls as `tool_format` (`policy.tool_format`) writes them."""
    cls = env_class(env_name)
    env = cls(**validate_env_kwargs(cls, env_kwargs))
    try:
        try:
            tasks = cls.generate_tasks(cfg.corpus_tasks, seed=0, split="train")
        except ValueError:  # a finite source smaller than the corpus size: take all of it
            tasks = cls.load_tasks(None, seed=0, split="train")
        # the chat template's role names open every turn the policy sees
        corpus = env.corpus(tasks) + ["system\nuser\nassistant\n"] * len(tasks)
        corpus += written_calls(env, tool_format)
        atomic = [
            a for a in env.example_actions() if len(a) <= 24 and not any(c.isspace() for c in a)
        ]
    finally:
        env.close()
    return build_tiny_policy(corpus, cfg, atomic, what=f"tiny policy for {env_name}", log=log)


def written_calls(env: Env, tool_format: str) -> list[str]:
    """What a tokenizer must cover of the calls in `tool_format` beyond an env's own corpus,
    which holds them as Hermes writes them: the format's generic rendering of the env's tools
    and its example calls written in the format (none without tools or for Hermes, so a build
    keeps its key). A character no text holds is not in a tiny tokenizer at all: the `=` of
    `<function=move>` would be lost."""
    fmt = written_format(tool_format)
    tools = tool_schemas(env.tools())
    if not tools or fmt.name == "hermes":
        return []
    assert fmt.generic_prompt is not None  # a format that writes calls teaches itself
    listing = "\n".join(json.dumps(t) for t in tools)
    calls = [fmt.format(c) for c in example_calls(env)]
    return [render(fmt.generic_prompt, system="", tools=listing), *calls]
