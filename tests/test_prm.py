"""PRM scorer on a tiny Skywork-layout PRM: the checkpoint layout, step rewards against an
independent re-implementation of Skywork's reference inference, batching, truncation that keeps
the task and the newest steps, aggregation, sharded checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentree.hub.tiny_prm import build_tiny_prm
from agentree.scorers import make_scorer
from agentree.scorers.prm import PRMScorer
from agentree.tree import Tree

ISSUE = "<issue>\nParser.parse crashes on empty input\n</issue>\nFix it in /testbed."


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory) -> Path:
    return build_tiny_prm(tmp_path_factory.mktemp("prm") / "tiny-prm")


@pytest.fixture(scope="module")
def scorer(prm_dir) -> PRMScorer:
    s = make_scorer("prm", model=str(prm_dir), device="cpu", dtype="float32")
    yield s
    s.close()


def swe_branch(n: int, problem: str = ISSUE) -> list:
    """A chain of `n` SWE-like steps (multi-line actions and observations)."""
    tree = Tree("t")
    node = tree.add_root(problem, []).id
    for i in range(n):
        node = tree.add_child(
            node,
            action=f"THOUGHT: look at part {i}.\n\n```bash\ngrep -rn 'part{i}' src/\n```",
            observation=f"<returncode>0</returncode>\n<output>\nsrc/p{i}.py:{i}: x\n</output>",
            reward=0.0,
            info={"env": {"returncode": 0}},
        ).id
    return tree.path(node)


def reference_step_rewards(prm_dir: Path, problem: str, response: str) -> tuple[list, list]:
    """Skywork-o1-PRM reference inference, written out independently of agentree.scorers.prm:
    prepare_input (BOS + problem + newline, each step tokenized on its own and followed by the
    id of "\\n"), the full causal LM with output_hidden_states, ValueHead on hidden_states[-1],
    sigmoid at the flagged positions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prm_dir)
    prompt_ids = tok.encode(tok.bos_token + problem + "\n")
    step_token_id = tok.encode("\n")[-1]
    input_ids, flags = list(prompt_ids), [0] * len(prompt_ids)
    for step in response.split("\n"):
        if step == "":
            break
        ids = [*tok.encode(step), step_token_id]
        input_ids += ids
        flags += [0] * (len(ids) - 1) + [1]
    lm = AutoModelForCausalLM.from_pretrained(prm_dir, dtype=torch.float32).eval()
    weights = load_file(prm_dir / "model.safetensors")
    head = torch.nn.Linear(lm.config.hidden_size, 1)
    head.load_state_dict(
        {"weight": weights["v_head.summary.weight"], "bias": weights["v_head.summary.bias"]}
    )
    with torch.no_grad():
        out = lm(input_ids=torch.tensor([input_ids]), output_hidden_states=True)
        value = head(out.hidden_states[-1]).squeeze(-1)[0]
    rewards = [torch.sigmoid(value[i]).item() for i, f in enumerate(flags) if f]
    return input_ids, rewards


