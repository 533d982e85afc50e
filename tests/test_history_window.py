"""The history window (`engine.history: last:k`): each turn's prompt is the task and the last k
turns, every turn is trained as its own sequence on exactly the ids it was sampled against,
forks and tree packing still hold, and the default (`all`) is the append-only path unchanged."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from helpers import load_benchmark

from agentree.algorithms.advantages import compute_advantages
from agentree.algorithms.loss import loss_normalizer, policy_loss
from agentree.algorithms.packing import choose_layout, make_batch, turn_samples
from agentree.chat import ChatFormat
from agentree.config import EngineConfig, TrainConfig, load_config
from agentree.engines.base import SamplingParams
from agentree.envs import Task, make_env
from agentree.learner.update import PolicyUpdate
from agentree.models.sft import example_from_messages, examples_from_trees, windowed
from agentree.rollout.base import RolloutContext, make_controller
from agentree.scorers import make_scorer
from agentree.tree import EndReason, Tree

OPEN = ["SFFF", "FFFF", "FFFF", "FFFG"]  # no holes: long episodes unless the goal is reached
TURNS = 7


@pytest.fixture(scope="module")
def engine(tiny_frozenlake):
    """The real tiny policy's engine, recording every (prompt, completion) it samples."""
    from agentree.engines.hf import HFEngine

    torch.manual_seed(0)
    eng = HFEngine.from_pretrained(tiny_frozenlake, seed=0)
    eng.sampled = []
    generate = eng.generate

    def recording(prompts, params):
        outs = generate(prompts, params)
        for p, o in zip(prompts, outs, strict=True):
            eng.sampled += [(tuple(p), tuple(c.token_ids), tuple(c.logprobs)) for c in o]
        return outs

    eng.generate = recording
    yield eng
    eng.close()


def rollout(engine, history: int | None, name: str = "patr", seed: int = 0, **cfg):
    chat = ChatFormat(engine.tokenizer)
    engine.seed(seed)
    # from a cold prefix cache: cached and recomputed KV round differently in the last bits,
    # and the default-mode comparison below is bit for bit
    engine.prefix_cache.clear()
    engine.sampled = []
    ctx = RolloutContext(
        engine=engine,
        chat=chat,
        sampling=SamplingParams(max_tokens=6, stop_token_ids=chat.stop_token_ids),
        env_factory=lambda: make_env("frozenlake", max_turns=TURNS, invalid_penalty=0.1),
        scorer=make_scorer("bfs"),
        rng=random.Random(seed),
        history=history,
    )
    controller = make_controller(name, **cfg)
    tasks = [Task(f"open{i}", options={"desc": OPEN}) for i in range(2)]
    trees, stats = controller.rollout(tasks, ctx)
    return trees, stats, [controller.group(t) for t in trees]


PATR = {"B0": 2, "K": 3, "M": 2, "top_k": 1, "alpha": 0.5, "theta": 99}


def as_text(chat, nodes) -> list[dict[str, str]] | None:
    """A trajectory's nodes as chat messages (the first observation, then each action and the
    observation after it); None where a sampled action's text tokenises to other ids than
    those sampled, so that text cannot reproduce the rollout."""
    eot = chat.end_of_turn_id
    if any(chat.encode(n.action) != [i for i in n.action_ids if i != eot] for n in nodes[1:]):
        return None
    messages = [{"role": "user", "content": nodes[0].observation}]
    for n in nodes[1:]:
        messages += [{"role": "assistant", "content": n.action}]
        messages += [{"role": "user", "content": n.observation}]
    return messages


