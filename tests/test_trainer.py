"""Trainer: exact token in/out, the update moves the loss and the weights, checkpoints resume."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from small_policy import metric_rows

import agentree.run.trainer as trainer_module
from agentree.config import load_config
from agentree.run.trainer import Trainer, make_batch, token_logprobs

SMALL = [
    "train.tasks_per_step=2",
    "train.micro_batch_size=4",
    "eval.tasks=2",
    "eval.samples=1",
    "engine.max_tokens=6",
    "env.max_turns=4",
    "rollout.K=2",
    "train.trees_every=1",
    "train.save_every=0",
]


def small_config(tmp_path, *extra, steps=1):
    return load_config(
        "frozenlake_patr",
        select={"steps": str(steps), "output": str(tmp_path)},
        overrides=SMALL + list(extra),
    )


def easy_tasks(tr, desc=("SGF", "FFF", "FFF")):
    """Maps with the goal next to the start, so groups mix wins and losses."""
    tr.train_tasks = [t.__class__(t.id, None, {"desc": list(desc)}) for t in tr.train_tasks[:4]]
    tr._order, tr._cursor = [], 0


def test_trainer_sees_exactly_the_sampled_ids(tmp_path, tiny_frozenlake):
    cfg = small_config(tmp_path)
    tr = Trainer(cfg, tmp_path, log=lambda s: None)
    trees, _stats = tr.rt.rollouts.rollout(tr.next_tasks(2))
    for tree in trees:
        trajs = tr.rt.controller.group(tree)
        batch = make_batch(trajs, [[1.0] * len(t.token_ids) for t in trajs], pad=0)
        for i, t in enumerate(trajs):
            sampled = [x for n in tree.path(t.leaf) for x in n.action_ids]
            sampled_lp = [x for n in tree.path(t.leaf) for x in n.logprobs]
            # targets are shifted by one: mask[j] marks token j+1
            targets = batch.ids[i, 1:][batch.mask[i] == 1].tolist()
            assert targets == sampled
            assert batch.sampled_lp[i][batch.mask[i] == 1].tolist() == pytest.approx(sampled_lp)
            glue = [x for n in tree.path(t.leaf)[:-1] for x in n.obs_ids]
            assert int((batch.mask[i] == 0).sum()) >= len(glue) - 1  # prompt+glue are masked
        with torch.no_grad():
            lp = token_logprobs(tr.model, batch, cfg.engine.temperature)
        drift = ((lp - batch.sampled_lp).abs() * batch.mask).max()
        assert drift < 1e-4  # recomputed log-probs of the stored ids equal the sampled ones
    tr.rt.close()


def test_update_changes_weights_and_writes_run_dir(tmp_path, tiny_frozenlake):
    cfg = small_config(
        tmp_path, "train.lr=0.01", "train.warmup_steps=2", "train.lr_schedule=constant", steps=2
    )
    tr = Trainer(cfg, tmp_path, log=lambda s: None)
    easy_tasks(tr)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    history = tr.fit()
    changed = [k for k, v in tr.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "no parameter moved"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # the optimiser stepped at the warm-up's rates: lr (s + 1) / warmup_steps
    assert [r["train/lr"] for r in steps] == pytest.approx([0.005, 0.01])
    for r in steps:
        assert torch.isfinite(torch.tensor(r["train/loss"]))
        assert r["train/logprob_drift"] < 1e-3
        assert "rollout/env_steps" in r and "rollout/forks" in r and "scorer/fallbacks" in r
    assert (
        "eval/success_rate" in history["eval_before"]
        and "eval/success_rate" in history["eval_after"]
    )
    trees = sorted((tmp_path / "trees").glob("*.json"))
    assert trees and json.loads(trees[0].read_text())["format"] == "agentree.tree/1"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"
    tr.rt.close()


def test_update_moves_logprobs_along_the_advantages(tmp_path, tiny_frozenlake):
    """After one update, sum_t A_t * (log pi_new - log pi_old) > 0 on the batch's policy tokens."""
    from agentree.algorithms.advantages import compute_advantages

    cfg = small_config(tmp_path, "train.lr=0.003", "train.kl_coef=0.0")
    tr = Trainer(cfg, tmp_path, log=lambda s: None)
    trees, _ = tr.rt.rollouts.rollout(tr.next_tasks(2))
    groups = [tr.rt.controller.group(t) for t in trees]
    for g in groups:  # make the groups informative: the first trajectory of each tree wins
        g[0].reward = 1.0
    advs = [a for g in compute_advantages("grpo", trees, groups) for a in g]
    batch = make_batch([t for g in groups for t in g], advs, pad=0)
    with torch.no_grad():
        before = token_logprobs(tr.model, batch, 1.0)
    tr.update(trees, groups)
    with torch.no_grad():
        after = token_logprobs(tr.model, batch, 1.0)
    gain = float(((after - before) * batch.adv * batch.mask).sum())
    assert gain > 0
    tr.rt.close()


