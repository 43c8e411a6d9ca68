"""What JAX compiles, watched through `jax.monitoring`: a count of lowerings (the "no compile while serving" tests)
and, per compiling thread, whether JAX's persistent cache answered (executable_cache.py).

The listeners are registered by `watch_compilations()`, which every ModelRunner calls, not on import: importing a
runner module changes nothing in the process.
"""

from __future__ import annotations

import threading

import jax

_LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

_compilations = 0
_watching = False
_lock = threading.Lock()
served_by_jax_cache = threading.local()  # per compiling thread: did JAX's persistent cache answer? (`.hit`)


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    global _compilations
    if event == _LOWERED:
        _compilations += 1


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT:
        served_by_jax_cache.hit = True


def watch_compilations() -> None:
    """Start counting (once per process; later calls do nothing)."""
    global _watching
    with _lock:
        if not _watching:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _watching = True


def compilation_count() -> int:
    """How many XLA computations this process has lowered since `watch_compilations` (each a compile or a cache
    load)."""
    return _compilations
