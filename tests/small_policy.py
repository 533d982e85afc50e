"""The policy that tests of training mechanics run on.

Sharding, packing, LoRA and resume tests compare two ways of computing one update; they need a
policy whose rollouts mix wins and losses, not the default run's warm start. This is the 2-layer
tiny policy fine-tuned on 400 episodes of the 0.5 expert: it builds in seconds and keeps the
comparisons at the model size their tolerances were measured on.
"""

import json
from pathlib import Path

WARM_2_LAYERS = [
    "policy.path=tiny-warm",
    "policy.tiny.num_layers=2",
    "policy.warm.pretrain_episodes=0",
    "policy.warm.expert_prob=0.5",
    "policy.warm.episodes=400",
    "policy.warm.epochs=2",
    "policy.warm.lr=0.002",
    "policy.warm.batch_size=4",
]


def metric_rows(run: Path) -> list[dict]:
    """What a run sampled and learned, step by step, not how long it took or what was cached:
    the rows a resumed run must share with the uninterrupted one."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    keep = ("step", "train/", "eval/", "rollout/env_steps", "rollout/forks", "scorer/")
    return [
        {k: v for k, v in json.loads(x).items() if k.startswith(keep) and k[-2:] != "_s"}
        for x in lines
    ]
