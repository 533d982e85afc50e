"""Sharded training: 2 gloo ranks under FSDP2 compute the single-process update, with and
without gradient accumulation and with LoRA; the asynchronous loop (`train.async_steps=1`) on 2
sharded ranks equals it in one process; checkpoints resume onto another learner and world size
(2 ranks -> 1, 1 process -> 2 ranks); LoRA trains only adapters and exports a merged model;
bf16 and checkpointing run; ranks > 0 load nothing but their shards, and the sharded model they
end up with equals the checkpoint exactly. Launching ranks as Ray actors and under torchrun:
tests/test_rank_launch.py.

Tolerance of the FSDP-vs-one-process comparisons (fp32): rtol 1e-5, atol 1e-6 on every
parameter after an AdamW step at lr 1e-3, where the step itself moves weights by ~1e-3.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from small_policy import WARM_2_LAYERS

from agentree.config import load_config
from agentree.run.trainer import Trainer

SMALL = [
    *WARM_2_LAYERS,
    "train.tasks_per_step=2",
    "eval.tasks=2",
    "eval.samples=1",
    "engine.max_tokens=6",
    "env.max_turns=4",
    "rollout.K=2",
    "train.trees_every=0",
    "train.save_every=0",
    "train.lr=1e-3",
    "train.kl_coef=0.001",
]
TOL = {"rtol": 1e-5, "atol": 1e-6}
VARIANTS = {
    "whole": ["train.micro_batch_size=64"],
    "accumulate": ["train.micro_batch_size=1"],
    "lora": ["train.micro_batch_size=2", "train.lora.r=4", "train.lora.alpha=8"],
    "packed": ["train.micro_batch_size=2", "train.packing=tree", "train.logits_chunk=7"],
    "window": ["train.micro_batch_size=1", "train.loss_agg=seq-mean"],
}
"""Each trains on the fixed batch; `accumulate` gives each rank several micro-batches (and one
an all-masked filler when their count is odd); `packed` trains tree-packed rows on the ranks,
through the output layer in slices of 7 tokens (`train.logits_chunk`); `window` trains the
batch's trees under a history window of one turn (`WINDOWED`) with seq-mean, so a trajectory's
turns are rows on both ranks and each counts as its share of a trajectory in the normaliser."""
WINDOWED = {"window"}


def load_batch(path: Path, variant: str = "whole") -> tuple[list, list]:
    """The fixed batch, its trees under a history window of one turn for `WINDOWED` variants."""
    trees, groups = torch.load(path, weights_only=False)
    if variant in WINDOWED:
        for tree in trees:
            tree.meta["history"] = 1
    return trees, groups


def cfg_for(out: Path, *extra: str):
    return load_config(
        "frozenlake_patr", select={"steps": "2", "output": str(out)}, overrides=SMALL + list(extra)
    )


def quiet(msg: str) -> None:
    pass


def full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(model, options=opts).items()}


def assert_same(
    got: dict, want: dict, moved_from: dict | None = None, tol: dict | None = None
) -> None:
    tol = tol or TOL
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m, k=k: f"{k}: {m}")
    if moved_from is not None:  # the comparison can fail: the update moved the weights
        moved = max(float((want[k] - moved_from[k]).abs().max()) for k in want)
        assert moved > 100 * TOL["atol"]


@pytest.fixture(scope="module")
def fixed_batch(tmp_path_factory, tiny_frozenlake) -> Path:
    """One rollout batch (trees, groups) from the tiny policy, on maps it sometimes solves."""
    out = tmp_path_factory.mktemp("batch")
    tr = Trainer(cfg_for(out), out, log=quiet)
    easy_maps(tr)
    trees, trajs, _, _, _ = tr.collect()
    tr.close()
    usable = [(tree, ts) for tree, ts in zip(trees, trajs, strict=True) if ts]
    assert sum(len(ts) for _, ts in usable) >= 3
    path = out / "batch.pt"
    torch.save(([u[0] for u in usable], [u[1] for u in usable]), path)
    return path


ASYNC = ["train.async_steps=1", "train.micro_batch_size=2"]
"""Two steps of the loop: step 1 trains on trees sampled during step 0's update (staleness 1)."""


