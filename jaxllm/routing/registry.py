"""Policies by name, and the loader: a registered name or a dotted path (`pkg.module:Class`), as scheduling
policies load (engine/policy.py)."""

from __future__ import annotations

from typing import Any

from jaxllm.plugins import load_class
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
    cls: Any = load_class(spec, POLICIES, RoutingPolicy, "--policy")
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"--policy {spec!r}: {e}") from None
