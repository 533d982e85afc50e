"""benchmarks/tree_mechanism.py: its counts by hand, and a tiny resumable run end to end."""

from __future__ import annotations

import json

import pytest
from helpers import load_benchmark

from agentree.rollout.base import RolloutStats, make_controller
from agentree.tree import EndReason, Tree


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("tree_mechanism")


def tree(task: str, paths: list[list[tuple[str, float]]]) -> Tree:
    """Each path a chain below the root: (state key, reward) per step."""
    t = Tree(task)
    t.add_root("start", [1], {"state_key": "S"})
    for path in paths:
        cur = 0
        for k, (state, reward) in enumerate(path):
            last = k == len(path) - 1
            cur = t.add_child(
                cur,
                action="a",
                action_ids=[2],
                reward=reward,
                end_reason=EndReason.COMPLETED if last else None,
                info={"state_key": state},
            ).id
    return t


def test_a_penalty_alone_is_informative_but_not_an_outcome(bench):
    """Rewards -0.1 (an invalid action's penalty) and 0, no success: the rewards differ, but
    the group holds no success and failure to tell apart."""
    d = tree("d", [[("A", -0.1)], [("A", 0.0)]])
    counts = bench.counts(make_controller("grpo"), [d], RolloutStats(env_steps=2))
    m = bench.metrics(counts)
    assert m["informative_share"] == 1.0 and m["outcome_informative_share"] == 0.0


def test_counts_and_rates_by_hand(bench):
    # task a: rewards 1 and 0 (informative, one success); states S, A, G, B -> 4
    # task b: rewards 0 and 0 (uninformative); states S, A -> 2
    # task c: its only branch cut by the budget: an empty group, uninformative; states S, A
    a = tree("a", [[("A", 0.0), ("G", 1.0)], [("B", 0.0)]])
    b = tree("b", [[("A", 0.0)], [("A", 0.0)]])
    c = tree("c", [[("A", 0.0)]])
    c.nodes[1].end_reason = EndReason.BUDGET
    stats = RolloutStats(env_steps=8, policy_tokens_generated=30, policy_tokens_prefilled=50)
    counts = bench.counts(make_controller("grpo"), [a, b, c], stats)
    assert counts["informative"] == 1 and counts["empty"] == 1 and counts["successes"] == 1
    assert counts["trajectories"] == 4 and counts["states"] == 4 + 2 + 2
    m = bench.metrics(counts)
    assert m["informative_share"] == pytest.approx(1 / 3)
    assert m["outcome_informative_share"] == pytest.approx(1 / 3)  # task a: a success, a failure
    assert m["successes_per_1k_steps"] == pytest.approx(1000 * 1 / 8)
    assert m["informative_per_1k_steps"] == pytest.approx(1000 * 1 / 8)
    assert m["success_rate"] == pytest.approx(1 / 4)
    assert m["distinct_states"] == pytest.approx(8 / 3)
    assert m["forward_tokens_per_step"] == pytest.approx(80 / 8)


def test_paired_differences_by_hand(bench):
    """Four tasks; a's groups hold both outcomes on tasks 0, 1, 2, b's on 1 and 3: the per-task
    differences are +1, 0, +1, -1, mean 1/4, sample variance (2 x (3/4)^2 + (1/4)^2 + (5/4)^2)
    / 3 = 11/12, so the standard error is sqrt(11/12 / 4)."""
    a = {"counts": {"mixed_by_task": [1, 1, 1, 0]}}
    b = {"counts": {"mixed_by_task": [0, 1, 0, 1]}}
    p = bench.paired(a, b)
    assert p["diff"] == pytest.approx(0.25) and p["tasks"] == 4
    assert p["se"] == pytest.approx((11 / 12 / 4) ** 0.5)
    assert (p["only_a"], p["only_b"]) == (2, 1)
    # runs from before the flags were kept, or over other tasks, are not paired
    assert bench.paired({"counts": {}}, b) is None
    assert bench.paired({"counts": {"mixed_by_task": [1, 0]}}, b) is None


def test_the_per_task_flags_follow_the_task_order(bench):
    a = tree("a", [[("A", 0.0), ("G", 1.0)], [("B", 0.0)]])
    b = tree("b", [[("A", 0.0)], [("A", 0.0)]])
    counts = bench.counts(make_controller("grpo"), [b, a], RolloutStats(env_steps=4))
    assert counts["mixed_by_task"] == [0, 1]
    assert bench.metrics(counts)["outcome_informative_share"] == 0.5