def test_checkpoint_resume_restores_state(tmp_path, tiny_frozenlake):
    cfg = small_config(tmp_path, "train.lr=0.01", steps=1)
    tr = Trainer(cfg, tmp_path, log=lambda s: None)
    tr.fit()
    weights = {k: v.clone() for k, v in tr.model.state_dict().items()}
    cursor = tr._cursor
    tr.rt.close()
    again = Trainer(cfg, tmp_path, log=lambda s: None)
    assert again.resume()
    assert again.step == 1 and again._cursor == cursor
    for k, v in again.model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert again.opt.state_dict()["state"], "optimizer state not restored"
    again.rt.close()


def test_a_resumed_run_continues_exactly_as_the_uninterrupted_one(tmp_path, tiny_frozenlake):
    """Resumed from step 2 (after an evaluation, which reseeds the engine), steps 3-4 draw the
    same tokens and end on the same weights: the checkpoint holds the rollouts' and the
    engine's random state beside the trainer's."""
    (tmp_path / "a").mkdir()
    cfg = small_config(
        tmp_path / "a", "train.lr=0.01", "train.save_every=2", "train.eval_every=2", steps=4
    )
    tr = Trainer(cfg, tmp_path / "a", log=lambda s: None)
    tr.fit()
    weights = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.rt.close()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000004")
    (tmp_path / "b" / "checkpoints" / "latest").write_text("step_000002")
    again = Trainer(cfg, tmp_path / "b", log=lambda s: None)
    assert again.resume() and again.step == 2
    again.fit()
    again.rt.close()

    assert metric_rows(tmp_path / "b") == metric_rows(tmp_path / "a")
    for k, v in again.model.state_dict().items():
        assert torch.equal(v, weights[k]), k


@pytest.mark.parametrize("during", ["evaluation", "update"])
def test_a_run_stopped_around_an_evaluation_evaluates_again_when_resumed(
    tmp_path, tiny_frozenlake, monkeypatch, during
):
    """Ctrl-C at the end of the held-out evaluation after step 2 (the engine has drawn every
    sample, the row is not written), or during step 2's update (held until the update is
    done, so it lands just before that evaluation): the checkpoint holds the state from before
    the evaluation, the resumed run evaluates step 2 first, and its rows and final weights
    equal the uninterrupted run's."""
    runs = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        cfg = small_config(tmp_path / name, "train.lr=0.01", "train.eval_every=2", steps=4)
        runs[name] = Trainer(cfg, tmp_path / name, log=lambda s: None)
    runs["a"].fit()
    runs["a"].rt.close()

    b = runs["b"]
    if during == "evaluation":
        real = trainer_module.evaluate

        def stopped_at_step_2(rt, cfg, seed):
            result = real(rt, cfg, seed=seed)
            if b.step == 2:
                raise KeyboardInterrupt("SIGINT")
            return result

        monkeypatch.setattr(trainer_module, "evaluate", stopped_at_step_2)
    else:
        update = b.update

        def signalled_in_step_2(*args, **kwargs):
            out = update(*args, **kwargs)
            if b.step == 1:  # counted once the step is done
                b.stop._handle(signal.SIGINT, None)  # what the installed handler receives
            return out

        monkeypatch.setattr(b, "update", signalled_in_step_2)
    with pytest.raises(KeyboardInterrupt):
        b.fit()
    b.save()  # what `agentree train` does on Ctrl-C
    b.rt.close()
    monkeypatch.undo()
    again = Trainer(cfg, tmp_path / "b", log=lambda s: None)
    assert again.resume() and again.step == 2
    again.fit()
    again.rt.close()
    assert metric_rows(tmp_path / "b") == metric_rows(tmp_path / "a")
    weights = runs["a"].model.state_dict()
    for k, v in again.model.state_dict().items():
        assert torch.equal(v, weights[k]), k


def test_max_minutes_stops_the_run_evaluates_saves_and_resumes_the_clock(tmp_path, tiny_frozenlake):
    cfg = small_config(tmp_path, "train.max_minutes=0.0001", steps=50)  # 6 ms: one step
    logs: list[str] = []
    tr = Trainer(cfg, tmp_path, log=logs.append)
    history = tr.fit()
    tr.rt.close()
    assert tr.step == 1
    assert "eval/success_rate" in history["eval_after"]
    assert any("train.max_minutes=0.0001 reached after step 1" in m for m in logs), logs
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000001"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r["time/trained_min"] for r in rows if "time/trained_min" in r]
    assert len(trained) == 1 and trained[0] > 0
    again = Trainer(cfg, tmp_path, log=lambda s: None)
    assert again.resume() and again._trained_s == pytest.approx(60 * trained[0])
    again.fit()  # the clock went on from the checkpoint: still past the limit, one more step
    again.rt.close()
    assert again.step == 2


def test_dynamic_sampling_drops_uninformative_groups(tmp_path, tiny_frozenlake):
    # one-turn episodes on maps whose goal is two steps away: every reward is 0
    cfg = small_config(
        tmp_path,
        "env.max_turns=1",
        "env.invalid_penalty=0",
        "train.dynamic_sampling=true",
        "train.max_refill_rounds=2",
    )
    tr = Trainer(cfg, tmp_path, log=lambda s: None)
    easy_tasks(tr, ("SFG", "FFF", "FFF"))
    metrics = tr.train_step()
    assert metrics["train/groups_dropped"] == 4  # 2 tasks x 2 refill rounds, then kept
    assert metrics["train/groups_informative"] == 0  # the kept groups are all 0 too
    tr.rt.close()


