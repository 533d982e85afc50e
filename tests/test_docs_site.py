"""The documentation site: `mkdocs build --strict`, then every page visited in a real Chromium.

The browser check builds the site into a temporary directory, serves it on 127.0.0.1 and walks
it from the home page in Debian's headless `chromium` through Playwright: every page must load,
every internal link must resolve (pages, files and `#anchors`), every image must decode, and no
request may leave the local server. It skips, saying why, only when mkdocs (`pip install
'agentree[docs]'`) or `/usr/bin/chromium` (`apt-get install chromium`) is missing; `.ci/run`
installs both.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def test_readme_links_point_at_files_in_the_repo():
    """The README links into docs/ by relative path; each target must exist."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t)]
    assert local, "the README links to no docs page"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert missing == []


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed: pip install 'agentree[docs]'")
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return out


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # the test reports failures itself
        pass


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not found: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def test_site_builds_strict_with_the_api_reference_rendered(site: Path):
    pages = {p.relative_to(site).as_posix() for p in site.rglob("index.html")}
    for expected in [
        "index.html",
        "results/index.html",
        "results/learning/index.html",
        "reference/envs/index.html",
        "reference/config/index.html",
    ]:
        assert expected in pages
    # the API reference is rendered from the docstrings, not left as a `:::` directive
    envs = (site / "reference/envs/index.html").read_text()
    assert "check_env" in envs and "snapshot" in envs and ":::" not in envs


@pytest.mark.slow
def test_every_page_loads_with_working_links_and_images(site: Path, served: str, browser):
    pages = sorted(p.relative_to(site).parent.as_posix() for p in site.rglob("index.html"))
    expected = {served if d == "." else urljoin(served, d + "/") for d in pages}
    page = browser.new_page()
    outside: list[str] = []
    failed: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(served) else outside.append(r.url))
    # a resource the server lacks answers 404; a request cut off by the next navigation
    # (net::ERR_ABORTED, e.g. the search index still loading) is not a fault of the site
    page.on(
        "response", lambda r: failed.append(f"{r.url} ({r.status})") if r.status >= 400 else None
    )
    page.on(
        "requestfailed",
        lambda r: (
            None if r.failure == "net::ERR_ABORTED" else failed.append(f"{r.url} ({r.failure})")
        ),
    )

    visited: dict[str, set[str] | None] = {}  # page url -> ids on it (None: did not load)
    links: dict[str, set[str]] = {}  # page url -> internal hrefs found on it
    broken_images: list[str] = []
    queue = [served]
    while queue:
        url = queue.pop()
        if url in visited:
            continue
        response = page.goto(url)
        if response is None or response.status != 200:
            visited[url] = None
            continue
        visited[url] = set(page.eval_on_selector_all("[id]", "els => els.map(e => e.id)"))
        hrefs = page.eval_on_selector_all("a[href]", "els => els.map(a => a.href)")
        links[url] = {h for h in hrefs if h.startswith(served)}
        broken_images += [
            f"{url}: {src}"
            for src in page.eval_on_selector_all(
                "img", "els => els.filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)"
            )
        ]
        queue += [t for t, _ in map(urldefrag, links[url]) if _is_page(t) and t not in visited]

    unreached = sorted(expected - set(visited))
    assert unreached == [], "pages no link reaches:\n" + "\n".join(unreached)
    broken: list[str] = []
    for url, hrefs in links.items():
        for href in sorted(hrefs):
            target, fragment = urldefrag(href)
            if _is_page(target):
                ids = visited[target]
                if ids is None:
                    broken.append(f"{url} -> {href} (does not load)")
                elif fragment and fragment not in ids:
                    broken.append(f"{url} -> {href} (no such anchor)")
            else:
                status = page.request.get(target).status
                if status != 200:
                    broken.append(f"{url} -> {href} ({status})")
    page.close()
    assert broken == [], "broken links:\n" + "\n".join(broken)
    assert broken_images == [], "broken images:\n" + "\n".join(broken_images)
    assert failed == [], "failed requests:\n" + "\n".join(failed)
    assert outside == [], "requests off the local server (the site must work offline):\n" + (
        "\n".join(outside)
    )
    assert len(visited) == len(expected) > 20


def _is_page(url: str) -> bool:
    path = urlparse(url).path
    return path.endswith("/") or path.endswith(".html")