def test_a_tiny_run_writes_its_summary_and_resumes(bench, tmp_path, capsys, tiny_frozenlake):
    out = tmp_path / "mech"
    common = ["--out", str(out), "--tasks", "2", "--budget", "7", "--threads", "1"]
    common += ["--methods", "grpo", "patr", "--set", "env.max_turns=4", "--batch", "1"]
    summary = bench.main([*common, "--temperatures", "1", "--policy", "tiny"])
    mech = summary["mechanism"]["frozenlake"]
    assert set(mech) == {"grpo", "patr"} and summary["budget"] == {"frozenlake": 7}
    assert summary["budget_reserve"] == {"frozenlake": False}
    for m in mech.values():
        assert len(m["informative_share"]) == len(m["base_success"]) == 1
        # the exact budget: at most 7 env steps per task, at least 7 - max_turns
        assert 7 - 4 <= m["env_steps_per_task"][0] <= 7
        assert 0.0 <= m["informative_share"][0] <= 1.0
    assert mech["grpo"]["base_success"] == mech["grpo"]["success_rate"]
    (pair,) = summary["paired"]["frozenlake"]
    grpo_run = json.loads((out / "frozenlake" / "grpo" / "tiny-T1.json").read_text())
    assert len(grpo_run["counts"]["mixed_by_task"]) == 2
    shares = {m: mech[m]["outcome_informative_share"][0] for m in mech}
    assert pair["patr - grpo"]["diff"] == pytest.approx(shares["patr"] - shares["grpo"])
    assert (out / "frozenlake_mechanism.png").stat().st_size > 0
    first = (out / "frozenlake" / "patr" / "tiny-T1.json").read_text()
    assert "2 runs to do" in capsys.readouterr().out
    # a second call with one more level (another policy: the same tiny weights by path) runs
    # only that level's two methods
    summary = bench.main([*common, "--temperatures", "1", "--policy", "tiny", str(tiny_frozenlake)])
    log = capsys.readouterr().out
    assert "tiny: 0 runs to do" in log and f"{tiny_frozenlake}: 2 runs to do" in log
    assert (out / "frozenlake" / "patr" / "tiny-T1.json").read_text() == first
    levels = summary["levels"]["frozenlake"]
    assert sorted((lv["policy"], lv["temperature"]) for lv in levels) == sorted(
        [("tiny", 1.0), (tiny_frozenlake.name, 1.0)]
    )
    assert json.loads((out / "summary.json").read_text()) == summary
    # the same levels under other settings are another table: refused, not mixed in
    with pytest.raises(SystemExit, match=r"measured with .*'budget_reserve': False"):
        bench.main([*common, "--temperatures", "1", "--policy", "tiny", "--budget-reserve"])
    with pytest.raises(SystemExit, match=r"not \{.*'sample_seed': 1\}"):
        bench.main([*common, "--temperatures", "1", "--policy", "tiny", "--sample-seed", "1"])
    # a replicate on the same tasks, reseeding the sampling alone: recorded with its seed
    again = [*common[2:], "--out", str(tmp_path / "again"), "--temperatures", "1"]
    bench.main([*again, "--policy", "tiny", "--sample-seed", "1", "--methods", "grpo"])
    grpo_again = json.loads(
        (tmp_path / "again" / "frozenlake" / "grpo" / "tiny-T1.json").read_text()
    )
    assert grpo_again["settings"] == {**grpo_run["settings"], "sample_seed": 1}
    assert len(grpo_again["counts"]["mixed_by_task"]) == 2
    # the two replicates pooled: per-task shares over the replicates, paired task by task
    pooled = bench.replicates([out, tmp_path / "again"])["frozenlake"]
    (level,) = [lv for lv in pooled if lv["policy"] == "tiny"]
    flags = [grpo_run["counts"]["mixed_by_task"], grpo_again["counts"]["mixed_by_task"]]
    assert level["methods"]["grpo"]["seeds"] == [None, 1]
    assert level["methods"]["grpo"]["mean"] == pytest.approx(sum(map(sum, flags)) / 4)
    patr_run = json.loads((out / "frozenlake" / "patr" / "tiny-T1.json").read_text())
    patr_flags = patr_run["counts"]["mixed_by_task"]
    diff = [p - (g0 + g1) / 2 for p, g0, g1 in zip(patr_flags, *flags, strict=True)]
    assert level["paired"]["patr - grpo"]["diff"] == pytest.approx(sum(diff) / 2)
    with pytest.raises(SystemExit, match="the sampling seed alone"):
        bench.replicates([out, out])
    # an earlier summary's levels join another directory's: alone they come back unchanged;
    # a level measured twice or at another budget is refused
    (tmp_path / "empty").mkdir()
    assert bench.summarize(tmp_path / "empty", [out / "summary.json"]) == summary
    text = json.dumps(summary).replace('"tiny"', '"tiny-warm@0.9,epochs=3"')
    moved = json.loads(text.replace(f'"{tiny_frozenlake.name}"', '"other"'))
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    merged = bench.summarize(out, [tmp_path / "moved.json"])
    assert len(merged["levels"]["frozenlake"]) == 4
    assert merged["mechanism"]["frozenlake"]["patr"]["policy"].count("tiny-warm@0.9,epochs=3") == 1
    with pytest.raises(SystemExit, match="measured twice"):
        bench.summarize(out, [out / "summary.json"])
    # levels measured under the other budget rule are refused; a summary that does not say
    # its rule (written before it was recorded) joins on its budget alone
    moved["budget_reserve"]["frozenlake"] = True
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    with pytest.raises(SystemExit, match="with the budget reserve, the other levels without"):
        bench.summarize(out, [tmp_path / "moved.json"])
    del moved["budget_reserve"]
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    assert bench.summarize(out, [tmp_path / "moved.json"])["budget_reserve"] == {
        "frozenlake": False
    }
    assert bench.summarize(tmp_path / "empty", [tmp_path / "moved.json"])["budget_reserve"] == {
        "frozenlake": None
    }
    moved["budget"]["frozenlake"] = 8
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    with pytest.raises(SystemExit, match="not one table"):
        bench.summarize(out, [tmp_path / "moved.json"])