def test_window_prompt_by_hand():
    """Root + last k turns, every id as stored; the training samples of a trajectory are its
    turns, loss only on each turn's action, advantages carried per node."""
    tree = Tree("t")
    tree.meta["history"] = 1
    tree.add_root("o0", [1, 2])
    a = tree.add_child(0, action="x", action_ids=[10, 11], logprobs=[-0.1, -0.2], obs_ids=[3])
    b = tree.add_child(a.id, action="y", action_ids=[12], logprobs=[-0.3], obs_ids=[4, 5])
    c = tree.add_child(b.id, action="z", action_ids=[13], logprobs=[-0.4], reward=1.0)
    c.end_reason = EndReason.COMPLETED
    assert tree.context_ids(a.id) == [1, 2, 10, 11, 3]
    assert tree.context_ids(b.id) == [1, 2, 12, 4, 5]  # turn 1 left the window
    traj = tree.trajectory(c.id)  # the whole path, what advantage estimators read
    assert traj.token_ids == [1, 2, 10, 11, 3, 12, 4, 5, 13]
    samples = tree.turn_trajectories(traj)
    assert [s.token_ids for s in samples] == [
        [1, 2, 10, 11],
        [1, 2, 10, 11, 3, 12],
        [1, 2, 12, 4, 5, 13],
    ]
    assert [s.loss_mask for s in samples] == [
        [0, 0, 1, 1],
        [0, 0, 0, 0, 0, 1],
        [0, 0, 0, 0, 0, 1],
    ]
    assert samples[0].logprobs == [0.0, 0.0, -0.1, -0.2]
    assert samples[2].node_of_token == [0, 0, b.id, b.id, b.id, c.id]
    # per-token advantages of the whole trajectory (say GiGPO's: one per turn) go with the
    # action ids of each turn; prompt ids get none
    adv = [0.0, 0.0, 0.5, 0.5, 0.0, -0.25, 0.0, 0.0, 2.0]
    groups, advs = turn_samples([tree], [[traj]], [[adv]])
    assert groups[0] == samples
    assert advs[0] == [[0.0, 0.0, 0.5, 0.5], [0.0] * 5 + [-0.25], [0.0] * 5 + [2.0]]
    # rejection-sampling fine-tuning on such trees trains the same samples
    examples, seen = examples_from_trees([tree])
    assert seen == 1 and [e.token_ids for e in examples] == [s.token_ids for s in samples]
    # without a window the trajectory is the one sample, unchanged
    tree.meta.pop("history")
    assert tree.turn_trajectories(traj) == [traj]
    assert tree.context_ids(b.id) == [1, 2, 10, 11, 3, 12, 4, 5]


def test_windowed_demonstrations_are_the_rollouts_turn_samples(engine):
    """A conversation laid out with the window (`windowed`, what a warm start or `agentree sft`
    trains on under `engine.history: last:k`) gives, turn by turn, the ids and loss masks the
    rollouts train: the text of windowed rollouts, tokenised as SFT does, against
    `Tree.turn_trajectories`. One difference, by design: an answer the rollout cut at
    `max_tokens` ends there, and SFT's answer closes its turn (the end-of-turn token it learns
    is the one the rollout's next observation opens with)."""
    k = 2
    trees, _, groups = rollout(engine, k, **PATR)
    chat = ChatFormat(engine.tokenizer)
    eot = chat.end_of_turn_id
    system = make_env("frozenlake").system_prompt
    checked = 0
    for tree, group in zip(trees, groups, strict=True):
        for traj in group:
            nodes = [tree.nodes[i] for i in traj.nodes]
            messages = as_text(chat, nodes)
            if messages is None:
                continue  # sampled ids whose text tokenises another way: SFT sees the text
            examples = [example_from_messages(chat, c, system) for c in windowed(messages, k)]
            samples = tree.turn_trajectories(traj)
            assert len(examples) == len(samples) == len(nodes) - 1
            for e, s in zip(examples, samples, strict=True):
                ids, mask = list(s.token_ids), list(s.loss_mask)
                if ids[-1] != eot:  # cut at max_tokens
                    ids, mask = [*ids, eot], [*mask, 1]
                assert e.token_ids == ids
                assert e.loss_mask == mask
            checked += len(nodes) - 1 > k  # turns beyond the window were dropped
    assert checked > 0


