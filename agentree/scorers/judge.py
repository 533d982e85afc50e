"""Phase-aware LLM judge blended with the trajectory heuristic (PATR §4.2 Eq. 8, appendix B).

    s = lam * s_judge + (1 - lam) * s_heur,   lam = 0.7 by default

The paper gives the judge "the larger weight" without a number; 0.7 keeps the heuristic as
the stabiliser the paper describes (it pulls an over-optimistic judge down by at most 0.15 at
neutral heuristic) while the judge decides the ranking.

Each branch is rendered compactly (task, recent steps with tool types and clipped outputs,
extracted signals) into one of the paper's prompts, chosen from the recent steps:
tests run or test results seen -> verification; else file edits -> editing; else mostly
search/read/run -> diagnosis; else default. Envs that are not bash agents always get the
default prompt. The reply must contain a JSON object {"score": x} with x in [0, 1]; chatter
around it is tolerated, anything else is a failed reply.

Requests go through the `openai` client to any OpenAI-compatible server (vLLM, `agentree
serve`), with a per-request timeout, `tenacity` retries with exponential backoff on transient
errors (timeouts, connection errors, 429, 5xx), a thread pool bounding concurrency, and an LRU
cache keyed by the rendered prompt (identical prompts in one batch are asked once). A judge
that times out, errors or returns garbage never fails the rollout: with `fallback: heuristic`
the branch gets the heuristic score and `Score.info["fallback"] = "heuristic"` (counted as
`rollout/scorer_fallback_heuristic`), with `fallback: none` it gets no score and the
controller's own fallback applies (`scorer/fallbacks`). The API key is read from the
environment variable named by `api_key_env` and never stored, logged or put in Score.info.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from agentree.envs.base import Task
from agentree.prompts import render
from agentree.scorers.base import NodePath, Score, Scorer, ScorerConfig
from agentree.scorers.heuristic import HeuristicConfig, TrajectoryHeuristicScorer
from agentree.scorers.trajectory import StepView, clip_middle

log = logging.getLogger(__name__)

PHASES = ("default", "diagnosis", "editing", "verification")


class JudgeConfig(ScorerConfig):
    """Settings of the LLM judge (defaults: PATR appendix A/B where it gives them)."""

    base_url: str = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible endpoint (vLLM, `agentree serve`, a hosted API)."""
    model: str = "Qwen/Qwen2.5-Coder-7B-Instruct"
    """Model name sent with each request (paper: Qwen2.5-Coder-7B-Instruct)."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the API key (unset: the placeholder 'EMPTY')."""
    lam: float = Field(0.7, ge=0.0, le=1.0)
    """lambda of Eq. 8: weight of the judge; the heuristic gets 1 - lambda."""
    phases: bool = True
    """Phase-specific prompts; false always uses the default prompt."""
    prompt_dir: str = "judge"
    """Folder under agentree/prompts with the templates system, default, diagnosis, editing,
    verification (the paper's five prompts), step and trajectory (the compact rendering)."""
    phase_window: int = Field(3, ge=1)
    """Recent steps the phase is read from."""
    recent_steps: int = Field(8, ge=1)
    """Steps shown to the judge (newest)."""
    max_task_chars: int = Field(4000, ge=64)
    """The task text is cut to this length (middle elided)."""
    max_action_chars: int = Field(400, ge=16)
    """Each shown command/action is cut to this length."""
    max_observation_chars: int = Field(800, ge=16)
    """Each shown output is cut to this length (head and tail kept)."""
    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature of the judge (0: greedy, so caching is exact)."""
    max_tokens: int = Field(64, ge=1)
    """Tokens the judge may answer with."""
    timeout: float = Field(30.0, gt=0.0)
    """Seconds one request may take."""
    retries: int = Field(2, ge=0)
    """Retries after a transient error (timeout, connection, 429, 5xx)."""
    backoff: float = Field(0.5, ge=0.0)
    """First retry delay in seconds; doubles per retry."""
    backoff_max: float = Field(8.0, ge=0.0)
    """Longest retry delay in seconds."""
    concurrency: int = Field(8, ge=1)
    """Requests in flight at once."""
    cache_size: int = Field(4096, ge=0)
    """Judge answers kept, keyed by the rendered prompt (0 disables the cache)."""
    fallback: Literal["heuristic", "none"] = "heuristic"
    """When the judge fails: use the heuristic score, or return no score."""
    heuristic: HeuristicConfig = Field(default_factory=HeuristicConfig)
    """Weights of the blended trajectory heuristic."""


class JudgeReplyError(ValueError):
    """The judge answered, but not with a usable {"score": x}."""


_JSON_OBJECT = re.compile(r"\{[^{}]*\}")


def parse_score(text: str | None) -> float:
    """The score of the last well-formed {"score": x} in `text`, x a number in [0, 1]."""
    if not text or not text.strip():
        raise JudgeReplyError("empty reply")
    problem = "no JSON object in the reply"
    for candidate in reversed(_JSON_OBJECT.findall(text)):
        try:
            obj = json.loads(candidate)
        except json.JSONDecodeError:
            problem = "malformed JSON"
            continue
        value = obj.get("score") if isinstance(obj, dict) else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            problem = "no numeric 'score' in the JSON"
        elif not math.isfinite(value) or not 0.0 <= value <= 1.0:
            problem = f"score {value!r} outside [0, 1]"
        else:
            return float(value)
    raise JudgeReplyError(problem)


def detect_phase(steps: Sequence[StepView], window: int = 3) -> str:
    """PATR appendix B phase rules over the last `window` steps."""
    recent = steps[-window:]
    if any("test" in s.tools or s.tests_passed is not None for s in recent):
        return "verification"
    if any("edit" in s.tools for s in recent):
        return "editing"
    exploring = sum(bool(s.tools & {"search", "read", "run"}) for s in recent)
    if recent and 2 * exploring >= len(recent):
        return "diagnosis"
    return "default"


@dataclass
class _Answer:
    score: float | None
    error: str | None = None
    reply: str | None = None
    attempts: int = 0
    cached: bool = False
    latency_s: float = 0.0


@dataclass
class _Prepared:
    key: str
    messages: list[dict[str, str]]
    phase: str
    heuristic: Score
    info: dict[str, Any] = field(default_factory=dict)


class JudgeScorer(Scorer):
    """LLM-as-judge scorer with heuristic blending; see the module docstring."""

    name = "judge"
    Config = JudgeConfig
    config: JudgeConfig

    def __init__(self, config: JudgeConfig | None = None) -> None:
        super().__init__(config)
        try:
            # deferred: openai is the optional [scorers] extra
            import openai
        except ImportError:
            raise ImportError(
                "the judge scorer needs the openai package: pip install 'agentree[scorers]'"
            ) from None

        cfg = self.config
        self._api_key = os.environ.get(cfg.api_key_env) or "EMPTY"
        # Retries are ours (tenacity), so the client's own are off.
        self._client = openai.OpenAI(
            base_url=cfg.base_url, api_key=self._api_key, timeout=cfg.timeout, max_retries=0
        )
        self._heuristic = TrajectoryHeuristicScorer(cfg.heuristic)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, float] = OrderedDict()
        self._logged: set[str] = set()
        self.stats = {"requests": 0, "retries": 0, "cache_hits": 0, "failures": 0, "fallbacks": 0}
        """Running counters (HTTP requests sent, retries, cache hits, failed branches,
        heuristic fallbacks)."""

    # -- rendering -----------------------------------------------------------------------------
    def render_trajectory(self, steps: Sequence[StepView], signals: dict[str, Any]) -> str:
        cfg = self.config
        shown = steps[-cfg.recent_steps :]
        blocks = [
            render(
                f"{cfg.prompt_dir}/step.txt",
                index=s.index,
                tool=s.tool,
                action=clip_middle((s.command or s.action).strip(), cfg.max_action_chars),
                status=_status(s),
                observation=clip_middle(s.output.strip(), cfg.max_observation_chars) or "(empty)",
            ).rstrip()
            for s in shown
        ]
        return render(
            f"{cfg.prompt_dir}/trajectory.txt",
            total=len(steps),
            shown=len(shown),
            signals=_signal_text(signals),
            steps="\n\n".join(blocks) or "(no steps yet)",
        ).rstrip()

    def prepare(self, branch: NodePath) -> _Prepared:
        """The judge request for one branch, and the heuristic score it is blended with."""
        cfg = self.config
        heuristic, steps = self._heuristic.score_one(branch)
        bash_agent = any(s.command for s in steps)
        phase = detect_phase(steps, cfg.phase_window) if cfg.phases and bash_agent else "default"
        task = clip_middle((branch[0].observation or "").strip(), cfg.max_task_chars)
        trajectory = self.render_trajectory(steps, heuristic.info["signals"])
        user = render(f"{cfg.prompt_dir}/{phase}.txt", task=task, trajectory=trajectory)
        system = render(f"{cfg.prompt_dir}/system.txt").strip()
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        key = hashlib.sha256(
            json.dumps([cfg.model, cfg.temperature, cfg.max_tokens, messages]).encode()
        ).hexdigest()
        return _Prepared(key, messages, phase, heuristic)

    # -- scoring -------------------------------------------------------------------------------
    def score(self, task: Task, branches: Sequence[NodePath]) -> list[Score]:
        if not branches:
            return []
        prepared = [self.prepare(b) for b in branches]
        unique = {p.key: p.messages for p in prepared}
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.concurrency, thread_name_prefix="judge")
        futures = {k: self._pool.submit(self._ask, k, m) for k, m in unique.items()}
        answers = {k: f.result() for k, f in futures.items()}
        return [self._combine(p, answers[p.key]) for p in prepared]

    def _combine(self, p: _Prepared, a: _Answer) -> Score:
        cfg = self.config
        h = p.heuristic.value
        assert h is not None
        info: dict[str, Any] = {
            "phase": p.phase,
            "heuristic": round(h, 4),
            "signals": p.heuristic.info["signals"],
            "prompt": p.messages[1]["content"],
            "reply": None if a.reply is None else a.reply[:500],
            "attempts": a.attempts,
            "cached": a.cached,
            "latency_s": round(a.latency_s, 4),
        }
        if a.score is not None:
            value = cfg.lam * a.score + (1 - cfg.lam) * h
            info.update(judge=a.score, lam=cfg.lam)
            return Score(value, info)
        info["judge_error"] = a.error
        with self._lock:
            self.stats["failures"] += 1
            if cfg.fallback == "heuristic":
                self.stats["fallbacks"] += 1
        if cfg.fallback == "heuristic":
            info["fallback"] = "heuristic"
            return Score(h, info)
        return Score(None, info)

    def _ask(self, key: str, messages: list[dict[str, str]]) -> _Answer:
        """One judge answer: from the cache, or from the server with retries."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                return _Answer(self._cache[key], cached=True)
        # deferred: tenacity is the optional [scorers] extra
        from tenacity import (
            Retrying,
            retry_if_exception,
            stop_after_attempt,
            wait_exponential,
        )

        cfg = self.config
        answer = _Answer(None)
        t0 = time.perf_counter()
        try:
            for attempt in Retrying(
                stop=stop_after_attempt(cfg.retries + 1),
                wait=wait_exponential(multiplier=cfg.backoff, max=cfg.backoff_max),
                retry=retry_if_exception(_transient),
                reraise=True,
            ):
                with attempt:
                    answer.attempts = attempt.retry_state.attempt_number
                    with self._lock:
                        self.stats["requests"] += 1
                        self.stats["retries"] += answer.attempts > 1
                    answer.reply = self._request(messages)
            answer.score = parse_score(answer.reply)
        except Exception as e:  # any failure becomes this branch's fallback
            answer.error = self._redact(f"{type(e).__name__}: {e}")[:500]
            self._warn(type(e).__name__, answer.error)
        answer.latency_s = time.perf_counter() - t0
        if answer.score is not None and cfg.cache_size:
            with self._lock:
                self._cache[key] = answer.score
                while len(self._cache) > cfg.cache_size:
                    self._cache.popitem(last=False)
        return answer

    def _request(self, messages: list[dict[str, str]]) -> str | None:
        cfg = self.config
        resp = self._client.chat.completions.create(
            model=cfg.model,
            messages=messages,  # type: ignore[arg-type]
            temperature=cfg.temperature,
            max_tokens=cfg.max_tokens,
        )
        return resp.choices[0].message.content if resp.choices else None

    def _redact(self, text: str) -> str:
        key = self._api_key
        return text.replace(key, "***") if key and key != "EMPTY" else text

    def _warn(self, kind: str, error: str) -> None:
        """Log each kind of judge failure once at warning level, later ones at debug."""
        with self._lock:
            first = kind not in self._logged
            self._logged.add(kind)
        action = "using the heuristic score" if self.config.fallback == "heuristic" else "no score"
        msg = f"judge at {self.config.base_url} failed ({error}); {action} for that branch"
        if kind == "AuthenticationError":
            msg += f" (is ${self.config.api_key_env} set?)"
        log.log(logging.WARNING if first else logging.DEBUG, msg)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._client.close()


