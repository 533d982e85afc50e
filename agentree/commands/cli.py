"""The `agentree` command: thin wrappers that merge config and call library functions."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from agentree.chat import ChatFormat
from agentree.commands.export import add_export_command
from agentree.commands.models import add_models_command
from agentree.commands.plot import add_plot_command
from agentree.commands.serve import add_serve_command
from agentree.commands.swe import add_swe_commands
from agentree.config import available_configs, load_config
from agentree.distributed.ranks import launch_on_ray
from agentree.envs.base import env_class
from agentree.learner.launch import spawn_ranks
from agentree.models.sft import SFTConfig, load_examples, run_sft
from agentree.policy import resolve_policy
from agentree.rollout.base import action_format, describe_action_format
from agentree.run.evaluation import run_eval
from agentree.run.outputs import claim, mark
from agentree.run.plan import dry_run
from agentree.run.resume import resume_config
from agentree.run.rollout import SAVE_EVERY, run_rollout
from agentree.run.summary import record_policy, run_summary, write_summary
from agentree.signals import interrupt_on_sigterm
from agentree.tools import tool_schemas
from agentree.viewer.pages import add_view_command

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _selection_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="config name (see `agentree configs`) or YAML file")
    p.add_argument("--env", help="env name or package.module:Class")
    p.add_argument("--rollout", help="rollout controller (patr, tree-random, grpo, arpo, ...)")
    p.add_argument("--scorer", help="process scorer (bfs, prm, judge, heuristic, random)")
    p.add_argument(
        "--policy",
        help="tiny, tiny-warm, smollm2-135m, a checkpoint directory, a .gguf file or a hub id",
    )
    p.add_argument("--output", help="run directory")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentree",
        description="RL for LLM agents with tree-structured, forkable rollouts.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="tree rollouts + GRPO/DAPO updates")
    _selection_flags(p)
    p.add_argument("--steps", type=int, help="optimiser steps")
    p.add_argument("--tasks", help="training tasks: a count, a JSON/JSONL file or a named source")
    p.add_argument("--resume", action="store_true", help="continue the run in --output")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, rank placement and memory estimate, then exit",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("rollout", help="build rollout trees without training")
    _selection_flags(p)
    p.add_argument(
        "--tasks", help="a count (default 8), a JSON/JSONL file or a named source (e.g. local)"
    )
    p.add_argument(
        "--save-every",
        type=int,
        help=f"tasks a block, each saved as it finishes (default {SAVE_EVERY})",
    )
    p.add_argument("--resume", action="store_true", help="finish the rollout in --output")
    p.set_defaults(func=cmd_rollout)

    p = sub.add_parser("eval", help="one trajectory per task; writes DIR/eval.json")
    _selection_flags(p)
    p.add_argument("--tasks", help="a count, a JSON/JSONL file or a named source (e.g. local)")
    p.add_argument(
        "--samples",
        type=int,
        help="trajectories per task (default 1; eval.samples is training's held-out samples)",
    )
    p.add_argument("--resume", action="store_true", help="finish the evaluation in --output")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("configs", help="list the shipped experiment configs")
    p.set_defaults(func=cmd_configs)

    # subcommands that live next to the code they drive
    for add in (
        add_serve_command,
        add_swe_commands,
        add_view_command,
        add_plot_command,
        add_export_command,
        add_sft_command,
        add_models_command,
    ):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # agentree shows its own progress; silence the per-file bars of model loading/saving
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = build_parser().parse_args(argv)
    if args.debug:
        os.environ["AGENTREE_DEBUG"] = "1"  # ranks started from here inherit it
    return reported(args.func, args)


def reported(fn: Callable[..., Any], *args: Any) -> int:
    """`fn(*args)` as an exit code; an error a user can act on is one line, not a traceback
    (AGENTREE_DEBUG=1 or --debug shows it)."""
    debug = os.environ.get("AGENTREE_DEBUG") == "1"
    try:
        return int(fn(*args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, FileNotFoundError, RuntimeError, ImportError, OSError) as e:
        if debug:
            raise
        print(f"agentree: error: {e}", file=sys.stderr)
        return EXIT_USAGE


# -- helpers ------------------------------------------------------------------------------------
def _console():
    # soft_wrap: a line longer than the terminal (or than 80 columns in a log file) is written
    # whole, so a path or a weights hash in a log stays one string
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _load(args: argparse.Namespace):

    select = {
        "env": args.env,
        "rollout": args.rollout,
        "scorer": args.scorer,
        "policy": args.policy,
        "output": args.output,
    }
    if getattr(args, "steps", None) is not None:
        select["steps"] = str(args.steps)
    if getattr(args, "tasks", None) is not None and args.command == "train":
        select["tasks"] = args.tasks
    return load_config(args.config, select=select, overrides=args.set)


def _run_dir(cfg, default_kind: str) -> Path:
    if cfg.output:
        return Path(cfg.output)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{cfg.env['name'].split(':')[-1]}-{default_kind}"


def _write_config(cfg, run_dir: Path, command: str) -> None:
    """The first files of an output directory, once its inputs are validated."""
    mark(run_dir, command)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())


# -- train --------------------------------------------------------------------------------------
def cmd_train(args: argparse.Namespace) -> int:

    rank = int(os.environ.get("RANK", "0"))
    console = _console()
    console.quiet = rank > 0
    if args.resume:
        if not args.output:
            raise ValueError("--resume needs --output DIR of the run to continue")
        claim(Path(args.output), "train", resume=True)
        select = {k: getattr(args, k) for k in ("env", "rollout", "scorer", "policy", "tasks")}
        cfg = resume_config(
            Path(args.output),
            config=args.config,
            select=select,
            overrides=args.set,
            steps=args.steps,
            log=console.print,
        )
    else:
        cfg = _load(args)
    if args.dry_run:
        print(dry_run(cfg))
        return 0
    if not cfg.output and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("under torchrun pass --output DIR: every rank must use one run directory")
    run_dir = _run_dir(cfg, cfg.rollout["name"])
    cfg.output = str(run_dir)
    if rank == 0:
        claim(run_dir, "train", resume=args.resume)
    if cfg.train.world_size > 1 and "RANK" not in os.environ:
        if cfg.distributed.backend == "ray":
            codes = launch_on_ray(cfg, train_rank, (cfg, args.resume, os.getcwd()))
            return next((int(c) for c in codes if c), 0)

        return spawn_ranks(cfg.train.world_size, train_rank, (cfg, args.resume, os.getcwd()))
    return train_entry(cfg, args.resume)


def train_rank(cfg: Any, resume: bool, cwd: str) -> int:
    """The entry point of a rank that `spawn_ranks` or a Ray actor started."""
    os.chdir(cwd)  # relative paths resolve as in the launching process
    return reported(train_entry, cfg, resume)


def train_entry(cfg: Any, resume: bool) -> int:
    """Train `cfg` (resolved, with its run directory set) on this rank: the entry point of
    every rank, whoever launched it (this process, torchrun, `spawn_ranks` or a Ray actor)."""

    # deferred: the trainer imports torch, which `agentree --help` should not pay for
    from agentree.run.trainer import Trainer

    rank = int(os.environ.get("RANK", "0"))
    console = _console()
    console.quiet = rank > 0
    run_dir = Path(cfg.output)
    t0 = time.perf_counter()
    console.print(
        f"[bold]agentree train[/] env={cfg.env['name']} rollout={cfg.rollout['name']} "
        f"scorer={cfg.scorer['name']} policy={cfg.policy.path} steps={cfg.train.steps} "
        f"-> {run_dir}"
    )
    trainer = Trainer(cfg, run_dir, log=console.print)
    try:
        if trainer.rt is not None:  # rank 0: the policy, tasks and env are loaded and valid
            _write_config(cfg, run_dir, "train")
            record_policy(run_dir, trainer.rt.policy_path, trainer.rt.policy_sha256)
        trainer.stop.install()  # Ctrl-C and SIGTERM (schedulers) both checkpoint below
        ckpt = trainer.resume() if resume else None
        if ckpt is not None and trainer.complete:
            console.print(
                f"{run_dir} is already complete: {trainer.step} of {cfg.train.steps} steps "
                f"trained and evaluated (checkpoint {ckpt.name}); nothing to do. Pass --steps N "
                "to train further"
            )
            return 0
        resumed_at = trainer.step if ckpt is not None else None
        if ckpt is not None:
            console.print(f"resuming from step {trainer.step} (checkpoint {ckpt})")
        elif resume:
            console.print(f"nothing to resume in {run_dir} (no checkpoint yet): starting at step 0")
        progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
            transient=False,
        )
        # Without a terminal (CI logs, nohup) a live bar shows nothing until the end: print
        # one plain line per step instead.
        live = console.is_terminal
        with progress if live else contextlib.nullcontext():
            bar = progress.add_task(
                "train", total=cfg.train.steps, completed=trainer.step, status=""
            )

            actions = [0, 0]  # well-formed, judged
            # off a terminal only Ray runs print it (per worker), every few seconds
            every = 5.0 if cfg.distributed.backend == "ray" else None
            on_rollout = _progress_lines(
                console, lambda msg: progress.update(bar, status=msg), every=every
            )
            trainer.progress = on_rollout
            started, first = time.perf_counter(), trainer.step  # this segment's pace, evals in

            def on_step(step: int, m: dict[str, float]) -> None:
                actions[0] += int(m.get("rollout/actions_well_formed", 0))
                actions[1] += int(m.get("rollout/actions_judged", 0))
                status = (
                    f"success {100 * m.get('train/success_rate', 0):.0f}% "
                    f"reward {m.get('train/reward_mean', 0):.2f} "
                    f"loss {m.get('train/loss', 0):+.3f} "
                    f"group {m.get('train/group_size', 0):.1f} "
                    f"{m.get('time/step_s', 0):.1f}s/step"
                )
                if first < step < cfg.train.steps:
                    pace = (time.perf_counter() - started) / (step - first)
                    status += f", about {pace * (cfg.train.steps - step) / 60:.1f} min left"
                if live:
                    progress.update(bar, completed=step, status=status)
                elif rank == 0:  # the other ranks hold no rollout metrics
                    print(f"step {step}/{cfg.train.steps} {status}", file=sys.stderr, flush=True)

            history = trainer.fit(on_step)
    except KeyboardInterrupt as stop:
        ckpt = trainer.save()
        by = f" by {stop.args[0]}" if stop.args else ""
        console.print(
            f"[yellow]interrupted{by} at step {trainer.step}[/]; checkpoint {ckpt}. "
            f"Continue with: agentree train --output {run_dir} --resume"
        )
        return EXIT_INTERRUPTED
    finally:
        trainer.stop.uninstall()
        trainer.close()
    if rank > 0:
        return 0
    sha256 = trainer.rt.policy_sha256 if trainer.rt is not None else None
    summary = run_summary(
        cfg,
        history,
        wall_s=time.perf_counter() - t0,
        trained_s=trainer.trained_s,
        resumed_at_step=resumed_at,
        policy_sha256=sha256,
    )
    before, after = summary["eval_before"], summary["eval_after"]
    line = f"held-out success rate: {100 * after:.1f}%"
    if before is not None:
        line = (
            f"held-out success rate: {100 * before:.1f}% -> {100 * after:.1f}% "
            f"({100 * (after - before):+.1f} points)"
        )
    took = f"in {summary['wall_s']:.0f}s"
    if resumed_at is not None:
        took += (
            f" since resuming at step {resumed_at} "
            f"({summary['trained_s'] / 60:.1f} min of training in all)"
        )
    console.print(f"[bold green]{line}[/] {took}; run directory {run_dir}")
    _print_action_format(console, *actions)
    if "walker_success" in summary:
        walker = summary["walker_success"]
        console.print(f"random-valid-move walker on the same held-out maps: {100 * walker:.1f}%")
    write_summary(run_dir, summary)
    return 0


# -- rollout ------------------------------------------------------------------------------------
def cmd_rollout(args: argparse.Namespace) -> int:

    if not args.output:
        raise ValueError("agentree rollout needs --output DIR")
    console = _console()
    cfg = _resumable_config(args, "rollout", console)
    try:
        # `kill` or a closed terminal stops it as Ctrl-C does: the blocks saved are kept
        with interrupt_on_sigterm(), console.status("rolling out") as status:
            trees, d = run_rollout(
                cfg,
                Path(args.output),
                tasks=args.tasks,
                save_every=args.save_every,
                resume=args.resume,
                log=console.print,
                progress=_progress_lines(console, status.update),
            )
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    console.print(
        f"{d['trajectories']} trajectories, {d['env_steps']} env steps, {d['forks']} forks, "
        f"{d['policy_tokens_generated']} tokens generated, {d['policy_tokens_prefilled']} "
        f"prefilled, success {100 * d['success_rate']:.1f}%, {d['wall_s']:.1f}s"
    )
    _print_action_format(console, *action_format(trees))
    return 0


def _resumable_config(args: argparse.Namespace, command: str, console: Any) -> Any:
    """The config of `agentree eval` or `rollout`: from the flags, or (`--resume`) the one the
    stopped run in --output saved, with any flag that would change it refused."""
    if not args.resume:
        return _load(args)
    out = Path(args.output)
    claim(out, command, resume=True)
    select = {k: getattr(args, k) for k in ("env", "rollout", "scorer", "policy")}
    return resume_config(
        out, config=args.config, select=select, overrides=args.set, steps=None, log=console.print
    )


def _progress_lines(
    console: Any, update: Callable[[str], None], every: float | None = 0.0
) -> Callable[[str], None]:
    """Rollout progress: `update` (a live status) on a terminal; without one (CI logs, nohup)
    one plain line when the progress changes, at most every `every` seconds (None: none)."""
    last = ["", 0.0]

    def show(msg: str) -> None:
        if console.is_terminal:
            update(msg)
        elif every is not None and msg != last[0] and time.perf_counter() - last[1] >= every:
            last[:] = [msg, time.perf_counter()]
            print(f"rollout: {msg}", file=sys.stderr, flush=True)

    return show


def _print_action_format(console: Any, well: int, judged: int) -> None:

    line = describe_action_format(well, judged)
    if line is not None:
        console.print(f"[yellow]{line}[/]" if not well else line)


# -- eval ---------------------------------------------------------------------------------------
def cmd_eval(args: argparse.Namespace) -> int:

    if not args.output:
        raise ValueError("agentree eval needs --output DIR")
    console = _console()
    out = Path(args.output)
    cfg = _resumable_config(args, "eval", console)
    try:
        # `kill` or a closed terminal stops it as Ctrl-C does: the blocks saved are kept
        with interrupt_on_sigterm(), console.status("evaluating") as status:
            result = run_eval(
                cfg,
                out,
                tasks=args.tasks,
                samples=args.samples,
                resume=args.resume,
                log=console.print,
                progress=_progress_lines(console, status.update),
            )
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    s = result["summary"]
    console.print(
        f"[bold green]{s['metric']}: {100 * s[s['metric']]:.1f}%[/] over {s['tasks']} tasks "
        f"in {s['wall_s']:.0f}s -> {args.output}/eval.json"
    )
    if "policy_sha256" in s:
        console.print(f"policy weights: sha256 {s['policy_sha256']}")
    if "rollout_stats" in result:
        d = result["rollout_stats"]
        console.print(
            f"{d['trajectories']} trajectories, {d['env_steps']} env steps, "
            f"{d['policy_tokens_generated']} tokens generated, {d['policy_tokens_prefilled']} "
            f"prefilled, {d['env_errors']} env errors"
        )
    return 0


def cmd_configs(args: argparse.Namespace) -> int:

    for name in available_configs():
        print(name)
    return 0


# -- sft --------------------------------------------------------------------------------
def add_sft_command(sub: Any) -> None:
    p = sub.add_parser("sft", help="supervised fine-tuning on chat JSONL or agentree trees")
    p.add_argument("--env", help="env whose system prompt (and tiny policy) to use")
    p.add_argument("--config", help="config name or YAML file (env settings, policy)")
    p.add_argument("--data", required=True, help="chat JSONL file, or a run/trees directory")
    p.add_argument("--output", required=True, help="directory for the fine-tuned policy")
    p.add_argument("--policy", help="policy to start from (default: the config's, e.g. tiny)")
    p.add_argument("--min-reward", type=float, help="keep tree trajectories with reward >= this")
    p.add_argument("--epochs", type=int, default=1, help="passes over the data")
    p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate")
    p.add_argument("--batch-size", type=int, default=8, help="examples per optimiser step")
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=0,
        help="examples forwarded together (gradients accumulated; 0: the whole batch)",
    )
    p.add_argument("--max-length", type=int, default=4096, help="tokens per example at most")
    p.add_argument("--seed", type=int, default=0, help="example order seed")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    p.set_defaults(func=cmd_sft)


def cmd_sft(args: Any) -> int:

    cfg = load_config(
        args.config, select={"env": args.env, "policy": args.policy}, overrides=args.set
    )
    policy = resolve_policy(cfg, print)
    env_name, env_kwargs = cfg.component("env")
    env = env_class(env_name)(**env_kwargs)
    try:
        system, tools = env.system_prompt, tool_schemas(env.tools())
    finally:
        env.close()
    # deferred: transformers takes seconds to import, which `agentree --help` should not pay for
    from transformers import AutoTokenizer

    chat = ChatFormat(AutoTokenizer.from_pretrained(policy), cfg.policy.tool_format)
    examples = load_examples(
        args.data,
        chat,
        min_reward=args.min_reward,
        system=system,
        tools=tools,
        history=cfg.engine.history_window,  # laid out as the rollouts will show them
    )
    sft = SFTConfig(
        epochs=args.epochs,
        lr=args.lr,
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        max_length=args.max_length,
        seed=args.seed,
        dtype=cfg.policy.dtype,
        device=cfg.policy.device,
    )
    state = Path(args.output) / ".sft-state"  # an interrupted run continues from it
    with interrupt_on_sigterm():  # `kill` keeps the state as Ctrl-C does
        summary = run_sft(
            policy, examples, args.output, sft, state_dir=state,
            tool_format=cfg.policy.tool_format, action_format=cfg.env.get("action_format"),
        )  # fmt: skip
    losses = summary["epoch_loss"]
    print(
        f"fine-tuned on {summary['examples']} examples ({summary['target_tokens']} target "
        f"tokens), loss {losses[0]:.4f} -> {losses[-1]:.4f} in {summary['wall_s']:.0f}s; "
        f"continue with: agentree train --policy {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
