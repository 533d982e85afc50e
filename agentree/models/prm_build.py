"""A process reward model on any causal LM's backbone, its value head fitted to an env's labels.

`agentree models prm --base smollm2-135m --env frozenlake --out DIR` writes a checkpoint in the
Skywork-o1-Open-PRM layout (the base LM's weights and `v_head.summary.{weight,bias}` beside
them) that the `prm` scorer loads like a released PRM (`--scorer prm --set scorer.model=DIR`).

The labels come from the env's exact process scorer (FrozenLake: `bfs`, Sokoban: `sokoban`),
which the PRM then imitates from text alone, the way a released PRM was trained on step
labels. Episodes are played by the env's scripted expert at mixed skill (`expert_probs`: the
shortest move with that probability, else a random one), so the data holds progress, stalls
and falls. Each step of each episode is one example: the PRM input of the episode's first k
steps, exactly as the scorer builds it (`PRMScorer.encode`), labelled with the process
scorer's value of that prefix.

The backbone stays frozen; only the value head `Linear(hidden, 1)` is fitted (a probe), by
binary cross-entropy against the soft labels: sigmoid(v_head(h)) is what the scorer reads at
each step separator. The base model's hidden state at the k-th separator of a full-episode
input is the prefix's own (causal attention), so an episode costs one forward pass while it
fits the scorer's `steps` window. A share of the episodes (`heldout`) is kept out of the fit
and reported: mean squared error against the constant predictor, Pearson correlation, and the
fraction of step pairs with different labels that the PRM orders correctly.

Departure from Skywork's recipe: their PRMs fine-tune the whole model on math step labels; a
frozen backbone with a fitted head is what fits a CPU, and the backbone can be fine-tuned
beforehand (`agentree sft`) and passed as `--base DIR`.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentree.envs.base import Task, env_class
from agentree.hub.pretrained import local_policy
from agentree.hub.store import build_once
from agentree.scorers.base import make_scorer
from agentree.tree import Node, Tree

LABEL_SCORERS = {"frozenlake": "bfs", "sokoban": "sokoban"}
"""The exact process scorer that labels each env's steps."""


class PRMBuildConfig(BaseModel):
    """Settings of `build_prm`."""

    model_config = ConfigDict(extra="forbid")

    episodes: int = Field(240, ge=2)
    """Scripted episodes played; every step of each is one example."""
    expert_probs: list[float] = Field(default_factory=lambda: [0.9, 0.6, 0.3, 0.0])
    """The expert's skill, cycled over episodes (0 is the random walker)."""
    heldout: float = Field(0.25, ge=0.0, lt=1.0)
    """Share of the episodes kept out of the fit and reported."""
    iterations: int = Field(600, ge=1)
    """Full-batch Adam steps on the value head."""
    lr: float = Field(0.01, gt=0.0)
    weight_decay: float = Field(1e-4, ge=0.0)
    steps: int = Field(10, ge=1)
    """The scorer's `steps` window (most recent steps in one input); kept in prm.json."""
    max_length: int = Field(4096, ge=16)
    """The scorer's token budget of one input."""
    seed: int = 0