def _token_grads(trees, groups, advs, size):
    """d loss / d log-prob of every policy token at rho = 1 under seq-mean, by (node, index in
    the node's action), from the rows and micro-batches an update builds."""
    samples, sample_advs = turn_samples(trees, groups, advs)
    micro = choose_layout(samples, sample_advs, 0, size, "padded")
    norm = sum(loss_normalizer(b.mask, "seq-mean", b.seq_tokens) for b in micro)
    by_node: dict[int, list[float]] = {}
    rows = sorted((t for g in samples for t in g), key=lambda t: len(t.token_ids))
    for k, b in enumerate(micro):
        lp = torch.zeros_like(b.mask, dtype=torch.float64).requires_grad_()
        loss, _ = policy_loss(
            lp, lp.detach(), b.adv.double(), b.mask, eps_low=0.2, eps_high=0.2,
            agg="seq-mean", normalizer=norm, seq_tokens=b.seq_tokens,
        )  # fmt: skip
        loss.backward()
        for i, traj in enumerate(rows[k * size : (k + 1) * size]):
            for pos, (owner, m) in enumerate(zip(traj.node_of_token, traj.loss_mask, strict=True)):
                if m:
                    by_node.setdefault(owner, []).append(float(lp.grad[i, pos - 1]))
    return norm, by_node


def test_seq_mean_weighs_a_windowed_trajectory_as_the_whole_one():
    """Eq. 2 under a window: a turn trained as its own row gives each of its tokens the weight
    it has in the whole trajectory, A / (the trajectory's policy tokens x trajectories), in
    whichever micro-batch it lands; the normaliser still counts trajectories."""
    tree = Tree("t")
    tree.add_root("o0", [1, 2])
    a = tree.add_child(0, action="x", action_ids=[10, 11], logprobs=[0.0, 0.0], obs_ids=[3])
    b = tree.add_child(a.id, action="y", action_ids=[12], logprobs=[0.0], obs_ids=[4, 5])
    c = tree.add_child(b.id, action="z", action_ids=[13], logprobs=[0.0], reward=1.0)
    d = tree.add_child(0, action="u", action_ids=[14], logprobs=[0.0], obs_ids=[6])
    e = tree.add_child(d.id, action="v", action_ids=[15, 16], logprobs=[0.0, 0.0])
    c.end_reason = e.end_reason = EndReason.COMPLETED
    group = tree.trajectories()
    assert [g.num_policy_tokens for g in group] == [4, 3]
    advs = [
        [
            [1.0 if m else 0.0 for m in group[0].loss_mask],
            [-1.0 if m else 0.0 for m in group[1].loss_mask],
        ]
    ]
    whole = _token_grads([tree], [group], advs, size=8)
    tree.meta["history"] = 1
    turns = tree.turn_trajectories(group[0])
    assert len(turns) == 3 and {t.trajectory_tokens for t in turns} == {4}
    for size in (1, 2, 8):  # every turn its own micro-batch, pairs, all at once
        norm, grads = _token_grads([tree], [group], advs, size)
        assert norm == pytest.approx(2.0)
        assert grads.keys() == whole[1].keys()
        for node, want in whole[1].items():
            assert grads[node] == pytest.approx(want, abs=1e-7)  # fp32 masks
    # by hand: -A / (4 x 2) on the first trajectory's tokens, +1 / (3 x 2) on the second's
    assert whole[1] == {
        a.id: [pytest.approx(-1 / 8)] * 2,
        b.id: [pytest.approx(-1 / 8)],
        c.id: [pytest.approx(-1 / 8)],
        d.id: [pytest.approx(1 / 6)],
        e.id: [pytest.approx(1 / 6)] * 2,
    }
    # were each turn its own sequence, the three one-turn rows of the first trajectory would
    # outweigh the second's two
    for t in turns:
        t.trajectory_tokens = None
    rows = make_batch(turns, [[1.0] * len(t.token_ids) for t in turns], 0)
    assert loss_normalizer(rows.mask, "seq-mean", rows.seq_tokens) == 3.0


