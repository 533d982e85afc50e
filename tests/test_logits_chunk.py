"""Log-probs through the output layer in slices of tokens (`train.logits_chunk`) equal the
log-probs of the full logits, with the same gradients, in both update layouts; the model's
ordinary logits come back afterwards (the engine shares the module)."""

from __future__ import annotations

import pytest
import torch

from agentree.algorithms.packing import batch_logprobs, make_batch, pack
from agentree.tree import EndReason, Tree

TOL = {"rtol": 1e-4, "atol": 1e-6}  # fp32; slices and the full matrix differ in summation order


def random_tree(vocab: int, seed: int = 0) -> Tree:
    """A prompt of 12 tokens with two branches of two turns each, one of which forks again:
    shared prefixes (packed rows) and trajectories of different lengths (padding)."""
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    t = Tree("chunks")
    t.add_root("p", toks(12))
    for _ in range(2):
        node = t.add_child(0, action_ids=toks(6), logprobs=[-1.0] * 6, obs_ids=toks(4))
        t.add_child(
            node.id, action_ids=toks(5), logprobs=[-1.0] * 5, end_reason=EndReason.COMPLETED
        )
    t.add_child(1, action_ids=toks(3), logprobs=[-1.0] * 3, end_reason=EndReason.COMPLETED)
    return t


@pytest.fixture(scope="module")
def model(tiny_frozenlake):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_frozenlake, dtype=torch.float32)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_gradients_equal_full_logits(model, layout, temperature):
    group = random_tree(model.config.vocab_size).trajectories()
    advs = [[1.0] * len(t.token_ids) for t in group]
    b = make_batch(group, advs, 0) if layout == "padded" else pack([group], [advs], 0)
    weight = torch.randn(make_batch(group, advs, 0).mask.shape, generator=torch.Generator())
    weight = weight * make_batch(group, advs, 0).mask

    def run(chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        lp = batch_logprobs(model, b, temperature, chunk)
        (lp * weight).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    full, g_full = run(0)
    n_tokens = int(b.ids.numel())
    assert n_tokens > 3 * 5  # several slices, the last one short
    for chunk in (5, 7, n_tokens + 1):
        lp, g = run(chunk)
        torch.testing.assert_close(lp, full, **TOL)
        for n in g_full:
            torch.testing.assert_close(g[n], g_full[n], **TOL)
        with torch.no_grad():
            torch.testing.assert_close(batch_logprobs(model, b, temperature, chunk), full)
    # the comparison can fail: the weighted log-probs reach every parameter
    assert all(float(v.abs().max()) > 0 for v in g_full.values())
    # the head is an ordinary output layer again
    logits = model(input_ids=b.ids[:1]).logits
    assert logits.shape[-1] == model.config.vocab_size


def test_dry_run_counts_one_slice_of_logits():
    """The memory estimate holds the fp32 logits and log-softmax (8 bytes a vocabulary entry)
    of one slice of tokens, not of the whole micro-batch."""
    from pathlib import Path

    from agentree.config import load_config
    from agentree.run.plan import estimate

    recipe = Path(__file__).parent.parent / "agentree" / "configs" / "swebench_patr_qwen3_8b.yaml"
    act = {
        c: estimate(load_config(str(recipe), overrides=[f"train.logits_chunk={c}"]))["per_rank"][
            "activations"
        ]
        for c in (0, 2048)
    }
    tokens, vocab = 32768, 151936  # the recipe's micro-batch (1 x max_context), Qwen3's vocab
    assert act[0] - act[2048] == 8 * (tokens - 2048) * vocab
