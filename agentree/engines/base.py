"""The policy-engine contract: token ids in, token ids and log-probs out.

Every backend (transformers in-process, vLLM offline, OpenAI-compatible HTTP) implements
`generate` over token-id prompts. Log-probs are those of the sampled token under the
temperature-scaled distribution (before top-p/top-k truncation), which is what the trainer
recomputes, so importance ratios start at 1 for on-policy data.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    """Most tokens to generate per completion."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop ids besides the tokenizer's EOS; the stop id is included in the output."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion as soon as it contains one (kept in the output)."""
    n: int = 1
    """Completions per prompt (prefix computed once, then expanded)."""
    logprobs: int = 0
    """Also return the top-`logprobs` alternatives at each sampled position."""
    entropy: bool = False
    """Also return the entropy of the sampling distribution at each position."""
    seed: int | None = None


Params = SamplingParams | Sequence[SamplingParams]
"""What `Engine.generate` samples with: one `SamplingParams` for every prompt, or one per
prompt (requests with other limits, stops, temperatures or log-prob counts in one call)."""


def per_prompt(prompts: Sequence[Sequence[int]], params: Params) -> list[SamplingParams]:
    """The `SamplingParams` of each prompt. A call draws from one seed, so the prompts'
    seeds must agree."""
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    each = list(params)
    if len(each) != len(prompts):
        raise ValueError(f"{len(each)} sampling params for {len(prompts)} prompts")
    if len({p.seed for p in each}) > 1:
        raise ValueError(
            "one engine call draws from one seed: give the prompts of a call the same "
            "`seed`, or generate them in separate calls"
        )
    return each


def room_to_generate(prompt: Sequence[int], max_model_len: int) -> int:
    """Tokens a completion of `prompt` may have within the context length, as every engine
    counts them; an empty prompt, or one that leaves no room, is an error."""
    if not prompt:
        raise ValueError("cannot generate from an empty prompt")
    room = max_model_len - len(prompt)
    if room <= 0:
        raise ValueError(
            f"prompt of {len(prompt)} tokens leaves no room to generate (max_model_len "
            f"{max_model_len})"
        )
    return room


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length", "abort"]
    """`abort`: ended early because its `on_token` listener asked (`TokenSink`)."""
    top_logprobs: list[dict[int, float]] | None = None
    entropies: list[float] | None = None


@dataclass
class EngineStats:
    """Running counters; controllers diff them around a rollout."""

    tokens_generated: int = 0
    tokens_prefilled: int = 0
    """Prompt/prefix tokens the model actually computed (prefix-cache hits excluded)."""
    tokens_cached: int = 0
    """Prompt tokens served from the prefix cache instead of being recomputed."""
    tokens_forward: int = 0
    """All tokens run through the model: prefilled plus fed back during decoding."""
    tokens_evicted: int = 0
    """Prefilled prompt tokens the prefix cache had held and dropped for room: what a larger
    cache would not have computed again (transformers engine; vLLM does not say)."""
    calls: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def snapshot(self) -> dict[str, int]:
        return {
            "tokens_generated": self.tokens_generated,
            "tokens_prefilled": self.tokens_prefilled,
            "tokens_cached": self.tokens_cached,
            "tokens_forward": self.tokens_forward,
            "tokens_evicted": self.tokens_evicted,
            "calls": self.calls,
        }


class DecodeSession(Protocol):
    """Step-wise decoding over a batch of live rows, for token-level tree samplers.

    Rows hold their KV state; `fork` re-indexes rows by copying state (a shared prefix is never
    recomputed). Typical loop: `lp = s.next_logprobs()`, choose tokens (and which rows to
    duplicate or drop), `s.fork(rows)`, `s.append(tokens)`.
    """

    @property
    def num_rows(self) -> int: ...

    def next_logprobs(self) -> Any:
        """Float tensor [num_rows, vocab]: log-softmax of the next-token logits / temperature."""
        ...

    def fork(self, rows: Sequence[int]) -> None:
        """New row i continues old row `rows[i]` (duplicate, drop or reorder rows)."""
        ...

    def append(self, tokens: Sequence[int]) -> None:
        """Feed one token per row."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SampledToken:
    """One token as `Engine.generate` tells it to `on_token`: what its `Completion` will hold
    at that position."""

    id: int
    logprob: float
    top: dict[int, float] | None = None
    """The top-`params.logprobs` alternatives, when asked for."""


TokenSink = Callable[[int, SampledToken], bool | None]
"""`on_token(completion index, token)`, what `Engine.generate` tells of each token sampled.
A true return says nobody wants the rest of that completion (a client that hung up): an engine
that samples step by step ends it there, with finish reason `abort`; one that reports whole
batches at the end has nothing left to save."""


