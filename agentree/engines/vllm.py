"""vLLM offline engine behind the `Engine` protocol: rollouts, weight updates, step-wise sessions.

Token ids in (`TokensPrompt`), token ids and log-probs out; prefix caching is on, so the shared
prefixes of a tree (siblings after a fork, the next turn of a branch) are computed once.

Log-prob semantics. The contract is the log-prob of the sampled token under the
temperature-scaled distribution, before top-p/top-k truncation. vLLM runs with
`logprobs_mode="processed_logprobs"`: log-softmax of the logits after temperature and after
top-k/top-p filtering. With `top_p=1` and `top_k=0` (the paper's settings and agentree's
defaults) that is exactly the contract at every temperature, and greedy (temperature 0) gives the
temperature-1 log-probs, as the transformers engine does. With `top_p<1` or `top_k>0` vLLM only
exposes the truncated, renormalised distribution: each log-prob is then larger than the contract
by -log(kept mass) (the trainer's importance ratio starts below 1). vLLM's other modes do not help:
`raw_logprobs` ignores the temperature, and neither mode gives the untruncated scaled values.
`top_logprobs` follow the same rule (the top-k of the same distribution).

Entropies are not returned by vLLM. They are computed exactly from the full-vocabulary
log-probs when the vocabulary is small (`entropy_topk=None` does this up to 4096 tokens),
otherwise from the top `entropy_topk` log-probs with the unseen tail mass r counted as
-r*log(min(r, p_k)), a lower bound of the tail's contribution (every tail token has p <= p_k).

Weight sync. `sync_weights(model)` loads the trainer's state dict into the running engine with
vLLM's in-place reload (`Worker.reload_weights`, which re-runs each layer's post-load
processing, e.g. the CPU backend's packed GEMM weights) and then resets the prefix cache, whose
KV the old weights computed. No restart. In-process engines get the tensors by reference;
multi-process engines (vLLM's default) get raw bytes through `collective_rpc`, one host copy.
With `enable_lora=True` the engine also takes a `LoraAdapter` (`accepts_adapters`): the trainer's
LoRA A and B matrices alone, written in peft's layout to a private temp directory and loaded as
a vLLM LoRA adapter under a new id each sync (the previous one is removed); every later request
samples with it, unmerged. The base weights never move, and the prefix cache needs no reset:
vLLM keys cached blocks by adapter id.

Sessions. vLLM has no step-wise API, so `open_session` emulates one: each `next_logprobs()` is
one 1-token request per distinct row asking for the full-vocabulary log-probs at temperature 1
(rescaled locally to the session temperature, which is exact). Prefix caching keeps every step to
the last partial block plus one token. Correct, but a request per row per token: slow next to
the transformers engine's KV-forking session, and costly for large vocabularies (vLLM hands
log-probs back as Python lists). `session_topk=K` returns only the top K per step (the rest at
-inf): fast, but then the samplers draw from the top-K truncated, renormalised distribution.

Streaming. With `on_token` or `on_done` (what `agentree serve` passes), `generate` adds the
requests to the engine and runs its step loop itself (`LLMEngine.add_request` / `step` /
`abort_request`, the loop `LLM.generate` runs), telling each token as the step that sampled it
returns and each completion as it ends, and aborting a request whose listener has gone.
Without them (rollouts, evaluation) `LLM.generate` runs the batch and only each request's final
output comes back.

Processes. By default vLLM runs its engine core (and on CPU a worker) in child processes;
`close()` shuts them down and removes their IPC sockets' directory, and a watchdog thread in
the worker ends them if this process dies without closing (killed, or a crash that skips
finalisers). `in_process=True` keeps everything in this process (zero-copy weight sync when the
trainer shares the GPU).
"""

from __future__ import annotations

import atexit
import itertools
import math
import multiprocessing
import os
import random
import shutil
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from agentree.engines.base import (
    Admit,
    Completion,
    DoneSink,
    EngineStats,
    LoraAdapter,
    Params,
    SampledToken,
    SamplingParams,
    TokenSink,
    admitted,
    per_prompt,
    room_to_generate,
)

