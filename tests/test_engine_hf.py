"""The transformers engine: exact log-probs, prefix reuse that changes nothing numerically."""

import pytest
import torch

from agentree.chat import ChatFormat
from agentree.engines.base import SampledToken, SamplingParams
from agentree.engines.hf import _Batch
from agentree.envs import make_env

_forward = _Batch._forward


def teacher_forced(engine, prompt, completion):
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logp = torch.log_softmax(engine.model(input_ids=ids).logits[0].float(), -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def prompts(engine, n=3):
    chat = ChatFormat(engine.tokenizer)
    env = make_env("frozenlake")
    out = []
    for seed in range(n):
        obs, _ = env.reset(seed=seed)
        out.append(chat.prompt_ids(obs, env.system_prompt))
    return chat, out


def test_sampled_logprobs_match_teacher_forcing(hf_engine):
    chat, ps = prompts(hf_engine)
    params = SamplingParams(max_tokens=10, stop_token_ids=chat.stop_token_ids, n=2)
    outs = hf_engine.generate(ps, params)
    assert [len(o) for o in outs] == [2, 2, 2]
    for p, comps in zip(ps, outs, strict=True):
        for c in comps:
            assert 1 <= len(c.token_ids) <= 10
            ref = teacher_forced(hf_engine, p, c.token_ids)
            assert max(abs(a - b) for a, b in zip(ref, c.logprobs, strict=True)) < 1e-4
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in chat.stop_token_ids


def test_prefix_cache_reuses_and_stays_exact(hf_engine):
    chat, ps = prompts(hf_engine, 2)
    params = SamplingParams(max_tokens=6, stop_token_ids=chat.stop_token_ids)
    first = hf_engine.generate(ps, params)
    before = hf_engine.stats.snapshot()
    nxt = [
        p + c[0].token_ids + chat.observation_ids("P _\n_ G", c[0].token_ids)
        for p, c in zip(ps, first, strict=True)
    ]
    second = hf_engine.generate(nxt, params)
    after = hf_engine.stats.snapshot()
    prefilled = after["tokens_prefilled"] - before["tokens_prefilled"]
    cached = after["tokens_cached"] - before["tokens_cached"]
    assert cached >= sum(len(p) for p in ps)  # the whole previous context came from the cache
    assert prefilled < sum(len(n) for n in nxt) - sum(len(p) for p in ps)
    for p, c in zip(nxt, second, strict=True):
        ref = teacher_forced(hf_engine, p, c[0].token_ids)
        assert max(abs(a - b) for a, b in zip(ref, c[0].logprobs, strict=True)) < 1e-4


def test_a_cache_too_small_says_what_it_recomputed_and_samples_the_same(tiny_frozenlake):
    """Two turns of 16 episodes on a 1 MiB cache (512 tokens of this model's KV, less than the
    16 histories after a turn, about 40 tokens each) and on a 64 MiB one, seeded alike: the
    second turn's prompts extend the first turn's; the small cache recomputes what it held and
    dropped, and says so (`tokens_evicted`), the large one drops nothing; the samples are the
    same."""
    from agentree.engines.hf import HFEngine

    seen = []
    for mb in (1, 64):
        engine = HFEngine.from_pretrained(tiny_frozenlake, seed=0, prefix_cache_mb=mb)
        chat, ps = prompts(engine, 16)
        params = SamplingParams(max_tokens=6, stop_token_ids=chat.stop_token_ids, seed=3)
        first = engine.generate(ps, params)
        nxt = [
            p + c[0].token_ids + chat.observation_ids("P _\n_ G", c[0].token_ids)
            for p, c in zip(ps, first, strict=True)
        ]
        second = engine.generate(nxt, params)
        seen.append(([c[0].token_ids for c in first + second], engine.stats.snapshot()))
        engine.close()
    (small_ids, small), (large_ids, large) = seen
    assert small_ids == large_ids
    assert large["tokens_evicted"] == 0 and large["tokens_cached"] >= sum(len(p) for p in ps)
    # it holds 12 of the 16 histories: the 4 it dropped lose their whole blocks (16 tokens
    # each, counted) and their partial last block (recomputed, not counted)
    assert small["tokens_evicted"] >= 4 * 16
    recomputed = small["tokens_prefilled"] - large["tokens_prefilled"]
    assert 0 < small["tokens_evicted"] <= recomputed


def test_identical_prompts_prefilled_once_but_sampled_independently(hf_engine):
    _chat, ps = prompts(hf_engine, 1)
    before = hf_engine.stats.tokens_prefilled
    outs = hf_engine.generate([ps[0]] * 6, SamplingParams(max_tokens=12, stop_token_ids=()))
    assert hf_engine.stats.tokens_prefilled - before == len(ps[0])
    assert len({tuple(o[0].token_ids) for o in outs}) > 1


def test_on_token_hears_every_token_of_every_completion_as_it_is_sampled(hf_engine, monkeypatch):
    """`on_token(i, t)` gets each completion's tokens in order (id, log-prob, alternatives: what
    the completion holds), `i` counting completions prompt by prompt, with repeated prompts
    (prefilled once) and calls split into several batches; each token is heard before the next
    decoding step (the step's forward is counted)."""
    chat, ps = prompts(hf_engine, 2)
    order = [ps[0], ps[1], ps[0], ps[0]]  # a repeated prompt, not adjacent
    params = SamplingParams(
        max_tokens=6, stop_token_ids=chat.stop_token_ids, n=2, seed=1, logprobs=2
    )
    monkeypatch.setattr(hf_engine, "max_batch_size", 3)  # three batches
    heard: dict[int, list[SampledToken]] = {}
    forwards: list[int] = []
    at: list[int] = []  # the forwards done when each token was heard
    monkeypatch.setattr(
        "agentree.engines.hf._Batch._forward",
        lambda self, *a: forwards.append(1) or _forward(self, *a),
    )

    def on_token(i: int, t: SampledToken) -> None:
        heard.setdefault(i, []).append(t)
        at.append(len(forwards))

    outs = hf_engine.generate(order, params, on_token)
    told = {
        i: [SampledToken(*x) for x in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True)]
        for i, c in enumerate(c for comps in outs for c in comps)
    }
    assert heard == told
    assert len(set(at)) >= 6  # heard between the decoding steps, not after the last
    again = hf_engine.generate(order, params)  # without the hook, the same draws
    assert [[c.token_ids for c in o] for o in outs] == [[c.token_ids for c in o] for o in again]


