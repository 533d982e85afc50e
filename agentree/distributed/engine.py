"""Engine replicas as Ray actors, and the client that routes requests to them.

`EngineReplica` wraps the same engine `agentree train` builds in-process
(`agentree.policy.build_engine`: transformers or vLLM). `RemoteEngine` implements the `Engine`
protocol over a list of replica handles, so a rollout worker's controller cannot tell it from a
local engine.

Routing is by prefix affinity: the branches of one tree extend the same prompt, so a request
goes to the replica that already served the longest earlier prompt that is a prefix of it
(block-aligned hashes, the same idea as the engines' own prefix caches); a prompt with no such
history goes to the replica with the fewest trees. Routing only decides where a prefix cache
can hit, never what is sampled.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import ray

from agentree.config import validate_config
from agentree.engines.base import (
    Admit,
    Completion,
    DoneSink,
    EngineStats,
    Params,
    TokenSink,
    per_prompt,
    report_tokens,
)
from agentree.policy import build_engine, resolve_policy

BLOCK = 16
"""Tokens per routing block (matches the transformers engine's prefix-cache block)."""


class ReplicaBehind(RuntimeError):
    """A replica asked to sample with weights older than the trainer's (it was restarted)."""


class EngineReplica:
    """One policy engine in its own process; weights arrive through the object store."""

    def __init__(self, cfg_data: dict[str, Any], weights: dict[str, Any] | None) -> None:
        cfg = validate_config(cfg_data)
        path = resolve_policy(cfg, lambda _msg: None)
        self.engine, self.model, self.tokenizer = build_engine(cfg, path)
        self.sessions: dict[int, Any] = {}
        self.version = 0
        if weights is not None:
            self.load_weights(weights, 0)

    def info(self) -> dict[str, Any]:
        return {
            "eos_token_ids": self.engine.eos_token_ids,
            "max_model_len": self.engine.max_model_len,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "version": self.version,
        }

    def generate(
        self, prompts: list[list[int]], params: Params, version: int = 0
    ) -> tuple[list[list[Completion]], dict[str, int]]:
        if self.version < version:  # restarted since the last sync: never sample stale weights
            raise ReplicaBehind(f"replica holds weights v{self.version}, v{version} wanted")
        before = self.engine.stats.snapshot()
        out = self.engine.generate(prompts, params)
        after = self.engine.stats.snapshot()
        return out, {k: after[k] - before[k] for k in after}

    def load_weights(self, weights: dict[str, Any], version: int) -> float:
        """Adopt the trainer's state dict (a Ray object: no file round-trip); seconds taken."""
        t0 = time.perf_counter()
        self.model.load_state_dict(weights)
        self.engine.sync_weights(self.model)  # drops KV cached under the old weights
        self.version = version
        return time.perf_counter() - t0

    def seed(self, seed: int) -> None:
        self.engine.seed(seed)

    def checksum(self) -> float:
        """Sum of all weights, to check that a sync arrived."""
        return sum(float(v.double().sum()) for v in self.model.state_dict().values())

    # -- step-wise sessions (token-level controllers) -----------------------------------------
    def open_session(self, prompts: list[list[int]], temperature: float) -> tuple[int, int]:
        s = self.engine.open_session(prompts, temperature)
        sid = id(s)
        self.sessions[sid] = s
        return sid, s.num_rows

    def session_next(self, sid: int) -> Any:
        return self.sessions[sid].next_logprobs().cpu()

    def session_fork(self, sid: int, rows: list[int]) -> int:
        s = self.sessions[sid]
        s.fork(rows)
        return s.num_rows

    def session_append(self, sid: int, tokens: list[int]) -> None:
        self.sessions[sid].append(tokens)

    def session_close(self, sid: int) -> None:
        s = self.sessions.pop(sid, None)
        if s is not None:
            s.close()

    def close(self) -> None:
        for sid in list(self.sessions):
            self.session_close(sid)
        self.engine.close()


class RemoteSession:
    """`DecodeSession` proxy for a session held by one replica."""

    def __init__(self, replica: Any, sid: int, rows: int) -> None:
        self.replica, self.sid, self._rows = replica, sid, rows

    @property
    def num_rows(self) -> int:
        return self._rows

    def next_logprobs(self) -> Any:
        return ray.get(self.replica.session_next.remote(self.sid))

    def fork(self, rows: Sequence[int]) -> None:
        self._rows = ray.get(self.replica.session_fork.remote(self.sid, list(rows)))

    def append(self, tokens: Sequence[int]) -> None:
        ray.get(self.replica.session_append.remote(self.sid, list(tokens)))

    def close(self) -> None:
        ray.get(self.replica.session_close.remote(self.sid))


class RemoteEngine:
    """The `Engine` protocol over engine replicas, with prefix-affinity routing."""

    def __init__(self, replicas: Sequence[Any], tokenizer: Any, info: dict[str, Any]) -> None:
        self.replicas = list(replicas)
        self.tokenizer = tokenizer
        self.stats = EngineStats()
        self._eos = tuple(info["eos_token_ids"])
        self._max_len = int(info["max_model_len"])
        self._owner: dict[int, int] = {}  # hash of a served prompt's block-aligned prefix
        self._trees = [0] * len(self.replicas)
        self.routed = [0] * len(self.replicas)
        self.version = 0
        """Weight version of the trainer; a replica behind it is not asked to sample."""
        self.down: set[int] = set()
        """Replicas that failed a request (died, restarting, or behind on weights)."""
        self.failovers = 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def max_model_len(self) -> int:
        return self._max_len

    def route(self, prompt: Sequence[int]) -> int:
        """Replica for `prompt`: owner of its longest known prefix, else the least used; a
        replica that is down is skipped (its trees move to the others)."""
        live = [i for i in range(len(self.replicas)) if i not in self.down]
        if not live:
            raise RuntimeError(
                f"all {len(self.replicas)} engine replicas are down (killed or restarting); "
                "see `ray status` and the replicas' logs"
            )
        hashes = block_hashes(prompt)
        for h in reversed(hashes):
            r = self._owner.get(h)
            if r is not None and r not in self.down:
                break
        else:
            r = min(live, key=lambda i: (self._trees[i], i))
            self._trees[r] += 1
        if hashes:
            self._owner[hashes[-1]] = r
        self.routed[r] += 1
        return r

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Params,
        on_token: TokenSink | None = None,
        on_done: DoneSink | None = None,
        admit: Admit | None = None,
    ) -> list[list[Completion]]:
        # `admit` is never asked: replicas return whole batches, so whatever waits runs in
        # the caller's next call
        each = per_prompt(prompts, params)
        out: list[list[Completion] | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        while todo:  # each pass loses at least one replica, so this ends
            by_replica: dict[int, list[int]] = {}
            for i in todo:
                by_replica.setdefault(self.route(prompts[i]), []).append(i)
            refs = {
                r: self.replicas[r].generate.remote(
                    [list(prompts[i]) for i in idx],
                    [each[i] for i in idx],
                    self.version,
                )
                for r, idx in by_replica.items()
            }
            todo = []
            for r, ref in refs.items():
                try:
                    comps, delta = ray.get(ref)
                except (ray.exceptions.RayActorError, ReplicaBehind):
                    # failover: this call's prompts go to the other replicas
                    self.down.add(r)
                    self.failovers += 1
                    todo += by_replica[r]
                    continue
                for i, c in zip(by_replica[r], comps, strict=True):
                    out[i] = c
                for k, v in delta.items():
                    if k != "calls":  # a call here is one call, however many replicas served it
                        setattr(self.stats, k, getattr(self.stats, k) + v)
        self.stats.calls += 1
        results = [c for c in out if c is not None]
        report_tokens(results, on_token, on_done)  # replicas answer whole batches
        return results

    def revive(self, version: int, timeout: float = 5.0) -> None:
        """Before a rollout: adopt the trainer's weight version and take back the replicas
        that are up again and hold those weights."""
        self.version = version
        for r in sorted(self.down):
            try:
                info = ray.get(self.replicas[r].info.remote(), timeout=timeout)
            except ray.exceptions.RayError:
                continue
            if info["version"] >= version:
                self.down.discard(r)

    def open_session(
        self, prompts: Sequence[Sequence[int]], temperature: float = 1.0
    ) -> RemoteSession:
        r = self.route(prompts[0]) if prompts else 0
        replica = self.replicas[r]
        sid, rows = ray.get(replica.open_session.remote([list(p) for p in prompts], temperature))
        self.stats.calls += 1
        return RemoteSession(replica, sid, rows)

    def seed(self, seed: int) -> None:
        ray.get([r.seed.remote(seed + i) for i, r in enumerate(self.replicas)])

    def sync_weights(self, model: Any) -> None:
        """Replicas are synced by the driver (`RayRollouts.sync_weights`), once for all
        workers; a worker holds no weights of its own."""

    def close(self) -> None:
        pass


def block_hashes(tokens: Sequence[int]) -> list[int]:
    """Chained hashes of each full BLOCK of `tokens`: entry j identifies tokens[: (j+1)*BLOCK]."""
    out, h = [], 0
    for s in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(tokens[s : s + BLOCK])))
        out.append(h)
    return out
