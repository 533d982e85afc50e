"""The vLLM engine on this machine's CPU with the tiny policy (opt-in: `pytest -m vllm`).

One policy engine for the whole session (start-up takes about a minute on CPU): a trainer built
with `engine.backend=vllm` owns it. Checks: PATR rollouts through the runtime, log-probs / top-k /
entropies equal the transformers model's teacher-forced values, stop rules, seeds, a call larger
than one step's token budget, the emulated decode session, weight updates in place (a perturbed
model and a trainer update; a model of other shapes refused without harm to the engine), the served
endpoint answering the judge client, and a close that leaves no engine process. The Skywork PRM on
vLLM starts its own short-lived engine; the `slow` tests start a client process each and kill it
(`-m "vllm and not slow"` skips them).
"""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path

import pytest
import torch
from helpers import interruptible, load_benchmark

pytest.importorskip(
    "vllm", reason="vLLM is not installed (GPU: pip install agentree[vllm]; CPU: docs/vllm.md)"
)

from agentree.config import load_config
from agentree.engines.base import SampledToken, SamplingParams
from agentree.engines.hf import HFEngine
from agentree.engines.vllm import VLLMEngine
from agentree.run.trainer import Trainer, make_batch, token_logprobs

pytestmark = pytest.mark.vllm

TOL = 1e-4
"""Log-prob agreement, float32 on both sides (vLLM's CPU kernels sum in another order)."""

# a second engine started beside the module's takes a small KV cache (a share of host memory)
SECOND_ENGINE_MEMORY = 0.05

SMALL = [
    "engine.backend=vllm",
    "train.tasks_per_step=2",
    "train.micro_batch_size=8",
    "train.lr=0.01",  # large on purpose: one step must visibly move the weights
    "engine.max_tokens=8",
    "env.max_turns=4",
    "rollout.K=2",
    "train.trees_every=0",
    "train.save_every=0",
]


@pytest.fixture(scope="session")
def trainer(tmp_path_factory: pytest.TempPathFactory, tiny_frozenlake):
    out = tmp_path_factory.mktemp("vllm-run")
    cfg = load_config("frozenlake_patr", select={"steps": "1", "output": str(out)}, overrides=SMALL)
    tr = Trainer(cfg, out, log=lambda s: None)
    yield tr
    tr.rt.close()


@pytest.fixture()
def engine(trainer) -> VLLMEngine:
    assert isinstance(trainer.rt.engine, VLLMEngine)
    return trainer.rt.engine


def prompt_ids(tok) -> list[int]:
    text = "<|im_start|>user\nP__G\n_O__\n___O\nWhich way?<|im_end|>\n<|im_start|>assistant\n"
    return tok.encode(text)


