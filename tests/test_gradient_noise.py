"""benchmarks/gradient_noise.py: the noise scale's estimators by hand (McCandlish et al. 2018,
Appendix A), and the per-task gradient terms adding up to the update's own gradient."""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import load_benchmark, printed, stop_when
from small_policy import WARM_2_LAYERS

from agentree.config import load_config
from agentree.run.trainer import Trainer

SMALL = [
    *WARM_2_LAYERS,
    "train.tasks_per_step=4",
    "engine.max_tokens=6",
    "env.max_turns=4",
    "train.trees_every=0",
    "train.save_every=0",
]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("gradient_noise")


def test_batch_stats_by_hand(bench):
    """x = (1,0), (3,0), (2,2), so g_i = x_i / 3: mean x = (2, 2/3), |mean x|^2 = 40/9,
    sum |x_i|^2 = 18; tr(Sigma) = (18 - 3 * 40/9) / 2 = 7/3, |G|^2 = 40/9 - (7/3)/3 = 11/3;
    halves: even g_0 + g_2 = (1, 2/3), odd g_1 = (1, 0), cosine 3 / sqrt(13)."""
    xs = [torch.tensor(v, dtype=torch.float64) for v in ((1.0, 0.0), (3.0, 0.0), (2.0, 2.0))]
    row = bench.batch_stats([x / 3 for x in xs])
    assert row["tasks"] == 3
    assert row["noise"] == pytest.approx(7 / 3)
    assert row["signal"] == pytest.approx(11 / 3)
    assert row["grad_sq"] == pytest.approx(40 / 9)
    assert row["cos_halves"] == pytest.approx(3 / math.sqrt(13))
    assert row["task_norms"] == pytest.approx([1 / 3, math.sqrt(8) / 3, 1.0])  # |x_i| / 3
    with pytest.raises(ValueError, match="at least 2 tasks"):
        bench.batch_stats([xs[0]])


def test_task_tails_by_hand(bench):
    """Norms (1, 1, 2) and (0, 1, 3): the largest task's share of sum |g_i|^2 is 4/6 and 9/10,
    both over half; the norms of the tasks with a gradient, 1, 1, 1, 2, 3, give median 1 (the
    3rd of 5) and max 3. A batch without the record (an older measurement) is left out."""
    tails = bench.task_tails([{"task_norms": [1, 1, 2]}, {"task_norms": [0, 1, 3]}, {}])
    assert tails["batches"] == 2
    assert tails["median"] == 1 and tails["p99"] == 3 and tails["max"] == 3
    assert tails["largest_share"] == pytest.approx((4 / 6 + 9 / 10) / 2)
    assert tails["dominated"] == 2
    assert bench.task_tails([{}]) is None
    assert bench.task_tails([{"task_norms": [0.0, 0.0]}]) is None  # no task with a gradient


def test_noise_scale_is_a_ratio_of_means_with_a_jackknife(bench):
    """Batches (noise 2, signal 1) and (4, 3): B = 3 / 2; leaving one out gives 4/3 and 2,
    mean 5/3, so the jackknife SE is sqrt(1/2 * (1/9 + 1/9)) = 1/3."""
    rows = [{"noise": 2.0, "signal": 1.0}, {"noise": 4.0, "signal": 3.0}]
    b, se = bench.noise_scale(rows)
    assert b == pytest.approx(1.5)
    assert se == pytest.approx(1 / 3)
    assert bench.noise_scale([{"noise": 2.0, "signal": -1.0}, {"noise": 1.0, "signal": 0.5}]) == (
        None,
        None,
    )
    cos = [0.5, None]  # the second batch had no informative group in one half
    full = [{**r, "cos_halves": c, "informative": 1} for r, c in zip(rows, cos, strict=True)]
    out = bench.summarise(full, 4)
    assert out["cos_to_gradient"]["4"] == pytest.approx(1 / math.sqrt(1 + 1.5 / 4))
    assert out["steps_at_twice"] == pytest.approx((1 + 1.5 / 8) / (1 + 1.5 / 4))
    assert out["cos_halves_predicted"] == pytest.approx(1 / (1 + 3 / 4))
    assert out["cos_halves"] == 0.5 and out["cos_halves_batches"] == 1
    assert out["cos_halves_se"] is None  # one batch's cosine has no standard error
    # signals 1 and 3: mean 2, sd sqrt(2), SE 1; the bound is mean noise 3 / (2 + 2 * 1)
    assert out["signal_se"] == pytest.approx(1.0)
    assert out["noise_scale_lower"] == pytest.approx(3 / 4)


