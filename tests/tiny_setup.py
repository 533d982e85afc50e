"""The real tiny policy + transformers engine + env, for the samplers' integration tests."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from agentree.chat import ChatFormat
from agentree.engines.base import SamplingParams
from agentree.engines.hf import HFEngine
from agentree.envs.base import env_class
from agentree.hub.tiny import TinyModelConfig, tiny_policy_for_env
from agentree.rollout.base import RolloutContext
from agentree.tree import Trajectory, Tree


def tiny_engine(env_name: str, cache: Path) -> HFEngine:
    """The env's tiny policy (built once into `cache`, or $AGENTREE_CACHE when set)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTREE_CACHE", os.environ.get("AGENTREE_CACHE", str(cache)))
        path = tiny_policy_for_env(env_name, {}, TinyModelConfig())
    return HFEngine.from_pretrained(path, seed=0)


def tiny_context(engine: HFEngine, env_name: str, *, max_tokens: int, temperature: float = 1.0):
    chat = ChatFormat(engine.tokenizer)
    return RolloutContext(
        engine=engine,
        chat=chat,
        sampling=SamplingParams(
            max_tokens=max_tokens, temperature=temperature, stop_token_ids=chat.stop_token_ids
        ),
        env_factory=env_class(env_name),
        max_context=1024,
        rng=random.Random(0),
    )


def check_group(tree: Tree, group: list[Trajectory], ctx: RolloutContext) -> None:
    """Tokens are prompt + sampled ids with the sampling log-probs of a teacher-forced forward,
    and every leaf holds the reward the env gives its response."""
    model, temp = ctx.engine.model, ctx.sampling.temperature
    env = ctx.env_factory()
    prompt = tree.root.obs_ids
    for traj in group:
        response = [t for n in tree.path(traj.leaf)[1:] for t in n.action_ids]
        assert traj.token_ids == prompt + response
        assert traj.loss_mask == [0] * len(prompt) + [1] * len(response)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([traj.token_ids])).logits[0, :-1].float()
        logp = torch.log_softmax(logits / temp, -1)
        forced = logp.gather(-1, torch.tensor(traj.token_ids[1:]).unsqueeze(1)).squeeze(1)
        sampled = torch.tensor(traj.logprobs[len(prompt) :])
        assert torch.allclose(forced[len(prompt) - 1 :], sampled, atol=1e-4)
        task = tree.task
        env.reset(seed=task["seed"], options=task["options"])
        _, reward, *_ = env.step(ctx.chat.decode_action(response))
        assert traj.reward == reward
        assert tree.nodes[traj.leaf].info["env"] is not None
    assert Tree.from_dict(tree.to_dict()).to_dict() == tree.to_dict()
