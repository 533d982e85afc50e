"""The train config reaches the update: advantage options and the off-policy loss settings."""

from __future__ import annotations

import pytest
import torch
from test_advantages import chain_tree, toy_tree

from agentree.algorithms.advantages import compute_advantages
from agentree.config import TrainConfig, load_config
from agentree.learner.update import PolicyUpdate


def row_sums(rows):
    return sorted(round(float(sum(r)), 9) for r in rows)


@pytest.mark.parametrize(
    ("advantage", "options"),
    [
        ("treepo", {}),
        ("treepo", {"norm": "tree-std"}),
        ("treepo", {"norm": "none", "distinct_subgroups": True}),
        ("grpo", {"eps": 0.5}),
    ],
)
def test_advantage_options_from_the_config_reach_the_estimator(advantage, options):
    tc = TrainConfig(advantage=advantage, advantage_options=options, micro_batch_size=64)
    update = PolicyUpdate(torch.nn.Linear(2, 2), tc)
    trees = [toy_tree(), chain_tree()]
    groups = [t.trajectories() for t in trees]
    (batch,) = update.batches(trees, groups)
    kw = {"scale": "std", **options} if advantage == "grpo" else options
    want = [a for per_tree in compute_advantages(advantage, trees, groups, **kw) for a in per_tree]
    assert row_sums(batch.adv.tolist()) == pytest.approx(row_sums(want), abs=1e-6)
    if not options:
        return
    # and the options change the numbers (a default config would not pass the check above)
    default = [a for g in compute_advantages(advantage, trees, groups) for a in g]
    assert row_sums(want) != pytest.approx(row_sums(default), abs=1e-6)


def test_train_config_options_are_validated_with_one_sentence():
    with pytest.raises(ValueError, match="advantage 'grpo' has no option 'norm'"):
        load_config(overrides=["train.advantage_options={norm: batch}"])
    with pytest.raises(ValueError, match="must be one of"):
        load_config(overrides=["train.advantage=treepo", "train.advantage_options={norm: group}"])
    with pytest.raises(ValueError, match=r"train\.adv_scale"):
        load_config(overrides=["train.advantage_options={scale: none}"])
    cfg = load_config(overrides=["train.clip_ratio_c=null", "train.log_ratio_clamp=5"])
    assert cfg.train.clip_ratio_c is None and cfg.train.log_ratio_clamp == 5.0
    assert (TrainConfig().clip_ratio_c, TrainConfig().log_ratio_clamp) == (3.0, 20.0)  # verl
    with pytest.raises(ValueError, match="clip_ratio_c"):
        load_config(overrides=["train.clip_ratio_c=0.5"])