def teacher_forced(model, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    """[len(ids), vocab] log-softmax of the temperature-scaled logits (temperature 0 -> 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)


def sampled_drift(trainer, trees, controller=None, model=None) -> float:
    """Largest |recomputed - sampled| log-prob over every policy token of `trees`, recomputed
    by `model` (default: the trainer's)."""
    worst = 0.0
    for tree in trees:
        trajs = (controller or trainer.rt.controller).group(tree)
        batch = make_batch(trajs, [[1.0] * len(t.token_ids) for t in trajs], pad=0)
        with torch.no_grad():
            lp = token_logprobs(model or trainer.model, batch, trainer.cfg.engine.temperature)
        worst = max(worst, float(((lp - batch.sampled_lp).abs() * batch.mask).max()))
    return worst


def test_patr_rollout_through_the_runtime(trainer, engine) -> None:
    trees, stats = trainer.rt.rollouts.rollout(trainer.next_tasks(2))
    trajs = [t for tree in trees for t in trainer.rt.controller.group(tree)]
    assert len(trees) == 2 and len(trajs) >= 2 * trainer.cfg.rollout["B0"]
    assert stats.forks > 0 and stats.policy_tokens_generated > 0
    # branches share their history: vLLM's prefix cache serves part of every later turn
    assert stats.policy_tokens_cached > 0
    assert stats.policy_tokens_prefilled > 0
    assert sampled_drift(trainer, trees) < TOL


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_top_and_entropy_match_transformers(trainer, engine, temperature) -> None:
    prompt = prompt_ids(engine.tokenizer)
    params = SamplingParams(
        max_tokens=16, temperature=temperature, n=2, logprobs=3, entropy=True, seed=1
    )
    for c in engine.generate([prompt], params)[0]:
        assert len(c.logprobs) == len(c.token_ids) == len(c.entropies) == len(c.top_logprobs)
        lp = teacher_forced(trainer.model, prompt, c.token_ids, temperature)
        sampled = lp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(sampled, torch.tensor(c.logprobs), atol=TOL)
        entropy = -(lp.exp() * lp).sum(-1)
        assert torch.allclose(entropy, torch.tensor(c.entropies), atol=TOL)
        for row, top in zip(lp, c.top_logprobs, strict=True):
            vals, idx = row.topk(3)
            assert set(top) == set(idx.tolist())
            for i, v in zip(idx.tolist(), vals.tolist(), strict=True):
                assert top[i] == pytest.approx(v, abs=TOL)
        if temperature == 0:
            assert c.token_ids == lp.argmax(-1).tolist()


def test_stop_strings_stop_ids_and_truncation(trainer, engine) -> None:
    tok = engine.tokenizer
    prompt = prompt_ids(tok)
    stop_id = tok.convert_tokens_to_ids("a") if "a" in tok.get_vocab() else 5
    params = SamplingParams(max_tokens=40, stop=("o",), stop_token_ids=(stop_id,), n=8, seed=3)
    outs = engine.generate([prompt], params)[0]
    assert any(c.finish_reason == "stop" for c in outs)
    ends = {stop_id, *engine.eos_token_ids}
    for c in outs:
        text = tok.decode(c.token_ids, skip_special_tokens=False)
        before = tok.decode(c.token_ids[:-1], skip_special_tokens=False)
        if c.finish_reason == "length":
            assert len(c.token_ids) == 40 and "o" not in text
        elif c.token_ids[-1] in ends:  # the stop id is kept, as the transformers engine does
            assert "o" not in before
        else:  # a stop string: kept in the output, and it ended generation at once
            assert "o" in text and "o" not in before
    # top-k/top-p truncate the sampling distribution: only top-5 tokens are ever drawn
    params = SamplingParams(max_tokens=12, top_k=5, top_p=0.95, n=4, seed=4)
    for c in engine.generate([prompt], params)[0]:
        lp = teacher_forced(trainer.model, prompt, c.token_ids, 1.0)
        ranks = (lp > lp.gather(-1, torch.tensor(c.token_ids)[:, None])).sum(-1)
        assert int(ranks.max()) < 5


def test_seeds_repeat_and_equal_prompts_differ(trainer, engine) -> None:
    """On a policy with broad next-token distributions: the trained default policy is peaked
    enough that identical prompts often draw the same short reply, so its output layer is
    scaled down 50x (logits / 50: close to uniform over the vocabulary), where two draws of 12
    tokens agree by chance with probability far below 1e-6."""
    broad = copy.deepcopy(trainer.model)
    with torch.no_grad():
        broad.get_output_embeddings().weight.mul_(0.02)
    engine.sync_weights(broad)  # the same architecture: swapped in place
    try:
        prompt = prompt_ids(engine.tokenizer)
        p = SamplingParams(max_tokens=12, seed=7)
        a = engine.generate([prompt, prompt], p)
        b = engine.generate([prompt, prompt], p)
        assert [c[0].token_ids for c in a] == [c[0].token_ids for c in b]
        assert a[0][0].token_ids != a[1][0].token_ids  # identical prompts, separate draws
        q = SamplingParams(max_tokens=12)
        engine.seed(11)
        x = engine.generate([prompt], q)[0][0].token_ids
        engine.seed(11)
        assert engine.generate([prompt], q)[0][0].token_ids == x
        engine.seed(12)
        assert engine.generate([prompt], q)[0][0].token_ids != x
    finally:
        engine.sync_weights(trainer.model)


def test_a_call_whose_prompts_exceed_one_steps_token_budget(trainer, engine) -> None:
    """Prompts that together hold more tokens than vLLM schedules in one step. With chunked
    prefill (vLLM's default) the prompt at the budget's edge is split across two steps, and
    vLLM's CPU build then fails on a seeded request (its CPU generator has no offset to rewind),
    i.e. on every agentree request: the engine died with `EngineDeadError`. On CPU agentree
    prefills each prompt whole."""
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    # random ids of the tiny policy's 163-token vocabulary: no two prompts share a cache block,
    # so the prefix cache serves none
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 150) for _ in range(360)] for _ in range(budget // 360 + 4)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, seed=5))
    assert len(outs) == len(prompts) and all(c[0].token_ids for c in outs)
    again = engine.generate(prompts, SamplingParams(max_tokens=4, seed=5))
    assert [c[0].token_ids for c in again] == [c[0].token_ids for c in outs]


@pytest.mark.parametrize("hooks", ["none", "both", "on_done"])
def test_params_per_prompt_give_each_prompt_its_own_call(trainer, engine, hooks) -> None:
    """One call with params of its own for each prompt (limits, `n`, temperatures, log-prob
    counts, entropy), through `LLM.generate` or the streaming loop (either hook): greedy
    prompts answered as their own calls answer them, a sampled one with log-probs at its own
    temperature; `on_done` told each completion, the one returned, once."""
    tok = engine.tokenizer
    prompt = prompt_ids(tok)
    other = tok.encode("<|im_start|>user\nG__P\nWhich way?<|im_end|>\n<|im_start|>assistant\n")
    each = [
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=2),  # its reply is longer
        SamplingParams(max_tokens=9, temperature=0.0, n=2, entropy=True),
        SamplingParams(max_tokens=6, temperature=0.7, logprobs=4),
    ]
    order = [prompt, other, prompt]
    heard: list[int] = []
    ended: list[tuple[int, object]] = []
    merged = engine.generate(
        order,
        each,
        (lambda i, _t: heard.append(i)) if hooks == "both" else None,
        (lambda i, c: ended.append((i, c))) if hooks != "none" else None,
    )
    assert [len(c) for c in merged] == [1, 2, 1]
    assert (len(merged[0][0].token_ids), merged[0][0].finish_reason) == (1, "length")
    assert len(merged[2][0].token_ids) > 1  # the same prompt, its own limit
    if hooks == "both":
        assert sorted(set(heard)) == [0, 1, 2, 3]  # completions counted prompt by prompt
    if hooks != "none":
        flat = [c for comps in merged for c in comps]
        assert sorted(i for i, _ in ended) == [0, 1, 2, 3]
        assert all(c is flat[i] for i, c in ended)
        assert ended[0][0] == 0  # the one-token completion ends first
    for p, sp, got in zip(order, each, merged, strict=True):
        for c in got:
            lp = teacher_forced(trainer.model, p, c.token_ids, sp.temperature)
            sampled = lp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert torch.allclose(sampled, torch.tensor(c.logprobs), atol=TOL)
            assert (c.entropies is not None) == sp.entropy
            tops = c.top_logprobs or []
            assert (c.top_logprobs is not None) == bool(sp.logprobs)
            assert all(len(t) == sp.logprobs for t in tops)
            if sp.temperature == 0:
                alone = engine.generate([p], sp)[0][0]
                assert (c.token_ids, c.finish_reason) == (alone.token_ids, alone.finish_reason)


