"""A policy with hand-set next-token distributions behind the engine interface.

The samplers under test run unchanged against it: `ToyEngine.open_session` and
`ToyEngine.generate` draw from `dist(response_so_far)`, so a test can force the branch, prune
and fork decisions it checks. Token 0 ends a response; prompts are `PROMPT`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from agentree.engines.base import Completion, EngineStats, Params, SamplingParams, per_prompt
from agentree.envs.base import Env
from agentree.rollout.base import RolloutContext

EOS = 0
PROMPT = [100, 101]
VOCAB = 102

Dist = Callable[[list[int]], dict[int, float]]
"""Response tokens so far -> next-token probabilities (missing tokens have probability 0)."""


class ToyTokenizer:
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return " ".join(str(i) for i in ids)


class ToyChat:
    tokenizer = ToyTokenizer()
    stop_token_ids = (EOS,)

    def prompt_ids(self, observation: str, system: str | None = None, tools=None) -> list[int]:
        return list(PROMPT)

    def parse_action(self, text: str, tools) -> str:
        return text  # the toy envs declare no tools

    def decode_action(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids if i != EOS)


def logprob_row(dist: Dist, response: list[int], temperature: float) -> torch.Tensor:
    probs = torch.zeros(VOCAB, dtype=torch.float64)
    for t, p in dist(response).items():
        probs[t] = p
    return torch.log_softmax(probs.log() / max(temperature, 1e-6), dim=-1).float()


class ToySession:
    def __init__(self, engine: ToyEngine, prompts: Sequence[Sequence[int]], temp: float) -> None:
        self.engine, self.temperature = engine, temp
        self.rows = [list(p) for p in prompts]
        engine.stats.tokens_prefilled += sum(len(p) for p in prompts)
        engine.stats.tokens_forward += sum(len(p) for p in prompts)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def next_logprobs(self) -> torch.Tensor:
        resp = [r[len(PROMPT) :] for r in self.rows]
        return torch.stack([logprob_row(self.engine.dist, x, self.temperature) for x in resp])

    def fork(self, rows: Sequence[int]) -> None:
        self.engine.forks.append(list(rows))
        self.rows = [list(self.rows[r]) for r in rows]

    def append(self, tokens: Sequence[int]) -> None:
        assert len(tokens) == len(self.rows)
        for row, t in zip(self.rows, tokens, strict=True):
            row.append(int(t))
        self.engine.stats.tokens_generated += len(tokens)
        self.engine.stats.tokens_forward += len(tokens)

    def close(self) -> None:
        self.engine.sessions_closed += 1


class ToyEngine:
    """`generate` samples every completion independently; identical prompts are prefilled once."""

    def __init__(self, dist: Dist, seed: int = 0) -> None:
        self.dist = dist
        self.tokenizer = ToyTokenizer()
        self.stats = EngineStats()
        self.generator = torch.Generator().manual_seed(seed)
        self.forks: list[list[int]] = []
        self.sessions_closed = 0
        self.prompts_seen: list[list[int]] = []

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (EOS,)

    @property
    def max_model_len(self) -> int:
        return 4096

    def open_session(self, prompts: Sequence[Sequence[int]], temperature: float = 1.0):
        return ToySession(self, prompts, temperature)

    def generate(self, prompts: Sequence[Sequence[int]], params: Params) -> list[list[Completion]]:
        self.prompts_seen += [list(p) for p in prompts]
        unique = {tuple(p) for p in prompts}
        self.stats.tokens_prefilled += sum(len(p) for p in unique)
        self.stats.tokens_forward += sum(len(p) for p in unique)
        out = []
        for p, sp in zip(prompts, per_prompt(prompts, params), strict=True):
            stop = set(sp.stop_token_ids) | {EOS}
            comps = []
            for _ in range(sp.n):
                toks: list[int] = []
                lps: list[float] = []
                finish = "length"
                for _ in range(sp.max_tokens):
                    lp = logprob_row(self.dist, list(p[len(PROMPT) :]) + toks, sp.temperature)
                    t = int(torch.multinomial(lp.exp(), 1, generator=self.generator))
                    toks.append(t)
                    lps.append(float(lp[t]))
                    if t in stop:
                        finish = "stop"
                        break
                self.stats.tokens_generated += len(toks)
                self.stats.tokens_forward += len(toks) - 1
                comps.append(Completion(toks, lps, finish))  # type: ignore[arg-type]
            out.append(comps)
        return out

    def seed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def sync_weights(self, model: Any) -> None:
        pass

    def close(self) -> None:
        pass


class ToyEnv(Env):
    """Single-step: the reward is the number of 7s in the response, over 10."""

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.done = False
        return "question", {"seed": seed}

    def step(self, action: str):
        assert not self.done, "one step per episode"
        self.done = True
        reward = action.split().count("7") / 10
        return "", reward, True, False, {"success": reward > 0, "answer": action}


def toy_context(dist: Dist, *, max_tokens: int = 64, step: int = 0, seed: int = 0):
    engine = ToyEngine(dist, seed=seed)
    ctx = RolloutContext(
        engine=engine,
        chat=ToyChat(),  # type: ignore[arg-type]
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0, stop_token_ids=(EOS,)),
        env_factory=ToyEnv,
        rng=random.Random(seed),
        step=step,
    )
    return ctx, engine
