"""Environments: the `Env` contract, the registry, and the checker (see `base.py`)."""

from agentree.envs.base import (
    Env,
    EnvCheckError,
    EnvConfig,
    ForkNotSupported,
    MoveGame,
    NoExpert,
    Task,
    check_env,
    env_class,
    env_names,
    has_expert,
    make_env,
    register_env,
)

__all__ = [
    "Env",
    "EnvCheckError",
    "EnvConfig",
    "ForkNotSupported",
    "MoveGame",
    "NoExpert",
    "Task",
    "check_env",
    "env_class",
    "env_names",
    "has_expert",
    "make_env",
    "register_env",
]
