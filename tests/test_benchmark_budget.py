"""The learning-efficiency benchmark's budget sizing, summary, paired comparison and resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import BENCHMARKS, load_benchmark
from small_policy import WARM_2_LAYERS, metric_rows

from agentree.config import load_config

PATH = BENCHMARKS / "learning_efficiency.py"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("learning_efficiency")


def settings(args: list[str]) -> list[str]:
    """The --set items and --rollout of a method's CLI arguments."""
    out = [f"rollout={args[i + 1]}" for i, a in enumerate(args) if a == "--rollout"]
    return out + [args[i + 1] for i, a in enumerate(args) if a == "--set"]


def test_methods_are_sized_to_the_env_step_budget(bench):
    m = bench.sized_methods(32, 5.4)
    assert set(m) == {
        "patr", "tree-random", "grpo", "arpo", "gigpo", "tree-grpo", "tree-grpo+grpo",
        "grpo+tree-grpo", "tsr", "patr+gigpo",
    }  # fmt: skip
    # flat: G = 32 / 5.4 ~ 6 trajectories of ~5.4 steps
    assert "rollout.G=6" in settings(m["grpo"]) and "train.advantage=gigpo" in settings(m["gigpo"])
    # Tree-GRPO: M chains + M*N*L half-length expansions: M (5.4 + 2 * 2.7) ~ 32 -> M = 3
    assert {"rollout=tree-grpo", "rollout.M=3", "rollout.N=2", "rollout.L=1"} <= set(
        settings(m["tree-grpo"])
    )
    # the same tree with GRPO's advantage over each task's leaves (Tree-GRPO's inter term alone)
    swap = {"train.advantage=treegrpo": "train.advantage=grpo"}
    assert settings(m["tree-grpo+grpo"]) == [swap.get(a, a) for a in settings(m["tree-grpo"])]
    # and flat groups with Tree-GRPO's advantage
    flat = settings(m["grpo"])
    assert settings(m["grpo+tree-grpo"]) == [*flat[:-1], "train.advantage=treegrpo", flat[-1]]
    # TSR beam: width x 2 candidates x 5.4 turns ~ 32 -> width 3
    assert {"rollout=tsr", "rollout.mode=beam", "rollout.width=3"} <= set(settings(m["tsr"]))
    # and every method spends exactly B = 32 env steps per task
    assert all("rollout.env_step_budget=32" in settings(args) for args in m.values())
    # every method's settings form a valid config of both cases
    for case in ("frozenlake", "sokoban"):
        for args in m.values():
            sets = settings(args)
            rollout = [s.split("=")[1] for s in sets if s.startswith("rollout=")]
            select = {"rollout": rollout[0]} if rollout else None
            load_config(
                bench.CASES[case]["config"],
                select=select,
                overrides=[s for s in sets if not s.startswith("rollout=")],
            )


def test_paired_comparison_and_standard_error(bench):
    p = bench.paired([0.5, 0.75, 0.5], [0.25, 0.75, 0.75])
    assert p["diffs"] == [0.25, 0.0, -0.25]
    assert p["mean"] == 0.0 and p["se"] == pytest.approx(0.25 / 3**0.5)
    assert (p["wins"], p["ties"], p["losses"]) == (1, 1, 1)
    assert bench.mean_se([0.6]) == (0.6, None)


def write_run(run: Path, env_steps: list[float], success: list[float]) -> None:
    """metrics.jsonl as `agentree train` writes it: eval rows at 0, 1, 2 and step rows."""
    rows = [{"step": 0, "eval/success_rate": success[0], "eval/pass_at_k": 0.5}]
    for i, e in enumerate(env_steps, start=1):
        rows.append({"step": i, "time/step_s": 2.0, "rollout/env_steps": e, "rollout/forks": 3})
        # two tasks a step: groups of 5 and 3 trajectories, one holding both outcomes
        rows[-1].update({"rollout/trajectories": 8, "train/group_size": 4.0})
        rows[-1].update({"train/success_rate": success[i] / 2, "train/groups_informative": 1})
        rows.append({"step": i, "eval/success_rate": success[i], "eval/pass_at_k": 0.75})
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


