"""What a tiny FrozenLake or Sokoban policy learns from scripted demonstrations, as it trains.

Fine-tunes the locally built tiny policy on the noisy BFS expert's demonstrations (the data
`tiny-warm` is built from) with the same loss as `agentree sft`, and every `--eval-every` steps
reports its first-move accuracy on held-out 4x4 maps (`--size 8`: 8x8, as `frozenlake8_patr`; or
6x6 Sokoban rooms with `--env sokoban`):
the share of maps where its most likely move is a shortest-path move (`top1`), and the
probability it puts on shortest-path moves (`p_best`), against about 31% / 32% for a FrozenLake
policy that knows only which moves stay on the map and about 27% for a Sokoban policy that
knows nothing (`agentree.models.warm.first_move_skill`).
At the end it can sample whole episodes (`--episodes-sampled`, temperature 1 over the four
moves) for the held-out success rate.

    python benchmarks/warm_probe.py --demos 8000 --first-turn --batch 32 --lr 3e-3
    python benchmarks/warm_probe.py --demos 8000 --first-turn --instructions
    python benchmarks/warm_probe.py --demos 2000 --epochs 3 --expert-prob 1.0 --episodes-sampled 4
    python benchmarks/warm_probe.py --env sokoban --demos 2400 --expert-prob 0.9 --layers 4
    python benchmarks/warm_probe.py --size 8 --demos 8000 --first-turn --layers 8 --hidden 256

`--first-turn` keeps only each demonstration's first move (a prompt holding one map);
otherwise whole episodes are used, as `tiny-warm` does. `--instructions` puts the env's system
prompt back in front of every prompt, which the tiny policies' chat template leaves out.
Prints one line per evaluation and writes them as JSON to `--out` if given.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", choices=("frozenlake", "sokoban"), default="frozenlake")
    ap.add_argument(
        "--size", type=int, choices=(4, 8), default=4, help="FrozenLake map side, as its config's"
    )
    ap.add_argument("--demos", type=int, default=8000, help="demonstration episodes")
    ap.add_argument("--expert-prob", type=float, default=1.0, help="expert's share of moves")
    ap.add_argument("--first-turn", action="store_true", help="train on first moves only")
    ap.add_argument("--instructions", action="store_true", help="prompts open with the system text")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--layers", type=int, default=2, help="tiny model depth")
    ap.add_argument("--hidden", type=int, default=128, help="tiny model width")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps")
    ap.add_argument("--eval-every", type=int, default=50, help="optimiser steps between probes")
    ap.add_argument("--probe-maps", type=int, default=200, help="held-out maps probed")
    ap.add_argument("--episodes-sampled", type=int, default=0, help="sampled episodes per map")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", help="write the probe lines here as JSON")
    args = ap.parse_args()

    import torch

    from agentree.chat import ChatFormat
    from agentree.config import read_config_file
    from agentree.envs.base import env_class
    from agentree.hub.load import load_policy
    from agentree.hub.tiny import TinyModelConfig, tiny_policy_for_env
    from agentree.models.sft import SFTExample, example_from_messages, sft_loss, sft_lr
    from agentree.models.warm import WarmConfig, demonstrations, first_move_skill

    if args.threads:
        torch.set_num_threads(args.threads)
    env_kwargs: dict = {}
    if args.env == "frozenlake":
        # the env of the shipped config the warm start is built for
        shipped = read_config_file("frozenlake_patr" if args.size == 4 else "frozenlake8_patr")
        env_kwargs = {k: v for k, v in shipped["env"].items() if k != "name"}
    shape = TinyModelConfig(
        vocab_size=160,
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
    )
    model, tokenizer = load_policy(
        tiny_policy_for_env(args.env, env_kwargs, shape), dtype="float32", device="cpu"
    )
    chat = ChatFormat(tokenizer)
    cls = env_class(args.env)
    env = cls(**env_kwargs)
    prefix: list[int] = []
    if args.instructions:
        prefix = chat.encode(f"<|im_start|>system\n{env.system_prompt}<|im_end|>\n")

    def prompt(obs: str) -> list[int]:
        return prefix + chat.prompt_ids(obs)

    warm = WarmConfig(expert_prob=args.expert_prob, episodes=args.demos)
    convs = demonstrations(args.env, env_kwargs, warm)
    if args.first_turn:
        convs = [c[:2] for c in convs]
    data = []
    for c in convs:
        e = example_from_messages(chat, c)
        data.append(SFTExample(prefix + e.token_ids, [0] * len(prefix) + e.loss_mask))
    held_out = cls.load_tasks(args.probe_maps, seed=0, split="eval")

    def probe() -> tuple[float, float]:
        model.eval()
        skill = first_move_skill(model, chat, env, held_out, prefix)
        model.train()
        return skill["top1"], skill["p_best"]

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    steps = args.epochs * math.ceil(len(data) / args.batch)
    rng = random.Random(0)
    lines = []
    t0 = time.perf_counter()

    def report(step: int, loss: float | None) -> None:
        top1, p_best = probe()
        line = {"step": step, "loss": loss, "top1": top1, "p_best": p_best}
        line["wall_s"] = round(time.perf_counter() - t0, 1)
        lines.append(line)
        print(json.dumps(line), flush=True)

    print(
        f"{len(data)} examples, {sum(len(e.token_ids) for e in data)} tokens, {steps} steps, "
        f"{len(held_out)} held-out maps",
        flush=True,
    )
    report(0, None)
    step, total, count = 0, 0.0, 0
    model.train()
    for _ in range(args.epochs):
        order = list(range(len(data)))
        rng.shuffle(order)
        for s in range(0, len(order), args.batch):
            for g in opt.param_groups:
                g["lr"] = sft_lr(args.lr, step, steps)
            loss, n = sft_loss(model, [data[i] for i in order[s : s + args.batch]], 0, "cpu")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            total, count, step = total + float(loss.detach()) * n, count + n, step + 1
            if step % args.eval_every == 0 or step in (steps, args.max_steps):
                report(step, total / max(count, 1))
                total, count = 0.0, 0
            if step == args.max_steps:
                break
        if step == args.max_steps:
            break
    result: dict = {"args": vars(args), "probes": lines}
    if args.episodes_sampled:
        result["sampled_success"] = sampled_success(args, model, chat, env, held_out, prompt)
        print(f"sampled success: {100 * result['sampled_success']:.1f}%", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def sampled_success(args, model, chat, env, tasks, prompt) -> float:
    """Held-out success sampling the four moves at temperature 1, 64 maps."""
    import torch

    from agentree.envs.frozenlake import MOVES

    move_ids = [chat.encode(f"```{m}```")[0] for m in MOVES]
    gen = torch.Generator().manual_seed(0)
    wins = total = 0
    model.eval()
    with torch.no_grad():
        for task in tasks[:64]:
            for _ in range(args.episodes_sampled):
                obs, info = env.reset(seed=task.seed, options=task.options)
                ids, done = prompt(obs), False
                while not done:
                    p = model(input_ids=torch.tensor([ids])).logits[0, -1].softmax(-1)[move_ids]
                    move = MOVES[int(torch.multinomial(p / p.sum(), 1, generator=gen))]
                    action = chat.encode(f"```{move}```")
                    obs, _, terminated, truncated, info = env.step(f"```{move}```")
                    done = terminated or truncated
                    ids = ids + action + chat.observation_ids(obs, action)
                wins += bool(info["success"])
                total += 1
    return wins / max(total, 1)


if __name__ == "__main__":
    main()
