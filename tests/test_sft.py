"""`agentree sft`: the loss mask is exactly the assistant tokens, the loss goes down, and the
result loads as a policy that `agentree train` continues from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentree.chat import ChatFormat
from agentree.commands.cli import main
from agentree.models.sft import (
    SFTConfig,
    example_from_messages,
    load_examples,
    run_sft,
    sft_loss,
)

SYSTEM = "You are walking on a frozen lake."
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "P _ _\n_ O _\n_ _ G"},
    {"role": "assistant", "content": "```Right```"},
    {"role": "user", "content": "_ P _\n_ O _\n_ _ G"},
    {"role": "assistant", "content": "```Right```"},
    {"role": "tool", "content": "_ _ P\n_ O _\n_ _ G"},
    {"role": "assistant", "content": "```Down```"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_frozenlake: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_frozenlake)


def test_mask_covers_exactly_the_assistant_tokens(tokenizer) -> None:
    chat = ChatFormat(tokenizer)
    ex = example_from_messages(chat, CONVERSATION)
    # the ids are those of the chat template's own rendering (tool turns read as user turns)
    rendered = [
        {"role": "user" if m["role"] == "tool" else m["role"], "content": m["content"]}
        for m in CONVERSATION
    ]
    text = tokenizer.apply_chat_template(rendered, tokenize=False)
    assert tokenizer.decode(ex.token_ids) == text.removesuffix("\n")
    # masked runs are exactly the assistant contents, each closed by the end-of-turn token
    runs, cur = [], []
    for tok, m in zip(ex.token_ids, ex.loss_mask, strict=True):
        if m:
            cur.append(tok)
        elif cur:
            runs.append(cur)
            cur = []
    runs.append(cur)
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert [tokenizer.decode(r) for r in runs] == [a + "<|im_end|>" for a in answers]
    assert ex.loss_mask[-1] == 1


def test_missing_system_message_takes_the_envs(tokenizer) -> None:
    import copy

    from agentree.hub.tiny import CHATML_TEMPLATE

    # the tiny policies' template leaves system messages out; a ChatML one that keeps them
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = CHATML_TEMPLATE.replace(" if message['role'] != 'system'", "")
    chat = ChatFormat(tokenizer)
    assert SYSTEM in tokenizer.decode(chat.prompt_ids("P _ G", SYSTEM))
    with_sys = example_from_messages(chat, CONVERSATION)
    without = example_from_messages(chat, CONVERSATION[1:], system=SYSTEM)
    assert with_sys == without


def test_malformed_conversations_are_rejected(tokenizer) -> None:
    chat = ChatFormat(tokenizer)
    with pytest.raises(ValueError, match="assistant"):
        example_from_messages(chat, CONVERSATION[:2])
    with pytest.raises(ValueError, match="role"):
        example_from_messages(chat, [{"role": "robot", "content": "x"}])


def test_an_answer_of_weight_zero_is_context(tokenizer) -> None:
    """OpenAI's `"weight": 0` on an assistant message: its tokens stay in the ids, unlearned."""
    chat = ChatFormat(tokenizer)
    whole = example_from_messages(chat, CONVERSATION)
    quiet = [dict(m) for m in CONVERSATION]
    quiet[2]["weight"] = 0
    ex = example_from_messages(chat, quiet)
    assert ex.token_ids == whole.token_ids
    first = [i for i, m in enumerate(whole.loss_mask) if m]
    answer = len(chat.encode("```Right```")) + 1  # and its end-of-turn token
    assert sum(whole.loss_mask) - sum(ex.loss_mask) == answer
    assert ex.loss_mask[first[0] : first[0] + answer] == [0] * answer
    with pytest.raises(ValueError, match="weight"):
        example_from_messages(chat, [*quiet[:2], {**quiet[2], "weight": 0.5}])
    with pytest.raises(ValueError, match="weight 1"):
        example_from_messages(chat, quiet[:4])  # only an unlearned answer