def test_summary_reports_actual_env_steps_and_reach(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "plot", lambda *a, **k: None)
    case = tmp_path / "frozenlake"
    write_run(case / "grpo" / "seed0", [40, 40], [0.2, 0.3, 0.4])
    write_run(case / "grpo" / "seed1", [44, 36], [0.2, 0.3, 0.6])
    write_run(case / "patr" / "seed0", [30, 34], [0.2, 0.5, 0.5])
    write_run(case / "patr" / "seed1", [30, 30], [0.2, 0.5, 0.5])
    s = bench.summarise("frozenlake", ["grpo", "patr"], [0, 1], tmp_path, None)
    grpo, patr = s["methods"]["grpo"], s["methods"]["patr"]
    assert grpo["final_success"] == pytest.approx(0.5)
    assert grpo["final_success_se"] == pytest.approx(0.1)  # stdev(0.4, 0.6) / sqrt(2)
    assert grpo["env_steps_per_step"] == 40 and patr["env_steps_per_step"] == 31
    # GRPO's final mean 0.5 is reached by PATR's mean curve at step 1: (30 + 30) / 2 env steps
    assert patr["env_steps_to_grpo_final"] == 30 and grpo["env_steps_to_grpo_final"] == 80
    assert patr["forks"] == 6 and patr["wall_s"] == 4 and patr["pass_at_4"] == 0.75
    assert s["paired_vs_grpo"]["patr"]["diffs"] == pytest.approx([0.1, -0.1])
    assert s["paired_patr_vs"]["grpo"]["diffs"] == pytest.approx([0.1, -0.1])  # PATR - GRPO
    assert set(s["paired_patr_vs"]) == {"grpo"}
    assert s["grpo_learned"] is True


def test_area_is_the_mean_held_out_success_after_step_0(bench, tmp_path, monkeypatch):
    """Each run's area is its held-out success averaged over the evaluations after step 0 (at
    multiples of `area_every` when given); methods are compared on it per seed, as on finals."""
    monkeypatch.setattr(bench, "plot", lambda *a, **k: None)
    case = tmp_path / "frozenlake"
    write_run(case / "grpo" / "seed0", [40, 40, 40], [0.2, 0.2, 0.3, 0.5])
    write_run(case / "grpo" / "seed1", [40, 40, 40], [0.2, 0.1, 0.4, 0.4])
    write_run(case / "patr" / "seed0", [30, 30, 30], [0.2, 0.4, 0.5, 0.5])
    write_run(case / "patr" / "seed1", [30, 30, 30], [0.2, 0.2, 0.3, 0.4])
    s = bench.summarise("frozenlake", ["grpo", "patr"], [0, 1], tmp_path, None)
    assert s["area_steps"] == [1, 2, 3]
    # GRPO: (0.2 + 0.3 + 0.5) / 3 = 1/3 and (0.1 + 0.4 + 0.4) / 3 = 0.3; PATR: 14/30 and 0.3
    assert s["methods"]["grpo"]["mean_eval_success"] == pytest.approx((1 / 3 + 0.3) / 2)
    assert s["methods"]["patr"]["mean_eval_success"] == pytest.approx((14 / 30 + 0.3) / 2)
    area = s["paired_patr_vs_mean_eval"]["grpo"]
    assert area["diffs"] == pytest.approx([0.4 / 3, 0.0])
    assert (area["wins"], area["ties"], area["losses"]) == (1, 1, 0)
    assert s["paired_vs_grpo_mean_eval"]["patr"]["diffs"] == pytest.approx([0.4 / 3, 0.0])
    # the finals tie on both seeds; only the area tells seed 0's earlier learning apart
    assert s["paired_patr_vs"]["grpo"]["diffs"] == pytest.approx([0.0, 0.0])
    s = bench.summarise("frozenlake", ["grpo", "patr"], [0, 1], tmp_path, None, area_every=2)
    assert s["area_steps"] == [2]
    assert s["paired_patr_vs_mean_eval"]["grpo"]["diffs"] == pytest.approx([0.2, -0.1])
    with pytest.raises(SystemExit, match="no held-out evaluation"):
        bench.summarise("frozenlake", ["grpo", "patr"], [0, 1], tmp_path, None, area_every=5)


