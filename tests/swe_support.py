"""Shared helpers for the SWE tests: Docker availability, the local-suite images, leak checks."""

from __future__ import annotations

import gc
import shutil
from functools import cache
from typing import Any

import pytest


def require_docker() -> Any:
    """The Docker client; skip only where no daemon can exist, fail where one should run."""
    from agentree.envs.swe import runtime

    try:
        return runtime.client()
    except runtime.DockerUnavailable as e:
        if shutil.which("dockerd") is None and shutil.which("docker") is None:
            pytest.skip(f"Docker is not installed on this machine, so no daemon can run ({e})")
        pytest.fail(f"Docker is installed but its daemon is unreachable: {e}")


@cache
def _build_local() -> list[dict[str, Any]]:
    from agentree.envs.swe import images, local_suite

    images.build_local(progress=lambda m: print(m, flush=True))
    return local_suite.records()


@pytest.fixture(scope="session", name="local_records")
def local_records_fixture() -> list[dict[str, Any]]:
    """SWE-bench records of the bundled suite, with their images built."""
    require_docker()
    return _build_local()


def settle() -> Any:
    """Collect dropped snapshot handles and wait for background removals."""
    from agentree.envs.swe.sandbox import ImageStore

    gc.collect()
    store = ImageStore.get()
    store.flush()
    return store


def session_resources() -> tuple[list[str], list[str]]:
    """Containers and snapshot images this test process still owns."""
    from agentree.envs.swe import runtime

    return owned_by(runtime.session_id())


def owned_by(session: str) -> tuple[list[str], list[str]]:
    """Containers and snapshot images labelled with `session`."""
    from agentree.envs.swe import runtime

    api = runtime.client().api
    flt = {"label": f"{runtime.SESSION}={session}"}
    containers = [x["Id"] for x in api.containers(all=True, filters=flt)]
    images = [
        im["Id"]
        for im in api.images(all=True, filters=flt)
        if (im.get("Labels") or {}).get(runtime.KIND) == "snapshot"
    ]
    return containers, images


def assert_no_leftovers(allow_spares: bool = False) -> None:
    store = settle()
    if not allow_spares:
        assert store.stats()["spares"] == 0, store.stats()
    containers, images = session_resources()
    assert containers == [], f"containers left behind: {containers}"
    assert images == [], f"snapshot images left behind: {images}"
    assert store.errors == [], store.errors