def build_prm(
    base: str,
    env_name: str,
    out: Path | str,
    *,
    env_kwargs: dict[str, Any] | None = None,
    cfg: PRMBuildConfig | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Write a PRM on `base`'s backbone to `out`, its value head fitted to `env_name`'s process
    labels; returns `out`. `base` is anything `--policy` takes (a directory, `smollm2-135m`)."""
    cfg = cfg or PRMBuildConfig()
    if env_name not in LABEL_SCORERS:
        raise ValueError(
            f"no process labels for env {env_name!r}: a PRM is fitted to an exact scorer's "
            f"values ({', '.join(f'{e}: {s}' for e, s in LABEL_SCORERS.items())})"
        )
    local = local_policy(base, log)
    target = Path(out)
    if target.exists():
        raise FileExistsError(f"{target} exists; pass a new --out directory")
    return build_once(
        target,
        lambda tmp: _build(local, base, env_name, env_kwargs or {}, cfg, tmp, log),
        what=f"PRM on {base} for {env_name}",
        expected=f"{cfg.episodes} episodes through the base model, minutes for a 100M model",
        log=log,
    )


def _build(
    local: str,
    base: str,
    env_name: str,
    env_kwargs: dict[str, Any],
    cfg: PRMBuildConfig,
    tmp: Path,
    log: Callable[[str], None],
) -> None:
    # deferred: torch and transformers take seconds to import (see build_prm)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentree.hub.tiny_prm import write_value_head
    from agentree.scorers.prm import PRMConfig, PRMScorer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(local)
    if tokenizer.bos_token is None:
        if "<|im_start|>" not in tokenizer.get_vocab():
            raise ValueError(
                f"{base}'s tokenizer has no bos_token and no <|im_start|>: the PRM input "
                "starts with one (Skywork's prepare_input)"
            )
        tokenizer.bos_token = "<|im_start|>"  # what Skywork's tokenizer uses
    model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    del model
    hidden = json.loads((tmp / "config.json").read_text())["hidden_size"]
    write_value_head(tmp, torch.zeros(1, hidden), torch.zeros(1))

    episodes = scripted_episodes(env_name, env_kwargs, cfg)
    labeller = make_scorer(LABEL_SCORERS[env_name])
    scorer = PRMScorer(
        PRMConfig(
            model=str(tmp),
            steps=cfg.steps,
            max_length=cfg.max_length,
            device="cpu",
            dtype="float32",
            record_input=False,
        )
    )
    try:
        log(f"PRM: {len(episodes)} episodes through {base} for the value head's inputs")
        feats, labels, groups = [], [], []
        done = time.perf_counter()
        for e, (task, path) in enumerate(episodes):
            x, y = _episode_examples(scorer, labeller, task, path)
            feats.append(x)
            labels += y
            groups += [e] * len(y)
            if (e + 1) % max(1, len(episodes) // 10) == 0:
                rate = (e + 1) / (time.perf_counter() - done)
                log(
                    f"PRM: {e + 1}/{len(episodes)} episodes, {len(labels)} steps "
                    f"({(len(episodes) - e - 1) / rate:.0f}s left)"
                )
    finally:
        scorer.close()
    x = torch.cat(feats)
    y = torch.tensor(labels, dtype=torch.float32)
    heldout_from = round(len(episodes) * (1 - cfg.heldout))
    train = torch.tensor([g < heldout_from for g in groups])
    weight, bias, loss = fit_value_head(x[train], y[train], cfg)
    write_value_head(tmp, weight, bias)
    with torch.no_grad():
        pred = torch.sigmoid(x @ weight.T + bias).squeeze(-1)
    report = {
        "base": base,
        "env": env_name,
        "env_kwargs": env_kwargs,
        "labels": LABEL_SCORERS[env_name],
        "config": cfg.model_dump(),
        "examples": {"train": int(train.sum()), "heldout": int((~train).sum())},
        "train": fit_metrics(pred[train], y[train], y[train]),
        "heldout": fit_metrics(pred[~train], y[~train], y[train]) if (~train).any() else None,
        "final_bce": loss,
        "constant_bce": constant_bce(y[train]),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    (tmp / "prm.json").write_text(json.dumps(report, indent=1))
    shown = report["heldout"] or report["train"]
    log(
        f"PRM: value head fitted on {report['examples']['train']} steps; "
        f"{'held-out' if report['heldout'] else 'train'}: correlation {shown['pearson']:.3f}, "
        f"pairs ordered {shown['pair_accuracy']:.1%}, mse {shown['mse']:.4f} "
        f"(constant {shown['mse_constant']:.4f})"
    )


def scripted_episodes(
    env_name: str, env_kwargs: dict[str, Any], cfg: PRMBuildConfig
) -> list[tuple[Task, list[Node]]]:
    """(task, root-to-leaf nodes) of `cfg.episodes` scripted episodes on training tasks, with
    the env's `info` on every node as a rollout stores it (what the label scorer reads)."""
    # deferred: agentree.models.warm imports torch through agentree.hub.tiny (seconds)
    from agentree.models.warm import expert_steps

    cls = env_class(env_name)
    tasks = cls.generate_tasks(cfg.episodes, seed=11 + cfg.seed, split="train")
    rng = random.Random(cfg.seed)
    env = cls(**env_kwargs)
    out = []
    try:
        for i, task in enumerate(tasks):
            p = cfg.expert_probs[i % len(cfg.expert_probs)]
            (obs, info), steps = expert_steps(env, task, p, rng)
            tree = Tree(task.id, task.to_dict())
            node = tree.add_root(obs, [], {"env": info})
            for action, obs, reward, terminated, truncated, info in steps:
                node = tree.add_child(
                    node.id,
                    action=action,
                    observation=obs,
                    reward=reward,
                    terminated=terminated,
                    truncated=truncated,
                    info={"env": info},
                )
            out.append((task, tree.path(node.id)))
    finally:
        env.close()
    return out


def _episode_examples(
    scorer: Any, labeller: Any, task: Task, path: Sequence[Node]
) -> tuple[Any, list[float]]:
    """The value head's inputs (one row per step) and labels of one episode. Prefixes that fit
    the scorer's window share the full input's forward pass; longer ones get their own."""
    # deferred: torch takes seconds to import (see build_prm)
    import torch

    steps = scorer.step_texts(path)
    labels = [s.value for s in labeller.score(task, [path[: k + 1] for k in range(1, len(path))])]
    if any(v is None for v in labels):
        raise ValueError(f"the label scorer could not score task {task.id}")
    problem = path[0].observation or ""
    shared = min(len(steps), scorer.config.steps)
    ids, flags, info = scorer.encode(problem, steps[:shared])
    inputs = [(ids, flags)] if info["steps_seen"] == shared else []
    first = shared if inputs else 0
    for k in range(first + 1, len(steps) + 1):
        ids_k, flags_k, _ = scorer.encode(problem, steps[:k])
        inputs.append((ids_k, flags_k[-1:]))
    feats = scorer.step_features(inputs)
    return torch.cat(feats), [float(v) for v in labels]


def fit_value_head(x: Any, y: Any, cfg: PRMBuildConfig) -> tuple[Any, Any, float]:
    """Weight [1, hidden], bias [1] of the value head: full-batch Adam on binary cross-entropy
    between sigmoid(x w + b) and the soft labels y; also the final loss."""
    # deferred: torch takes seconds to import (see build_prm)
    import torch

    gen = torch.Generator().manual_seed(cfg.seed)
    head = torch.nn.Linear(x.shape[1], 1)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.01, generator=gen)
        mean = float(y.mean().clamp(1e-4, 1 - 1e-4))
        head.bias.fill_(float(torch.logit(torch.tensor(mean))))  # start at the constant fit
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    loss = torch.tensor(0.0)
    for _ in range(cfg.iterations):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head(x).squeeze(-1), y)
        loss.backward()
        opt.step()
    return head.weight.detach().clone(), head.bias.detach().clone(), round(float(loss.detach()), 6)