def test_pairs_across_batches_by_hand(bench):
    """One task a block, x = (1,0), (3,0), (2,2): every pair gives what one batch of three
    gives (tr(Sigma) 7/3, |G|^2 11/3). Leaving a block out leaves two tasks: signals
    (|S|^2 - Q) / 2 = 6, 2 and 3, so the jackknife SE is sqrt(2/3 * 78/9) = sqrt(52) / 3."""
    xs = [torch.tensor(v) for v in ((1.0, 0.0), (3.0, 0.0), (2.0, 2.0))]
    est = bench.across_batches(xs, [1.0, 9.0, 8.0], [1, 1, 1], 3)
    assert est["noise"] == pytest.approx(7 / 3)
    assert est["signal"] == pytest.approx(11 / 3)
    assert est["noise_scale"] == pytest.approx(7 / 11)
    assert est["signal_se"] == pytest.approx(math.sqrt(52) / 3)
    scales = [2.5 / 6, 2.5 / 2, 2 / 3]
    mean = sum(scales) / 3
    want = math.sqrt(2 / 3 * sum((v - mean) ** 2 for v in scales))
    assert est["noise_scale_se"] == pytest.approx(want)


def test_paired_signal_to_noise_is_scale_free_and_refuses_other_blocks(bench):
    """The same tasks' terms at twice the scale (another estimator's advantages, doubled) have
    the same |G|^2 / tr(Sigma) = (11/3) / (7/3) = 11/7 in every leave-one-out, so the paired
    difference and its standard error are 0; blocks of other sizes cannot be paired."""
    xs = [torch.tensor(v) for v in ((1.0, 0.0), (3.0, 0.0), (2.0, 2.0))]
    a = {"sums": xs, "sq": [1.0, 9.0, 8.0], "tasks": [1, 1, 1]}
    b = {"sums": [2 * x for x in xs], "sq": [4.0, 36.0, 32.0], "tasks": [1, 1, 1]}
    out = bench.paired(a, b)
    assert out["snr"] == pytest.approx(11 / 7) and out["snr_against"] == pytest.approx(11 / 7)
    assert out["snr_diff"] == pytest.approx(0.0, abs=1e-12)
    assert out["snr_diff_se"] == pytest.approx(0.0, abs=1e-12)
    assert out["snr_se"] > 0  # the leave-one-out ratios differ: 6/2.5, 2/2.5, 3/2
    with pytest.raises(SystemExit, match="same blocks"):
        bench.paired(a, {**b, "tasks": [2, 1, 1]})


def test_unpaired_signal_to_noise_combines_the_two_errors(bench, tmp_path: Path):
    """The same tasks at twice the scale on batches of their own: 11/7 on both sides, each with
    the jackknife SE of the leave-one-out ratios 12/5, 4/5 and 3/2, sqrt(2/3 * their squared
    deviations); the two sides share no batch, so the difference's SE is sqrt(2) times that
    (paired on the same blocks it would be 0). Through the command, as `--pool --versus`."""
    xs = [torch.tensor(v) for v in ((1.0, 0.0), (3.0, 0.0), (2.0, 2.0))]
    a = {"sums": xs, "sq": [1.0, 9.0, 8.0], "tasks": [1, 1, 1]}
    b = {"sums": [2 * x for x in xs], "sq": [4.0, 36.0, 32.0], "tasks": [1, 1, 1]}
    loo = [12 / 5, 4 / 5, 3 / 2]
    mean = sum(loo) / 3
    se = math.sqrt(2 / 3 * sum((v - mean) ** 2 for v in loo))
    paths = []
    for name, side in (("a", a), ("b", b)):
        paths.append(tmp_path / f"{name}.json")
        rows = [{"noise": 1.0, "signal": 1.0, "cos_halves": None, "informative": 1}] * 3
        paths[-1].write_text(json.dumps(bench.summarise(rows, 1) | {"checkpoint": None}))
        torch.save(side, bench.blocks_path(paths[-1]))
    out = tmp_path / "versus.json"
    assert bench.main(["--pool", str(paths[0]), "--versus", str(paths[1]), "--out", str(out)]) == 0
    up = json.loads(out.read_text())["unpaired"]
    assert up["snr"] == pytest.approx(11 / 7) and up["snr_versus"] == pytest.approx(11 / 7)
    assert up["snr_se"] == pytest.approx(se) and up["snr_versus_se"] == pytest.approx(se)
    assert up["snr_diff"] == pytest.approx(0.0, abs=1e-12)
    assert up["snr_diff_se"] == pytest.approx(math.sqrt(2) * se)
    assert up["versus"] == [str(paths[1])] and up["blocks_versus"] == 3