def test_a_warm_recipe_after_the_at_sign(bench):
    assert bench.warm_recipe("tiny-warm") == ("tiny-warm", [])
    assert bench.warm_recipe("tiny-warm@0.6") == ("tiny-warm", ["policy.warm.expert_prob=0.6"])
    assert bench.warm_recipe("tiny-warm@0.9,pretrain_epochs=6") == (
        "tiny-warm",
        ["policy.warm.expert_prob=0.9", "policy.warm.pretrain_epochs=6"],
    )
    with pytest.raises(SystemExit, match="neither an expert probability"):
        bench.warm_recipe("tiny-warm@strong")


def test_a_variant_runs_its_controller_and_is_paired_with_it(bench, tmp_path):
    """`NAME=CONTROLLER` in --methods: an ablation measured beside its controller, its level
    files recording the controller and settings it ran, compared task by task with it."""
    out = tmp_path / "mech"
    argv = ["--out", str(out), "--tasks", "2", "--budget", "7", "--threads", "1", "--batch", "2"]
    argv += ["--set", "env.max_turns=4", "--temperatures", "1", "--policy", "tiny"]
    argv += ["--methods", "grpo", "tree-grpo", "tg-noroot=tree-grpo"]
    summary = bench.main([*argv, "--method-set", "tg-noroot.expand_root=false"])
    run = json.loads((out / "frozenlake" / "tg-noroot" / "tiny-T1.json").read_text())
    assert run["settings"]["controller"] == "tree-grpo"
    assert run["settings"]["expand_root"] is False
    base = json.loads((out / "frozenlake" / "tree-grpo" / "tiny-T1.json").read_text())
    assert "controller" not in base["settings"] and "expand_root" not in base["settings"]
    (pair,) = summary["paired"]["frozenlake"]
    assert set(pair) >= {"tg-noroot - grpo", "tree-grpo - grpo", "tg-noroot - tree-grpo"}
    x, y = run["counts"]["mixed_by_task"], base["counts"]["mixed_by_task"]
    assert pair["tg-noroot - tree-grpo"]["diff"] == pytest.approx((sum(x) - sum(y)) / 2)
    pooled = bench.replicates([out])["frozenlake"][0]["paired"]
    assert pooled["tg-noroot - tree-grpo"]["diff"] == pytest.approx((sum(x) - sum(y)) / 2)
    # a variant named like a controller, or of no controller, is refused
    for bad in ("grpo=patr", "x=no-such-controller"):
        with pytest.raises(ValueError, match="NEW_NAME=CONTROLLER"):
            bench.main([*argv[:-4], "--methods", "grpo", bad])


def test_pairs_by_hand(bench):
    """Every method against GRPO, PATR against Tree-Random, a variant against its controller
    only where that controller was measured."""
    runs = {
        m: {"settings": s}
        for m, s in {
            "grpo": {},
            "patr": {},
            "tree-random": {},
            "patr-k2": {"controller": "patr"},
            "arpo-x": {"controller": "arpo"},
        }.items()
    }
    assert bench.pairs(runs) == [
        ("patr", "grpo"),
        ("tree-random", "grpo"),
        ("patr-k2", "grpo"),
        ("arpo-x", "grpo"),
        ("patr", "tree-random"),
        ("patr-k2", "patr"),
    ]