_Requests = tuple[list[list[int]], list[Any], list[SamplingParams]]
"""vLLM requests, one per sample: prompts, vLLM sampling params, the params they came with."""

EXACT_ENTROPY_VOCAB = 4096
"""Vocabularies up to this size get exact entropies (full-vocabulary log-probs) by default."""


class VLLMEngine:
    """`Engine` over `vllm.LLM` (offline). Extra keyword arguments go to `vllm.LLM`."""

    def __init__(
        self,
        model: str | Path,
        tokenizer: Any = None,
        *,
        seed: int = 0,
        in_process: bool | None = None,
        entropy_topk: int | None = None,
        session_topk: int | None = None,
        gpu_memory_utilization: float | None = None,
        **llm_kwargs: Any,
    ) -> None:
        """`in_process=None` follows vLLM (VLLM_ENABLE_V1_MULTIPROCESSING, default: child
        processes). `gpu_memory_utilization` defaults to 0.2 on CPU (there it is the share of
        host memory for the KV cache) and 0.5 on a GPU (a trainer usually shares the device).
        `entropy_topk`: how many top log-probs entropies are computed from (None: the whole
        vocabulary up to 4096 tokens, else 20). `session_topk`: candidates a decode session
        sees per step (None: the whole vocabulary, exact; K: only the top K, the rest at -inf,
        i.e. top-K sampling)."""
        path = str(model)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer = tokenizer
        self.stats = EngineStats()
        self.stats.extra.update(weight_syncs=0, requests=0)
        self._rng = random.Random(seed)
        self._closed = True
        self.accepts_adapters = bool(llm_kwargs.get("enable_lora"))
        """Whether `sync_weights` takes a `LoraAdapter` (vLLM started with enable_lora)."""
        self._lora: Any = None  # the LoRARequest every request samples with
        self._request_ids = itertools.count()  # for the requests `_stream` adds itself
        self._lora_dir: str | None = None
        t0 = time.perf_counter()
        self.llm = start_llm(
            path,
            in_process=in_process,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            max_logprobs=-1,  # sessions and exact entropies ask for the whole vocabulary
            seed=seed,
            **llm_kwargs,
        )
        self._closed = False
        self.startup_s = time.perf_counter() - t0
        self._shapes = checkpoint_shapes(path)
        self.in_process = is_in_process(self.llm)
        mc = self.llm.llm_engine.model_config
        self._max_len = int(mc.max_model_len)
        self._max_seqs = int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
        self._vocab = int(mc.get_vocab_size())
        eos = getattr(mc.hf_config, "eos_token_id", None)
        ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        self._eos = tuple(sorted(ids))
        if entropy_topk is None:
            entropy_topk = self._vocab if self._vocab <= EXACT_ENTROPY_VOCAB else 20
        self.entropy_topk = min(entropy_topk, self._vocab)
        self.session_topk = min(session_topk or self._vocab, self._vocab)

    # -- protocol ---------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def max_model_len(self) -> int:
        return self._max_len

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache so far."""
        total = self.stats.tokens_cached + self.stats.tokens_prefilled
        return self.stats.tokens_cached / total if total else 0.0

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Params,
        on_token: TokenSink | None = None,
        on_done: DoneSink | None = None,
        admit: Admit | None = None,
    ) -> list[list[Completion]]:
        if not prompts:
            return []
        self._check_open()
        each = per_prompt(prompts, params)
        self.stats.calls += 1
        # Per-request seeds drawn from one stream: repeatable under `seed()` / `params.seed`, and
        # identical prompts still get different samples (vLLM would give equal seeds equal draws).
        seed = each[0].seed
        rng = random.Random(seed) if seed is not None else self._rng
        requests = self._requests(list(zip(prompts, each, strict=True)), rng)
        counts = [ps.n for ps in each]  # completions of each prompt, admitted ones after

        def more(free: int) -> _Requests:
            assert admit is not None
            joined = admitted(admit, free, seed)
            counts.extend(ps.n for _, ps in joined)
            return self._requests(joined, rng)

        if on_token is None and on_done is None and admit is None:
            inputs, sps, asked = requests
            outs = self._run(inputs, sps)
            comps = [
                self._completion(prompt, out, ps)
                for prompt, out, ps in zip(inputs, outs, asked, strict=True)
            ]
        else:
            comps = self._stream(requests, on_token, on_done, more if admit is not None else None)
        results: list[list[Completion]] = []
        for n in counts:
            results.append(comps[:n])
            comps = comps[n:]
        return results

    def _requests(
        self, asked: list[tuple[Sequence[int], SamplingParams]], rng: random.Random
    ) -> _Requests:
        """A vLLM request per sample of `asked` (prompts with their params): its prompt, its
        vLLM sampling params (seeded from `rng`) and the params it came with."""
        inputs, sps, params = [], [], []
        for p, ps in asked:
            room = room_to_generate(p, self._max_len)
            k = max(ps.logprobs, self.entropy_topk if ps.entropy else 0)
            for _ in range(ps.n):
                inputs.append(list(p))
                sps.append(self._sampling(ps, min(ps.max_tokens, room), k, rng))
                params.append(ps)
        return inputs, sps, params

    def open_session(
        self, prompts: Sequence[Sequence[int]], temperature: float = 1.0
    ) -> VLLMSession:
        self._check_open()
        self.stats.calls += 1
        return VLLMSession(self, [list(p) for p in prompts], temperature)

    def seed(self, seed: int) -> None:
        self._rng.seed(seed)

    def rng_state(self) -> Any:
        return self._rng.getstate()

    def set_rng_state(self, state: Any) -> None:
        self._rng.setstate(state)

    def sync_weights(self, model: Any) -> None:
        """Load `model`'s current weights into the running engine, then drop the stale cache;
        a `LoraAdapter` replaces the adapter requests sample with instead."""
        self._check_open()
        t0 = time.perf_counter()
        if isinstance(model, LoraAdapter):
            self._sync_adapter(model)
        else:
            self._sync_full(model)
        self.stats.extra["weight_syncs"] += 1
        self.stats.extra["weight_sync_s"] = time.perf_counter() - t0

    def _sync_full(self, model: Any) -> None:
        state = model.state_dict()
        for name, t in state.items():
            # vLLM's loaders assert on a wrong shape, which ends the engine: refuse it here
            want = self._shapes.get(name)
            if want is not None and tuple(t.shape) != want:
                raise ValueError(
                    f"cannot sync {name} of shape {tuple(t.shape)} into the engine, whose "
                    f"checkpoint has {want}: sync a model of the engine's architecture and "
                    "vocabulary"
                )
        if self.in_process:
            payload: list[Any] = [(name, t.detach()) for name, t in state.items()]
        else:
            payload = [_pack(name, t) for name, t in state.items()]
        self.llm.collective_rpc("agentree_load_weights", args=(payload,))
        self.llm.reset_prefix_cache()
        self.stats.extra["weight_sync_bytes"] = sum(
            t.numel() * t.element_size() for t in state.values()
        )

    def _sync_adapter(self, adapter: LoraAdapter) -> None:
        if not self.accepts_adapters:
            raise ValueError(
                "this vLLM engine was started without enable_lora; pass engine.vllm.enable_lora="
                "true or sync merged weights"
            )
        # deferred: vllm is the optional [vllm] extra
        from vllm.lora.request import LoRARequest

        if self._lora_dir is None:
            self._lora_dir = tempfile.mkdtemp(prefix="agentree-lora-")
        old = self._lora
        new_id = 1 if old is None else old.lora_int_id + 1
        path = adapter.save(Path(self._lora_dir) / f"v{new_id}")
        request = LoRARequest(f"agentree-v{new_id}", new_id, str(path))
        self.llm.llm_engine.add_lora(request)  # loaded now: the sync's cost is paid here
        self._lora = request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.stats.extra["weight_sync_bytes"] = adapter.nbytes

    def close(self) -> None:
        """Shut the engine down (child processes included); idempotent."""
        if self._closed:
            return
        self._closed = True
        llm = self.__dict__.pop("llm", None)
        try:
            if llm is not None:
                stop_llm(llm)
        finally:
            if self._lora_dir is not None:
                shutil.rmtree(self._lora_dir, ignore_errors=True)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the vLLM engine is closed")

    def _sampling(self, params: SamplingParams, max_tokens: int, k: int, rng: random.Random):
        # deferred: vllm is the optional [vllm] extra (a GPU build); this module imports without it
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=1,
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            # EOS ids as the transformers engine reads them (config + tokenizer), kept in output
            stop_token_ids=sorted(set(params.stop_token_ids) | set(self._eos)),
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
            logprobs=k,
            flat_logprobs=True,
            detokenize=bool(params.stop),  # only stop strings need text
            skip_special_tokens=False,
            seed=rng.getrandbits(62),
        )

    def _run(self, inputs: list[list[int]], sps: list[Any]) -> list[Any]:
        # deferred: vllm is the optional [vllm] extra
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=p) for p in inputs]
        outs = self.llm.generate(prompts, sps, use_tqdm=False, lora_request=self._lora)
        self._count_prompts(inputs, outs)
        return outs

    def _stream(
        self,
        requests: _Requests,
        on_token: TokenSink | None,
        on_done: DoneSink | None,
        more: Callable[[int], _Requests] | None = None,
    ) -> list[Completion]:
        """`_run` through the engine's own loop (`LLMEngine.add_request` / `step` /
        `abort_request`, what `LLM.generate` runs), telling `on_token` the tokens each step
        adds and `on_done` each request's completion as it ends; a request whose `on_token`
        answers true is aborted there. After each step `more(free)` may bring requests that
        join (continuous batching; `free`: what the scheduler's `max_num_seqs` leaves). Each
        request's completion, the joined ones after."""
        # deferred: vllm is the optional [vllm] extra
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        inputs: list[list[int]] = []
        asked: list[SamplingParams] = []
        names: list[str] = []
        row: dict[str, int] = {}
        last: list[Any] = []
        comps: list[Completion | None] = []
        heard: list[int] = []

        def add(new: _Requests) -> None:
            for prompt, sp, ps in zip(*new, strict=True):
                inputs.append(prompt)
                asked.append(ps)
                # every step's tokens so far: vLLM's output processor hands its own growing
                # token and log-prob lists, not copies, so a long stream stays linear
                sp.output_kind = RequestOutputKind.CUMULATIVE
                names.append(f"agentree-{next(self._request_ids)}")
                row[names[-1]] = len(names) - 1
                last.append(None)
                comps.append(None)
                heard.append(0)
                engine.add_request(
                    names[-1], TokensPrompt(prompt_token_ids=prompt), sp, lora_request=self._lora
                )

        try:
            add(requests)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    i = row[out.request_id]
                    if comps[i] is not None:
                        continue  # aborted at its listener's word: ended already
                    last[i], c = out, out.outputs[0]
                    kept = None
                    for k in range(heard[i], len(c.token_ids) if on_token else 0):
                        logprob, top, _ = self._position(c.logprobs, k, c.token_ids[k], asked[i])
                        gone = on_token(i, SampledToken(c.token_ids[k], logprob, top))
                        if gone and not (out.finished and k == len(c.token_ids) - 1):
                            engine.abort_request([out.request_id])
                            kept = k + 1
                            break
                    heard[i] = len(c.token_ids)
                    if out.finished or kept is not None:
                        comps[i] = self._completion(inputs[i], out, asked[i], kept)
                        if on_done is not None:
                            on_done(i, comps[i])
                if more is not None:
                    add(more(self._max_seqs - engine.get_num_unfinished_requests()))
        finally:  # an error or an interrupt leaves no request of this call in the engine
            running = [name for i, name in enumerate(names) if comps[i] is None]
            if running:
                engine.abort_request(running)
        self._count_prompts(inputs, last)
        return comps  # type: ignore[return-value]  # every request ended

    def _count_prompts(self, inputs: list[list[int]], outs: list[Any]) -> None:
        self.stats.extra["requests"] += len(outs)
        for prompt, out in zip(inputs, outs, strict=True):
            cached = int(out.num_cached_tokens or 0)
            self.stats.tokens_cached += cached
            self.stats.tokens_prefilled += len(prompt) - cached
            self.stats.tokens_forward += len(prompt) - cached

    def _completion(
        self, prompt: list[int], out: Any, params: SamplingParams, kept: int | None = None
    ) -> Completion:
        """The `Completion` of a request's output; `kept`: it was aborted after that many
        tokens (`_stream`)."""
        c = out.outputs[0]
        if kept is None and c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request ended with finish_reason={c.finish_reason!r}")
        ids = list(c.token_ids)[:kept]
        n = len(ids)
        self.stats.tokens_generated += n
        self.stats.tokens_forward += max(n - 1, 0)  # each token but the last is fed back
        logprobs, tops, ents = [], [], []
        for i, t in enumerate(ids):
            logprob, top, entropy = self._position(c.logprobs, i, t, params)
            logprobs.append(logprob)
            if top is not None:
                tops.append(top)
            if entropy is not None:
                ents.append(entropy)
        return Completion(
            token_ids=ids,
            logprobs=logprobs,
            finish_reason=c.finish_reason if kept is None else "abort",
            top_logprobs=tops if params.logprobs else None,
            entropies=ents if params.entropy else None,
        )

    def _position(
        self, lp: Any, i: int, t: int, params: SamplingParams
    ) -> tuple[float, dict[int, float] | None, float | None]:
        """The log-prob of token `t` at position `i` of vLLM's flat log-probs `lp`, the
        top-`params.logprobs` alternatives and the entropy there (when asked for)."""
        s, e = lp.start_indices[i], lp.end_indices[i]
        pos = dict(zip(lp.token_ids[s:e], lp.logprobs[s:e], strict=True))
        top = entropy = None
        if params.logprobs:
            ranks = dict(zip(lp.token_ids[s:e], lp.ranks[s:e], strict=True))
            best = sorted(pos, key=lambda tid: ranks[tid] or 0)[: params.logprobs]
            top = {tid: float(pos[tid]) for tid in best}
        if params.entropy:
            entropy = entropy_from_logprobs(list(pos.values()), self._vocab)
        return float(pos[t]), top, entropy

    def next_logprobs(self, rows: Sequence[Sequence[int]]) -> Any:
        """[len(rows), vocab] float tensor: next-token log-softmax at temperature 1."""
        unique: dict[tuple[int, ...], int] = {}
        for r in rows:
            if len(r) >= self._max_len:
                raise ValueError(f"a session row reached max_model_len {self._max_len}")
            unique.setdefault(tuple(r), len(unique))
        # deferred: vllm is the optional [vllm] extra
        from vllm import SamplingParams as VSamplingParams

        sp = VSamplingParams(
            n=1,
            max_tokens=1,
            temperature=1.0,
            logprobs=self.session_topk,
            flat_logprobs=True,
            detokenize=False,
            seed=0,  # the sampled token is discarded
        )
        outs = self._run([list(u) for u in unique], [sp] * len(unique))
        table = torch.full((len(unique), self._vocab), float("-inf"))
        for j, out in enumerate(outs):
            lp = out.outputs[0].logprobs
            s, e = lp.start_indices[0], lp.end_indices[0]
            table[j, torch.tensor(lp.token_ids[s:e])] = torch.tensor(lp.logprobs[s:e])
        return table[torch.tensor([unique[tuple(r)] for r in rows], dtype=torch.long)]


class VLLMSession:
    """`DecodeSession` emulated with 1-token requests (see the module docstring)."""

    def __init__(self, engine: VLLMEngine, prompts: list[list[int]], temperature: float) -> None:
        self.engine = engine
        self.temperature = temperature
        self.tokens = prompts
        """Each row's prompt plus every token appended so far."""
        self._lp: Any = None

    @property
    def num_rows(self) -> int:
        return len(self.tokens)

    def next_logprobs(self) -> Any:
        if self._lp is None:
            self._lp = self.engine.next_logprobs(self.tokens)
        t = self.temperature
        if t == 1.0:
            return self._lp
        # log_softmax(log p / t) == log_softmax(logits / t): exact for any t
        return torch.log_softmax(self._lp / max(t, 1e-6), dim=-1)

    def fork(self, rows: Sequence[int]) -> None:
        self.tokens = [list(self.tokens[r]) for r in rows]
        if self._lp is not None:
            self._lp = self._lp[list(rows)]

    def append(self, tokens: Sequence[int]) -> None:
        for row, t in zip(self.tokens, tokens, strict=True):
            row.append(int(t))
        self.engine.stats.tokens_generated += len(tokens)
        self._lp = None

    def close(self, store: bool = True) -> None:
        """Nothing to release: vLLM's prefix cache already holds every row's blocks."""
        self._lp = None


SOCKETS_PREFIX = "agentree-vllm-ipc-"
"""The directories `start_llm` gives an engine's IPC sockets (`VLLM_RPC_BASE_PATH`)."""
_SOCKET_DIRS: set[str] = set()  # of the engines not stopped yet: removed at exit (Ctrl-C)


@atexit.register
def _remove_socket_dirs() -> None:
    for d in list(_SOCKET_DIRS):
        shutil.rmtree(d, ignore_errors=True)


def start_llm(
    path: str,
    *,
    in_process: bool | None = None,
    gpu_memory_utilization: float | None = None,
    **kwargs: Any,
) -> Any:
    """`vllm.LLM(path, **kwargs)` with agentree's defaults and process hygiene.

    Defaults: `gpu_memory_utilization` 0.2 on CPU (the share of host memory for the KV cache)
    and 0.5 on a GPU (a trainer or scorer usually shares the device); on CPU, 32-token KV blocks
    and each prompt prefilled in one step (no chunked prefill).
    The caller's global RNG streams are kept, and a watchdog in the engine's worker ends the
    engine if this process dies without `stop_llm`.
    """
    # deferred: vllm is the optional [vllm] extra
    from vllm import LLM
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    if gpu_memory_utilization is None:
        gpu_memory_utilization = 0.2 if on_cpu else 0.5
    args: dict[str, Any] = {
        "gpu_memory_utilization": gpu_memory_utilization,
        "worker_extension_cls": f"{__name__}.WorkerExtension",
    }
    if on_cpu:
        # The CPU backend defaults to 128-token blocks; prefix caching reuses whole blocks
        # only, so smaller blocks (its kernels want multiples of 32) share more of a tree.
        args["block_size"] = 32
        # A prompt split across steps (chunked prefill) makes vLLM rewind its request's
        # generator, which CPU generators cannot: every agentree request is seeded, so the
        # engine died once a call held more prompt tokens than a step. Prompts are prefilled
        # whole (vLLM then raises the step's budget to the longest prompt the model takes).
        args["enable_chunked_prefill"] = False
    args.update(kwargs)
    # the engine's IPC sockets go into a directory of its own, which `stop_llm` removes
    # (vLLM names them `VLLM_RPC_BASE_PATH/<uuid>` and leaves them behind)
    sockets = tempfile.mkdtemp(prefix=SOCKETS_PREFIX)
    try:
        with _vllm_env(in_process, sockets), _keep_rng_state():
            llm = LLM(path, **args)
    except BaseException:
        shutil.rmtree(sockets, ignore_errors=True)
        raise
    llm._agentree_sockets = sockets
    _SOCKET_DIRS.add(sockets)
    if not is_in_process(llm):
        llm.collective_rpc("agentree_watch_client", args=(os.getpid(),))
    return llm


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a local safetensors checkpoint, read from its headers (empty for a hub
    id or another format)."""
    # deferred: safetensors is only needed once an engine has started
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                shapes[k] = tuple(st.get_slice(k).get_shape())
    return shapes


def is_in_process(llm: Any) -> bool:
    """Whether vLLM's engine core runs inside this process."""
    return type(llm.llm_engine.engine_core).__name__ == "InprocClient"


def stop_llm(llm: Any) -> None:
    """Shut an engine from `start_llm` down, wait for its processes to end and remove its
    sockets."""
    in_process = is_in_process(llm)
    llm.llm_engine.engine_core.shutdown()
    _reap_children()
    sockets = getattr(llm, "_agentree_sockets", None)
    if sockets:
        shutil.rmtree(sockets, ignore_errors=True)
        _SOCKET_DIRS.discard(sockets)
    if in_process:
        # the in-process worker set up torch.distributed; a later engine needs it gone
        # deferred: vllm is the optional [vllm] extra
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()


def entropy_from_logprobs(logprobs: Sequence[float], vocab: int) -> float:
    """Entropy of a distribution given all of its log-probs, or a lower bound from its top ones.

    With fewer than `vocab` values the unseen tail mass r is counted as -r*log(min(r, p_min)):
    each unseen token has p <= p_min (the smallest seen) and the tail has total mass r.
    """
    h, mass, p_min = 0.0, 0.0, 1.0
    for v in logprobs:
        if v == float("-inf") or math.isnan(v):
            continue
        p = math.exp(v)
        h -= p * v
        mass += p
        p_min = min(p_min, p)
    r = 1.0 - mass
    if len(logprobs) < vocab and r > 1e-9:
        h -= r * math.log(min(r, p_min))
    return h


def _pack(name: str, t: Any) -> tuple[str, str, list[int], bytes]:
    """A tensor as (name, dtype, shape, raw bytes): collective_rpc arguments cross processes as
    msgpack (between the client and the engine core), where tensors are not reconstructed."""
    t = t.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), raw