def test_measurements_pool_their_batches(bench, tmp_path: Path):
    """Two files of one setting summarise as one; files of different batch sizes refuse."""
    rows = [{"noise": 2.0, "signal": 1.0}, {"noise": 4.0, "signal": 3.0}]
    rows = [{**r, "cos_halves": None, "informative": 0} for r in rows]
    paths = []
    for i, r in enumerate(rows):
        paths.append(tmp_path / f"m{i}.json")
        paths[-1].write_text(json.dumps(bench.summarise([r], 4) | {"checkpoint": None}))
    pooled = bench.pool(paths)
    assert pooled["noise_scale"] == pytest.approx(1.5) and len(pooled["batches"]) == 2
    assert pooled["cos_halves"] is None
    odd = tmp_path / "m8.json"
    odd.write_text(json.dumps(bench.summarise(rows, 8) | {"checkpoint": None}))
    with pytest.raises(SystemExit, match="tasks_per_step"):
        bench.pool([paths[0], odd])


def easy(tr: Trainer) -> None:
    """3x3 maps the 2-layer policy sometimes solves, so the batch's groups are informative."""
    tr.train_tasks = [
        t.__class__(t.id, None, {"desc": ["SGF", "FFF", "FFF"]}) for t in tr.train_tasks[:4]
    ]


@pytest.mark.parametrize(
    ("rollout", "extra"), [("grpo", ["rollout.G=4"]), ("patr", ["train.packing=tree"])]
)
def test_task_terms_add_up_to_the_updates_gradient(
    bench, tmp_path: Path, rollout: str, extra: list[str]
):
    """The update's gradient, caught just before its optimiser step (no clipping), equals the
    sum of the per-task terms, with gradient accumulation (one row a micro-batch) and the KL
    term on, for flat groups in padded rows and for PATR's trees in tree-packed rows."""
    overrides = [
        *SMALL,
        "train.micro_batch_size=1",
        "train.grad_clip=1e9",
        "train.kl_coef=0.01",
        *extra,
    ]
    select = {"output": str(tmp_path), "rollout": rollout}
    cfg = load_config("frozenlake_patr", select=select, overrides=overrides)
    tr = Trainer(cfg, tmp_path, log=lambda msg: None)
    try:
        easy(tr)
        trees, groups, _, _, _ = tr.collect()
        assert any(len({t.reward for t in g}) > 1 for g in groups)
        terms = list(bench.task_gradients(tr.updater, trees, groups))
        assert len(terms) == len(trees)
        caught: list[torch.Tensor] = []
        params = [p for p in tr.model.parameters() if p.requires_grad]

        def catch(opt, args, kwargs):
            caught.append(torch.cat([p.grad.reshape(-1) for p in params]))

        handle = tr.updater.opt.register_step_pre_hook(catch)
        tr.update(trees, groups)
        handle.remove()
    finally:
        tr.close()
    total = torch.stack(terms).sum(0)
    assert float(total.norm()) > 1e-4  # the comparison can fail: there is a gradient
    torch.testing.assert_close(caught[0].double(), total, rtol=1e-5, atol=1e-8)