def test_on_token_hears_each_step_and_ends_a_completion_whose_listener_has_gone(
    trainer, engine, monkeypatch
) -> None:
    """With `on_token` (as `agentree serve` calls it) the engine runs its step loop itself: each
    token is heard as the step that sampled it returns (id, log-prob, alternatives, as the
    completion holds them), the draws are those of `LLM.generate`, and a completion whose
    listener answers true is aborted there (finish reason `abort`) while the others run on.
    On the broad policy of the seeds test, whose completions run long."""
    broad = copy.deepcopy(trainer.model)
    with torch.no_grad():
        broad.get_output_embeddings().weight.mul_(0.02)
    engine.sync_weights(broad)
    llm_engine = engine.llm.llm_engine
    steps: list[int] = []
    step = llm_engine.step
    monkeypatch.setattr(llm_engine, "step", lambda: steps.append(1) or step())
    try:
        prompt = prompt_ids(engine.tokenizer)
        params = SamplingParams(max_tokens=12, n=2, logprobs=2, seed=3)
        plain = engine.generate([prompt], params)[0]
        assert len(plain[1].token_ids) > 3  # long enough to be cut
        heard: list[tuple[int, SampledToken, int]] = []
        told = engine.generate([prompt], params, lambda i, t: heard.append((i, t, len(steps))))[0]
        for i, (a, b) in enumerate(zip(plain, told, strict=True)):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            assert (a.logprobs, a.top_logprobs) == (b.logprobs, b.top_logprobs)
            assert [t for j, t, _ in heard if j == i] == [
                SampledToken(*x) for x in zip(b.token_ids, b.logprobs, b.top_logprobs, strict=True)
            ]
        longest = max(len(c.token_ids) for c in plain)
        assert len({at for _, _, at in heard}) >= longest  # a step at a time, not at the end
        counts = [0, 0]

        def on_token(i: int, _t: SampledToken) -> bool:
            counts[i] += 1
            return i == 1 and counts[i] == 3

        cut = engine.generate([prompt], params, on_token)[0]
        assert (cut[0].token_ids, cut[0].finish_reason) == (
            plain[0].token_ids,
            plain[0].finish_reason,
        )
        assert cut[1].token_ids == plain[1].token_ids[:3] and cut[1].finish_reason == "abort"
        assert len(cut[1].logprobs) == 3 and not llm_engine.has_unfinished_requests()
    finally:
        monkeypatch.undo()
        engine.sync_weights(trainer.model)


