"""One registry helper for every pluggable part: envs, scorers, rollout controllers, advantage
estimators. A `Registry` maps short names to objects (registered with a decorator, or listed
as built-in "package.module:Name" paths imported on first use, so a name costs nothing until
it is used), and also resolves any "package.module:Name" path, so users plug in their own part
without touching agentree."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def import_object(path: str) -> Any:
    """Import `package.module:Name`, with an error a user can act on."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected 'package.module:Name', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} for {path!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None


class Registry(Generic[T]):
    """Names of one kind of part. `base`: the class every entry must subclass (None for
    functions, which must be callable)."""

    def __init__(
        self, kind: str, base: type | None = None, builtin: dict[str, str] | None = None
    ) -> None:
        self.kind = kind
        self.base = base
        self.builtin = dict(builtin or {})
        self.registered: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make the class or function available under `name`."""

        def deco(obj: T) -> T:
            self._check(name, obj, TypeError)
            self.registered[name] = obj
            return obj

        return deco

    def names(self) -> list[str]:
        return sorted(set(self.builtin) | set(self.registered))

    def __contains__(self, name: object) -> bool:
        return name in self.registered or name in self.builtin

    def get(self, name: str) -> T:
        """The entry named `name`, or the object at a "package.module:Name" path."""
        if name in self.registered:
            return self.registered[name]
        if name in self.builtin:
            obj = import_object(self.builtin[name])
        elif ":" in name:
            obj = import_object(name)
        else:
            raise ValueError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}, "
                "or pass 'package.module:Name'"
            )
        self._check(name, obj, ValueError)
        return obj

    def _check(self, name: str, obj: Any, error: type[Exception]) -> None:
        if self.base is None:
            if not callable(obj):
                raise error(f"{self.kind} {name!r} must be a function, got {obj!r}")
        elif not (isinstance(obj, type) and issubclass(obj, self.base)):
            where = f"{self.base.__module__.replace('.base', '')}.{self.base.__name__}"
            raise error(f"{self.kind} {name!r} is not a subclass of {where}")