def test_a_run_directory_is_measured_and_left_as_it_was(
    bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The command on a run's config: two batches, the figures written, the run untouched and
    no temporary directory left behind (in a temporary root of this test's own, so that other
    measurements running beside it cannot be mistaken for its leftovers)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    run = tmp_path / "run"
    run.mkdir()
    select = {"output": str(run), "rollout": "grpo"}
    cfg = load_config("frozenlake_patr", select=select, overrides=[*SMALL, "rollout.G=4"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    before = sorted(p.name for p in run.iterdir())
    out = tmp_path / "noise.json"
    assert bench.main([str(run), "--batches", "2", "--out", str(out)]) == 0
    assert list(scratch.glob("agentree-*")) == []  # the trainer's directory was removed
    result = json.loads(out.read_text())
    assert len(result["batches"]) == 2 and result["tasks_per_step"] == 4
    assert all(r["tasks"] == 4 for r in result["batches"])
    assert result["across_batches"]["tasks"] == 8 and result["across_batches"]["blocks"] == 2
    assert bench.blocks_path(out).exists()
    pooled = tmp_path / "pooled.json"
    assert bench.main(["--pool", str(out), "--out", str(pooled)]) == 0
    again = json.loads(pooled.read_text())["across_batches"]
    assert again["signal"] == pytest.approx(result["across_batches"]["signal"])
    assert sorted(p.name for p in run.iterdir()) == before


@pytest.mark.slow
def test_a_stopped_measurement_keeps_its_batches_and_leaves_nothing(tmp_path: Path):
    """SIGTERM after two batches of twenty: the command summarises the batches it measured
    (marked as stopped), exits 130 like a stopped run, and removes its temporary directory."""
    run = tmp_path / "run"
    run.mkdir()
    select = {"output": str(run), "rollout": "grpo"}
    cfg = load_config("frozenlake_patr", select=select, overrides=[*SMALL, "rollout.G=4"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    scratch = tmp_path / "scratch"  # its temporary root: nothing else writes there
    scratch.mkdir()
    out = tmp_path / "noise.json"
    script = Path(__file__).parents[1] / "benchmarks" / "gradient_noise.py"
    argv = [sys.executable, "-u", str(script), str(run), "--batches", "20", "--out", str(out)]
    log = tmp_path / "output.log"
    code, output, _ = stop_when(argv, scratch, printed(log, "batch 2/20"), 600, log)  # its lines
    assert code == 130, output
    assert "stopped by SIGTERM after" in output
    result = json.loads(out.read_text())
    assert result["batches_requested"] == 20
    assert result["stopped_after"] == len(result["batches"]) >= 2
    assert result["across_batches"]["tasks"] == 4 * result["stopped_after"]
    assert list(scratch.glob("agentree-*")) == []  # torch may keep its own caches there


@pytest.mark.slow
def test_a_stop_while_the_trainer_is_built_leaves_nothing(tmp_path: Path):
    """SIGTERM once the policy is resolved, while the trainer around it is still being built
    (before its own stop handling is installed): nothing written, exit 130, and the temporary
    directory the trainer was being built in is removed."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = tmp_path / "noise.json"
    script = Path(__file__).parents[1] / "benchmarks" / "gradient_noise.py"
    argv = [sys.executable, "-u", str(script), "frozenlake_patr", "--rollout", "grpo"]
    argv += [x for item in SMALL for x in ("--set", item)]
    argv += ["--batches", "20", "--out", str(out)]
    log = tmp_path / "output.log"  # the trainer's log, as it builds
    code, output, _ = stop_when(argv, scratch, printed(log, "policy weights:"), 600, log)
    assert code == 130, output
    assert "before two batches were measured: nothing written" in output
    assert not out.exists()
    assert list(scratch.glob("agentree-*")) == []


def test_expected_gradients_cosine_by_hand(bench):
    """Four blocks of one task: a = (1,0), (3,0), (2,2), (0,2) and b = the same with y negated.
    From the pairs in different blocks (12 ordered pairs of one task each): G_a . G_b = ((6,4) .
    (6,-4) - (1 + 9 + 0 - 4)) / 12 = 7/6, |G_a|^2 = |G_b|^2 = (52 - 22) / 12 = 5/2, so the
    cosine is 7/15; a setting against itself gives 1."""
    a = [torch.tensor(v) for v in ((1.0, 0.0), (3.0, 0.0), (2.0, 2.0), (0.0, 2.0))]
    b = [x * torch.tensor([1.0, -1.0]) for x in a]
    side_a = {"sums": a, "sq": [float(x @ x) for x in a], "tasks": [1, 1, 1, 1]}
    side_b = {"sums": b, "sq": [float(x @ x) for x in b], "tasks": [1, 1, 1, 1]}
    out = bench.expected_cosine(side_a, side_b)
    assert out["cos_expected"] == pytest.approx(7 / 15)
    assert out["cos_expected_se"] is not None and out["cos_expected_se"] > 0
    same = bench.expected_cosine(side_a, side_a)
    assert same["cos_expected"] == pytest.approx(1.0)
    assert same["cos_expected_se"] == pytest.approx(0.0, abs=1e-12)
    assert bench.paired(side_a, side_b)["cos_expected"] == pytest.approx(7 / 15)
