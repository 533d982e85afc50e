"""Supervised fine-tuning on agent trajectories: `agentree sft`.

Two sources of examples:
- chat JSONL, one `{"messages": [...]}` per line (the format SWE-Gym, SWE-smith and R2E-Gym
  trajectories come in): system/user/assistant turns, tool or observation turns read as user
  turns, because that is how agentree delivers observations;
- agentree tree files (a run, rollout or eval directory, or a folder of tree JSON), keeping the
  trajectories whose reward is at least `min_reward`: rejection-sampling fine-tuning on earlier
  rollouts. Their token ids and loss masks are used exactly as sampled.

Chat messages are tokenised with `agentree.chat.ChatFormat`, the token-in/token-out code the
rollouts use: `prompt_ids(first user turn, system)`, then each assistant turn's ids followed by
`observation_ids` of the next user turn. A fine-tuned checkpoint therefore sees in training the
same token layout it will condition on in `agentree train --policy DIR`. The loss is the mean
next-token cross-entropy over assistant tokens only (each assistant turn plus the end-of-turn
token that closes it, so the model learns to stop). An assistant message with `"weight": 0`
(OpenAI's fine-tuning field) is context only: its tokens are not learned.

With a history window (`engine.history: last:k`, `windowed`), a conversation becomes one example
per assistant turn, laid out as the rollouts show that turn: the task (system prompt and first
observation), the last k turns as context, and the turn's own answer, the only tokens learned.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentree.chat import ChatFormat
from agentree.hub.store import write_policy_record
from agentree.tools import ToolCall
from agentree.tree import Tree

OBSERVATION_ROLES = frozenset({"user", "tool", "ipython", "function", "observation"})


class SFTConfig(BaseModel):
    """Optimisation settings of one fine-tuning run."""

    model_config = ConfigDict(extra="forbid")

    epochs: int = Field(1, ge=1)
    """Passes over the examples."""
    lr: float = Field(1e-5, gt=0.0)
    """Peak learning rate (AdamW); cosine decay to 10% after a 5% warm-up."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    batch_size: int = Field(8, ge=1)
    """Examples per optimiser step."""
    micro_batch_size: int = Field(0, ge=0)
    """Examples forwarded together: a step's gradient is accumulated over its micro-batches,
    each weighted by its share of the batch's target tokens, so it is the whole batch's. 0: the
    whole batch at once. 1 pads nothing and holds one example's activations at a time, what a
    real model on long agent trajectories wants on a CPU (SmolLM2 on 4 SWE trajectories of
    2,048 tokens held 16 GB at once)."""
    max_length: int = Field(4096, ge=2)
    """Longer examples are cut to their first `max_length` tokens."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Max global gradient norm."""
    seed: int = 0
    """Seeds the example order."""
    dtype: str = "auto"
    """Model dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16."""
    device: str = "auto"
    """auto, cpu, cuda, ..."""
    lora_r: int = Field(0, ge=0)
    """LoRA rank (peft, on every linear layer but the output layer); 0 trains all weights. The
    adapters are merged into the saved model, so the output is a plain checkpoint."""


@dataclass
class SFTExample:
    """Token ids of one conversation and a mask that is 1 exactly on the tokens to learn."""

    token_ids: list[int]
    loss_mask: list[int]

    @property
    def num_target_tokens(self) -> int:
        return sum(self.loss_mask)


