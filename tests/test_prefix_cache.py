"""The transformers engine's prefix cache finds the longest cached prefix among siblings."""

from __future__ import annotations

import torch

from agentree.engines.hf import PrefixCache


def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(1, n, 2), torch.zeros(1, n, 2))]


def test_lookup_picks_the_sibling_with_the_longest_match():
    cache = PrefixCache(budget_bytes=2**20, block=4)
    prompt = list(range(100, 108))  # two whole blocks shared by both entries
    a, b = [*prompt, 1, 2, 3], [*prompt, 4, 5, 6]
    cache.insert(a, kv(len(a)))
    cache.insert(b, kv(len(b)))  # the most recent entry holding the shared blocks
    ids = list(cache.entries)
    assert cache.lookup([*prompt, 1, 2, 3, 9]) == (ids[0], 11)
    assert cache.lookup([*prompt, 4, 5]) == (ids[1], 10)
    assert cache.lookup([*prompt, 7]) == (ids[1], 8)  # ties go to the most recent
    assert cache.lookup([*prompt[:3], 0]) == (None, 0)  # not even one whole block


def test_tokens_dropped_for_room_are_counted_when_a_prompt_needs_them_again():
    """A budget of 12 tokens (16 bytes a token here) holds one 8-token entry, not two: the
    second evicts the first, whose two blocks a later prompt then finds lost (8 tokens), the
    surviving entry's blocks and an entry superseded by its extension not; a re-stored block is
    no longer lost; an entry larger than the whole budget is lost at once; `clear` (new
    weights) forgets what was lost, since stale KV is not a cache too small; a cache turned off
    loses nothing."""
    cache = PrefixCache(budget_bytes=16 * 12, block=4)
    a, b = list(range(100, 108)), list(range(200, 208))
    cache.insert(a, kv(8))
    cache.insert(b, kv(8))
    assert [e.tokens for e in cache.entries.values()] == [b]
    assert cache.lookup([*a, 1, 2]) == (None, 0) and cache.evicted_tokens == 8
    assert cache.lookup([*b, 1, 2])[1] == 8 and cache.evicted_tokens == 8
    assert cache.lookup([*a[:4], 0, 0, 0, 0]) == (None, 0) and cache.evicted_tokens == 12
    (eid,) = cache.entries
    cache.insert([*b, 1, 2, 3, 4], kv(12), supersedes=eid)  # b extended: b's blocks live on
    assert cache.lookup([*b, 1, 2, 3, 4, 5])[1] == 12 and cache.evicted_tokens == 12
    cache.insert(a, kv(8))  # evicts the extended b: a's blocks are held again, b's lost
    assert cache.lookup(a)[1] == 8 and cache.evicted_tokens == 12
    assert cache.lookup([*b, 1, 2, 3, 4, 5]) == (None, 0) and cache.evicted_tokens == 24
    big = list(range(300, 316))
    cache.insert(big, kv(16))  # 256 bytes: never stored
    assert cache.lookup(big) == (None, 0) and cache.evicted_tokens == 40
    cache.clear()
    assert cache.lookup(big) == (None, 0) and cache.evicted_tokens == 40
    off = PrefixCache(budget_bytes=0, block=4)  # engine.prefix_cache_mb=0: nothing is lost
    off.insert(a, kv(8))
    assert off.lookup(a) == (None, 0) and off.evicted_tokens == 0


def test_a_partly_held_prompt_counts_only_the_lost_tokens_it_recomputes():
    """Two blocks held by one entry, the third lost: a prompt matching all three and two more
    tokens reuses the 8 held (and 1 token more of the entry's partial block), recomputes the
    3 lost ones left of the third block (its own first token was reused), and 2 new ones."""
    cache = PrefixCache(budget_bytes=16 * 12, block=4)
    held, lost = list(range(100, 108)), [7, 8, 9, 10]
    cache.insert([*held, *lost], kv(12))
    cache.insert([*held, 7], kv(9))  # evicts the first: of its blocks only the third is gone
    cache.insert(list(range(400, 412)), kv(12))  # evicts the 9
    cache.insert([*held, 7], kv(9))  # back, evicting the 400s
    assert cache.lookup([*held, *lost, 1, 2]) == (list(cache.entries)[-1], 9)
    assert cache.evicted_tokens == 3
