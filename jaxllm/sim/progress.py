"""Progress for `jaxllm calibrate`'s long passes (and `jaxllm tune --validate`'s servers), on stderr: a line when
each part starts, and a ticking bar while it waits on something that reports nothing (a child server loading and
compiling), so it is never silent for more than a second or two."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path


class Progress:
    """`say` prints one line to stderr, stamped with the command and the seconds since the start; disabled:
    nothing."""

    def __init__(self, enabled: bool = True, command: str = "calibrate"):
        self.enabled, self.command = enabled, command
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, message: str) -> None:
        if self.enabled:
            print(f"[{self.command} {self.elapsed():5.0f} s] {message}", file=sys.stderr, flush=True)

    def waiting(self, what: str, status: Callable[[], str] | None = None, interval: float = 1.0) -> Waiting:
        return Waiting(what, status, interval, enabled=self.enabled)


class Waiting:
    """`with Waiting("starting jaxllm serve", status):` a bar with the elapsed time, redrawn every `interval`
    seconds from a thread, showing `status()` (e.g. the server log's last line) beside it."""

    def __init__(
        self, what: str, status: Callable[[], str] | None = None, interval: float = 1.0, *, enabled: bool = True
    ):
        self.what, self.status, self.interval, self.enabled = what, status, interval, enabled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = 0

    def __enter__(self) -> Waiting:
        if self.enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(desc=self.what, bar_format="{desc}: {elapsed} {postfix}", file=sys.stderr)
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            self.ticks += 1
            if self.status is not None:
                self._bar.set_postfix_str(self.status()[:70], refresh=False)
            self._bar.refresh()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._bar.close()


def last_line(path: Path) -> Callable[[], str]:
    """A status for `Waiting`: the file's last non-empty line (a child's log), or "" while there is none."""

    def status() -> str:
        try:
            with open(path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(f.tell() - 4096, 0))
                lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
        except OSError:
            return ""
        return lines[-1] if lines else ""

    return status