# -- examples ------------------------------------------------------------------------------------
def example_from_messages(
    chat: Any,
    messages: Sequence[dict[str, Any]],
    system: str | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> SFTExample:
    """Tokenise a conversation the way the rollouts do; mask = assistant tokens + end of turn.

    `chat` is an `agentree.chat.ChatFormat`. `system` is used when the conversation has no
    system message of its own (the env's system prompt, so the layout matches RL rollouts).
    With `tools` (OpenAI function schemas, as the env declares them) the prompt declares them,
    an assistant message's `tool_calls` are written in the chat's call format after its content,
    and the `tool` messages answering them come back as tool turns, as in a tool rollout.
    """
    msgs = [
        m
        for m in messages
        if str(m.get("content") or "").strip() or m["role"] == "assistant" or m.get("tool_calls")
    ]
    if msgs and msgs[0]["role"] == "system":
        system, msgs = str(msgs[0]["content"]), msgs[1:]
    turns = _merge_observations(msgs, bool(tools), chat.tool_format.format if tools else None)
    if not turns or turns[0][0] != "user":
        raise ValueError("a conversation must start with a user message (after the system one)")
    if not any(role == "assistant" and learn for role, _, learn in turns):
        raise ValueError(
            "a conversation without an assistant message (of weight 1) teaches nothing"
        )
    ids = chat.prompt_ids(turns[0][1], system, tools)
    mask = [0] * len(ids)
    action: list[int] = []
    for role, content, learn in turns[1:]:
        if role == "assistant":
            action = [*chat.encode(content), chat.end_of_turn_id]
            ids += action
            mask += [int(learn)] * len(action)
        else:
            results = content if role == "tool" else None
            obs = chat.observation_ids("" if results else content, action, results)
            ids += obs
            mask += [0] * len(obs)
    while mask and mask[-1] == 0:  # an observation after the last answer teaches nothing
        ids.pop()
        mask.pop()
    return SFTExample(ids, mask)


def _assistant_text(m: dict[str, Any], write_calls: Callable[[list[ToolCall]], str] | None) -> str:
    """An assistant message's text with its OpenAI `tool_calls` written by `write_calls`."""
    content = str(m.get("content") or "")
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function", c)
        args = fn.get("arguments") or {}
        calls.append(ToolCall(fn["name"], json.loads(args) if isinstance(args, str) else args))
    if not calls:
        return content
    if write_calls is None:
        raise ValueError("an assistant message has tool_calls but the env declares no tools")
    written = write_calls(calls)
    return f"{content.rstrip()}\n{written}" if content.strip() else written


def _merge_observations(
    msgs: Sequence[dict[str, Any]],
    tool_turns: bool = False,
    write_calls: Callable[[list[ToolCall]], str] | None = None,
) -> list[tuple]:
    """(role, content, learn) turns alternating user/assistant, consecutive observations
    joined; with `tool_turns`, a run of `tool` messages is one ("tool", [results], False) turn
    instead. `learn` is False for observations and for assistant messages of weight 0."""
    out: list[tuple] = []
    for m in msgs:
        role = m["role"]
        if role == "tool" and tool_turns:
            if out and out[-1][0] == "tool":
                out[-1][1].append(str(m.get("content") or ""))
            else:
                out.append(("tool", [str(m.get("content") or "")], False))
            continue
        if role in OBSERVATION_ROLES:
            role = "user"
        elif role != "assistant":
            raise ValueError(f"unsupported message role {role!r} (system, user, assistant, tool)")
        if role == "assistant":
            if out and out[-1][0] == role:
                raise ValueError("two assistant messages in a row; merge them or add the reply")
            weight = m.get("weight", 1)
            if weight not in (0, 1):
                raise ValueError(f"an assistant message's weight is 0 or 1, got {weight!r}")
            out.append((role, _assistant_text(m, write_calls), weight == 1))
            continue
        content = str(m.get("content") or "")
        if out and out[-1][0] == role:
            out[-1] = (role, out[-1][1] + "\n\n" + content, False)
        else:
            out.append((role, content, False))
    return out


def windowed(messages: Sequence[dict[str, Any]], k: int) -> list[list[dict[str, Any]]]:
    """A conversation as the rollouts show it under `engine.history: last:k`: one conversation
    per assistant turn, holding the task (a system message and the observations before the
    first answer), the last k turns before it (each an answer and the observations after it,
    the answers at weight 0: context, not learned) and the turn's own answer."""
    if k < 1:
        raise ValueError(f"a history window holds at least one turn, got {k}")
    task: list[dict[str, Any]] = []
    turns: list[list[dict[str, Any]]] = []  # each: an answer, then the observations after it
    for m in messages:
        if m["role"] == "assistant":
            turns.append([m])
        elif turns:
            turns[-1].append(m)
        else:
            task.append(m)
    out = []
    for i, turn in enumerate(turns):
        context = [
            {**msg, "weight": 0} if msg["role"] == "assistant" else msg
            for earlier in turns[max(0, i - k) : i]
            for msg in earlier
        ]
        out.append([*task, *context, turn[0]])
    return out


def windowed_all(
    convs: Sequence[Sequence[dict[str, Any]]], k: int | None
) -> list[list[dict[str, Any]]]:
    """Every conversation of `convs` turn by turn under a window of k (`windowed`); unchanged
    without one."""
    if k is None:
        return [list(c) for c in convs]
    return [turn for c in convs for turn in windowed(c, k)]


def read_chat_jsonl(path: str | Path) -> list[list[dict[str, Any]]]:
    """Conversations of a chat JSONL file (`{"messages": [...]}` per line)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not JSON ({e.msg})") from None
        msgs = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(msgs, list):
            raise ValueError(f"{path}:{n} has no 'messages' list")
        out.append(msgs)
    return out


def examples_from_trees(
    trees: Iterable[Any], min_reward: float | None = None
) -> tuple[list[SFTExample], int]:
    """(examples, trajectories seen): every finished trajectory with reward >= `min_reward`."""
    out, seen = [], 0
    for tree in trees:
        for t in tree.trajectories():
            seen += 1
            if min_reward is None or t.reward >= min_reward:
                # a tree with a history window: each turn on the prompt it was sampled against
                for s in tree.turn_trajectories(t):
                    out.append(SFTExample(list(s.token_ids), list(s.loss_mask)))
    return out, seen


def find_tree_files(directory: str | Path) -> list[Path]:
    """Tree JSON files under a run/rollout/eval directory or a folder of trees."""
    root = Path(directory)
    files = sorted(p for p in root.rglob("*.json") if p.parent.name == "trees" or p.parent == root)
    return [p for p in files if _is_tree_file(p)]


def _is_tree_file(path: Path) -> bool:
    with open(path) as f:
        head = f.read(64)
    return '"format": "agentree.tree/' in head


def load_examples(
    source: str | Path,
    chat: Any,
    *,
    min_reward: float | None = None,
    system: str | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
    history: int | None = None,
    log: Callable[[str], None] = print,
) -> list[SFTExample]:
    """Examples from a chat JSONL file or a directory of agentree trees; `system`, `tools` (the
    env's) and `history` (the window k of `engine.history: last:k`, or None) lay chat
    conversations out as the rollouts do. Trees carry their own window."""
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"--data {path} does not exist")
    if path.is_dir():
        files = find_tree_files(path)
        if not files:
            raise ValueError(f"{path} holds no agentree tree files (trees/*.json)")
        examples, seen = examples_from_trees((Tree.load(f) for f in files), min_reward)
        log(f"{len(examples)} of {seen} trajectories from {len(files)} trees kept")
    else:
        if min_reward is not None:
            raise ValueError("--min-reward filters agentree trees; chat JSONL has no rewards")
        convs = read_chat_jsonl(path)
        convs = windowed_all(convs, history)
        examples = [example_from_messages(chat, m, system, tools) for m in convs]
        log(f"{len(examples)} {'turns' if history else 'conversations'} from {path}")
    if not examples:
        raise ValueError(f"no training examples in {path} (lower --min-reward?)")
    return examples


# -- training ------------------------------------------------------------------------------------
def run_sft(
    policy_path: str | Path,
    examples: Sequence[SFTExample] | Sequence[Sequence[dict[str, Any]]],
    output: str | Path,
    cfg: SFTConfig | None = None,
    *,
    system: str | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
    log: Callable[[str], None] = print,
    state_dir: str | Path | None = None,
    state_every_s: float = 600.0,
    tool_format: str = "text",
    action_format: str | None = None,
) -> dict[str, Any]:
    """Fine-tune the causal LM at `policy_path` and save it (model + tokenizer) to `output`.

    `examples` are `SFTExample`s or conversations (lists of chat messages, tokenised here with
    the policy's chat format; `system` fills in a missing system message, `tools` are the env's
    tool schemas, and `tool_format` the format their calls are written in). `action_format` is
    the env's (None where it has none); the output's `POLICY_RECORD` keeps both. Returns a summary
    (losses per epoch, tokens, wall time), also written to `output/sft.json`.

    With `state_dir`, the run writes its state there (weights, optimiser, position in the
    example order, random state) every `state_every_s` seconds and at an interrupt (Ctrl-C,
    or SIGTERM where the caller turns it into one), and a later call with the same policy,
    examples and config continues from it, computing what the uninterrupted run would have;
    the directory is removed once the model is saved. A state written by other settings is
    ignored (and replaced).
    """
    # deferred: torch (and agentree.engines.hf, which imports it) take seconds to import; the
    # CLI imports this module at start
    import torch

    from agentree.hub.load import load_policy

    cfg = cfg or SFTConfig()
    t0 = time.perf_counter()
    model, tokenizer = load_policy(policy_path, dtype=cfg.dtype, device=cfg.device)
    data = [
        e
        if isinstance(e, SFTExample)
        else example_from_messages(ChatFormat(tokenizer, tool_format), e, system, tools)
        for e in examples
    ]
    data = [_truncate(e, cfg.max_length) for e in data]
    data = [e for e in data if e.num_target_tokens > 0]
    if not data:
        raise ValueError("no example has assistant tokens to learn (check max_length)")
    too_big = max(max(e.token_ids) for e in data)
    if too_big >= len(tokenizer):
        raise ValueError(
            f"token id {too_big} is outside the policy's vocabulary ({len(tokenizer)}): the "
            "trees were sampled by a policy with another tokenizer"
        )
    torch.manual_seed(cfg.seed)
    if cfg.lora_r:
        # deferred: peft is the optional [train] extra
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_r, lora_alpha=2 * cfg.lora_r, target_modules="all-linear")
        model = get_peft_model(model, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.epochs * math.ceil(len(data) / cfg.batch_size)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rng = random.Random(cfg.seed)
    dev = next(model.parameters()).device
    model.train()
    tokens = sum(len(e.token_ids) for e in data)
    log(
        f"sft: {len(data)} examples, {tokens} tokens, {steps} steps of {cfg.batch_size} "
        f"({cfg.epochs} epoch(s)); time per step is printed as it runs"
    )
    saved = SFTState(state_dir, str(policy_path), cfg, data) if state_dir else None
    at = saved.load(model, opt, rng, log) if saved else None
    if saved and not at:
        log(
            f"sft: state kept in {saved.dir} every {state_every_s / 60:g} min and at Ctrl-C; "
            "the same command continues from it"
        )
    epoch_loss: list[float] = at["epoch_loss"] if at else []
    step = first = at["step"] if at else 0
    t_loop, last_note, last_save = time.perf_counter(), time.perf_counter(), time.perf_counter()
    for epoch in range(at["epoch"] if at else 0, cfg.epochs):
        if at and epoch == at["epoch"]:  # the epoch the state was written in
            order, start, (total, count) = at["order"], at["next"], at["sums"]
        else:
            order, start, (total, count) = list(range(len(data))), 0, (0.0, 0)
            rng.shuffle(order)
        for s in range(start, len(order), cfg.batch_size):
            batch = [data[i] for i in order[s : s + cfg.batch_size]]
            here = {"epoch": epoch, "order": order, "next": s, "sums": (total, count)}
            try:
                for g in opt.param_groups:
                    g["lr"] = sft_lr(cfg.lr, step, steps)
                opt.zero_grad(set_to_none=True)
                loss, n = _accumulate(model, batch, cfg.micro_batch_size or len(batch), pad, dev)
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            except KeyboardInterrupt:  # this step has not changed the weights yet: keep them
                if saved:
                    saved.save(model, opt, rng, {**here, "step": step, "epoch_loss": epoch_loss})
                    log(
                        f"sft: interrupted in step {step + 1}; state of step {step} kept in "
                        f"{saved.dir}: the same command continues from it (remove it to start "
                        "over)"
                    )
                raise
            opt.step()
            total += loss * n
            count += n
            step += 1
            now = time.perf_counter()
            if now - last_note >= 30 or step == first + 1:  # a real model: seconds per step
                per = (now - t_loop) / (step - first)
                log(
                    f"sft step {step}/{steps}: loss {loss:.4f}, {per:.1f}s/step, "
                    f"about {per * (steps - step) / 60:.1f} min left"
                )
                last_note = now
            if saved and step < steps and now - last_save >= state_every_s:
                here.update(next=s + cfg.batch_size, sums=(total, count))
                saved.save(model, opt, rng, {**here, "step": step, "epoch_loss": epoch_loss})
                last_save = time.perf_counter()
        epoch_loss.append(total / max(count, 1))
        log(f"sft epoch {epoch + 1}/{cfg.epochs}: loss {epoch_loss[-1]:.4f}")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    if cfg.lora_r:
        model = model.merge_and_unload()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_policy_record(out, tool_format, action_format)
    summary = {
        "policy": str(policy_path),
        "examples": len(data),
        "target_tokens": sum(e.num_target_tokens for e in data),
        "steps": steps,
        "epoch_loss": epoch_loss,
        "config": cfg.model_dump(),
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    (out / "sft.json").write_text(json.dumps(summary, indent=1))
    if saved:
        saved.remove()
    return summary


class SFTState:
    """The resumable state of one fine-tuning run in a directory: `state.pt` (weights,
    optimiser, random state and position) beside `run.json`, which names the run (policy,
    config, examples) so that a state is only picked up by the run that wrote it."""

    def __init__(
        self, directory: str | Path, policy: str, cfg: SFTConfig, data: Sequence[SFTExample]
    ) -> None:
        self.dir = Path(directory)
        digest = hashlib.sha256()
        for e in data:
            digest.update(json.dumps([e.token_ids, e.loss_mask]).encode())
        self.run = {"policy": policy, "config": cfg.model_dump(), "examples": digest.hexdigest()}

    def load(self, model: Any, opt: Any, rng: random.Random, log: Callable[[str], None]) -> Any:
        """Restore the weights, optimiser and random state; the saved position, or None."""
        # deferred: torch takes seconds to import; the CLI imports this module at start
        import torch

        path = self.dir / "state.pt"
        if not path.is_file():
            return None
        if json.loads((self.dir / "run.json").read_text()) != self.run:
            log(f"sft: {self.dir} holds the state of another run; starting over")
            return None
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        log(f"sft: resuming at step {state['at']['step']} (state in {self.dir})")
        return state["at"]

    def save(self, model: Any, opt: Any, rng: random.Random, at: dict[str, Any]) -> None:
        """Write the state whole or not at all (a temporary file renamed into place)."""
        # deferred: torch takes seconds to import; the CLI imports this module at start
        import torch

        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "run.json").write_text(json.dumps(self.run))
        state = {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "rng": rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "at": at,
        }
        tmp = self.dir / "state.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.dir / "state.pt")

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _accumulate(
    model: Any, batch: Sequence[SFTExample], size: int, pad: int, device: Any
) -> tuple[float, int]:
    """Backward the batch's mean target-token loss in micro-batches of `size` examples; returns
    (that loss, the batch's target tokens). One micro-batch is exactly `sft_loss`'s gradient."""
    n = sum(sum(e.loss_mask[1:]) for e in batch)  # the targets sft_loss counts
    total = 0.0
    for s in range(0, len(batch), size):
        loss, k = sft_loss(model, batch[s : s + size], pad, device)
        (loss * (k / max(n, 1))).backward()  # one micro-batch: k / n is exactly 1.0
        total += float(loss.detach()) * k
    return total / max(n, 1), n


SFT_LOGITS_CHUNK = 1024
"""Target positions per slice of the output layer in `sft_loss`."""


def sft_loss(model: Any, batch: Sequence[SFTExample], pad: int, device: Any) -> tuple[Any, int]:
    """(mean cross-entropy over the batch's masked target tokens, number of those tokens).

    Logits are computed only at positions that predict a target token, a slice at a time
    (`output_layer.chunked_logprobs`): an agent's trajectory is mostly tool output, which has
    none, and a full [tokens x vocab] fp32 logits tensor of a real model's vocabulary is
    gigabytes per batch."""
    # deferred: torch takes seconds to import; the CLI imports this module at start
    import torch

    from agentree.algorithms.output_layer import chunked_logprobs

    length = max(len(e.token_ids) for e in batch)
    ids = torch.full((len(batch), length), pad, dtype=torch.long)
    attn = torch.zeros(len(batch), length, dtype=torch.long)
    mask = torch.zeros(len(batch), length, dtype=torch.bool)
    for i, e in enumerate(batch):
        ids[i, : len(e.token_ids)] = torch.tensor(e.token_ids)
        attn[i, : len(e.token_ids)] = 1
        mask[i, : len(e.loss_mask)] = torch.tensor(e.loss_mask, dtype=torch.bool)
    # the logits at position t predict token t+1: rows are the positions before a target
    before = mask[:, 1:]
    rows = torch.arange(ids.numel()).view(ids.shape)[:, :-1][before]
    targets = ids[:, 1:][before]
    ids, attn = ids.to(device), attn.to(device)
    with chunked_logprobs(model, rows.to(device), targets.to(device), 1.0, SFT_LOGITS_CHUNK):
        logp = model(input_ids=ids, attention_mask=attn).logits
    n = int(before.sum())
    return -logp.sum() / max(n, 1), n


def _truncate(e: SFTExample, max_length: int) -> SFTExample:
    if len(e.token_ids) <= max_length:
        return e
    return SFTExample(e.token_ids[:max_length], e.loss_mask[:max_length])


def sft_lr(peak: float, step: int, steps: int) -> float:
    """The SFT schedule: linear warm-up over 5% of `steps`, then cosine down to 10% of `peak`."""
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(steps - warm, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