def test_no_reach_target_when_grpo_ends_at_or_below_its_start(bench, tmp_path, monkeypatch):
    """A GRPO final no higher than the shared start is met at 0 env steps by every curve: the
    reach figure is then null for every method, and the summary says GRPO did not learn."""
    monkeypatch.setattr(bench, "plot", lambda *a, **k: None)
    case = tmp_path / "frozenlake"
    write_run(case / "grpo" / "seed0", [40, 40], [0.2, 0.1, 0.2])
    write_run(case / "patr" / "seed0", [30, 30], [0.2, 0.3, 0.1])
    s = bench.summarise("frozenlake", ["grpo", "patr"], [0], tmp_path, None)
    assert s["grpo_learned"] is False
    assert s["methods"]["grpo"]["env_steps_to_grpo_final"] is None
    assert s["methods"]["patr"]["env_steps_to_grpo_final"] is None


def test_summary_names_the_budget_rule_and_refuses_a_mix(bench, tmp_path, monkeypatch):
    """The summary says which budget rule its runs were trained under (from their saved
    configs) and the branches cut per step; runs under different rules are not summarised
    together."""
    monkeypatch.setattr(bench, "plot", lambda *a, **k: None)
    case = tmp_path / "frozenlake"
    write_run(case / "grpo" / "seed0", [40, 40], [0.2, 0.3, 0.4])
    write_run(case / "patr" / "seed0", [30, 34], [0.2, 0.5, 0.5])
    rows = (case / "grpo" / "seed0" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(r) for r in rows]
    for r, cut in zip([r for r in rows if "time/step_s" in r], [3, 5], strict=True):
        r["rollout/budget_cut"] = cut
    (case / "grpo" / "seed0" / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    for method, reserve in (("grpo", "true"), ("patr", "true")):
        cfg = load_config(
            "frozenlake8_patr",
            overrides=["rollout.env_step_budget=128", f"rollout.budget_reserve={reserve}"],
        )
        (case / method / "seed0" / "config.yaml").write_text(cfg.to_yaml())
    s = bench.summarise("frozenlake", ["grpo", "patr"], [0], tmp_path, None)
    assert s["budget"] == {"env_step_budget": 128, "budget_reserve": True}
    assert s["methods"]["grpo"]["budget_cut_per_step"] == 4
    assert s["methods"]["patr"]["budget_cut_per_step"] == 0
    cfg = load_config("frozenlake8_patr", overrides=["rollout.env_step_budget=128"])
    (case / "patr" / "seed0" / "config.yaml").write_text(cfg.to_yaml())
    with pytest.raises(SystemExit, match="different budgets"):
        bench.summarise("frozenlake", ["grpo", "patr"], [0], tmp_path, None)


def test_summary_names_the_estimator_each_method_trained_with(bench, tmp_path, monkeypatch):
    """A `--set train.advantage=...` replaces a method's estimator, so the summary says which
    one its runs' saved configs name, and refuses one method's seeds trained with two."""
    monkeypatch.setattr(bench, "plot", lambda *a, **k: None)
    case = tmp_path / "frozenlake"
    for seed in (0, 1):
        write_run(case / "tree-grpo+grpo" / f"seed{seed}", [30, 34], [0.2, 0.5, 0.5])
        cfg = load_config("frozenlake_patr", overrides=["train.advantage=treegrpo"])
        (case / "tree-grpo+grpo" / f"seed{seed}" / "config.yaml").write_text(cfg.to_yaml())
    s = bench.summarise("frozenlake", ["tree-grpo+grpo"], [0, 1], tmp_path, None)
    assert s["methods"]["tree-grpo+grpo"]["advantage"] == "treegrpo"
    cfg = load_config("frozenlake_patr")
    (case / "tree-grpo+grpo" / "seed1" / "config.yaml").write_text(cfg.to_yaml())
    with pytest.raises(SystemExit, match="different advantage estimators"):
        bench.summarise("frozenlake", ["tree-grpo+grpo"], [0, 1], tmp_path, None)


def test_calibration_measures_the_budget_from_the_warm_start_and_is_kept(
    bench, tmp_path, monkeypatch
):
    """B is PATR's env steps per task and E the flat episodes' mean length, each read from an
    `agentree rollout` of the warm start; a resumed benchmark reads them back, and the groups
    are sized from them."""
    import argparse

    args = argparse.Namespace(calibrate=2, set=["env.max_turns=4"], budget=None, turns=None)
    sizing = bench.calibrate("frozenlake", tmp_path, args)
    assert sizing["tasks"] == 2
    assert 1.0 <= sizing["turns"] <= 4.0
    assert sizing["budget_per_task"] >= sizing["turns"]  # a tree holds at least one episode
    kept = json.loads((tmp_path / "frozenlake" / "sizing.json").read_text())
    assert kept == sizing

    def no_rollout(*a, **k):
        raise AssertionError("a kept calibration is read back, not measured again")

    with monkeypatch.context() as m:
        m.setattr(bench.subprocess, "run", no_rollout)
        assert bench.calibrate("frozenlake", tmp_path, args) == sizing
    args.sizing = {"frozenlake": sizing}
    g = max(2, round(sizing["budget_per_task"] / sizing["turns"]))
    assert f"rollout.G={g}" in settings(bench.methods_of("frozenlake", args)["grpo"])
    args.budget, args.turns = 30.0, 5.0  # by hand, over the calibration
    assert "rollout.G=6" in settings(bench.methods_of("frozenlake", args)["grpo"])


def test_mean_curve_averages_the_evaluations_all_seeds_share(bench):
    a = {
        "step": [0, 5, 10],
        "budget": [0, 50, 100],
        "wall_s": [0, 1, 2],
        "success": [0.2, 0.4, 0.6],
    }
    b = {"step": [0, 10], "budget": [0, 90], "wall_s": [0, 3], "success": [0.4, 0.8]}
    for c in (a, b):
        c["pass_at_k"] = c["success"]
    m = bench.mean_curve([a, b])
    assert m["step"] == [0, 10] and m["success"] == pytest.approx([0.3, 0.7])
    assert m["budget"] == [0, 95]


@pytest.mark.slow
def test_a_stopped_benchmark_continues_its_runs_as_if_never_stopped(tmp_path, tiny_frozenlake):
    """SIGTERM while a run is in flight (wherever it lands: rollout, update or evaluation),
    then the same command: the run continues from the checkpoint its stop wrote, and its
    rows equal an uninterrupted benchmark's."""
    argv = [sys.executable, str(PATH), "--seeds", "0", "--methods", "grpo", "--steps", "4"]
    argv += ["--eval-every", "1", "--eval-tasks", "2", "--eval-samples", "2"]
    argv += ["--tasks-per-step", "2", "--budget", "12", "--turns", "3"]
    for item in WARM_2_LAYERS:
        argv += ["--set", item]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    subprocess.run([*argv, "--out", str(tmp_path / "a")], check=True, **quiet)
    stopped = [*argv, "--out", str(tmp_path / "b")]
    run = tmp_path / "b" / "frozenlake" / "grpo" / "seed0"
    proc = subprocess.Popen(stopped, **quiet)
    deadline = time.monotonic() + 300
    while not any('"time/step_s"' in line for line in lines(run / "metrics.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline, "no step in 300 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    assert (run / "checkpoints" / "latest").exists() and not (run / "summary.json").exists()
    resumed_at = time.time()
    subprocess.run(stopped, check=True, **quiet)
    first = json.loads(lines(run / "metrics.jsonl")[0])
    assert first["step"] == 0 and first["time"] < resumed_at  # kept, not run again
    assert metric_rows(run) == metric_rows(tmp_path / "a" / "frozenlake" / "grpo" / "seed0")
    log = run.with_suffix(".log").read_text()  # both segments' console output
    assert "interrupted by SIGTERM" in log and "resuming from step" in log
    key = json.loads((tmp_path / "b" / "summary.json").read_text())["warm_start"]
    assert (Path(os.environ["AGENTREE_CACHE"]) / "tiny-warm" / key / "config.json").is_file()


def test_a_run_that_does_not_stop_in_time_is_killed_and_named(tmp_path):
    """The benchmark's stop handler on a run that ignores SIGTERM: after the grace period the
    run is killed, the benchmark says which run and where its log is, and exits 128 + 15."""
    script = f"""
import importlib.util, signal, sys, threading, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("le", {str(PATH)!r})
le = importlib.util.module_from_spec(spec)
sys.modules["le"] = le  # as an import would: the module's dataclasses look themselves up there
spec.loader.exec_module(le)
le.STOP_GRACE_S = 1
deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True)"
deaf += "; time.sleep(60)"
run = Path({str(tmp_path / "seed0")!r})
args = ([sys.executable, "-c", deaf], run, "", {{}})
threading.Thread(target=le.run_train, args=args, daemon=True).start()
while not (run.with_suffix(".log").exists() and run.with_suffix(".log").read_text()):
    time.sleep(0.05)  # SIGTERM is ignored from here
le.stop_runs(signal.SIGTERM, None)
"""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 128 + signal.SIGTERM, out.stderr
    assert time.monotonic() - t0 < 30
    assert f"{tmp_path / 'seed0'} did not checkpoint within 1 s of SIGTERM and was killed" in (
        out.stdout
    )
    assert f"(see {tmp_path / 'seed0.log'})" in out.stdout
    assert "stopped 1 run(s); run the same command again to resume" in out.stdout


def test_a_finished_run_leaves_no_pipe_open(bench, tmp_path, capsys):
    """Each run's output is copied to its log through a pipe, closed once the run is done: a
    benchmark of many runs does not run out of file descriptors."""
    fds = len(os.listdir("/proc/self/fd"))
    for i in range(3):
        bench.run_train([sys.executable, "-c", "print('ok')"], tmp_path / f"s{i}", "", {})
    assert len(os.listdir("/proc/self/fd")) == fds
    assert (tmp_path / "s2.log").read_text() == "ok\n" and capsys.readouterr().out == "ok\n" * 3


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_field_tables_read_the_benchmarks_summary(bench, tmp_path, monkeypatch):
    tables = load_benchmark("field_tables")
    assert tables.interpolate([0, 40, 80], [0.2, 0.3, 0.5], 60) == pytest.approx(0.4)
    assert tables.interpolate([0, 40], [0.2, 0.3], 50) is None
    monkeypatch.setattr(bench, "plot", lambda *a, **k: None)
    case = tmp_path / "frozenlake"
    write_run(case / "grpo" / "seed0", [40, 40], [0.2, 0.3, 0.4])
    write_run(case / "patr" / "seed0", [30, 34], [0.2, 0.5, 0.5])
    summary = bench.summarise("frozenlake", ["grpo", "patr"], [0], tmp_path, 0.1)
    details = json.loads((tmp_path / "frozenlake_details.json").read_text())
    rows = tables.main_table(summary, details)
    assert rows[2].startswith("| flat GRPO | 20.0 | 40.0 ± - | 40 | 80 |")
    assert rows[3].startswith("| PATR | 20.0 | 50.0 ± - | 32 | 30 |")
    assert rows[-1].startswith("| random-valid-move walker | 10.0% |")
    assert tables.paired_table(summary)[2] == "| flat GRPO | +10.0 | +10.0 ± - | 1 / 0 / 0 |"
    # a row per run: held-out at step 0 (a tenth) and 2 (the last), not 1; train success the
    # mean of half of steps 1-2's held-out figures; 8 trajectories over 2 tasks, 1 informative
    runs = tables.runs_table(details, "lake")
    assert runs[0].startswith("| env | method | seed | held-out % at 0 / 2 | pass@4 at end |")
    grpo, patr = "20.0 / **40.0** | 75.0 | 17.5 → 17.5", "20.0 / **50.0** | 75.0 | 25.0 → 25.0"
    assert runs[2] == f"| lake | grpo | 0 | {grpo} | 4.0 / 0 | 1.0 of 2 | 80 | 4 s |"
    assert runs[3] == f"| lake | patr | 0 | {patr} | 4.0 / 0 | 1.0 of 2 | 64 | 4 s |"
    renamed = tables.runs_table(details, "lake", "grpo, 32 tasks")
    assert renamed[2] == f"| lake | grpo, 32 tasks | 0 | {grpo} | 4.0 / 0 | 1.0 of 2 | 80 | 4 s |"
    assert (tables.wall(59.4), tables.wall(60), tables.wall(1530)) == ("59 s", "1 min", "26 min")
    # the area: PATR (0.5 + 0.5) / 2 against GRPO (0.3 + 0.4) / 2
    area = tables.paired_table(summary, "_mean_eval")[2]
    assert area == "| flat GRPO | +15.0 | +15.0 ± - | 1 / 0 / 0 |"
    # equal env steps, quarters of PATR's 64: at 16 GRPO has 0.2 + 0.1 x 16 / 40, PATR
    # 0.2 + 0.3 x 16 / 30
    assert tables.equal_budget_table(details)[2:] == [
        "| 16 | 24.0 | 36.0 |",
        "| 32 | 28.0 | 50.0 |",
        "| 48 | 32.0 | 50.0 |",
        "| 64 | 36.0 | 50.0 |",
    ]


def test_earlier_seeds_are_summarised_with_kept_runs_as_if_all_were_kept(
    bench, tmp_path, monkeypatch
):
    """Seeds summarised before (their run directories gone) join today's runs through the
    details file the earlier summary wrote: the summary equals one over all runs kept together,
    and a seed given twice, a method missing or another budget rule is refused."""
    monkeypatch.setattr(bench, "plot", lambda *a, **k: None)
    curves = {
        ("grpo", 0): ([40, 40], [0.2, 0.3, 0.4]),
        ("grpo", 1): ([44, 36], [0.2, 0.3, 0.6]),
        ("grpo", 2): ([42, 38], [0.1, 0.1, 0.3]),
        ("patr", 0): ([30, 34], [0.2, 0.5, 0.5]),
        ("patr", 1): ([30, 30], [0.2, 0.5, 0.5]),
        ("patr", 2): ([31, 33], [0.1, 0.2, 0.4]),
    }
    together, before, today = tmp_path / "all", tmp_path / "before", tmp_path / "today"
    for (method, seed), (env_steps, success) in curves.items():
        write_run(together / "frozenlake" / method / f"seed{seed}", env_steps, success)
        where = before if seed < 2 else today
        write_run(where / "frozenlake" / method / f"seed{seed}", env_steps, success)
    expected = bench.summarise("frozenlake", ["grpo", "patr"], [0, 1, 2], together, 0.1)
    first = bench.summarise("frozenlake", ["grpo", "patr"], [0, 1], before, 0.1)
    (before / "summary.json").write_text(json.dumps(first))
    shutil.rmtree(before / "frozenlake")  # only the summary and its details are left
    earlier = bench.load_earlier([before / "frozenlake_details.json"], ["grpo", "patr"])
    merged = bench.summarise("frozenlake", ["grpo", "patr"], [2], today, 0.1, None, earlier)
    assert merged == expected
    assert merged["methods"]["patr"]["seeds"] == [0, 1, 2]
    assert (today / "frozenlake_details.json").read_text() == (
        together / "frozenlake_details.json"
    ).read_text()
    # the earlier file's walker figure is a mean over its two seeds' maps
    assert earlier.walker == [(0.1, 2)]

    with pytest.raises(SystemExit, match="both kept and in an --earlier file"):
        bench.summarise("frozenlake", ["grpo", "patr"], [0, 1, 2], together, 0.1, None, earlier)
    with pytest.raises(SystemExit, match=r"holds no runs of \['gigpo'\]"):
        bench.load_earlier([before / "frozenlake_details.json"], ["grpo", "gigpo"])
    details = before / "frozenlake_details.json"
    with pytest.raises(SystemExit, match="seed 0 of grpo is in two --earlier files"):
        bench.load_earlier([details, details], ["grpo", "patr"])
    # the earlier runs under the reserve, today's cut when the budget ends
    first["budget"] = {"env_step_budget": 128, "budget_reserve": True}
    (before / "summary.json").write_text(json.dumps(first))
    earlier = bench.load_earlier([details], ["grpo", "patr"])
    cfg = load_config("frozenlake8_patr", overrides=["rollout.env_step_budget=128"])
    for method in ("grpo", "patr"):
        (today / "frozenlake" / method / "seed2" / "config.yaml").write_text(cfg.to_yaml())
    with pytest.raises(SystemExit, match="different budgets"):
        bench.summarise("frozenlake", ["grpo", "patr"], [2], today, 0.1, None, earlier)


def test_paired_rows_pair_a_pages_run_rows_seed_by_seed(tmp_path):
    """benchmarks/paired_rows.py on hand-made rows: A - B per seed on the final and on the mean
    of the evaluations after step 0, with the standard error worked by hand."""
    rows = [
        "| FrozenLake 8x8 | patr | 0 | 10.0 / 12.0 / 14.0 / 16.0 / **20.0** | 30 |",
        "| FrozenLake 8x8 | grpo | 0 | 10.0 / 11.0 / 12.0 / 13.0 / **14.0** | 30 |",
        "| FrozenLake 8x8 | patr | 1 | 8.0 / 9.0 / 9.0 / 9.0 / **9.0** | 30 |",
        "| FrozenLake 8x8 | grpo | 1 | 8.0 / 9.0 / 10.0 / 11.0 / **14.0** | 30 |",
        "| Sokoban 7x7 | grpo | 1 | 50.0 / 50.0 / 50.0 / 50.0 / **50.0** | 30 |",
    ]
    page = tmp_path / "page.md"
    header = "| env | method | seed | held-out % at 0 / 10 / 20 / 30 / 40 | wall |"
    page.write_text("\n".join(["# Runs", header, *rows, "", "## Again", rows[0]]) + "\n")
    script = str(PATH.parent / "paired_rows.py")
    args = [sys.executable, script, str(page), "patr", "grpo", "--env", "FrozenLake 8x8"]
    done = subprocess.run([*args, "--until", "## Again"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # finals 20 - 14 and 9 - 14: mean 0.5, standard error |6 - (-5)| / 2 = 5.5;
    # areas 15.5 - 12.5 and 9.0 - 11.0: mean 0.5, standard error |3 - (-2)| / 2 = 2.5
    assert "final: +6.0, -5.0; mean +0.5 ± 5.5, 1/2 won (patr 14.5, grpo 14.0)" in done.stdout
    assert "area: +3.0, -2.0; mean +0.5 ± 2.5, 1/2 won" in done.stdout
    twice = subprocess.run(args, capture_output=True, text=True)
    assert twice.returncode != 0 and "patr seed 0 has two rows" in twice.stderr
    # patr at step 20 (14.0, 9.0) against grpo at step 40 (14.0, 14.0): 0.0 and -5.0
    at = subprocess.run([*args, "--until", "## Again", "--at", "20", "40"], capture_output=True,
                        text=True)  # fmt: skip
    assert at.returncode == 0, at.stderr
    assert "patr at step 20 - grpo at step 40: +0.0, -5.0; mean -2.5 ± 2.5, 0/2 won" in at.stdout
    odd = subprocess.run([*args, "--until", "## Again", "--at", "15", "40"], capture_output=True,
                         text=True)  # fmt: skip
    assert odd.returncode != 0 and "not 15" in odd.stderr
    # a row's steps come from its table's header; without one, --at refuses rather than guess
    page.write_text("\n".join(["# Runs", *rows[:4]]) + "\n")
    bare = subprocess.run([*args, "--at", "20", "40"], capture_output=True, text=True)
    assert bare.returncode != 0 and "no table header above it" in bare.stderr