def test_learning_rate_schedules():
    from agentree.config import TrainConfig
    from agentree.run.trainer import lr_at

    const = TrainConfig(lr=1.0, steps=10, warmup_steps=2)
    assert [lr_at(const, s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cos = TrainConfig(lr=1.0, steps=11, lr_schedule="cosine", lr_min_ratio=0.1)
    # progress = step / 10: cos(0)=1 -> 1.0, cos(pi/2)=0 -> 0.55, cos(pi)=-1 -> 0.1
    assert lr_at(cos, 0) == pytest.approx(1.0)
    assert lr_at(cos, 5) == pytest.approx(0.55)
    assert lr_at(cos, 10) == pytest.approx(0.1)
    # warm-up, then the cosine over the remaining steps: lr (s + 1) / w for s < w = 2, then
    # progress (s - 2) / 9: 0 -> 1.0, 4/9 -> 0.1 + 0.45 (1 + cos(4 pi / 9)) = 0.62814, 1 -> 0.1
    both = TrainConfig(lr=1.0, steps=12, warmup_steps=2, lr_schedule="cosine", lr_min_ratio=0.1)
    assert [lr_at(both, s) for s in (0, 1, 2)] == pytest.approx([0.5, 1.0, 1.0])
    assert lr_at(both, 6) == pytest.approx(0.62814, abs=1e-5)
    assert lr_at(both, 11) == pytest.approx(0.1)
    assert TrainConfig().warmup_steps == 0  # off by default: the schedule as it was


_GRAD_NORMS = """
import json, sys, torch
from pathlib import Path
if sys.argv[1] == "toggled":  # what a warm-start build leaves behind (`one_thread`)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_num_threads(n)
from agentree.config import load_config
from agentree.run.trainer import Trainer
cfg = load_config("frozenlake_patr", select={"steps": "3", "output": sys.argv[2]},
                  overrides=json.loads(sys.argv[3]))
tr = Trainer(cfg, Path(sys.argv[2]), log=lambda s: None)
norms = [tr.train_step()["train/grad_norm"] for _ in range(3)]
tr.rt.close()
print(json.dumps(norms))
"""


@pytest.mark.slow  # two fresh processes
def test_a_run_computes_the_same_whether_or_not_it_built_its_policy_first(
    tmp_path, tiny_frozenlake
):
    # torch's CPU kernels split work one way before set_num_threads is first called and another
    # after; a warm-start build calls it, so the default run ended at 48.0% held-out when it
    # built its warm start and 30.1% when it found it cached, until load_policy called it too
    sets = [*SMALL, f"policy.path={tiny_frozenlake}"]
    out = {}
    for mode in ("plain", "toggled"):
        run = subprocess.run(
            [sys.executable, "-c", _GRAD_NORMS, mode, str(tmp_path / mode), json.dumps(sets)],
            capture_output=True, text=True, check=True, timeout=600,
        )  # fmt: skip
        out[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["plain"] == out["toggled"]  # to the bit
    assert any(g > 0 for g in out["plain"])  # the steps did learn something


def test_the_trainer_says_once_when_the_prefix_cache_drops_what_the_rollout_needs(
    tmp_path, tiny_frozenlake
):
    """8 tasks' trees on a 1 MiB prefix cache (512 tokens of the tiny policy's KV): it drops
    histories that the next turn extends, the rollout counts the tokens computed again, and
    the trainer says once in two steps what to raise; on 64 MiB it drops nothing and says
    nothing. The steps are the same either way (the same samples; log-probs equal to float
    rounding, as KV computed again is); only what the engine computes differs."""
    engine = ("wall_s", "policy_tokens_prefilled", "policy_tokens_cached", "policy_tokens_evicted")
    rows = {}
    for mb in (1, 64):
        said: list[str] = []
        cfg = small_config(
            tmp_path / str(mb), f"engine.prefix_cache_mb={mb}", "train.tasks_per_step=8", steps=2
        )
        tr = Trainer(cfg, tmp_path / str(mb), log=said.append)
        try:
            rows[mb] = [tr.train_step() for _ in range(2)]
        finally:
            tr.close()
        warned = [m for m in said if "engine.prefix_cache_mb" in m]
        evicted = [r["rollout/policy_tokens_evicted"] for r in rows[mb]]
        if mb == 1:
            assert min(evicted) > 0 and len(warned) == 1 and "(1 MiB now)" in warned[0]
        else:
            assert evicted == [0, 0] and warned == []
    for small, large in zip(rows[1], rows[64], strict=True):
        same = [k for k in small if not k.startswith("time/") and not k.endswith(engine)]
        assert len(same) > 20
        assert {k: small[k] for k in same} == pytest.approx({k: large[k] for k in same}, abs=1e-5)
