"""In-process transformers engine with a prefix KV cache.

Why a custom decode loop instead of `model.generate`: tree rollouts ask for many continuations
of contexts that share long prefixes (siblings after a fork, the next turn of a branch). Here
every finished sequence's KV is kept in a block-hashed prefix cache; a new prompt reuses the
longest cached common prefix and only its new suffix is run through the model. Identical
prompts within one call are prefilled once and then expanded. Rows with different cached
lengths are batched by left-padding the cached KV and the suffixes separately, leaving masked
holes; explicit position ids keep the maths identical to an unpadded forward. Prompts that join
a running call (`admit`, continuous batching) are prefilled as a batch of their own, whose rows
are then added to the running one the same way, after the running batch has dropped the columns
that only its ended rows attended to.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agentree.engines.base import (
    Admit,
    Completion,
    DoneSink,
    EngineStats,
    Params,
    SampledToken,
    SamplingParams,
    TokenSink,
    admitted,
    per_prompt,
    room_to_generate,
)
from agentree.hub.load import load_policy
from agentree.hub.pretrained import kv_shape

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each [kv_heads, seq, head_dim] for one sequence."""


@dataclass
class _Entry:
    tokens: list[int]
    kv: KV
    hashes: list[int]
    nbytes: int


class PrefixCache:
    """LRU store of per-sequence KV, looked up by longest common token prefix.

    Sequences are indexed by chained hashes of 16-token blocks (as in vLLM's prefix caching);
    the match is then extended token by token against the candidate, so any common prefix is
    reused, not only whole stored sequences. An entry that a new one extends is dropped.

    The blocks dropped for room (evicted, or too large to store) are remembered by hash, up to
    `GHOSTS` of them, so that a lookup can say how many of a prompt's tokens the cache had held
    and lost: `evicted_tokens` counts them, the recomputation a larger budget would have saved.
    """

    GHOSTS = 1 << 18
    """Most evicted block hashes remembered (about 30 MB of Python ints at most)."""

    def __init__(self, budget_bytes: int, block: int = 16) -> None:
        self.budget = budget_bytes
        self.block = block
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.index: dict[int, dict[int, None]] = {}
        self.nbytes = 0
        self._next_id = 0
        self.ghosts: OrderedDict[int, None] = OrderedDict()
        self.evicted_tokens = 0

    def _hashes(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        out, h, b = [], 0, self.block
        n = len(tokens) if limit is None else min(limit, len(tokens))
        for i in range(n // b):
            h = hash((h, tuple(tokens[i * b : (i + 1) * b])))
            out.append(h)
        return out

    def lookup(self, tokens: Sequence[int]) -> tuple[int | None, int]:
        """(entry id, common prefix length) of the best cached match, or (None, 0).

        Every entry holding the last matched block is extended token by token and the longest
        match wins: siblings that share whole blocks (copies of a path in a tree) differ only
        in their partial last block, and the most recent one is often not the right one.
        """
        hashes = self._hashes(tokens)
        held = next((i for i, h in enumerate(hashes) if h not in self.index), len(hashes))
        # the blocks after the last one held: held once, and dropped for room?
        lost = next((i for i, h in enumerate(hashes[held:]) if h not in self.ghosts), None)
        lost_to = (held + (len(hashes) - held if lost is None else lost)) * self.block
        if not held:
            self.evicted_tokens += lost_to
            return None, 0
        candidates, matched = self.index[hashes[held - 1]], held * self.block
        best, best_len = None, -1
        for eid in reversed(candidates):  # most recent first among equal matches
            entry = self.entries[eid]
            n, limit = matched, min(len(entry.tokens), len(tokens))
            while n < limit and entry.tokens[n] == tokens[n]:
                n += 1
            if n > best_len:
                best, best_len = eid, n
        assert best is not None
        if self.entries[best].tokens[:matched] != list(tokens[:matched]):  # hash collision
            return None, 0
        self.entries.move_to_end(best)
        self.evicted_tokens += max(0, lost_to - best_len)
        return best, best_len

    def insert(self, tokens: list[int], kv: KV, supersedes: int | None = None) -> None:
        if supersedes is not None and supersedes in self.entries:
            old = self.entries[supersedes]
            if len(old.tokens) <= len(tokens) and tokens[: len(old.tokens)] == old.tokens:
                self._remove(supersedes)
        nbytes = sum(k.numel() * k.element_size() * 2 for k, _ in kv)
        if len(tokens) < self.block:
            return
        hashes = self._hashes(tokens)
        if nbytes > self.budget:
            if self.budget:  # a cache turned off (0) drops nothing for room
                self._mark_dropped(hashes)
            return
        entry = _Entry(tokens, kv, hashes, nbytes)
        eid = self._next_id
        self._next_id += 1
        self.entries[eid] = entry
        for h in hashes:
            self.index.setdefault(h, {})[eid] = None
            self.ghosts.pop(h, None)
        self.nbytes += nbytes
        while self.nbytes > self.budget and self.entries:
            self._remove(next(iter(self.entries)), evicted=True)

    def _remove(self, eid: int, evicted: bool = False) -> None:
        entry = self.entries.pop(eid)
        self.nbytes -= entry.nbytes
        gone = []
        for h in entry.hashes:
            ids = self.index.get(h)
            if ids is not None:
                ids.pop(eid, None)
                if not ids:
                    del self.index[h]
                    gone.append(h)
        if evicted:
            self._mark_dropped(gone)

    def _mark_dropped(self, hashes: Sequence[int]) -> None:
        """Remember blocks dropped for room (the oldest memories go first)."""
        for h in hashes:
            self.ghosts[h] = None
        while len(self.ghosts) > self.GHOSTS:
            self.ghosts.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry (new weights: the KV is stale, not lost for room)."""
        self.entries.clear()
        self.index.clear()
        self.ghosts.clear()
        self.nbytes = 0


class _Batch:
    """Live rows sharing one padded KV cache; the decoding state of a generate call/session."""

    def __init__(self, engine: HFEngine, prompts: list[list[int]]) -> None:
        # deferred: transformers takes seconds to import, and this module's torch helpers
        # (sample_next for LATR) must not pay for it
        from transformers import DynamicCache

        self.engine = engine
        cache = engine.prefix_cache
        evicted = cache.evicted_tokens
        hits = [cache.lookup(p) for p in prompts]
        engine.stats.tokens_evicted += cache.evicted_tokens - evicted
        # Always recompute at least the last prompt token: its logits are not cached.
        reuse = [min(m, len(p) - 1) for (_, m), p in zip(hits, prompts, strict=True)]
        self.sources = [eid for eid, _ in hits]
        suffix = [p[r:] for p, r in zip(prompts, reuse, strict=True)]
        max_c, max_s = max(reuse), max(len(s) for s in suffix)
        dev = engine.device
        n = len(prompts)
        mask = torch.zeros(n, max_c + max_s, dtype=torch.long, device=dev)
        ids = torch.full((n, max_s), engine.pad_id, dtype=torch.long, device=dev)
        layers: KV = []
        if max_c:
            for li in range(engine.num_layers):
                # one allocation per layer; rows are left-padded copies of their cached prefix
                k_all = engine.empty_kv(max_c).unsqueeze(0).repeat(n, 1, 1, 1)
                v_all = k_all.clone()
                for i, (eid, c) in enumerate(zip(self.sources, reuse, strict=True)):
                    if c:
                        k, v = cache.entries[eid].kv[li]
                        k_all[i, :, max_c - c :] = k[:, :c]
                        v_all[i, :, max_c - c :] = v[:, :c]
                layers.append((k_all, v_all))
        for i, (c, s) in enumerate(zip(reuse, suffix, strict=True)):
            mask[i, max_c - c : max_c] = 1
            mask[i, max_c + max_s - len(s) :] = 1
            ids[i, max_s - len(s) :] = torch.tensor(s, device=dev)
        self.cache = DynamicCache(ddp_cache_data=layers) if layers else DynamicCache()
        self.mask = mask
        self.tokens = [list(p) for p in prompts]
        engine.stats.tokens_prefilled += sum(len(s) for s in suffix)
        engine.stats.tokens_cached += sum(reuse)
        engine.stats.tokens_forward += sum(len(s) for s in suffix)
        positions = (mask.cumsum(1) - 1).clamp(min=0)[:, max_c:]
        self.logits = self._forward(ids, positions)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.engine.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cache = out.past_key_values
        return out.logits[:, -1].float()

    def append(self, tokens: Sequence[int]) -> None:
        dev = self.engine.device
        n = len(tokens)
        positions = self.mask.sum(1, keepdim=True)
        self.mask = torch.cat([self.mask, torch.ones(n, 1, dtype=torch.long, device=dev)], 1)
        for row, t in zip(self.tokens, tokens, strict=True):
            row.append(int(t))
        ids = torch.tensor(list(tokens), dtype=torch.long, device=dev).unsqueeze(1)
        self.engine.stats.tokens_forward += n
        self.logits = self._forward(ids, positions)

    def select(self, rows: Sequence[int]) -> None:
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.engine.device)
        self.cache.batch_select_indices(idx)
        self.mask = self.mask[idx]
        self.logits = self.logits[idx]
        self.tokens = [list(self.tokens[r]) for r in rows]
        self.sources = [self.sources[r] for r in rows]

    def extend(self, other: _Batch) -> None:
        """Add `other`'s rows after these: the shorter cache is left-padded to the longer one
        (the padding masked), so every row keeps its own positions. The columns no row of
        this batch attends to any more go first: a call that prompts keep joining would
        otherwise grow one column a step for as long as it runs, its rows' own needs aside."""
        # deferred: as in __init__
        from transformers import DynamicCache

        used = self.mask.any(0).nonzero()
        first = int(used[0]) if len(used) else 0
        self.mask = self.mask[:, first:]
        width = max(self.mask.shape[1], other.mask.shape[1])

        def padded(t: torch.Tensor, dim: int) -> torch.Tensor:
            # zeros on the left of dimension `dim` (the sequence), up to `width`
            pad = [0, 0] * (t.dim() - 1 - dim) + [width - t.shape[dim], 0]
            return F.pad(t, pad)

        layers = [
            (
                torch.cat([padded(a.keys[:, :, first:], 2), padded(b.keys, 2)]),
                torch.cat([padded(a.values[:, :, first:], 2), padded(b.values, 2)]),
            )
            for a, b in zip(self.cache.layers, other.cache.layers, strict=True)
        ]
        self.cache = DynamicCache(ddp_cache_data=layers)
        self.mask = torch.cat([padded(self.mask, 1), padded(other.mask, 1)])
        self.logits = torch.cat([self.logits, other.logits])
        self.tokens += other.tokens
        self.sources += other.sources

    def row_kv(self, row: int) -> KV:
        keep = self.mask[row].nonzero().squeeze(1)
        return [
            (layer.keys[row][:, keep], layer.values[row][:, keep]) for layer in self.cache.layers
        ]

    def store(self, row: int) -> None:
        """Put row's KV (every token fed so far) into the prefix cache."""
        self.engine.prefix_cache.insert(self.tokens[row], self.row_kv(row), self.sources[row])


class HFSession:
    """`DecodeSession` over a `_Batch`: step-wise decoding with forks that copy KV rows."""

    def __init__(self, batch: _Batch, temperature: float) -> None:
        self.batch = batch
        self.temperature = temperature
        self._closed = False

    @property
    def num_rows(self) -> int:
        return len(self.batch.tokens)

    @property
    def tokens(self) -> list[list[int]]:
        """Each row's prompt plus every token appended so far."""
        return self.batch.tokens

    def next_logprobs(self) -> torch.Tensor:
        return F.log_softmax(self.batch.logits / max(self.temperature, 1e-6), dim=-1)

    @torch.no_grad()
    def fork(self, rows: Sequence[int]) -> None:
        self.batch.select(rows)

    @torch.no_grad()  # decoding must not build autograd graphs through the shared model
    def append(self, tokens: Sequence[int]) -> None:
        self.batch.engine.stats.tokens_generated += len(tokens)
        self.batch.append(tokens)

    def close(self, store: bool = True) -> None:
        """End the session; by default keep every row's KV in the prefix cache."""
        if self._closed:
            return
        self._closed = True
        if store:
            for r in range(self.num_rows):
                self.batch.store(r)


class HFEngine:
    """transformers backend; shares the model object with the trainer (no weight copies)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        prefix_cache_mb: int = 1024,
        max_batch_size: int = 256,
        seed: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.stats = EngineStats()
        self.prefix_cache = PrefixCache(prefix_cache_mb * 2**20)
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self._kv_heads, self._head_dim = kv_shape(cfg)
        self._max_len = max_model_len or getattr(cfg, "max_position_embeddings", 4096)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: str = "auto", device: str = "auto", **kwargs: Any
    ) -> HFEngine:
        model, tokenizer = load_policy(path, dtype=dtype, device=device)
        return cls(model, tokenizer, **kwargs)

    # -- protocol ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.model.config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    @property
    def max_model_len(self) -> int:
        return self._max_len

    def empty_kv(self, length: int = 0) -> torch.Tensor:
        return torch.zeros(
            self._kv_heads, length, self._head_dim, dtype=self.model.dtype, device=self.device
        )

    @torch.no_grad()
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
        each = per_prompt(prompts, params)
        seed = each[0].seed
        if seed is not None:
            self.generator.manual_seed(seed)
        self.stats.calls += 1
        asked = list(zip(prompts, each, strict=True))  # admitted prompts join at the end
        done: list[Completion | None] = [None] * sum(ps.n for ps in each)

        def more(free: int) -> list[_Prompt]:
            assert admit is not None
            joined = admitted(admit, free, seed)
            first = len(done)
            asked.extend(joined)
            done.extend([None] * sum(ps.n for _, ps in joined))
            return _distinct(joined, first)

        # Identical prompts are prefilled once; each occurrence still gets its own samples.
        groups = _distinct(asked, 0)
        was_training = self.model.training
        self.model.eval()
        try:
            start = 0
            while start < len(groups):
                stop, width = start, 0
                while stop < len(groups) and (
                    stop == start or width + len(groups[stop].rows) <= self.max_batch_size
                ):
                    width += len(groups[stop].rows)
                    stop += 1
                # only the last batch admits: none waits behind it
                joins = more if admit is not None and stop == len(groups) else None
                self._decode(groups[start:stop], done, on_token, on_done, joins)
                start = stop
        finally:
            self.model.train(was_training)
        out: list[list[Completion]] = []
        first = 0
        for _, ps in asked:
            out.append(done[first : first + ps.n])  # type: ignore[arg-type]  # all ended
            first += ps.n
        return out

    def _decode(
        self,
        groups: list[_Prompt],
        done: list[Completion | None],
        on_token: TokenSink | None,
        on_done: DoneSink | None,
        more: Callable[[int], list[_Prompt]] | None,
    ) -> None:
        """Decode `groups` in one batch until every row ends, each row its completion `label`
        in `done`; `on_token` hears each row's tokens and `on_done` its completion as it ends.
        Rows whose sampling agrees (temperature, top-p, top-k, log-probs, entropy) sample
        together; each row keeps its own limit and stops. After each step `more(free)` may
        bring prompts that join the batch (continuous batching)."""
        batch, rows = self._join(None, [], groups)
        while rows:
            sampled = self._sample([r.params for r in rows], batch.logits)
            keep: list[int] = []
            for i, (row, (t, lp, entropy, top)) in enumerate(zip(rows, sampled, strict=True)):
                row.add(t, lp, entropy, top)
                finish = "stop" if t in row.stops or row.stop_text.hit(row.tokens) else None
                last = len(row.tokens) == row.limit
                if on_token is not None:
                    gone = on_token(row.label, SampledToken(t, lp, top))  # its listener left
                    if gone and finish is None and not last:
                        finish = "abort"
                if finish is not None or last:
                    batch.store(i)
                    done[row.label] = row.completion(finish or "length")
                    if on_done is not None:
                        on_done(row.label, done[row.label])  # type: ignore[arg-type]
                else:
                    keep.append(i)
            self.stats.tokens_generated += len(rows)
            if len(keep) < len(rows):
                rows = [rows[i] for i in keep]
                if rows:
                    batch.select(keep)
            if rows:
                batch.append([r.tokens[-1] for r in rows])
            joining = more(self.max_batch_size - len(rows)) if more is not None else []
            if joining:
                batch, rows = self._join(batch if rows else None, rows, joining)

    def _join(
        self, batch: _Batch | None, rows: list[_Row], groups: list[_Prompt]
    ) -> tuple[_Batch, list[_Row]]:
        """`batch` and its `rows` with `groups` prefilled and added (a new batch for None)."""
        # each row's positions are its own: its room is what its prompt leaves
        rooms = [room_to_generate(g.prompt, self._max_len) for g in groups]
        new = _Batch(self, [g.prompt for g in groups])
        owner = [u for u, g in enumerate(groups) for _ in g.rows]
        if len(owner) > len(groups):
            new.select(owner)
        texts: dict[tuple[str, ...], _StopText] = {}
        eos = set(self.eos_token_ids)
        joined = [
            _Row(
                label=label,
                params=ps,
                limit=min(ps.max_tokens, room),
                stops=set(ps.stop_token_ids) | eos,
                stop_text=texts.setdefault(ps.stop, _StopText(self.tokenizer, ps.stop)),
            )
            for g, room in zip(groups, rooms, strict=True)
            for ps, label in g.rows
        ]
        if batch is None:
            return new, joined
        batch.extend(new)
        return batch, rows + joined

    def _sample(
        self, params: list[SamplingParams], logits: torch.Tensor
    ) -> list[tuple[int, float, float | None, dict[int, float] | None]]:
        """One (token, log-prob, entropy, top alternatives) per row of `logits`, each row
        drawn with its params: rows whose sampling agrees are drawn together, in the order
        their first row comes (one group, the usual call, is one `sample_next`)."""
        groups: dict[tuple, list[int]] = {}
        for r, p in enumerate(params):
            key = (p.temperature, p.top_p, p.top_k, p.logprobs, p.entropy)
            groups.setdefault(key, []).append(r)
        out: list[Any] = [None] * len(params)
        for members in groups.values():
            whole = len(members) == len(params)
            token, logprob, entropy, top = sample_next(
                logits if whole else logits[members], params[members[0]], self.generator
            )
            ents = entropy.tolist() if entropy is not None else [None] * len(members)
            found = top if top is not None else [None] * len(members)
            for r, t, lp, e, k in zip(
                members, token.tolist(), logprob.tolist(), ents, found, strict=True
            ):
                out[r] = (t, lp, e, k)
        return out

    @torch.no_grad()
    def open_session(self, prompts: Sequence[Sequence[int]], temperature: float = 1.0) -> HFSession:
        self.model.eval()
        self.stats.calls += 1
        return HFSession(_Batch(self, [list(p) for p in prompts]), temperature)

    def seed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def sync_weights(self, model: Any) -> None:
        """Adopt `model`'s weights; cached KV was computed by the old weights, so drop it."""
        if model is not self.model:
            self.model.load_state_dict(model.state_dict())
        self.prefix_cache.clear()

    def close(self) -> None:
        self.prefix_cache.clear()


@dataclass
class _Prompt:
    """A distinct prompt of a call and its rows: each sample's params and completion label."""

    prompt: list[int]
    rows: list[tuple[SamplingParams, int]]


def _distinct(asked: Sequence[tuple[Sequence[int], SamplingParams]], first: int) -> list[_Prompt]:
    """`asked` (prompts with their params) as distinct prompts, labelling completions from
    `first` on, prompt by prompt, `n` each: a repeated prompt is prefilled once."""
    groups: dict[tuple[int, ...], _Prompt] = {}
    for p, ps in asked:
        group = groups.setdefault(tuple(p), _Prompt(list(p), []))
        group.rows += [(ps, first + k) for k in range(ps.n)]
        first += ps.n
    return list(groups.values())


@dataclass
class _Row:
    """A live row of a decoding batch: the completion it builds."""

    label: int
    """Its completion's index in the call."""
    params: SamplingParams
    limit: int
    stops: set[int]
    stop_text: _StopText
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    tops: list[dict[int, float]] = field(default_factory=list)

    def add(
        self, token: int, logprob: float, entropy: float | None, top: dict[int, float] | None
    ) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if entropy is not None:
            self.entropies.append(entropy)
        if top is not None:
            self.tops.append(top)

    def completion(self, finish: str) -> Completion:
        return Completion(
            token_ids=self.tokens,
            logprobs=self.logprobs,
            finish_reason=finish,  # type: ignore[arg-type]
            top_logprobs=self.tops if self.params.logprobs else None,
            entropies=self.entropies if self.params.entropy else None,
        )


class _StopText:
    """Detects stop strings in a completion by decoding only its last few tokens."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        # every token decodes to at least one character, so this many tokens cover any stop
        self.window = max((len(s) for s in self.stops), default=0) + 1

    def hit(self, tokens: list[int]) -> bool:
        if not self.stops:
            return False
        tail = self.tokenizer.decode(tokens[-self.window :], skip_special_tokens=False)
        # we stop at the first occurrence, so any occurrence in the tail is new
        return any(s in tail for s in self.stops)


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[dict[int, float]] | None]:
    """Sample one token per row; log-probs are under the temperature-scaled distribution."""
    greedy = params.temperature <= 0
    logp = F.log_softmax(logits / (1.0 if greedy else params.temperature), dim=-1)
    if greedy:
        token = logp.argmax(-1)
    else:
        filtered = logp
        if params.top_k and params.top_k < logp.shape[-1]:
            kth = logp.topk(params.top_k, dim=-1).values[:, -1:]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_lp, order = filtered.sort(-1, descending=True)
            cum = sorted_lp.exp().cumsum(-1)
            drop = cum - sorted_lp.exp() > params.top_p  # keep the token that crosses top_p
            sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
            filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_lp)
        probs = filtered.exp()
        token = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator)
        token = token.squeeze(1)
    logprob = logp.gather(-1, token.unsqueeze(1)).squeeze(1)
    entropy = -(logp.exp() * logp).nan_to_num().sum(-1) if params.entropy else None
    top = None
    if params.logprobs:
        vals, idx = logp.topk(params.logprobs, dim=-1)
        top = [
            dict(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(idx, vals, strict=True)
        ]
    return token, logprob, entropy, top
