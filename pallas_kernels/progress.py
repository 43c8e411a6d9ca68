"""Progress bars for the slow first-use work below the engine: the CPU kernels' self-check (`cpu_choice`), the
GGUF weights' conversion (`jaxllm.weights.converted`). Each also logs a line at INFO when it starts; the bars
are drawn only where the engine's `progress` flag is on for the current context (`Worker` sets it for its
start; a thread started with `contextvars.copy_context().run` inherits it), so library calls and tests stay
quiet by default."""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator

ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxllm_progress", default=False)


@contextlib.contextmanager
def showing(enabled: bool) -> Iterator[None]:
    """`with showing(progress):` the bars below are drawn (or not) until the block ends."""
    token = ENABLED.set(enabled)
    try:
        yield
    finally:
        ENABLED.reset(token)


def bar(total: int, desc: str, unit: str):
    """A tqdm bar on stderr, disabled unless `showing(True)` is in effect."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not ENABLED.get())
