"""Test doubles for the *policy* (never for the component under test), and the loader the
benchmark scripts' tests share."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from agentree.engines.base import Completion, EngineStats, SamplingParams


class ScriptedEngine:
    """An Engine whose 'policy' is a function of the decoded context: deterministic actions.

    Lets controller tests force known branch/prune decisions. Token ids are the tokenizer's
    encoding of the chosen text plus the end-of-turn id; log-probs are 0.
    """

    def __init__(self, tokenizer: Any, choose: Callable[[str, int], str]) -> None:
        self.tokenizer = tokenizer
        self.choose = choose
        self.stats = EngineStats()
        self.calls: list[int] = []

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.eos_token_id,)

    @property
    def max_model_len(self) -> int:
        return 100_000

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        self.calls.append(len(prompts))
        out = []
        for i, p in enumerate(prompts):
            text = self.tokenizer.decode(list(p))
            ids = self.tokenizer.encode(self.choose(text, i), add_special_tokens=False)
            ids = [*ids, self.tokenizer.eos_token_id]
            self.stats.tokens_generated += len(ids) * params.n
            self.stats.tokens_prefilled += len(p)
            out.append([Completion(list(ids), [0.0] * len(ids), "stop") for _ in range(params.n)])
        return out

    def seed(self, seed: int) -> None:
        pass

    def sync_weights(self, model: Any) -> None:
        pass

    def close(self) -> None:
        pass


def interruptible() -> None:
    """`preexec_fn` giving a child the Ctrl-C handling a terminal user has.

    A shell starts background jobs with SIGINT ignored and children inherit that, so a test
    suite launched in the background (as CI may do) would otherwise send SIGINT into the void.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py` imported as module `name` (the scripts are not a package), and
    registered in `sys.modules` so that what it defines can be pickled and inspected."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