def constant_bce(y: Any) -> float:
    """Binary cross-entropy of the best constant (the labels' mean): the fit's baseline."""
    # deferred: torch takes seconds to import (see build_prm)
    import torch

    p = y.mean().clamp(1e-6, 1 - 1e-6)
    return round(float(torch.nn.functional.binary_cross_entropy(p.expand_as(y), y)), 6)


def fit_metrics(pred: Any, y: Any, y_fit: Any) -> dict[str, float]:
    """Mean squared error (and that of the fit set's mean as a constant), Pearson correlation,
    and the share of pairs with different labels that `pred` orders as `y` does (ties half)."""
    # deferred: torch takes seconds to import (see build_prm)
    import torch

    mse = float(((pred - y) ** 2).mean())
    mse_constant = float(((y_fit.mean() - y) ** 2).mean())
    pearson = float(torch.corrcoef(torch.stack([pred, y]))[0, 1]) if len(y) > 1 else 0.0
    pearson = 0.0 if math.isnan(pearson) else pearson  # a constant prediction
    dy = y[:, None] - y[None, :]
    dp = pred[:, None] - pred[None, :]
    pairs = dy > 1e-6
    right = (dp[pairs] > 0).float() + 0.5 * (dp[pairs] == 0).float()
    pair_accuracy = float(right.mean()) if pairs.any() else 0.0
    return {
        "mse": round(mse, 6),
        "mse_constant": round(mse_constant, 6),
        "pearson": round(pearson, 4),
        "pair_accuracy": round(pair_accuracy, 4),
    }