def test_a_completion_whose_listener_has_gone_ends_at_that_token(hf_engine):
    """`on_token` returning true ends that completion there (finish reason `abort`), in the
    middle of a batch, with the token it heard kept; the other completions, greedy, are what
    they are without it, repeated prompt included."""
    _, ps = prompts(hf_engine, 2)
    order = [ps[0], ps[1], ps[0]]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    plain = [o[0] for o in hf_engine.generate(order, params)]
    assert len(plain[1].token_ids) > 3  # long enough to be cut

    def on_token(i: int, _t: SampledToken) -> bool:
        heard[i] += 1
        return i == 1 and heard[i] == 3

    heard = [0, 0, 0]
    cut = [o[0] for o in hf_engine.generate(order, params, on_token)]
    assert cut[1].token_ids == plain[1].token_ids[:3] and cut[1].finish_reason == "abort"
    assert len(cut[1].logprobs) == 3
    for i in (0, 2):
        assert (cut[i].token_ids, cut[i].finish_reason) == (
            plain[i].token_ids,
            plain[i].finish_reason,
        )
    assert heard == [len(c.token_ids) for c in cut]


def scaled_logprobs(engine, prompt, temperature):
    """The log-probs of the first token after `prompt`, at `temperature`."""
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([list(prompt)])).logits[0, -1].float()
    return torch.log_softmax(logits / temperature, -1)