def _transient(e: BaseException) -> bool:
    """Errors worth retrying: timeouts, connection problems, rate limits, server errors."""
    # deferred: openai is the optional [scorers] extra
    import openai

    if isinstance(e, openai.APITimeoutError | openai.APIConnectionError):
        return True
    return isinstance(e, openai.APIStatusError) and (e.status_code == 429 or e.status_code >= 500)


def _status(s: StepView) -> str:
    parts = []
    if s.returncode is not None:
        parts.append(f"exit {s.returncode}")
    if s.timed_out:
        parts.append("timed out")
    if s.format_error:
        parts.append("malformed action")
    if s.tests_passed is not None:
        parts.append("tests passed" if s.tests_passed else "tests failed")
    if s.informative_traceback:
        parts.append("traceback")
    if s.reward:
        parts.append(f"reward {s.reward:g}")
    return ", ".join(parts) or "-"


_SIGNAL_NAMES = {
    "repeats": "repeated actions",
    "failures": "failed commands",
    "premature_finish": "premature submits",
    "blind_edits": "edits before evidence",
    "grounded_edits": "edits after evidence",
    "targeted_tests": "targeted test runs",
    "informative_tracebacks": "informative tracebacks",
    "discoveries": "code/file discoveries",
}


def _signal_text(signals: dict[str, Any]) -> str:
    """The non-zero signals in words, e.g. 'failed commands: 2; latest tests: passed'."""
    parts = [f"{name}: {signals[k]}" for k, name in _SIGNAL_NAMES.items() if signals.get(k)]
    if signals.get("last_tests_passed") is not None:
        parts.append("latest tests: " + ("passed" if signals["last_tests_passed"] else "failed"))
    if signals.get("files_seen"):
        parts.append("files seen: " + ", ".join(signals["files_seen"]))
    return "; ".join(parts) or "none"