def test_prompts_admitted_mid_call_get_what_calls_of_their_own_give(trainer, engine) -> None:
    """Continuous batching (`admit`): greedy requests that join the step loop after its second
    step get what calls of their own give (tokens, log-probs, alternatives), are numbered
    after the call's own, heard from when they join, and returned after it; one engine call.
    The call's own request samples the broad policy of the seeds test, so it runs long."""
    broad = copy.deepcopy(trainer.model)
    with torch.no_grad():
        broad.get_output_embeddings().weight.mul_(0.02)
    engine.sync_weights(broad)
    try:
        tok = engine.tokenizer
        prompt = prompt_ids(tok)
        other = tok.encode("<|im_start|>user\nG__P\nWhich way?<|im_end|>\n<|im_start|>assistant\n")
        own = SamplingParams(max_tokens=12, temperature=1.0)
        later = [
            SamplingParams(max_tokens=5, temperature=0.0, logprobs=2),
            SamplingParams(max_tokens=4, temperature=0.0, n=2),
        ]
        asks: list[int] = []
        events: list[tuple[str, int]] = []

        def admit(free):
            asks.append(free)
            events.append(("ask", len(asks)))
            return ([other, prompt], later) if len(asks) == 2 else None

        calls = engine.stats.calls
        out = engine.generate(
            [prompt],
            own,
            lambda i, _t: events.append(("token", i)),
            lambda i, _c: events.append(("done", i)),
            admit,
        )
        assert engine.stats.calls - calls == 1 and len(out[0][0].token_ids) > 3
        assert [len(c) for c in out] == [1, 1, 2]
        joined = events.index(("ask", 2))
        for label in (1, 2, 3):
            heard = [k for k, e in enumerate(events) if e == ("token", label)]
            assert heard and min(heard) > joined and ("done", label) in events[heard[-1] :]
        for p, sp, got in zip([other, prompt], later, out[1:], strict=True):
            alone = engine.generate([p], sp)[0]
            for g, a in zip(got, alone, strict=True):
                assert (g.token_ids, g.finish_reason) == (a.token_ids, a.finish_reason)
                assert g.logprobs == pytest.approx(a.logprobs, abs=TOL)
                assert (g.top_logprobs is None) == (not sp.logprobs)
        with pytest.raises(ValueError, match="call's seed"):
            engine.generate([prompt], own, admit=lambda _f: ([other], SamplingParams(seed=3)))
        assert not engine.llm.llm_engine.has_unfinished_requests()
    finally:
        engine.sync_weights(trainer.model)