def test_params_per_prompt_give_each_prompt_its_own_call(hf_engine):
    """One call with params of its own for each prompt (other limits, stops, log-prob counts,
    entropy, `n`, temperatures) gives each prompt what a call of its own gives: greedy rows
    the same tokens, log-probs and alternatives; a sampled row its log-probs under its own
    temperature; a repeated prompt is still prefilled once."""
    _, ps = prompts(hf_engine, 3)
    each = [
        SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, stop_token_ids=()),
        SamplingParams(max_tokens=9, temperature=0.0, n=2, entropy=True),
        SamplingParams(max_tokens=5, temperature=0.5, logprobs=4, stop_token_ids=()),
        SamplingParams(max_tokens=7, temperature=0.0, stop=("e",), stop_token_ids=()),
    ]
    order = [ps[0], ps[1], ps[2], ps[0]]  # the last repeats the first with other params
    before = hf_engine.stats.snapshot()
    merged = hf_engine.generate(order, each)
    after = hf_engine.stats.snapshot()
    assert after["calls"] - before["calls"] == 1
    assert after["tokens_prefilled"] - before["tokens_prefilled"] == sum(map(len, ps))
    assert [len(c) for c in merged] == [1, 2, 1, 1]
    assert [len(c.token_ids) for c in merged[0]] == [3]
    assert merged[3][0].finish_reason == "stop" or len(merged[3][0].token_ids) == 7
    for p, sp, got in zip(order, each, merged, strict=True):
        alone = hf_engine.generate([p], sp)[0]
        for g, a in zip(got, alone, strict=True):
            if sp.temperature == 0:
                assert (g.token_ids, g.finish_reason) == (a.token_ids, a.finish_reason)
                assert g.logprobs == pytest.approx(a.logprobs, abs=1e-4)
                assert (g.entropies is None) == (not sp.entropy)
                if sp.entropy:
                    assert g.entropies == pytest.approx(a.entropies, abs=1e-4)
            else:
                ref = scaled_logprobs(hf_engine, p, sp.temperature)
                assert g.logprobs[0] == pytest.approx(ref[g.token_ids[0]].item(), abs=1e-4)
                assert len(g.token_ids) <= sp.max_tokens
            if sp.logprobs:
                assert all(len(t) == sp.logprobs for t in g.top_logprobs)
                # a sampled row's later positions follow its own draws: its first is compared
                k = len(g.top_logprobs) if sp.temperature == 0 else 1
                for gt, at in zip(g.top_logprobs[:k], a.top_logprobs[:k], strict=True):
                    assert list(gt) == list(at)
                    assert list(gt.values()) == pytest.approx(list(at.values()), abs=1e-4)
            else:
                assert g.top_logprobs is None


def test_on_done_hears_each_completion_as_it_ends(hf_engine):
    """`on_done(i, completion)` is told each completion once, the one `generate` returns, when
    it ends: a short row's before the long rows sample their next token."""
    _, ps = prompts(hf_engine, 2)
    each = [
        SamplingParams(max_tokens=2, temperature=0.0, stop_token_ids=()),
        SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=(), n=2),
    ]
    events: list[tuple[str, int]] = []
    ended: dict[int, object] = {}

    def on_done(i, c):
        events.append(("done", i))
        ended[i] = c

    out = hf_engine.generate(
        ps, each, on_token=lambda i, _t: events.append(("token", i)), on_done=on_done
    )
    flat = [c for comps in out for c in comps]
    assert sorted(ended) == [0, 1, 2] and all(ended[i] is c for i, c in enumerate(flat))
    for i, c in enumerate(flat):
        tokens = [k for k, (what, j) in enumerate(events) if what == "token" and j == i]
        assert len(tokens) == len(c.token_ids)
        assert events.index(("done", i)) == tokens[-1] + 1  # right after its last token
    if len(flat[1].token_ids) > 2:  # the long rows decode on after the short one ended
        assert events.index(("done", 0)) < max(
            k for k, (what, j) in enumerate(events) if what == "token" and j == 1
        )