def test_windowed_by_hand():
    """The task, the last k turns (answers at weight 0) and the turn's answer; an answer of
    weight 0 is context, not learned."""
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "o0"}]
    for i in (1, 2, 3):
        msgs += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"o{i}"}]
    convs = windowed(msgs, 1)
    assert [[m["content"] for m in c] for c in convs] == [
        ["S", "o0", "a1"],
        ["S", "o0", "a1", "o1", "a2"],
        ["S", "o0", "a2", "o2", "a3"],
    ]
    assert [m.get("weight", 1) for m in convs[2]] == [1, 1, 0, 1, 1]
    with pytest.raises(ValueError, match="at least one turn"):
        windowed(msgs, 0)


def test_history_setting_is_checked():
    assert EngineConfig().history_window is None
    assert EngineConfig(history="last:3").history_window == 3
    for bad in ("last:0", "last", "3", "first:2"):
        with pytest.raises(ValueError, match="history"):
            load_config(None, overrides=[f"engine.history={bad}"])


def test_each_turn_trains_on_the_ids_it_was_sampled_against(engine):
    """PATR in window mode: every training sample is a prompt the engine was given followed
    by the completion it sampled for it (ids and log-probs), the prompt is the root and the
    last k turns, and forks below the window continue from the parent's window."""
    k = 2
    trees, stats, groups = rollout(engine, k, **PATR)
    sampled = {(p, c): lp for p, c, lp in engine.sampled}
    assert stats.forks > 0
    advs = [[[0.0] * len(t.token_ids) for t in g] for g in groups]
    samples, _ = turn_samples(trees, groups, advs)
    beyond = 0
    for tree, group in zip(trees, samples, strict=True):
        assert tree.history == k
        for s in group:
            a = sum(s.loss_mask)
            prompt, action = tuple(s.token_ids[:-a]), tuple(s.token_ids[-a:])
            assert s.loss_mask == [0] * len(prompt) + [1] * a
            assert (prompt, action) in sampled  # sampled against exactly this prompt
            assert s.logprobs[-a:] == pytest.approx(sampled[prompt, action])
            parent = tree.nodes[s.nodes[-2]]
            path = tree.path(parent.id)
            expect = list(tree.root.obs_ids)
            for n in path[1:][-k:]:
                expect += n.action_ids + n.obs_ids
            assert list(prompt) == expect
            beyond += len(path) - 1 > k
    assert beyond > 0  # some turns were sampled with earlier turns out of the window
    forked = [n for t in trees for n in t.nodes if len(n.children) > 1 and n.turn >= k]
    assert forked  # a fork where the window already dropped turns


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_packed_equals_padded_in_window_mode(engine, agg):
    """One `PolicyUpdate` on window-mode trees moves the weights the same with tree-packed
    and padded rows, the packed rows sharing the turns' common prompts."""
    trees, _, groups = rollout(engine, 2, **PATR)
    torch.manual_seed(1)
    # rewards differ only by chance on these maps: give the leaves distinct rewards so the
    # group advantages are not all zero
    for tree in trees:
        for i, leaf in enumerate(tree.finished_leaves()):
            leaf.reward = float(i % 3)
    groups = [t.trajectories() for t in trees]
    moved, stats = {}, {}
    for packing in ("tree", "padded"):
        model = copy.deepcopy(engine.model).float()
        tc = TrainConfig(packing=packing, lr=1e-3, micro_batch_size=4, kl_coef=0.0, loss_agg=agg)
        upd = PolicyUpdate(model, tc, pad_id=0)
        stats[packing] = upd(trees, groups, lr=1e-3)
        assert stats[packing]["train/logprob_drift"] < 1e-4  # sampled = recomputed per turn
        moved[packing] = [p.detach() for p in model.parameters()]
    assert stats["tree"]["train/packed"] == 1.0
    assert stats["tree"]["train/forward_tokens"] < stats["padded"]["train/forward_tokens"]
    # (on-policy, seq-mean's loss is sum_i A_i / T = 0 up to rounding: compared absolutely)
    for key in ("train/loss", "train/grad_norm", "train/policy_tokens"):
        assert stats["tree"][key] == pytest.approx(stats["padded"][key], rel=1e-4, abs=1e-7)
    start = list(engine.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(moved["tree"], start, strict=True))
    for a, b in zip(moved["tree"], moved["padded"], strict=True):
        assert torch.allclose(a, b, rtol=0, atol=0.05 * 1e-3)


