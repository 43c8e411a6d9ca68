"""A deadline for blocking collectives: a peer that died would otherwise leave this process hanging forever.

A collective (gloo on CPU, NCCL on GPU) waits for every process; nothing in it times out on its
own. The watchdog is a daemon thread: armed, it ends the process with one line on stderr and a
non-zero status when it is not disarmed or re-armed before its deadline.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import NoReturn

EXIT_STATUS = 3


def die(message: str) -> NoReturn:
    """One line on stderr, then exit at once: a thread blocked in a collective cannot be unwound."""
    sys.stderr.flush()
    # nothing after it: JAX's coordination agent logs from its own thread when a peer is gone. So stderr goes to
    # /dev/null first (any other thread's line from now on is dropped), and this line goes to the stderr it was
    # (writing it first left a window: a CI run saw the agent's warning land after it)
    ours = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    os.write(ours, f"jaxllm: error: {message}\n".encode())
    os._exit(EXIT_STATUS)


class Watchdog:
    def __init__(self, timeout: float, name: str = "jaxllm-watchdog"):
        self.timeout = timeout
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._message = ""
        threading.Thread(target=self._watch, name=name, daemon=True).start()

    def arm(self, message: str) -> None:
        """From now, `timeout` seconds until the process exits with `message` (unless re-armed or disarmed)."""
        with self._cond:
            self._deadline, self._message = time.monotonic() + self.timeout, message
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left <= 0:
                    die(self._message)
                self._cond.wait(left)