def easy_maps(tr: Trainer) -> None:
    """Train on 3x3 maps the tiny policy sometimes solves (informative groups)."""
    tr.train_tasks = [
        t.__class__(t.id, None, {"desc": ["SGF", "FFF", "FFF"]}) for t in tr.train_tasks[:4]
    ]
    tr._order, tr._cursor = [], 0


def async_loop(tr: Trainer) -> list[dict[str, float]]:
    """`Trainer.fit`'s steps without its evaluations."""
    if tr.rt is not None:
        easy_maps(tr)
    out = []
    while tr.step < tr.cfg.train.steps:
        out.append(tr.train_step())
        tr.step += 1
    return out


def single_process(
    batch: Path, out: Path, extra: list[str], updates: int, variant: str = "whole"
) -> list[dict]:
    """The reference: the update on one process (the ordinary trainer, or LoRA without FSDP)."""
    tr = Trainer(cfg_for(out, *extra), out, log=quiet)
    trees, groups = load_batch(batch, variant)
    states = [full_state(tr.model)]
    for step in range(updates):
        tr.step = step  # the learning-rate schedule follows the step, as in the loop
        tr.update(trees, groups)
        states.append(full_state(tr.model))
    tr.close()
    return states


def _rank_main(rank: int, world: int, port: int, batch: Path, out: Path) -> None:
    from agentree.learner.launch import rank_env

    os.environ.update(rank_env(rank, world, "127.0.0.1", port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    sharded = ["train.fsdp=true", f"train.world_size={world}"]
    # the asynchronous loop: rank 0 rolls out on a thread while every rank updates
    tr = Trainer(cfg_for(out / "async", *ASYNC, *sharded), out / "async", log=quiet)
    async_loop(tr)
    state = full_state(tr.model)
    if rank == 0:
        torch.save(state, out / "async" / "params.pt")
    tr.close()
    # a checkpoint written by one process, resumed by the ranks
    run = out / "from_one"
    tr = Trainer(cfg_for(run, *VARIANTS["whole"], *sharded), run, log=quiet)
    assert tr.resume() and tr.step == 1
    tr.update(*torch.load(batch, weights_only=False))
    state = full_state(tr.model)
    if rank == 0:
        torch.save(state, run / "params.pt")
    tr.close()

    for name, extra in VARIANTS.items():
        run = out / name
        cfg = cfg_for(run, *extra, *sharded)
        tr = Trainer(cfg, run, log=quiet)
        loaded = full_state(tr.model)  # rank 1 built it on the meta device, rank 0 sent shards
        tr.update(*load_batch(batch, name))
        tr.step = 1
        tr.publish()
        state = full_state(tr.model)
        tr.save()
        if rank == 0:
            torch.save(state, run / "params.pt")
            torch.save(loaded, run / "loaded.pt")
            engine = {k: v.clone() for k, v in tr.rt.model.state_dict().items()}
            torch.save(engine, run / "engine.pt")
            tr.rt.close()
    tr.close()


@pytest.fixture(scope="module")
def two_ranks(fixed_batch, tmp_path_factory) -> Path:
    """Every variant trained one step by 2 gloo ranks (one spawn for all: start-up dominates);
    the asynchronous loop; a one-process checkpoint resumed and updated by the ranks."""
    from agentree.learner.launch import free_port

    out = tmp_path_factory.mktemp("ranks")
    one = out / "from_one"  # one update in one process, checkpointed at step 1
    tr = Trainer(cfg_for(one, *VARIANTS["whole"]), one, log=quiet)
    tr.update(*torch.load(fixed_batch, weights_only=False))
    tr.step = 1
    tr.save()
    tr.close()
    (out / "async").mkdir()
    mp.spawn(_rank_main, args=(2, free_port(), fixed_batch, out), nprocs=2)
    return out


@pytest.mark.parametrize("variant", ["whole", "accumulate", "window"])
def test_two_fsdp_ranks_match_one_process(variant, two_ranks, fixed_batch, tmp_path):
    if variant in WINDOWED:  # some trajectory is split into turn rows
        trees, groups = load_batch(fixed_batch, variant)
        pairs = zip(trees, groups, strict=True)
        rows = sum(len(tree.turn_trajectories(t)) for tree, g in pairs for t in g)
        assert rows > sum(map(len, groups))
    init, want = single_process(fixed_batch, tmp_path, VARIANTS[variant], 1, variant)
    loaded = torch.load(two_ranks / variant / "loaded.pt")
    assert loaded.keys() == init.keys()
    assert all(torch.equal(loaded[k], init[k]) for k in init)  # sharded load: exact
    got = torch.load(two_ranks / variant / "params.pt")
    assert_same(got, want, moved_from=init)
    # rank 0's engine model received the trained weights
    engine = torch.load(two_ranks / variant / "engine.pt")
    for k, v in got.items():
        torch.testing.assert_close(engine[k], v, rtol=0, atol=0)


def test_two_fsdp_ranks_on_packed_trees_match_one_process(two_ranks, fixed_batch, tmp_path):
    """Tree packing composes with sharding: ranks training on their share of the packed rows
    give the single-process packed update (packed equals padded: tests/test_packing.py)."""
    init, want = single_process(fixed_batch, tmp_path, VARIANTS["packed"], updates=1)
    got = torch.load(two_ranks / "packed" / "params.pt")
    # Ranks sum a packed row's gradient in slices of 7 tokens and other row groupings than one
    # process does; where an element's gradient nearly cancels, AdamW's m / sqrt(v) turns that
    # summation-order difference into a visible part of one step (measured: 1 of 16384
    # elements off, by 1.5e-6 in one run and 2.0e-5 in another, against steps of ~3e-4), so this
    # comparison allows 1e-4 where the others allow 1e-6.
    assert_same(got, want, moved_from=init, tol={"rtol": 1e-3, "atol": 1e-4})


def test_two_fsdp_ranks_match_one_process_with_lora(two_ranks, fixed_batch, tmp_path):
    init, want = single_process(fixed_batch, tmp_path, VARIANTS["lora"], updates=1)
    loaded = torch.load(two_ranks / "lora" / "loaded.pt")
    assert all(torch.equal(loaded[k], init[k]) for k in init)  # base and adapters from rank 0
    got = torch.load(two_ranks / "lora" / "params.pt")
    assert_same(got, want, moved_from=init)
    # the engine runs the same adapters in place (its keys: the model's inside peft's wrapper)
    engine = torch.load(two_ranks / "lora" / "engine.pt")
    for k, v in got.items():
        if ".lora_" in k:
            assert torch.equal(engine[k.removeprefix("base_model.model.")], v)


def test_async_loop_on_two_sharded_ranks_matches_one_process(two_ranks, tmp_path):
    """train.async_steps=1 through the one loop: 2 FSDP ranks (rank 0 rolling out on a thread
    during the update) end where one process ends, after a fresh and a one-step-stale update."""
    tr = Trainer(cfg_for(tmp_path, *ASYNC), tmp_path, log=quiet)
    init = full_state(tr.model)
    metrics = async_loop(tr)
    want = full_state(tr.model)
    tr.close()
    assert [m["train/staleness"] for m in metrics] == [0.0, 1.0]
    assert all(m["train/policy_tokens"] > 0 for m in metrics)
    assert_same(torch.load(two_ranks / "async" / "params.pt"), want, moved_from=init)


def test_one_process_checkpoint_resumes_on_two_ranks(two_ranks, fixed_batch, tmp_path):
    """Saved by the one-process learner, resumed by 2 FSDP ranks: their next update equals
    two updates in one process."""
    want = single_process(fixed_batch, tmp_path, VARIANTS["whole"], updates=2)
    assert_same(torch.load(two_ranks / "from_one" / "params.pt"), want[2], moved_from=want[1])


@pytest.mark.parametrize(
    ("variant", "fsdp"), [("whole", "true"), ("whole", "false"), ("lora", "true")]
)
def test_distributed_checkpoint_resumes_on_one_rank(
    variant, fsdp, two_ranks, fixed_batch, tmp_path
):  # fmt: skip
    """Saved by 2 ranks, resumed by 1 FSDP rank or by the one-process learner: weights and
    AdamW moments carry over, so the next update equals two updates in one process."""
    want = single_process(fixed_batch, tmp_path / "ref", VARIANTS[variant], updates=2)
    run = two_ranks / variant
    cfg = cfg_for(run, *VARIANTS[variant], f"train.fsdp={fsdp}", "train.world_size=1")
    tr = Trainer(cfg, run, log=quiet)
    try:
        assert tr.resume() and tr.step == 1
        assert_same(full_state(tr.model), torch.load(run / "params.pt"))
        trees, groups = torch.load(fixed_batch, weights_only=False)
        tr.update(trees, groups)
        assert_same(full_state(tr.model), want[2], moved_from=want[1])
    finally:
        tr.close()


def _surrogate(tr, micro, old) -> float:
    """The clipped objective of the fixed batch against the initial policy's log-probs."""
    from agentree.algorithms.loss import loss_normalizer, policy_loss
    from agentree.algorithms.packing import batch_logprobs

    tc = tr.cfg.train
    norm = sum(loss_normalizer(b.mask, tc.loss_agg, b.seq_tokens) for b in micro)
    total = 0.0
    with torch.no_grad():
        for b, o in zip(micro, old, strict=True):
            lp = batch_logprobs(tr.model, b, 1.0)
            loss, _ = policy_loss(
                lp, o, b.adv, b.mask, eps_low=tc.eps_low, eps_high=tc.eps_high,
                agg=tc.loss_agg, normalizer=norm, seq_tokens=b.seq_tokens,
            )  # fmt: skip
            total += float(loss)
    return total


def test_lora_trains_only_adapters_and_exports_merged(fixed_batch, tmp_path):
    from transformers import AutoModelForCausalLM

    from agentree.algorithms.packing import batch_logprobs
    from agentree.commands.cli import main
    from agentree.hub.pretrained import local_policy
    from agentree.learner.base import ShardedLearner
    from agentree.learner.lora import is_adapter_key
    from agentree.run.checkpoint import latest_checkpoint

    cfg = cfg_for(tmp_path / "run", "train.lora.r=4", "train.lora.alpha=8", "train.lr=1e-2")
    tr = Trainer(cfg, tmp_path / "run", log=quiet)
    assert isinstance(tr.learner, ShardedLearner)
    trees, groups = torch.load(fixed_batch, weights_only=False)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    micro = tr.updater.batches(trees, groups)
    with torch.no_grad():
        old = [batch_logprobs(tr.model, b, 1.0) for b in micro]
    s0 = _surrogate(tr, micro, old)
    for _ in range(4):
        tr.update(trees, groups)
    s1 = _surrogate(tr, micro, old)
    assert s1 < s0 - 1e-3, (s0, s1)
    after = tr.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(is_adapter_key(k) for k in changed)
    assert any(".lora_B." in k for k in changed)

    tr.step = 4
    tr.save()
    out = tmp_path / "merged"
    assert main(["export", str(tmp_path / "run"), "--output", str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = micro[0].ids[:1, :12]
    tr.model.eval()
    with torch.no_grad():
        a = tr.model.generate(input_ids=prompt, max_new_tokens=16, do_sample=False)
        b = merged.generate(input_ids=prompt, max_new_tokens=16, do_sample=False)
        # the merged weights give the adapted model's distribution, not just its argmax
        torch.testing.assert_close(
            merged(input_ids=a).logits, tr.model(input_ids=a).logits, rtol=1e-4, atol=1e-4
        )
    assert a.tolist() == b.tolist()
    tr.close()
    # `--policy` the LoRA checkpoint itself: merged once, into the cache, as export merges it
    ckpt = latest_checkpoint(tmp_path / "run")
    cached = local_policy(str(ckpt), log=None)
    assert Path(cached).parent.name == "merged" and local_policy(str(ckpt), log=None) == cached
    again = AutoModelForCausalLM.from_pretrained(cached).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in merged.state_dict().items())
    ev = tmp_path / "eval"
    assert main(["eval", "--policy", str(ckpt), "--tasks", "2", "--output", str(ev)]) == 0
    assert json.loads((ev / "eval.json").read_text())["summary"]["tasks"] == 2
    assert main(["train", "--policy", str(ckpt), "--dry-run"]) == 0  # its base's architecture


def test_lora_with_bf16_base_trains_only_fp32_adapters(fixed_batch, tmp_path):
    """train.dtype=bf16 under LoRA: the frozen base stays bf16 (no fp32 master copy), the
    adapters are fp32 and are the only weights that move; the objective improves."""
    from agentree.algorithms.packing import batch_logprobs
    from agentree.learner.lora import is_adapter_key

    extra = ["train.lora.r=4", "train.lora.alpha=8", "train.lr=1e-2", "train.dtype=bf16"]
    for fsdp in ("false", "true"):
        tr = Trainer(cfg_for(tmp_path / fsdp, *extra, f"train.fsdp={fsdp}"), tmp_path / fsdp)
        try:
            before = full_state(tr.model)
            dtypes = {is_adapter_key(k): {v.dtype} for k, v in before.items()}
            assert dtypes == {True: {torch.float32}, False: {torch.bfloat16}}
            trees, groups = torch.load(fixed_batch, weights_only=False)
            micro = tr.updater.batches(trees, groups)
            with torch.no_grad():
                old = [batch_logprobs(tr.model, b, 1.0).float() for b in micro]
            s0 = _surrogate(tr, micro, old)
            for _ in range(4):
                tr.update(trees, groups)
            assert _surrogate(tr, micro, old) < s0 - 1e-3
            after = full_state(tr.model)
            changed = {k for k in before if not torch.equal(before[k], after[k])}
            assert changed and all(is_adapter_key(k) for k in changed)
        finally:
            tr.close()


def test_bf16_and_gradient_checkpointing_run_a_step(tiny_frozenlake, tmp_path):
    from agentree.learner.base import ShardedLearner

    cfg = cfg_for(
        tmp_path, "train.fsdp=true", "train.dtype=bf16", "train.gradient_checkpointing=true",
        "train.micro_batch_size=2",
    )  # fmt: skip
    tr = Trainer(cfg, tmp_path, log=quiet)
    try:
        assert isinstance(tr.learner, ShardedLearner)
        before = full_state(tr.model)
        assert all(v.dtype == torch.float32 for v in before.values())  # fp32 master weights
        m = tr.train_step()
        after = full_state(tr.model)
        assert all(torch.isfinite(v).all() for v in after.values())
        assert m["train/policy_tokens"] > 0 and torch.isfinite(torch.tensor(m["train/loss"]))
        assert any(not torch.equal(before[k], after[k]) for k in before)
    finally:
        tr.close()


def test_bf16_without_fsdp_is_a_clear_error(tmp_path):
    """Rejected with the config, before any model is built."""
    with pytest.raises(ValueError, match=r"train\.fsdp=true"):
        cfg_for(tmp_path, "train.dtype=bf16")
    with pytest.raises(ValueError, match=r"train\.fsdp=true"):
        cfg_for(tmp_path, "train.world_size=2")


@pytest.mark.parametrize(
    ("config", "expect"),
    [
        ("agentree/configs/frozenlake_patr_qwen2.5_0.5b.yaml", "Qwen/Qwen2.5-0.5B-Instruct"),
        ("agentree/configs/swebench_patr_qwen3_8b.yaml", "Qwen/Qwen3-8B"),
    ],
)
def test_gpu_recipes_dry_run_without_weights(config, expect, capsys):
    from agentree.commands.cli import main

    root = Path(__file__).parent.parent
    assert main(["train", "--config", str(root / config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"built-in architecture table for {expect}" in out
    assert "rank 0:" in out and "FSDP2" in out and "engine: vllm" in out
    total = float(out.split("total")[-1].split("GiB")[0])
    assert 1 < total < 80  # the recipes are sized for 80 GB GPUs (docs/scaling.md)


def test_dry_run_counts_parameters_of_a_local_checkpoint(tiny_frozenlake, capsys):
    """A local path is read from its config.json; the count is the real model's."""
    from transformers import AutoModelForCausalLM

    from agentree.commands.cli import main

    args = ["train", "--policy", str(tiny_frozenlake), "--dry-run", "--set", "train.lora.r=4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_frozenlake).parameters())
    assert f"parameters: {n / 1e6:.2f}M (LoRA r=4" in out


def test_dry_run_counts_a_bf16_frozen_base_under_lora():
    """LoRA with train.dtype=bf16: 2 bytes a base parameter, 4 an adapter one, sharded."""
    from agentree.run.plan import estimate

    root = Path(__file__).parent.parent
    recipe = str(root / "agentree/configs/swebench_patr_qwen3_8b.yaml")
    e = estimate(load_config(recipe, overrides=["train.lora.r=16", "train.world_size=4"]))
    n = e["params"]
    assert e["per_rank"]["weights"] == (2 * n["total"] + 4 * n["lora"]) / 4


def test_dry_run_counts_the_engines_where_the_run_places_them():
    """A local transformers engine samples from the trainer's weights (no copy); a vLLM engine
    holds a copy in the policy's dtype beside its KV cache; on Ray each engine replica, or the
    engine of each rollout worker, holds one."""
    from agentree.run.plan import GIB, dry_run, estimate

    def engine_line(*overrides: str, config: str | None = None) -> tuple[str, int]:
        cfg = load_config(config, overrides=list(overrides))
        out = dry_run(cfg).splitlines()
        return out[-1].strip(), estimate(cfg)["params"]["total"]

    line, _ = engine_line()
    assert line == (
        "engine on rank 0: samples from the trainer's weights (no copy); cached prefix KV up to "
        "engine.prefix_cache_mb (1024 MiB: 262,144 tokens of 4.0 KiB)"
    )
    root = Path(__file__).parent.parent
    line, p = engine_line(config=str(root / "agentree/configs/frozenlake_patr_qwen2.5_0.5b.yaml"))
    assert line == (
        f"engine weights (bfloat16): {2 * p / GIB:.2f} GiB on rank 0, its own copy; vLLM adds "
        "its KV cache (engine.vllm.gpu_memory_utilization)"
    )
    line, p = engine_line("engine.backend=vllm", "policy.dtype=float32")
    assert line.startswith(f"engine weights (float32): {4 * p / GIB:.2f} GiB on rank 0, its own")
    line, _ = engine_line("distributed.backend=ray", "distributed.rollout_workers=3")
    assert line.startswith(
        "engine weights (auto, bf16 on a GPU): 0.00 GiB on each of the 3 rollout workers, each "
        "its own copy; cached prefix KV"
    )
    line, _ = engine_line("distributed.backend=ray", "distributed.engine_gpus=1")
    assert " on 1 engine replica, its own copy; " in line