def test_a_window_wider_than_the_episode_is_the_default_path(engine):
    """`last:k` with k >= the turn limit drops nothing: the same trees, token for token, as
    the default append-only mode, whose trees carry no window and train whole trajectories."""
    whole, _, whole_groups = rollout(engine, None, **PATR)
    wide, _, _ = rollout(engine, TURNS, **PATR)
    for a, b in zip(whole, wide, strict=True):
        assert "history" not in a.meta
        assert [(n.action_ids, n.obs_ids, n.logprobs) for n in a.nodes] == [
            (n.action_ids, n.obs_ids, n.logprobs) for n in b.nodes
        ]
    advs = [[[0.0] * len(t.token_ids) for t in g] for g in whole_groups]
    samples, _ = turn_samples(whole, whole_groups, advs)
    assert samples == whole_groups


def test_gigpo_finds_identical_states_in_window_mode(engine):
    """GiGPO groups steps by the env's state key, which the window does not touch: each turn's
    sample carries the step advantage GiGPO gave that turn in the whole trajectory."""
    trees, _, groups = rollout(engine, 1, "grpo", G=4)
    keys = [n.info.get("state_key") for t in trees for n in t.nodes if n.parent is not None]
    assert keys and None not in keys
    assert len(set(keys)) < len(keys)  # states recur across the group: anchor groups exist
    advs = compute_advantages("gigpo", trees, groups)
    assert any(x != 0.0 for g in advs for a in g for x in a)  # invalid-move penalties differ
    samples, sample_advs = turn_samples(trees, groups, advs)
    for group, group_advs, trajs, whole in zip(samples, sample_advs, groups, advs, strict=True):
        expected = []
        for t, a in zip(trajs, whole, strict=True):
            for node in t.nodes[1:]:
                expected.append(
                    [
                        x
                        for o, m, x in zip(t.node_of_token, t.loss_mask, a, strict=True)
                        if m and o == node
                    ]
                )
        got = [
            [x for x, m in zip(a, s.loss_mask, strict=True) if m]
            for s, a in zip(group, group_advs, strict=True)
        ]
        assert got == expected


@pytest.mark.parametrize("k", [None, 1])
def test_turn_skill_probes_the_prompts_the_rollouts_sample_against(engine, k):
    """`benchmarks/turn_skill.py` asks the policy at turn t of an episode with the prompt it
    builds from the conversation so far (`conversation_prompt`): for the whole history and for
    a window, every such prompt is one the engine was asked to sample against in a rollout."""
    turn_skill = load_benchmark("turn_skill")
    trees, _, groups = rollout(engine, k, **PATR)
    sampled = {p for p, _, _ in engine.sampled}
    chat = ChatFormat(engine.tokenizer)
    system = make_env("frozenlake").system_prompt
    checked = 0
    for tree, group in zip(trees, groups, strict=True):
        for traj in group:
            messages = as_text(chat, [tree.nodes[i] for i in traj.nodes])
            if messages is None:
                continue  # sampled ids whose text tokenises another way: the probe sees text
            for t in range(len(traj.nodes) - 1):  # each turn's prompt: the episode before it
                prompt = turn_skill.conversation_prompt(chat, messages[: 2 * t + 1], k, system)
                assert tuple(prompt) in sampled
                checked += 1
    assert checked > len(trees) * 2  # later turns too, not only the first