def test_session_matches_the_transformers_session(trainer, engine) -> None:
    prompt = prompt_ids(engine.tokenizer)
    hf = HFEngine(trainer.model, engine.tokenizer)
    ours, ref = (e.open_session([prompt, prompt[:-2]], 0.8) for e in (engine, hf))
    try:
        for step in range(4):
            a, b = ours.next_logprobs(), ref.next_logprobs()
            assert a.shape == b.shape
            assert torch.allclose(a.exp(), b.exp(), atol=TOL)
            rows = [0, 0, 1] if step == 0 else list(range(ours.num_rows))
            ours.fork(rows)
            ref.fork(rows)
            tokens = [5 + step + 3 * i for i in range(ours.num_rows)]  # rows diverge
            ours.append(tokens)
            ref.append(tokens)
        assert ours.tokens == ref.tokens
    finally:
        ours.close()
        ref.close()


def test_latr_token_tree_through_the_emulated_session(trainer, engine) -> None:
    from agentree.rollout.base import make_controller

    latr = make_controller("latr", k=4, tau_abs=0.01, tau_rel=0.03)
    calls = engine.stats.extra["requests"]
    trees, stats = latr.rollout(trainer.next_tasks(2), trainer.rt.rollouts.context())
    assert engine.stats.extra["requests"] > calls
    assert all(len(latr.group(t)) >= 2 for t in trees)
    assert stats.policy_tokens_generated > 0
    assert sampled_drift(trainer, trees, latr) < TOL


