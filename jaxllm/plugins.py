"""Where users plug in their own classes (scheduling policies, routing policies): a registered name, or a dotted
path to a subclass of the interface. Pure Python: the engine's host side and the router both load through it."""

from __future__ import annotations

import importlib
from typing import TypeVar, cast

T = TypeVar("T")


def load_class(spec: str, registered: dict[str, type[T]], base: type, what: str) -> type[T]:
    """`registered[spec]`, or the class at `spec` (`pkg.module:Class` or `pkg.module.Class`), which must subclass
    `base`. Errors are one-line ValueErrors naming `what` (the setting: "--policy", "scheduling policy")."""
    if spec in registered:
        return registered[spec]
    module_name, sep, class_name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not module_name:
        raise ValueError(
            f"{what} {spec!r} is not one of {', '.join(registered)} nor a dotted path to a class (pkg.module:Class)"
        )
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {spec!r} cannot be loaded: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{what} {spec!r} is not a subclass of {base.__module__}.{base.__qualname__}")
    return cast("type[T]", cls)