def test_prompts_admitted_mid_call_get_what_calls_of_their_own_give(hf_engine):
    """Continuous batching (`admit`): prompts that join a running call after its third step,
    or after its own rows have all ended, get the tokens, log-probs and alternatives a call of
    their own gives; their completions are numbered after the call's own, heard by the hooks
    from when they join, and returned after the call's prompts; it stays one engine call."""
    _, ps = prompts(hf_engine, 3)
    first = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=())
    later = [
        SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, stop_token_ids=()),
        SamplingParams(max_tokens=4, temperature=0.0, n=2, stop_token_ids=()),
    ]
    for joins_at, limit in ((3, 12), (2, 2)):  # mid-call; after the call's own row ended
        asks: list[int] = []
        events: list[tuple[str, int]] = []

        def admit(free, joins_at=joins_at, asks=asks, events=events):
            asks.append(free)
            events.append(("ask", len(asks)))
            return ([ps[1], ps[2]], later) if len(asks) == joins_at else None

        own = SamplingParams(**{**first.__dict__, "max_tokens": limit})
        before = hf_engine.stats.calls
        out = hf_engine.generate(
            [ps[0]],
            own,
            on_token=lambda i, _t, events=events: events.append(("token", i)),
            on_done=lambda i, _c, events=events: events.append(("done", i)),
            admit=admit,
        )
        assert hf_engine.stats.calls - before == 1
        assert [len(c) for c in out] == [1, 1, 2]
        assert asks[0] == hf_engine.max_batch_size - 1  # what the live row leaves
        joined = events.index(("ask", joins_at))
        for label in (1, 2, 3):
            heard = [k for k, e in enumerate(events) if e == ("token", label)]
            assert heard and min(heard) > joined
            assert events.index(("done", label)) == heard[-1] + 1
        for p, sp, got in zip([ps[0], *ps[1:]], [own, *later], out, strict=True):
            alone = hf_engine.generate([p], sp)[0]
            for g, a in zip(got, alone, strict=True):
                assert (g.token_ids, g.finish_reason) == (a.token_ids, a.finish_reason)
                assert g.logprobs == pytest.approx(a.logprobs, abs=1e-4)
                if sp.logprobs:
                    assert [list(t) for t in g.top_logprobs] == [list(t) for t in a.top_logprobs]
    with pytest.raises(ValueError, match="call's seed"):
        hf_engine.generate(
            [ps[0]], first, admit=lambda _f: ([ps[1]], SamplingParams(seed=3, max_tokens=2))
        )


def test_a_call_that_prompts_keep_joining_stays_as_wide_as_its_live_rows_need(
    hf_engine, monkeypatch
):
    """One prompt joins at every step for 40 steps: the running batch sheds the columns only
    its ended rows attended to, so it never grows wider than a live row needs (its prompt and
    its tokens, and a joiner's), where it would otherwise grow a column a step; every joiner
    still gets what a call of its own gives."""
    _, ps = prompts(hf_engine, 3)
    sp = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=())
    widths: list[int] = []
    forward = _Batch._forward

    def recorded(batch, ids, positions):
        widths.append(batch.mask.shape[1])
        return forward(batch, ids, positions)

    monkeypatch.setattr(_Batch, "_forward", recorded)
    joiners = [ps[k % 3] for k in range(40)]
    out = hf_engine.generate(
        [ps[0]], sp, admit=lambda _free: ([joiners.pop(0)], sp) if joiners else None
    )
    assert len(out) == 41
    assert max(widths) <= max(map(len, ps)) + 2 * sp.max_tokens
    alone = [hf_engine.generate([p], sp)[0][0] for p in ps]
    for k, (got,) in enumerate(out):
        want = alone[0 if k == 0 else (k - 1) % 3]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_params_per_prompt_keep_one_seed_and_one_count(hf_engine):
    _, ps = prompts(hf_engine, 2)
    with pytest.raises(ValueError, match="one seed"):
        hf_engine.generate(ps, [SamplingParams(seed=1), SamplingParams(seed=2)])
    with pytest.raises(ValueError, match="1 sampling params for 2 prompts"):
        hf_engine.generate(ps, [SamplingParams()])


def test_each_row_has_the_room_its_own_prompt_leaves(hf_engine, monkeypatch):
    """Rows are positioned on their own, so a short prompt batched with a long one may run to
    its own limit: the context length bounds each row by its own prompt."""
    _, (short,) = prompts(hf_engine, 1)
    long = short + short[1:]
    monkeypatch.setattr(hf_engine, "_max_len", len(long) + 2)
    params = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=())
    got = hf_engine.generate([long, short], params)
    assert [len(c[0].token_ids) for c in got] == [2, 6]
    assert [c[0].finish_reason for c in got] == ["length", "length"]