def _unpack(item: Sequence[Any]) -> tuple[str, Any]:
    if len(item) == 2:  # in-process: (name, tensor)
        return item[0], item[1]
    name, dtype, shape, raw = item
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer; load_weights copies it anyway
        flat = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0)
    return name, flat.view(getattr(torch, dtype)).reshape(shape)


class WorkerExtension:
    """Methods vLLM mixes into its worker class (`worker_extension_cls`); run via collective_rpc."""

    def agentree_load_weights(self, payload: list[Sequence[Any]]) -> int:
        """Reload weights in place from checkpoint-format (name, tensor) pairs."""
        weights = [_unpack(item) for item in payload]
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(weights)

    def agentree_watch_client(self, client_pid: int) -> bool:
        """End the engine, and remove its sockets, if the client process dies without shutting
        it down."""
        me = os.getpid()
        if client_pid == me:
            return False
        parent = os.getppid()
        # The worker either is the engine core (its parent is the client) or is the engine
        # core's child; either way stopping the core stops every engine process.
        core = me if parent == client_pid else parent

        sockets = os.environ.get("VLLM_RPC_BASE_PATH", "")  # `start_llm`'s, if it is ours

        def watch() -> None:
            while _alive(client_pid):
                time.sleep(1.0)
            if Path(sockets).name.startswith(SOCKETS_PREFIX):
                shutil.rmtree(sockets, ignore_errors=True)
            os.kill(core, signal.SIGTERM)
            time.sleep(15.0)
            os._exit(1)  # the core's orderly shutdown should have ended us by now

        threading.Thread(target=watch, name="agentree-client-watch", daemon=True).start()
        return True


def _reap_children(timeout: float = 10.0) -> None:
    """Wait for the engine processes vLLM just stopped, so none lingers even as a zombie."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [p for p in multiprocessing.active_children() if "EngineCore" in p.name]:
            return
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a dead client whose zombie is not yet reaped still answers kill(pid, 0)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


@contextmanager
def _vllm_env(in_process: bool | None, sockets: str) -> Iterator[None]:
    """Select vLLM's process layout and its sockets' directory for the engine being built,
    then restore the environment."""
    # deferred: vllm is the optional [vllm] extra
    from vllm import envs

    want = {"VLLM_RPC_BASE_PATH": sockets}
    if in_process is not None:
        want["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    old = {key: os.environ.get(key) for key in want}
    os.environ.update(want)
    # an engine core that ran in this process froze vLLM's view of the environment
    # (`enable_envs_cache`): without a fresh look, this engine's sockets would go where that
    # engine's went
    envs.disable_envs_cache()
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def _keep_rng_state() -> Iterator[None]:
    """vLLM seeds the global RNGs of the process it runs in; keep the caller's streams."""
    py, npy, pt = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(pt)