def test_weight_sync_changes_outputs_in_place(trainer, engine) -> None:
    prompt = prompt_ids(engine.tokenizer)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    before = engine.generate([prompt], greedy)[0][0]
    perturbed = copy.deepcopy(trainer.model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    children = _engine_pids()
    engine.sync_weights(perturbed)
    assert _engine_pids() == children  # same processes: updated in place, no restart
    after = engine.generate([prompt], greedy)[0][0]
    expected = HFEngine(perturbed, engine.tokenizer).generate([prompt], greedy)[0][0]
    assert after.token_ids != before.token_ids
    assert after.token_ids == expected.token_ids
    assert after.logprobs == pytest.approx(expected.logprobs, abs=TOL)
    engine.sync_weights(trainer.model)
    assert engine.generate([prompt], greedy)[0][0].token_ids == before.token_ids
    # a model of another vocabulary is refused with a sentence, and the engine lives on
    wider = copy.deepcopy(trainer.model)
    wider.resize_token_embeddings(wider.config.vocab_size + 64)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.sync_weights(wider)
    assert engine.generate([prompt], greedy)[0][0].token_ids == before.token_ids


def test_trainer_updates_reach_the_engine(trainer, engine) -> None:
    syncs = engine.stats.extra["weight_syncs"]
    metrics = trainer.train_step()  # rollout, update, sync_weights
    assert engine.stats.extra["weight_syncs"] == syncs + 1
    assert metrics["rollout/trajectories"] > 0
    # an update that surely moves the weights: the first trajectory of each group wins
    trees, _ = trainer.rt.rollouts.rollout(trainer.next_tasks(2))
    groups = [trainer.rt.controller.group(t) for t in trees]
    for g in groups:
        g[0].reward = 1.0
    old = copy.deepcopy(trainer.model)
    trainer.update(trees, groups)
    trainer.rt.engine.sync_weights(trainer.model)  # what train_step does after its update
    trees, _ = trainer.rt.rollouts.rollout(trainer.next_tasks(2))
    assert sampled_drift(trainer, trees) < TOL  # sampled by the updated weights
    assert sampled_drift(trainer, trees, model=old) > 10 * TOL  # ...which differ from the old


def test_served_endpoint_answers_the_judge(trainer, engine) -> None:
    from test_judge import GREP, branch, heuristic_of, judge

    from agentree.commands.serve import OpenAIServer, ServerHandle
    from agentree.policy import resolve_backend

    assert resolve_backend("auto") == "vllm"  # `agentree serve` picks vLLM when installed
    api = OpenAIServer(engine, engine.tokenizer, "tiny-judge")
    with ServerHandle(api, "127.0.0.1", 0).start() as handle:
        import openai

        client = openai.OpenAI(base_url=handle.url, api_key="EMPTY", timeout=60, max_retries=0)
        r = client.chat.completions.create(
            model="tiny-judge",
            messages=[{"role": "user", "content": "score?"}],
            max_tokens=8,
            logprobs=True,
            top_logprobs=2,
        )
        assert r.usage.completion_tokens >= 1
        assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
        # streamed (the engine's steps tell each token): the deltas join to the unstreamed
        # reply drawn with the same seed
        req = {"model": "tiny-judge", "messages": [{"role": "user", "content": "go"}]}
        whole = client.chat.completions.create(**req, max_tokens=8, seed=5).choices[0]
        parts = [
            c.choices[0]
            for c in client.chat.completions.create(**req, max_tokens=8, seed=5, stream=True)
        ]
        assert "".join(p.delta.content or "" for p in parts) == whole.message.content
        assert parts[-1].finish_reason == whole.finish_reason
        j = judge(handle.url, model="tiny-judge", max_tokens=16, retries=0)
        scores = j.score(None, [branch(GREP)])
        j.close()
    # the tiny policy writes random tokens: the server answers, the reply is unusable
    assert scores[0].info["reply"] is not None
    assert scores[0].info["fallback"] == "heuristic"
    assert scores[0].value == pytest.approx(heuristic_of(branch(GREP)))


def test_skywork_prm_on_vllm_matches_transformers(tmp_path_factory) -> None:
    """The PRM scorer with backend vllm (a second, short-lived engine) scores as transformers."""
    from test_prm import swe_branch

    from agentree.hub.tiny import TinyModelConfig
    from agentree.hub.tiny_prm import build_tiny_prm
    from agentree.scorers.prm import PRMConfig, PRMScorer

    shape = TinyModelConfig(  # head_dim 32, the smallest the CPU attention kernels take
        vocab_size=512, min_frequency=2, hidden_size=128, num_heads=4, num_kv_heads=2
    )
    path = str(build_tiny_prm(tmp_path_factory.mktemp("prm") / "tiny", shape))
    branches = [swe_branch(n) for n in (1, 3, 6)]
    ref = PRMScorer(PRMConfig(model=path, device="cpu", dtype="float32"))
    expected = ref.score(None, branches)
    ref.close()
    before = _engine_pids()
    small = {"gpu_memory_utilization": SECOND_ENGINE_MEMORY}
    prm = PRMScorer(PRMConfig(model=path, backend="vllm", dtype="float32", vllm=small))
    try:
        got = prm.score(None, branches)
    finally:
        prm.close()
    assert _engine_pids() == before
    for a, b in zip(expected, got, strict=True):
        assert len(b.info["step_scores"]) == len(a.info["step_scores"]) > 0
        assert b.info["step_scores"] == pytest.approx(a.info["step_scores"], abs=TOL)
        assert b.value == pytest.approx(a.value, abs=TOL)


def test_the_mechanism_benchmark_on_vllm(tmp_path, tiny_frozenlake) -> None:
    """benchmarks/tree_mechanism.py with `engine.backend=vllm` (its own short-lived engine, as a
    GPU user runs it for a real LM): every method keeps the exact budget and counts its forward
    tokens, each level is written per task, and the close leaves no engine process."""
    bench = load_benchmark("tree_mechanism")
    before = _engine_pids()
    out = tmp_path / "mech"
    summary = bench.main(
        [
            *("--out", str(out), "--policy", str(tiny_frozenlake), "--tasks", "2"),
            *("--budget", "12", "--temperatures", "1", "--methods", "grpo", "patr"),
            *("--batch", "2", "--set", "engine.backend=vllm", "--set", "env.max_turns=4"),
            *("--set", "engine.max_tokens=8"),
            *("--set", f"engine.vllm.gpu_memory_utilization={SECOND_ENGINE_MEMORY}"),
        ]
    )
    assert _engine_pids() == before
    mech = summary["mechanism"]["frozenlake"]
    for m in ("grpo", "patr"):
        # at most 12 env steps a task, at least 12 - max_turns
        assert 12 - 4 <= mech[m]["env_steps_per_task"][0] <= 12
        assert mech[m]["forward_tokens_per_step"][0] > 0
    level_file = out / "frozenlake" / "patr" / f"{tiny_frozenlake.name}-T1.json"
    level = json.loads(level_file.read_text())
    assert level["counts"]["trajectories"] >= 2 and len(level["counts"]["mixed_by_task"]) == 2


CLIENT = """
import sys
from agentree.engines.base import SamplingParams
from agentree.engines.vllm import VLLMEngine
if __name__ == "__main__":
    engine = VLLMEngine(sys.argv[1], dtype="float32", gpu_memory_utilization=float(sys.argv[2]))
    print("CLIENT-READY", engine.llm._agentree_sockets, flush=True)
    while True:
        engine.generate([[5, 6, 7] * 20], SamplingParams(max_tokens=64, n=8))
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "interrupt"])
def test_a_dead_client_leaves_no_engine_process(tiny_frozenlake, tmp_path, how) -> None:
    """SIGKILL (no finalisers run) or Ctrl-C (SIGINT to the process group) mid-generation:
    no engine process is left, nor the engine's sockets."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    log = tmp_path / "client.log"  # a file, not a pipe: nobody has to keep reading it
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, str(tiny_frozenlake), str(SECOND_ENGINE_MEMORY)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal would give it
            preexec_fn=interruptible,
        )
    engine: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 600
        while "CLIENT-READY" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, _root_cause(log.read_text())
            time.sleep(1)
        time.sleep(2)
        engine = psutil.Process(proc.pid).children(recursive=True)
        assert any("VLLM" in p.name() for p in engine)
        if how == "kill":
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            alive = [p for p in engine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            if not alive:
                break
            time.sleep(0.5)
        assert not alive, [p.name() for p in alive]
        # the engine's sockets went with it (its watchdog removes their directory)
        sockets = Path(log.read_text().split("CLIENT-READY", 1)[1].split()[0])
        assert sockets.name.startswith("agentree-vllm-ipc-") and not sockets.exists()
    finally:  # whatever happened, leave nothing behind
        proc.kill()
        for p in engine:
            if p.is_running():
                p.kill()


AFTER_IN_PROCESS = """
import sys
from pathlib import Path
from agentree.engines.vllm import VLLMEngine
if __name__ == "__main__":
    first = VLLMEngine(sys.argv[1], dtype="float32", gpu_memory_utilization=float(sys.argv[2]),
                       in_process=True)
    second = VLLMEngine(sys.argv[1], dtype="float32", gpu_memory_utilization=float(sys.argv[2]),
                        in_process=False)
    own, before = Path(second.llm._agentree_sockets), Path(first.llm._agentree_sockets)
    print("OWN", sorted(p.name for p in own.iterdir() if p.is_socket()), flush=True)
    print("FIRST", sorted(p.name for p in before.iterdir()), flush=True)
    second.close()
    first.close()
    print("LEFT", own.exists(), before.exists(), flush=True)
"""


@pytest.mark.slow
def test_an_engine_started_after_an_in_process_one_keeps_its_own_sockets(
    tiny_frozenlake, tmp_path
) -> None:
    """An in-process engine core freezes vLLM's view of the environment (`enable_envs_cache`);
    an engine started after it in the same process still puts its sockets in its own
    directory, and both directories are gone after close."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", AFTER_IN_PROCESS, str(tiny_frozenlake), str(SECOND_ENGINE_MEMORY)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout
    assert done.returncode == 0, _root_cause(done.stdout + done.stderr)
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines()}
    assert lines["OWN"] != "[]"  # the second engine's client sockets, in its directory
    assert lines["FIRST"] == "[]"  # none strayed into the first engine's
    assert lines["LEFT"] == "False False"


def _root_cause(log: str) -> str:
    """A failed engine start's log: vLLM's ERROR lines (the engine core's root cause is logged
    there, far above the client's traceback) and the tail."""
    errors = [line for line in log.splitlines() if "ERROR" in line or "Error:" in line]
    return "\n".join(errors[:40]) + "\n...\n" + log[-1500:]


def test_close_leaves_no_engine_process(trainer, engine) -> None:
    """Nor a socket: vLLM's IPC sockets sit in the engine's own directory, removed on close."""
    assert _engine_pids()  # the engine core runs in a child process
    sockets = Path(engine.llm._agentree_sockets)
    assert any(p.is_socket() for p in sockets.iterdir())
    trainer.rt.close()
    assert _engine_pids() == set()
    assert not sockets.exists()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    trainer.rt.close()  # idempotent


def _engine_pids() -> set[int]:
    """Live (not zombie) descendants of this process that vLLM started."""
    import psutil

    out = set()
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(
                p.cmdline()
            ):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out
