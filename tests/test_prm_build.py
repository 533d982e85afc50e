"""A PRM on a Llama backbone, its value head fitted to FrozenLake's BFS labels: the checkpoint
loads through the `prm` scorer, the scorer scores each prefix as the builder's shared forward
pass saw it, the fit beats the constant predictor, and the metrics match a hand count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from agentree.models.prm_build import (
    PRMBuildConfig,
    _episode_examples,
    build_prm,
    fit_metrics,
    scripted_episodes,
)
from agentree.scorers import make_scorer


@pytest.fixture(scope="module")
def llama_dir(tiny_frozenlake: Path, tmp_path_factory) -> Path:
    """A small random Llama (the architecture SmolLM2 and Llama checkpoints have) on the tiny
    FrozenLake tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("llama") / "base"
    tok = AutoTokenizer.from_pretrained(tiny_frozenlake)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def prm_dir(llama_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prm") / "prm"
    cfg = PRMBuildConfig(episodes=16, iterations=300, steps=3, heldout=0.25)
    return build_prm(str(llama_dir), "frozenlake", out, cfg=cfg, log=lambda m: None)


def test_the_checkpoint_has_the_skywork_layout_and_a_report(prm_dir: Path) -> None:
    with safe_open(str(prm_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("v_head.summary.weight").shape == (1, 32)
        assert f.get_tensor("v_head.summary.bias").shape == (1,)
    assert any(n.startswith("model.layers.0.") for n in names)  # the backbone beside the head
    report = json.loads((prm_dir / "prm.json").read_text())
    assert report["labels"] == "bfs" and report["examples"]["heldout"] > 0
    # a bias started at the constant fit and a convex loss: the fit can only do better
    assert report["final_bce"] < report["constant_bce"]
    assert report["train"]["mse"] < report["train"]["mse_constant"]


def test_the_scorer_scores_every_prefix_as_the_builder_saw_it(prm_dir: Path) -> None:
    """Prefixes within the 3-step window share one forward pass in the builder; longer ones are
    encoded alone. Either way the value head's input must be what `score` computes."""
    scorer = make_scorer("prm", model=str(prm_dir), steps=3, device="cpu", dtype="float32")
    labeller = make_scorer("bfs")
    try:
        episodes = scripted_episodes("frozenlake", {}, PRMBuildConfig(episodes=8, seed=3))
        task, path = max(episodes, key=lambda e: len(e[1]))
        assert len(path) - 1 > 3  # the episode outgrows the window
        feats, labels = _episode_examples(scorer, labeller, task, path)
        with torch.no_grad():
            built = torch.sigmoid(scorer.v_head(feats)).squeeze(-1).tolist()
        scored = [s.value for s in scorer.score(task, [path[: k + 1] for k in range(1, len(path))])]
        assert scored == pytest.approx(built, abs=1e-5)
        assert len(labels) == len(scored)
    finally:
        scorer.close()


def test_an_env_without_labels_is_a_clear_error(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no process labels for env 'countdown'"):
        build_prm(str(llama_dir), "countdown", tmp_path / "x", log=lambda m: None)
    assert not (tmp_path / "x").exists()


def test_fit_metrics_by_hand() -> None:
    pred = torch.tensor([0.2, 0.6, 0.6, 0.9])
    y = torch.tensor([0.0, 1.0, 0.5, 0.5])
    m = fit_metrics(pred, y, torch.tensor([0.0, 1.0]))
    # squared errors 0.04, 0.16, 0.01, 0.16; the fit set's mean 0.5 gives 0.25, 0.25, 0, 0
    assert m["mse"] == pytest.approx(0.0925) and m["mse_constant"] == pytest.approx(0.125)
    # pairs with y_i > y_j: (1,0) right, (1,2) tie 0.5, (1,3) wrong, (2,0) right, (3,0) right
    assert m["pair_accuracy"] == pytest.approx(3.5 / 5)
    expected = torch.corrcoef(torch.stack([pred, y]))[0, 1].item()
    assert m["pearson"] == pytest.approx(expected, abs=1e-4)


def test_the_cli_builds_one_and_refuses_to_overwrite(llama_dir: Path, tmp_path: Path, capsys):
    from agentree.commands.cli import main

    out = tmp_path / "prm"
    args = ["models", "prm", "--base", str(llama_dir), "--env", "frozenlake", "--out", str(out)]
    assert main([*args, "--episodes", "4", "--set", "max_turns=4"]) == 0
    report = json.loads((out / "prm.json").read_text())
    assert report["config"]["episodes"] == 4 and report["env_kwargs"] == {"max_turns": 4}
    assert f"--scorer prm --set scorer.model={out}" in capsys.readouterr().out
    assert main(args) == 2  # an existing directory is never overwritten
    assert "exists; pass a new --out directory" in capsys.readouterr().err