DoneSink = Callable[[int, Completion], None]
"""`on_done(completion index, completion)`: a completion has ended, while the rest of its call
may still be decoding (so a caller can answer it before the call returns)."""


Admit = Callable[[int], tuple[Sequence[Sequence[int]], Params] | None]
"""`admit(free)`: asked by an engine between the decoding steps of a call, more prompts to
join the call now (continuous batching), with their params, of at most `free` completions in
all; `None` when nothing waits. Their params must carry the call's seed. Their completions are
numbered after those the call has so far, told to the hooks like the call's own, and returned
after the call's own prompts in the order admitted. Only an engine that decodes step by step
asks (transformers, vLLM); one that never asks is still correct, so a caller keeps whatever
was not admitted for a later call."""


def admitted(
    admit: Admit, free: int, seed: int | None
) -> list[tuple[Sequence[int], SamplingParams]]:
    """What `admit` lets join a call now, each prompt with its params: nothing without room;
    checked as `per_prompt` checks a call, against the call's seed."""
    if free <= 0:
        return []
    got = admit(free)
    if not got or not got[0]:
        return []
    prompts, params = got
    each = per_prompt(prompts, params)
    if each[0].seed != seed:
        raise ValueError("prompts admitted into an engine call must carry the call's seed")
    count = sum(p.n for p in each)
    if count > free:
        raise ValueError(f"admitted {count} completions where {free} fit")
    return list(zip(prompts, each, strict=True))


def report_tokens(
    results: list[list[Completion]],
    on_token: TokenSink | None,
    on_done: DoneSink | None = None,
) -> None:
    """Every token of finished `results` to `on_token`, and every completion to `on_done`,
    completion by completion: how an engine that returns whole batches (the Ray replica
    router) keeps the hooks."""
    i = 0
    for comps in results:
        for c in comps:
            if on_token is not None:
                for k, t in enumerate(c.token_ids):
                    top = c.top_logprobs[k] if c.top_logprobs else None
                    on_token(i, SampledToken(t, c.logprobs[k], top))
            if on_done is not None:
                on_done(i, c)
            i += 1


@runtime_checkable
class Engine(Protocol):
    tokenizer: Any
    stats: EngineStats

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def max_model_len(self) -> int: ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Params,
        on_token: TokenSink | None = None,
        on_done: DoneSink | None = None,
        admit: Admit | None = None,
    ) -> list[list[Completion]]:
        """One list of `n` completions per prompt, `params` one for all prompts or one each
        (`per_prompt`), then one per prompt that joined the call through `admit` (`Admit`).
        `on_token(i, token)` hears each token (`SampledToken`) as it is sampled, `i` counting
        completions prompt by prompt (with one `params`, `i // params.n` is the prompt), and
        `on_done(i, completion)` each completion as it ends: the transformers and vLLM
        engines call them as each token is sampled and each completion ends, and end a
        completion whose `on_token` returns true; engines that finish whole batches elsewhere
        call them at the end (`report_tokens`)."""
        ...

    def open_session(
        self, prompts: Sequence[Sequence[int]], temperature: float = 1.0
    ) -> DecodeSession:
        """Prefill `prompts` (through the prefix cache) and return a step-wise session."""
        ...

    def seed(self, seed: int) -> None:
        """Reseed sampling (evaluation uses this for repeatable draws)."""
        ...

    def rng_state(self) -> Any:
        """Where sampling stands, for a checkpoint: a resumed run draws what the
        uninterrupted one would have drawn."""
        ...

    def set_rng_state(self, state: Any) -> None: ...

    def sync_weights(self, model: Any) -> None:
        """Load the trainer's current weights (no-op when the engine shares the model): a
        model, anything with `.state_dict()`, or a `LoraAdapter` where the engine says
        `accepts_adapters`."""
        ...

    def close(self) -> None: ...


@dataclass
class LoraAdapter:
    """LoRA adapters as peft saves them, sent to an engine instead of merged full weights.

    `tensors` are peft's adapter state dict (`...<module>.lora_A.weight` / `.lora_B.weight`,
    the adapter name left out) and `config` its `adapter_config.json`; `save` writes both in
    peft's layout, which vLLM's LoRA loader reads. An engine that runs adapters unmerged has
    `accepts_adapters = True`; `sync_weights(adapter)` then replaces the adapter it samples with.
    """

    tensors: dict[str, Any]
    config: dict[str, Any]

    @property
    def nbytes(self) -> int:
        """Bytes of adapter weights one sync moves."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def save(self, directory: str | Path) -> Path:
        # deferred: safetensors imports torch; engines that never see an adapter do not pay it
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps(self.config, indent=1))
        return out