def test_chat_data_is_windowed_as_the_rollouts_show_it(tokenizer, tmp_path: Path) -> None:
    """`engine.history: last:k` lays each chat conversation out turn by turn (`windowed`)."""
    chat = ChatFormat(tokenizer)
    data = tmp_path / "demos.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    whole = load_examples(data, chat, log=lambda _m: None)
    turns = load_examples(data, chat, history=1, log=lambda _m: None)
    assert len(whole) == 1 and len(turns) == 3
    assert [sum(e.loss_mask) for e in turns] == [len(chat.encode("```Right```")) + 1] * 2 + [
        len(chat.encode("```Down```")) + 1
    ]
    # the last turn: the task, the turn before it (unlearned), its answer; the first answer
    # has left the window
    last = tokenizer.decode(turns[2].token_ids)
    assert last.count("```Right```") == 1 and "P _ _" in last and "_ P _" not in last


def test_loss_from_target_positions_equals_the_full_logits_loss(
    tiny_frozenlake: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logits only where a target token is predicted, in slices smaller than the batch's
    targets, and the batch forwarded one example at a time: the same mean cross-entropy and
    the same gradients as the full logits of the padded batch."""
    import torch
    from transformers import AutoModelForCausalLM

    import agentree.models.sft

    chat = ChatFormat(tokenizer)
    batch = [
        example_from_messages(chat, CONVERSATION),
        example_from_messages(chat, CONVERSATION[:3]),
    ]
    model = AutoModelForCausalLM.from_pretrained(tiny_frozenlake, torch_dtype=torch.float32)
    pad = tokenizer.pad_token_id

    # by hand: right-padded rows, logits at t scored against token t+1 where it is a target
    length = max(len(e.token_ids) for e in batch)
    total, count = torch.zeros(()), 0
    ids = torch.tensor([e.token_ids + [pad] * (length - len(e.token_ids)) for e in batch])
    attn = torch.tensor([[1] * len(e.token_ids) + [0] * (length - len(e.token_ids)) for e in batch])
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    for i, e in enumerate(batch):
        for t in range(1, len(e.token_ids)):
            if e.loss_mask[t]:
                total = total - torch.log_softmax(logits[i, t - 1], -1)[e.token_ids[t]]
                count += 1
    (total / count).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    monkeypatch.setattr(agentree.models.sft, "SFT_LOGITS_CHUNK", 3)  # several slices per batch
    loss, n = sft_loss(model, batch, pad, "cpu")
    loss.backward()
    assert n == count > 3
    assert loss.item() == pytest.approx((total / count).item(), rel=1e-5)
    for p, g in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)

    # one example at a time, gradients accumulated by target-token share: the same step
    model.zero_grad()
    loss, n = agentree.models.sft._accumulate(model, batch, 1, pad, "cpu")
    assert n == count and loss == pytest.approx((total / count).item(), rel=1e-5)
    for p, g in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


def test_sft_lowers_the_loss_and_the_output_trains(tiny_frozenlake: Path, tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(16)))
    out = tmp_path / "sft"
    chat = ChatFormat(__import__("transformers").AutoTokenizer.from_pretrained(tiny_frozenlake))
    examples = load_examples(data, chat)
    summary = run_sft(tiny_frozenlake, examples, out, SFTConfig(epochs=4, lr=3e-3, batch_size=4))
    losses = summary["epoch_loss"]
    assert losses[-1] < 0.5 * losses[0]
    assert (out / "config.json").exists() and (out / "sft.json").exists()
    # the fine-tuned policy continues into RL training through the ordinary --policy path
    run = tmp_path / "run"
    rc = main(
        [
            "train",
            "--policy",
            str(out),
            "--steps",
            "1",
            "--output",
            str(run),
            "--set",
            "train.tasks_per_step=2",
            "--set",
            "eval.tasks=2",
            "--set",
            "eval.samples=1",
        ]
    )
    assert rc == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in r for r in rows)


def test_cli_fine_tunes_on_filtered_trees(tiny_frozenlake: Path, tmp_path: Path) -> None:
    """Rejection sampling: roll out with the tiny policy, keep rewarded trajectories, fine-tune."""
    roll = tmp_path / "roll"
    args = ["--env", "frozenlake", "--rollout", "grpo", "--policy", str(tiny_frozenlake)]
    assert main(["rollout", *args, "--tasks", "4", "--output", str(roll)]) == 0
    from agentree.tree import Tree

    trees = [Tree.load(p) for p in sorted((roll / "trees").glob("*.json"))]
    rewards = [t.reward for tree in trees for t in tree.trajectories()]
    best = max(rewards)
    sft = ["sft", "--env", "frozenlake", "--policy", str(tiny_frozenlake), "--data", str(roll)]
    out = tmp_path / "rft"
    argv = [*sft, "--output", str(out), "--min-reward", str(best), "--micro-batch-size", "1"]
    assert main(argv) == 0
    summary = json.loads((out / "sft.json").read_text())
    assert summary["examples"] == sum(r >= best for r in rewards)
    assert summary["config"]["micro_batch_size"] == 1
    # nothing left after filtering is a usage error with a sentence, not a crash
    assert main([*sft, "--output", str(tmp_path / "none"), "--min-reward", str(best + 1)]) == 2


def test_an_interrupted_fine_tune_resumes_where_it_stopped(
    tiny_frozenlake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in the 4th of 8 steps keeps the state of step 3 (and one written every step);
    the same call again continues from it and saves what the uninterrupted run saves."""
    import torch
    from safetensors.torch import load_file

    import agentree.models.sft as sft

    chat = ChatFormat(__import__("transformers").AutoTokenizer.from_pretrained(tiny_frozenlake))
    moves = ["Right", "Down", "Left", "Up"]
    convs = [
        [*CONVERSATION[:-1], {"role": "assistant", "content": f"```{moves[i % 4]}```"}]
        for i in range(8)
    ]
    examples = [example_from_messages(chat, c) for c in convs]
    cfg = SFTConfig(epochs=2, lr=3e-3, batch_size=2)
    whole = run_sft(tiny_frozenlake, examples, tmp_path / "whole", cfg, log=lambda _: None)

    real, calls = sft._accumulate, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    state = tmp_path / "state"
    monkeypatch.setattr(sft, "_accumulate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_sft(tiny_frozenlake, examples, tmp_path / "out", cfg, state_dir=state, state_every_s=0)
    assert torch.load(state / "state.pt", weights_only=False)["at"]["step"] == 3
    calls.clear()

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sft, "_accumulate", counted)
    logs: list[str] = []
    again = run_sft(
        tiny_frozenlake, examples, tmp_path / "out", cfg, state_dir=state, log=logs.append
    )
    assert f"sft: resuming at step 3 (state in {state})" in logs
    assert len(calls) == 8 - 3  # steps 4-8 only
    assert again["epoch_loss"] == whole["epoch_loss"]
    a = load_file(tmp_path / "whole" / "model.safetensors")
    b = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not state.exists()  # removed once the model is saved
    # a state written by other settings is not picked up
    other = cfg.model_copy(update={"lr": 1e-3})
    with pytest.raises(KeyboardInterrupt):
        monkeypatch.setattr(sft, "_accumulate", interrupted)
        calls.clear()
        run_sft(tiny_frozenlake, examples, tmp_path / "o2", cfg, state_dir=state, state_every_s=0)
    monkeypatch.setattr(sft, "_accumulate", real)
    logs.clear()
    run_sft(tiny_frozenlake, examples, tmp_path / "o2", other, state_dir=state, log=logs.append)
    assert f"sft: {state} holds the state of another run; starting over" in logs
