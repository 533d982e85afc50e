"""Images built locally, with no registry: the Debian base and the bundled local suite.

The base image is a minimal Debian (python3, git, pytest, patch, procps) made with
`debootstrap` and `docker import` (about a minute, once). A local-suite image is the base plus
the task's repository at /testbed, committed in git with a fixed author and date so the commit
id matches the record's `base_commit`; its `agentree.content` label says which repository
content it holds, so `build_local` rebuilds only what is missing or stale.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

from agentree.envs.swe import local_suite, runtime
from agentree.envs.swe.instances import SWEInstance
from agentree.envs.swe.sandbox import Sandbox, SandboxConfig, SandboxError

BASE_IMAGE = "agentree/swe-base:bookworm"
BASE_PACKAGES = ("python3", "git", "python3-pytest", "patch", "procps")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
CONTENT = "agentree.content"
_TRIM = ("var/cache/apt/archives", "usr/share/doc", "usr/share/man", "usr/share/info")

Progress = Callable[[str], None]


def _quiet(msg: str) -> None:
    pass


def image_exists(name: str) -> bool:
    try:
        runtime.client().api.inspect_image(name)
    except Exception as e:
        if "No such image" in str(e) or getattr(e, "status_code", None) == 404:
            return False
        raise
    return True


def _image_labels(name: str) -> dict[str, str]:
    return runtime.client().api.inspect_image(name)["Config"].get("Labels") or {}


# -- base image ------------------------------------------------------------------------------
def build_base(*, force: bool = False, progress: Progress = _quiet) -> str:
    """Build the Debian base image with debootstrap unless it exists; returns its name."""
    runtime.client()  # fail fast without a daemon; also installs the exit/SIGTERM cleanup
    if not force and image_exists(BASE_IMAGE):
        return BASE_IMAGE
    if shutil.which("debootstrap") is None:
        raise RuntimeError(
            "building the SWE base image needs debootstrap: apt-get install -y debootstrap "
            "(or run .ci/setup_docker.sh)"
        )
    if os.geteuid() != 0:
        raise RuntimeError("building the SWE base image with debootstrap needs root")
    mirror = os.environ.get("AGENTREE_DEBIAN_MIRROR", DEBIAN_MIRROR)
    tmp = tempfile.mkdtemp(prefix="agentree-rootfs-")
    try:
        root = os.path.join(tmp, "root")
        progress(
            f"building {BASE_IMAGE} once: debootstrap bookworm ({', '.join(BASE_PACKAGES)}) "
            f"from {mirror}, about a minute ..."
        )
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}"]
        _run_group([*cmd, "bookworm", root, mirror], "debootstrap")
        for sub in _TRIM:
            shutil.rmtree(os.path.join(root, sub), ignore_errors=True)
        tar = os.path.join(tmp, "rootfs.tar")
        _run_group(["tar", "-C", root, "-cf", tar, "."], "tar")
        progress(f"importing {BASE_IMAGE} ...")
        changes = [
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "ENV LANG=C.UTF-8",
            'CMD ["bash"]',
            f"LABEL {runtime.LABEL}=1 {runtime.KIND}=image",
        ]
        runtime.client().api.import_image(
            src=tar,
            repository=BASE_IMAGE.split(":")[0],
            tag=BASE_IMAGE.split(":")[1],
            changes=changes,
        )
    finally:
        _remove_rootfs(tmp)
    if not image_exists(BASE_IMAGE):
        raise RuntimeError(f"docker import did not produce {BASE_IMAGE}")
    return BASE_IMAGE


def _run_group(cmd: list[str], name: str) -> None:
    """Run `cmd` in its own process group; on any interruption kill the whole group."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate()
    except BaseException:  # Ctrl-C, SIGTERM (SystemExit): no orphaned dpkg writing into /tmp
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = out.strip().splitlines()[-5:]
        raise RuntimeError(f"{name} failed:\n" + "\n".join(tail))


def _remove_rootfs(tmp: str) -> None:
    # An interrupted debootstrap can leave /proc or /sys mounted inside the tree.
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        mounts = [line.split()[1] for line in f if line.split()[1].startswith(tmp)]
        for m in sorted(mounts, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)
    shutil.rmtree(tmp, ignore_errors=True)


# -- local suite -----------------------------------------------------------------------------
def local_image_current(slug: str) -> bool:
    name = local_suite.image_name(local_suite.record(slug)["instance_id"])
    return image_exists(name) and _image_labels(name).get(CONTENT) == local_suite.content_hash(slug)