def test_greedy_is_deterministic_and_topk_restricts(hf_engine):
    _, ps = prompts(hf_engine, 1)
    g = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=())
    a = hf_engine.generate(ps, g)[0][0].token_ids
    hf_engine.sync_weights(hf_engine.model)  # clears the cache: a cold run must agree
    assert hf_engine.generate(ps, g)[0][0].token_ids == a
    with torch.no_grad():
        top1 = hf_engine.model(input_ids=torch.tensor([ps[0]])).logits[0, -1].argmax().item()
    assert a[0] == top1
    k = SamplingParams(max_tokens=1, top_k=1, stop_token_ids=(), n=8)
    assert {o.token_ids[0] for o in hf_engine.generate(ps, k)[0]} == {top1}


def test_session_forks_copy_state(hf_engine):
    _, ps = prompts(hf_engine, 2)
    s = hf_engine.open_session(ps)
    s.fork([0, 0, 1])
    s.append([5, 6, 7])
    lp = s.next_logprobs()
    for row, (base, tok) in enumerate([(ps[0], 5), (ps[0], 6), (ps[1], 7)]):
        with torch.no_grad():
            logits = hf_engine.model(input_ids=torch.tensor([[*base, tok]])).logits[0, -1]
        assert (torch.log_softmax(logits.float(), -1) - lp[row]).abs().max() < 1e-4
    assert s.tokens[1] == ps[0] + [6]
    s.close()


def test_entropy_and_top_logprobs(hf_engine):
    _, ps = prompts(hf_engine, 1)
    c = hf_engine.generate(ps, SamplingParams(max_tokens=3, logprobs=3, entropy=True))[0][0]
    assert len(c.entropies) == len(c.top_logprobs) == len(c.token_ids)
    assert all(
        0 <= h <= torch.log(torch.tensor(len(hf_engine.tokenizer))).item() + 1e-4
        for h in c.entropies
    )
    assert all(len(t) == 3 for t in c.top_logprobs)


def test_prompt_longer_than_model_is_an_error(hf_engine):
    with pytest.raises(ValueError, match="no room"):
        hf_engine.generate([[1] * hf_engine.max_model_len], SamplingParams(max_tokens=4))


def test_stop_strings_end_completions(hf_engine):
    _, ps = prompts(hf_engine, 1)
    tok = hf_engine.tokenizer
    stops = ("```Up```", "```Down```", "```Left```", "```Right```")
    params = SamplingParams(max_tokens=40, stop=stops, stop_token_ids=(), n=16)
    for c in hf_engine.generate(ps, params)[0]:
        text = tok.decode(c.token_ids)
        hits = [s for s in stops if s in text]
        if c.finish_reason == "stop" and c.token_ids[-1] not in hf_engine.eos_token_ids:
            # the last token completed the stop (it may carry a character or two past it)
            before_last = tok.decode(c.token_ids[:-1])
            assert len(hits) == 1 and hits[0] not in before_last
        elif c.finish_reason == "stop":
            assert not hits
        else:
            assert not hits and len(c.token_ids) == 40


def test_cpu_gqa_attention_equals_transformers_sdpa(monkeypatch):
    """`load_policy` registers an `sdpa` that lets torch share KV heads on the CPU when a mask
    is given (transformers copies each KV head per query head there): on a grouped-query model
    with a left-padded batch, the logits and every gradient are transformers' own, and the
    shared-head kernel was the one that ran."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from agentree.algorithms import attention as hf

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(3, 64, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding of different lengths
    mask[1, :2] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        (logits[mask.bool()] ** 2).mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    shared = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **kw):
        shared.append(kw.get("enable_gqa", False))
        return sdpa(*a, **kw)

    monkeypatch.setattr(hf.F, "scaled_dot_product_attention", spy)
    try:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
        want, want_grads = run()
        AttentionInterface.register("sdpa", hf.cpu_gqa_sdpa)
        got, got_grads = run()
    finally:
        AttentionInterface.register("sdpa", hf.cpu_gqa_sdpa)
    # per layer: transformers' run copied the KV heads, this one shared them
    assert shared == [False, False, True, True]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
