"""`agentree view`: data annotations checked by hand, and the page in a real headless Chromium.

The browser tests drive Debian's `chromium` through Playwright (install `agentree[view]` and
`apt-get install chromium`); they are not skipped when either is missing.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from agentree.commands.cli import main
from agentree.tree import EndReason, Tree, save_trees
from agentree.viewer.pages import node_kind, render_html, rollout_group, view_data, write_view

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
FAST = ["--set", "engine.max_tokens=6", "--set", "env.max_turns=4", "--set", "rollout.K=2"]


def patr_tree(task_id: str = "map-1", group: str = "keep-all") -> Tree:
    """A PATR-shaped tree: root, 3 scored branches; one expanded into 2, one pruned."""
    t = Tree(task_id, {"id": task_id, "seed": 1})
    t.meta = {"controller": "patr", "config": {"group": group}}
    t.add_root("P _\n_ G", [1, 2])
    a = t.add_child(0, action="```Right```", action_ids=[5], observation="_ P\n_ G", score=0.9)
    a.info.update(expanded=2, scorer={"step_scores": [0.4, 0.9], "aggregate": "last"})
    b = t.add_child(0, action="```Up```", action_ids=[6], observation="P _\n_ G", score=0.2)
    b.end_reason = EndReason.PRUNED_LOW_SCORE
    c = t.add_child(0, action="```Down```", action_ids=[7], observation="_ _\nP G", score=0.6)
    c.info["scorer"] = {"phase": "diagnosis", "judge": 0.7, "reply": 'reasoning {"score": 0.7}'}
    win = t.add_child(a.id, action="```Down```", action_ids=[7], observation="_ _\n_ P", reward=1.0)
    win.terminated, win.end_reason = True, EndReason.COMPLETED
    win.info["env"] = {"success": True}
    lose = t.add_child(a.id, action="```Left```", action_ids=[8], observation="P _\n_ G")
    lose.truncated, lose.end_reason = True, EndReason.MAX_TURNS
    last = t.add_child(c.id, action="```Up```", action_ids=[6], observation="P _\n_ G")
    last.end_reason = EndReason.PRUNED_REPEAT
    return t


def token_tree() -> Tree:
    """A LATR-shaped tree: a shared segment that branches on two candidate tokens."""
    t = Tree("cd-1", {"id": "cd-1"})
    t.meta = {"controller": "latr", "group": [2, 3, 4]}
    t.add_root("use 3 5 to make 8", [1])
    shared = t.add_child(0, action="<answer>", action_ids=[10, 11])
    top = t.add_child(shared.id, action="3+5</answer>", action_ids=[12, 13], reward=1.0)
    top.end_reason = EndReason.COMPLETED
    latr = {"birth": 2, "p": 0.3, "p_top": 0.4, "token": "5", "top_token": "3"}
    alt = t.add_child(shared.id, action="5+3</answer>", action_ids=[14, 13], reward=1.0)
    alt.end_reason, alt.info["latr"] = EndReason.COMPLETED, dict(latr)
    odd = t.add_child(shared.id, action="8</answer>", action_ids=[15, 13], reward=0.1)
    odd.end_reason, odd.info["latr"] = EndReason.PRUNED_SIMILAR, {**latr, "p": 0.28, "token": "8"}
    return t


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    """A training run directory with trees saved at steps 1 and 2, as the trainer names them."""
    run = tmp_path / "run"
    save_trees([patr_tree("map-1"), patr_tree("map-2")], run / "trees", prefix="step000001_")
    save_trees([token_tree()], run / "trees", prefix="step000002_")
    (run / "config.yaml").write_text("train:\n  advantage: grpo\n  adv_scale: std\n")
    rows = [{"step": 1, "train/success_rate": 0.25}, {"step": 2, "train/success_rate": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


# -- annotations ------------------------------------------------------------------------------
def test_node_kinds():
    t = patr_tree()
    kinds = [node_kind(t, n.id) for n in t.nodes]
    assert kinds == ["root", "expanded", "pruned", "surviving", "leaf", "leaf", "pruned"]


def test_leaf_advantages_are_patr_eq9_by_hand(run_dir: Path):
    data = view_data(run_dir)
    assert [g["label"] for g in data["steps"]] == ["step 1", "step 2"]
    nodes = data["steps"][0]["trees"][0]["nodes"]
    # keep-all group: leaves 2 (R 0), 4 (R 1), 5 (R 0), 6 (R 0); mean 0.25, sample std 0.5
    # A = (R - 0.25) / (0.5 + 1e-6): +1.5 for the winner, -0.5 for the others (PATR Eq. 9)
    adv = {n["id"]: n["advantage"] for n in nodes if n["end_reason"]}
    assert adv[4] == pytest.approx(0.75 / (0.5 + 1e-6))
    for leaf in (2, 5, 6):
        assert adv[leaf] == pytest.approx(-0.25 / (0.5 + 1e-6))
    by_id = {n["id"]: n for n in nodes}
    assert by_id[4]["success"] is True and by_id[5]["success"] is False
    assert by_id[4]["ret"] == 1.0 and by_id[2]["kind"] == "pruned"
    assert data["steps"][0]["metrics"]["train/success_rate"] == 0.25


@pytest.mark.parametrize(
    ("train", "estimator", "options"),
    [
        ({"advantage": "grpo", "adv_scale": "none", "advantage_options": {"eps": 0.5}},
         "grpo", {"scale": "none", "eps": 0.5}),
        ({"advantage": "treepo", "advantage_options": {"norm": "tree-std", "eps": 0.5}},
         "treepo", {"norm": "tree-std", "eps": 0.5}),
        ({"advantage": "gigpo", "advantage_options": {
            "step_gamma": 0.5, "norm": "std", "state_key": "observation", "step_weight": 2.0}},
         "gigpo", {"step_gamma": 0.5, "norm": "std", "state_key": "observation",
                   "step_weight": 2.0}),
        ({"advantage": "rtmc", "advantage_options": {
            "gamma": 0.5, "prior": 0.3, "state_key": "observation"}},
         "rtmc", {"gamma": 0.5, "prior": 0.3, "state_key": "observation"}),
        ({"advantage": "treegrpo", "advantage_options": {"eps": 0.5}}, "treegrpo", {"eps": 0.5}),
    ],
)  # fmt: skip
def test_viewer_shows_the_advantages_trained_with_the_runs_options(
    tmp_path: Path, train: dict, estimator: str, options: dict
):
    """The page's advantages are the ones the update trained on: the estimator with the run's
    `train.advantage_options` (and `adv_scale`), not its defaults."""
    import yaml

    from agentree.algorithms.advantages import compute_advantages

    run = tmp_path / "run"
    tree = patr_tree()
    save_trees([tree], run / "trees", prefix="step000001_")
    (run / "config.yaml").write_text(yaml.safe_dump({"train": train}))
    group = rollout_group(tree)
    per_token = compute_advantages(estimator, [tree], [group], **options)[0]
    defaults = compute_advantages(estimator, [tree], [group])[0]
    assert per_token != defaults  # the options matter for this tree
    nodes = view_data(run)["steps"][0]["trees"][0]["nodes"]
    shown = {n["id"]: n["advantage"] for n in nodes if n["end_reason"]}
    for traj, adv in zip(group, per_token, strict=True):
        policy = [a for a, m in zip(adv, traj.loss_mask, strict=True) if m]
        assert shown[traj.leaf] == pytest.approx(sum(policy) / len(policy))


def test_best_n_group_leaves_pruned_out():
    t = patr_tree(group="best-n")
    assert sorted(tr.leaf for tr in rollout_group(t)) == [4, 5]


def test_token_tree_group_comes_from_meta(run_dir: Path):
    tree = view_data(run_dir)["steps"][1]["trees"][0]
    adv = {n["id"]: n["advantage"] for n in tree["nodes"] if n["end_reason"]}
    # group rewards (1, 1, 0.1): mean 0.7, sample std sqrt(0.54) -> A = (R - 0.7) / std
    std = math.sqrt(((0.3**2) * 2 + 0.6**2) / 2)
    assert adv[2] == pytest.approx(0.3 / (std + 1e-6))
    assert adv[4] == pytest.approx(-0.6 / (std + 1e-6))


def test_page_is_self_contained_and_data_cannot_close_the_script(run_dir: Path):
    t = patr_tree()
    t.nodes[1].observation = "</script><script>alert(1)</script>"
    save_trees([t], run_dir / "trees", prefix="step000003_")
    page = render_html(view_data(run_dir))
    assert "</script><script>alert" not in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page


def test_cli_writes_view_of_rollout_and_eval_dirs(tmp_path: Path, tiny_frozenlake, capsys):
    for cmd in ("rollout", "eval"):
        out = tmp_path / cmd
        assert main([cmd, "--tasks", "2", "--output", str(out), *FAST]) == 0
        assert main(["view", str(out)]) == 0
        assert f"wrote {out / 'view.html'}" in capsys.readouterr().out
        data = view_data(out)
        assert data["kind"] == cmd and len(data["steps"]) == 1
        files = sorted((out / "trees").glob("*.json"))
        drawn = sum(len(t["nodes"]) for t in data["steps"][0]["trees"])
        assert drawn == sum(len(json.loads(f.read_text())["nodes"]) for f in files)


def test_missing_trees_is_one_clear_error(tmp_path: Path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["view", str(tmp_path / "empty")]) == 2
    assert "no tree files" in capsys.readouterr().err


# -- the page in a real browser ----------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert shutil.which(CHROMIUM), f"{CHROMIUM} not found: apt-get install chromium"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def open_page(browser, path: Path):
    page = browser.new_page(viewport={"width": 1500, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_selector("svg [data-node-id]")
    return page, errors


def nodes_in_files(run_dir: Path, prefix: str) -> int:
    files = (run_dir / "trees").glob(f"{prefix}*.json")
    return sum(len(json.loads(f.read_text())["nodes"]) for f in files)


def test_browser_draws_every_node_and_shows_pruned_end_reason(browser, run_dir, tmp_path):
    html, _ = write_view(run_dir, tmp_path / "view.html")
    page, errors = open_page(browser, html)
    drawn = page.locator("svg [data-node-id]")
    assert drawn.count() == nodes_in_files(run_dir, "step000001_") == 14
    # every drawn node carries its id from the tree file
    ids = sorted(int(x) for x in drawn.evaluate_all("els => els.map(e => e.dataset.nodeId)"))
    assert ids == sorted(list(range(7)) * 2)
    page.locator("#tree-0 [data-node-id='2'] .shape").click()
    details = page.locator("#details").inner_text()
    assert "end reason: pruned_low_score" in details
    assert "pruned" in page.locator("#tree-0 [data-node-id='2']").get_attribute("class")
    # the scorer's output (PRM step scores) and the judge's reasoning
    page.locator("#tree-0 [data-node-id='1'] .shape").click()
    assert "prm step scores (2)" in page.locator("#details").inner_text().lower()
    page.locator("#tree-0 [data-node-id='3'] .shape").click()
    assert 'reasoning {"score": 0.7}' in page.locator("#details").inner_text()
    shot = tmp_path / "view.png"
    page.screenshot(path=str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000

    # step selector: the token tree of step 2, with its branch point's candidate tokens
    page.select_option("#step", "1")
    assert drawn.count() == nodes_in_files(run_dir, "step000002_") == 5
    page.locator("#tree-0 [data-node-id='1'] .shape").click()
    text = page.locator("#details").inner_text()
    assert "branch point: candidate tokens" in text.lower()
    assert '"3"\t0.400' in text and '"5"\t0.300' in text and '"8"\t0.280' in text
    page.locator("#tree-0 [data-node-id='4'] .shape").click()
    assert "end reason: pruned_similar" in page.locator("#details").inner_text()
    assert errors == []


def test_browser_collapse_search_and_zoom(browser, run_dir, tmp_path):
    html, _ = write_view(run_dir, tmp_path / "view.html")
    page, errors = open_page(browser, html)
    drawn = page.locator("#tree-0 [data-node-id]")
    assert drawn.count() == 7
    page.locator("#tree-0 [data-node-id='1'] .shape").dblclick()
    assert drawn.count() == 5  # node 1's two children hidden
    assert page.locator("#tree-0 .badge").text_content() == "+2"
    page.locator("#tree-0 button", has_text="expand all").click()
    assert drawn.count() == 7
    page.fill("#search", "Left")
    page.press("#search", "Enter")
    assert page.locator("#matches").inner_text().startswith("2 matches")  # node 5 in both trees
    assert page.locator(".node.match").count() == 2
    assert page.locator("#tree-0 .node.selected").get_attribute("data-node-id") == "5"
    view = page.locator("#tree-0 svg > g")
    before = view.get_attribute("transform")
    page.locator("#tree-0 button", has_text="+").click()
    assert view.get_attribute("transform") != before
    assert errors == []
