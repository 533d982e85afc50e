"""What a policy knows at each turn of an episode, not only at the first: does it read the state?

`first_move_skill` (agentree.models.warm) probes a policy on its first turn, where the prompt
holds one observation. Rollouts also ask it on later turns, where the prompt holds the episode
so far (`engine.history: all`) or the task and the last k turns (`last:k`). This plays the noisy
expert (`--expert-prob`, the warm start's demonstrator) for k turns on held-out tasks, lays the
conversation out as the rollouts would (`windowed` for a window, tokenised by
`example_from_messages`), and measures at the state reached, over the env's fixed action set
(`action_skill`, the rule `first_move_skill` uses):

- `top1`: the share of states where the policy's most likely action is a best one
  (`Env.best_actions`; Sokoban: about 0.27 for a policy that knows nothing);
- `p_best`: the mean probability it puts on best actions, which is what sampling at
  temperature 1 gets.

A policy that reads the room keeps its first-turn figures on later turns; one that does not
falls to chance there, and RL has no state to attach its reward to after the first move.
States where the episode has ended, or with no best action, are skipped (`states` counts the
rest).

    python benchmarks/turn_skill.py --config sokoban2_grpo --policy tiny-warm RUN/checkpoints/latest
    python benchmarks/turn_skill.py --config sokoban2_grpo --history all
    python benchmarks/turn_skill.py --config frozenlake_patr_tools --turns 0 --tasks 200

`--policy` takes the config's names (`tiny-warm`: the config's warm build, with its `--set`
overrides) or checkpoint directories. In an env's tool mode (`env.action_format: tools`) the
episode's moves are calls and their results tool turns, and each action is scored as the
policy writes it (`policy.tool_format`), as the rollouts lay them out. Prints one line per
policy and turn, and writes them as JSON to `--out` if given.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def conversation_prompt(
    chat: Any,
    messages: list[dict[str, Any]],
    window: int | None,
    system: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids the rollouts would give the policy after `messages` (which end with an
    observation), under the history window `window` (None: the whole episode), with the env's
    `system` prompt and `tools` as the rollouts send them."""
    from agentree.models.sft import example_from_messages, windowed

    probe = [*messages, {"role": "assistant", "content": "?"}]  # the answer to be sampled
    if window is not None:
        probe = windowed(probe, window)[-1]
    ex = example_from_messages(chat, probe, system, tools)
    # the prompt ends where the last answer's learned tokens (its final masked run) begin
    start = len(ex.loss_mask)
    while start and ex.loss_mask[start - 1]:
        start -= 1
    return ex.token_ids[:start]


def states_at_turn(
    chat: Any,
    env: Any,
    tasks: list[Any],
    turn: int,
    window: int | None,
    expert_prob: float,
    rng: random.Random,
) -> Iterator[tuple[list[int], list[str]]]:
    """(prompt ids, best actions) at turn `turn` of the noisy expert's episode on each task that
    is still going there and has a best action (`agentree.models.warm.action_skill`'s states)."""
    from agentree.models.warm import episode_messages, scripted_action
    from agentree.rollout.turn.turns import scripted_episode
    from agentree.tools import tool_schemas

    tools = tool_schemas(env.tools()) or None

    for task in tasks:
        tree = scripted_episode(
            env, task, lambda _t, _h: scripted_action(env, expert_prob, rng), max_steps=turn
        )
        root, *path = tree.nodes
        best = env.best_actions()
        if (path and path[-1].end_reason is not None) or not best:
            continue  # the episode ended before this turn, or no move is best here
        messages = episode_messages(
            env, root.observation, [(n.action, n.observation) for n in path]
        )
        yield conversation_prompt(chat, messages, window, env.system_prompt, tools), best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--config", default=None, help="config NAME or FILE (default: the default run's)"
    )
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument(
        "--policy", nargs="+", default=["tiny-warm"], help="policy names or directories"
    )
    ap.add_argument("--history", default=None, help="all or last:k (default: the config's)")
    ap.add_argument("--turns", type=int, nargs="+", default=[0, 3, 6, 9])
    ap.add_argument("--tasks", type=int, default=120, help="held-out tasks probed")
    ap.add_argument("--expert-prob", type=float, default=0.3, help="the played expert's share")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the lines here as JSON")
    args = ap.parse_args()

    import torch

    from agentree.chat import ChatFormat
    from agentree.config import load_config
    from agentree.envs.base import env_class
    from agentree.hub.load import load_policy
    from agentree.models.warm import action_skill
    from agentree.policy import resolve_policy

    torch.set_num_threads(1)
    history = [] if args.history is None else [f"engine.history={args.history}"]
    cfg = load_config(args.config, overrides=[*args.set, *history])
    window = cfg.engine.history_window
    name, env_kwargs = cfg.component("env")
    env = env_class(name)(**env_kwargs)
    tasks = type(env).load_tasks(args.tasks, seed=args.seed, split="eval")
    lines = []
    try:
        for policy in args.policy:
            named = load_config(
                args.config, overrides=[*args.set, *history, f"policy.path={policy}"]
            )
            path = resolve_policy(named, print)
            model, tokenizer = load_policy(path, dtype="float32", device="cpu")
            model.eval()
            chat = ChatFormat(tokenizer, named.policy.tool_format)  # a tool env's calls in it
            for k in args.turns:
                rng = random.Random(args.seed * 1000 + k)
                states = states_at_turn(chat, env, tasks, k, window, args.expert_prob, rng)
                row = {"turn": k, **action_skill(model, chat, env, states)}
                line = {"policy": str(policy), "history": cfg.engine.history, **row}
                lines.append(line)
                print(
                    f"{policy} ({cfg.engine.history}) turn {row['turn']}: top1 {row['top1']:.3f}"
                    f", p_best {row['p_best']:.3f} over {row['states']} states",
                    flush=True,
                )
    finally:
        env.close()
    if args.out:
        Path(args.out).write_text(json.dumps(lines, indent=1))


if __name__ == "__main__":
    main()