def build_local(
    *, force: bool = False, only: Iterable[str] | None = None, progress: Progress = _quiet
) -> list[str]:
    """Build the local-suite images that are missing or stale; returns the images built.

    `only` limits the build to these instance ids (or task folder names).
    """
    wanted = set(only) if only is not None else None
    slugs = [
        s
        for s in local_suite.slugs()
        if wanted is None or s in wanted or local_suite.record(s)["instance_id"] in wanted
    ]
    if wanted is not None and len(slugs) < len(wanted):
        known = {local_suite.record(s)["instance_id"] for s in local_suite.slugs()}
        raise ValueError(f"not in the local suite: {sorted(wanted - known - set(slugs))}")
    todo = [s for s in slugs if force or not local_image_current(s)]
    if not todo:
        return []
    build_base(progress=progress)
    built = []
    for s in todo:
        rec = local_suite.record(s)
        progress(f"building {local_suite.image_name(rec['instance_id'])} ...")
        built.append(_build_one(s, rec))
    return built


def _build_one(slug: str, rec: dict[str, Any]) -> str:
    name = local_suite.image_name(rec["instance_id"])
    old = image_exists(name) and runtime.client().api.inspect_image(name)["Id"]
    cfg = SandboxConfig(workdir="/", prewarm=0)
    with Sandbox(BASE_IMAGE, cfg) as sb:
        files = local_suite.repo_files(slug)
        sb.write_files({f"testbed/{p}": data for p, data in files.items()}, root="/")
        name_, _, email = local_suite.AUTHOR.partition(" <")
        ident = (
            f"GIT_AUTHOR_NAME='{name_}' GIT_AUTHOR_EMAIL='{email[:-1]}' "
            f"GIT_COMMITTER_NAME='{name_}' GIT_COMMITTER_EMAIL='{email[:-1]}' "
            f"GIT_AUTHOR_DATE='{local_suite.COMMIT_TIME}' "
            f"GIT_COMMITTER_DATE='{local_suite.COMMIT_TIME}'"
        )
        r = sb.exec(
            "cd /testbed && git init -q -b main && git add -A && "
            f"{ident} git commit -q -m '{local_suite.COMMIT_MESSAGE.strip()}' && "
            "git rev-parse HEAD",
            timeout=120,
        )
        head = r.output.strip().splitlines()[-1] if r.output.strip() else ""
        if r.returncode != 0 or head != rec["base_commit"]:
            raise SandboxError(
                f"building {name}: repository commit is {head or r.output!r}, expected "
                f"{rec['base_commit']} (the suite files or the base image's git changed)"
            )
        labels = {
            runtime.LABEL: "1",
            runtime.KIND: "image",
            runtime.SESSION: "",
            runtime.OWNER: "",
            CONTENT: local_suite.content_hash(slug),
        }
        repo, _, tag = name.partition(":")
        runtime.client().api.commit(
            sb.container_id,
            repository=repo,
            tag=tag,
            changes=[
                "WORKDIR /testbed",
                "LABEL " + " ".join(f'{k}="{v}"' for k, v in labels.items()),
            ],
        )
    new = runtime.client().api.inspect_image(name)["Id"]
    if old and old != new:
        with contextlib.suppress(Exception):  # still used by a running container: leave it
            runtime.client().api.remove_image(old)
    return name


# -- on demand -------------------------------------------------------------------------------
def ensure_image(instance: SWEInstance, *, build: bool = True, progress: Progress = _quiet) -> None:
    """Make sure `instance.image` exists locally: build local-suite images, pull others."""
    if instance.image.startswith(local_suite.IMAGE_REPO + ":"):
        slug = local_suite.slug_of_image(instance.image)  # generated tasks share these images
        if slug is not None and not local_image_current(slug):
            if not build:
                raise SandboxError(
                    f"local-suite image {instance.image} is missing; run `agentree swe build-local`"
                )
            build_local(only=[slug], progress=progress)
            return
    if image_exists(instance.image):
        return
    progress(f"pulling {instance.image} ...")
    try:
        runtime.client().images.pull(instance.image)
    except Exception as e:
        raise SandboxError(
            f"image {instance.image} for {instance.instance_id} is not available locally and "
            f"could not be pulled ({str(e).splitlines()[0][:160]}); pull or build it first"
        ) from None


def ensure_images(
    instances: Iterable[SWEInstance], *, build: bool = True, progress: Progress = _quiet
) -> None:
    """`ensure_image` for many instances, building the local-suite ones in one pass."""
    todo = list(instances)
    local = sorted({s for i in todo if (s := local_suite.slug_of_image(i.image)) is not None})
    if local and build:
        build_local(only=local, progress=progress)
    for inst in todo:
        ensure_image(inst, build=build, progress=progress)