def test_tiny_prm_has_the_released_layout(prm_dir: Path) -> None:
    config = json.loads((prm_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForPrmModel"] and config["model_type"] == "qwen2"
    weights = load_file(prm_dir / "model.safetensors")
    hidden = config["hidden_size"]
    assert weights["v_head.summary.weight"].shape == (1, hidden)
    assert weights["v_head.summary.bias"].shape == (1,)
    assert any(k.startswith("model.layers.0.") for k in weights)
    special = json.loads((prm_dir / "tokenizer_config.json").read_text())
    assert special["bos_token"] == "<|im_start|>" and special["eos_token"] == "<|im_end|>"


def test_step_rewards_match_the_reference_computation(scorer: PRMScorer, prm_dir: Path) -> None:
    branch = swe_branch(3)
    score = scorer.score(None, [branch])[0]
    response = "\n".join(scorer.step_texts(branch))
    ids, expected = reference_step_rewards(prm_dir, ISSUE, response)
    got_ids, flags, _ = scorer.encode(ISSUE, scorer.step_texts(branch))
    assert got_ids == ids
    assert len(flags) == 3 and all(got_ids[f] == scorer.separator_id for f in flags)
    assert score.info["step_scores"] == pytest.approx(expected, abs=1e-5)
    assert score.value == pytest.approx(expected[-1], abs=1e-5)  # paper: the last step's score
    assert len(set(round(x, 4) for x in expected)) > 1  # a head that reads the input


def test_serialisation_is_one_line_per_step(scorer: PRMScorer) -> None:
    branch = swe_branch(2)
    texts = scorer.step_texts(branch)
    assert len(texts) == 2 and all("\n" not in t for t in texts)
    assert texts[0].startswith("Step 1: Action: THOUGHT: look at part 0.\\n\\n```bash")
    assert "| Observation: <returncode>0</returncode>\\n<output>" in texts[0]
    assert texts[1].endswith("| Reward: 0")
    info = scorer.score(None, [branch])[0].info
    assert info["input"].startswith("<|im_start|>" + ISSUE + "\nStep 1: ")
    assert info["input"].count("\nStep ") == 2


def test_batched_scores_equal_one_by_one(prm_dir: Path, scorer: PRMScorer) -> None:
    branches = [swe_branch(n) for n in (1, 4, 2, 6, 3)]
    batched = PRMScorer(scorer.config.model_copy(update={"batch_size": 3}))
    one = PRMScorer(scorer.config.model_copy(update={"batch_size": 1}))
    a = batched.score(None, branches)
    b = one.score(None, branches)
    for x, y in zip(a, b, strict=True):
        assert x.info["step_scores"] == pytest.approx(y.info["step_scores"], abs=1e-5)
    assert [len(x.info["step_scores"]) for x in a] == [1, 4, 2, 6, 3]


def test_only_the_most_recent_steps_are_serialised(scorer: PRMScorer) -> None:
    s = PRMScorer(scorer.config.model_copy(update={"steps": 10}))
    info = s.score(None, [swe_branch(14)])[0].info
    assert (info["steps_total"], info["steps_seen"]) == (14, 10)
    assert "Step 5: " in info["input"] and "Step 4: " not in info["input"]
    assert "Step 14: " in info["input"]


def test_truncation_keeps_the_task_and_the_newest_steps(scorer: PRMScorer) -> None:
    s = PRMScorer(scorer.config.model_copy(update={"max_length": 400}))
    info = s.score(None, [swe_branch(10)])[0].info
    assert info["tokens"] <= 400
    assert 0 < info["steps_seen"] < 10 and not info["truncated_problem"]
    assert info["input"].startswith("<|im_start|>" + ISSUE + "\n")
    assert "Step 10: " in info["input"] and "Step 1: " not in info["input"]
    assert len(info["step_scores"]) == info["steps_seen"]


def test_long_task_is_cut_to_its_head(scorer: PRMScorer) -> None:
    long_issue = ISSUE + " details" * 400
    s = PRMScorer(scorer.config.model_copy(update={"max_length": 300, "max_problem_tokens": 64}))
    info = s.score(None, [swe_branch(3, long_issue)])[0].info
    assert info["truncated_problem"] and info["problem_tokens"] > 64
    assert info["input"].startswith("<|im_start|><issue>\nParser.parse crashes")
    assert info["steps_seen"] >= 1 and "Step 3: " in info["input"]
    assert info["tokens"] <= 300


def test_a_newest_step_longer_than_the_budget_keeps_head_and_tail(scorer: PRMScorer) -> None:
    tree = Tree("t")
    tree.add_root(ISSUE, [])
    n = tree.add_child(0, action="```bash\npytest\n```", observation="y" * 3000 + "THE END")
    s = PRMScorer(scorer.config.model_copy(update={"max_length": 200}))
    sc = s.score(None, [tree.path(n.id)])[0]
    assert sc.info["clipped_step"] and sc.info["tokens"] == 200
    assert sc.info["input"].endswith("Reward: 0\n")
    assert 0.0 <= sc.value <= 1.0


@pytest.mark.parametrize("mode", ["last", "mean", "max", "min", "weighted"])
def test_aggregation(scorer: PRMScorer, mode: str) -> None:
    s = PRMScorer(scorer.config.model_copy(update={"aggregate": mode, "last_weight": 0.25}))
    sc = s.score(None, [swe_branch(5)])[0]
    r = sc.info["step_scores"]
    mean = sum(r) / len(r)
    expected = {
        "last": r[-1],
        "mean": mean,
        "max": max(r),
        "min": min(r),
        "weighted": 0.25 * r[-1] + 0.75 * mean,
    }[mode]
    assert sc.value == pytest.approx(expected, abs=1e-6)
    assert sc.info["aggregate"] == mode


def test_a_branch_without_steps_is_unscored(scorer: PRMScorer) -> None:
    tree = Tree("t")
    tree.add_root(ISSUE, [])
    assert scorer.score(None, [tree.path(0)])[0].value is None
    assert scorer.score(None, []) == []


def test_sharded_checkpoint_with_index(prm_dir: Path, scorer: PRMScorer, tmp_path: Path) -> None:
    """The released 7B PRM is sharded; the value head is found through the index."""
    sharded = tmp_path / "sharded"
    shutil.copytree(prm_dir, sharded)
    weights = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    half = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, keys in half.items():
        save_file({k: weights[k] for k in keys}, sharded / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    other = PRMScorer(scorer.config.model_copy(update={"model": str(sharded)}))
    branch = swe_branch(3)
    a, b = scorer.score(None, [branch])[0], other.score(None, [branch])[0]
    assert a.info["step_scores"] == pytest.approx(b.info["step_scores"], abs=1e-6)


def test_checkpoint_without_value_head_is_a_clear_error(prm_dir: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(prm_dir, plain)
    weights = load_file(plain / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if not k.startswith("v_head.")},
        plain / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.raises(ValueError, match="no value head"):
        make_scorer("prm", model=str(plain), device="cpu")


def test_unknown_model_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"scorer\.model=tiny"):
        make_scorer("prm", model=str(tmp_path / "does-not-exist"))


def test_batches_respect_size_and_padded_token_budget(scorer: PRMScorer) -> None:
    s = PRMScorer(scorer.config.model_copy(update={"batch_size": 3, "max_batch_tokens": 100}))
    lengths = [10, 50, 20, 30, 40, 5, 60, 120]
    inputs = [([0] * n, [n - 1]) for n in lengths]
    batches = list(s._batches(list(range(len(lengths))), inputs))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        width = max(lengths[i] for i in b)
        assert len(b) <= 3 and (len(b) * width <= 100 or len(b) == 1)
    assert batches == [[5, 0, 2], [3, 4], [1], [6], [7]]  # lengths 5 10 20 | 30 40 | 50 | 60 | 120
