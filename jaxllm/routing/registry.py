"""Policies by name, and the loader: a registered name or a dotted path (`pkg.module:Class`), as scheduling
policies load (engine/policy.py)."""

from __future__ import annotations

import importlib
from typing import Any

from jaxllm.routing.base import RoutingPolicy
from jaxllm.routing.least_loaded import LeastLoaded
from jaxllm.routing.prefix_aware import PrefixAware
from jaxllm.routing.round_robin import RoundRobin
from jaxllm.routing.session import SessionAffinity

POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoaded, SessionAffinity, PrefixAware)
}


def load_policy(spec: str, **options: Any) -> RoutingPolicy:
    """A policy by name (round_robin, least_loaded, session, prefix_aware) or a dotted path to a RoutingPolicy
    subclass; `options` go to its constructor. A bad name is a ValueError in one line."""
    known = POLICIES
    if spec in known:
        cls: Any = known[spec]
    else:
        module_name, sep, class_name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
        if not sep or not module_name:
            raise ValueError(
                f"--policy {spec!r} is not one of {', '.join(known)} nor a dotted path to a class (pkg.module:Class)"
            )
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--policy {spec!r} cannot be loaded: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, RoutingPolicy)):
            raise ValueError(f"--policy {spec!r} is not a subclass of jaxllm.routing.base.RoutingPolicy")
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"--policy {spec!r}: {e}") from None
