"""A multi-host node runs its engine in a child process, so that a lost peer always ends in one line.

When a node dies, JAX's coordination client (C++) in every other node aborts its process with a
page of fatal log ("... another task died", a stack trace, SIGABRT) as soon as it notices — for
a dead leader that is within milliseconds, before our watchdog or the failed collective can say
anything. JAX 0.10 gives Python no say: its missed-heartbeat callback cannot receive the status
(nanobind has no caster for absl::Status) and error polling cannot be turned off. So the node
command re-runs itself as a child: the parent passes the child's stderr through, forwards
signals, exits with the child's status, and replaces JAX's fatal log with one
`jaxllm: error: node R: ...` line. The child dies with the parent (PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from jaxllm.distributed.watchdog import EXIT_STATUS

CHILD_ENV = "JAXLLM_NODE_PARENT"  # set in the child: the parent's pid
JAX_FATAL = b"Terminating process because the JAX distributed service detected fatal errors"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def supervise(node_rank: int, argv: list[str]) -> int | None:
    """In the parent: run `jaxllm argv` as the child and return its exit status. In the child: None."""
    parent = os.environ.get(CHILD_ENV)
    if parent is not None:
        _die_with(int(parent))
        return None
    env = {**os.environ, CHILD_ENV: str(os.getpid())}
    child = subprocess.Popen(
        [sys.executable, "-m", "jaxllm.entrypoints.cli", *argv], env=env, stderr=subprocess.PIPE, start_new_session=True
    )  # signals reach it once, from us
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, _: child.send_signal(sig))
    fatal = _pass_stderr(child.stderr)
    status = child.wait()
    if fatal is None:
        return status if status >= 0 else 128 - status
    sys.stderr.write(
        f"jaxllm: error: node {node_rank}: another node died or is unreachable, JAX's coordination "
        f"service gave up ({fatal})\n"
    )
    return EXIT_STATUS


def _pass_stderr(stream) -> str | None:
    """Copy the child's stderr to ours until it ends, line by line (progress bars' \\r too). Returns the status
    in JAX's fatal log if the child hit one; that log is read and dropped."""
    out, pending = sys.stderr.buffer, b""
    while chunk := os.read(stream.fileno(), 65536):
        pending += chunk
        if JAX_FATAL in pending:
            start = pending.rfind(b"\n", 0, pending.find(JAX_FATAL)) + 1  # the fatal line's own prefix goes too
            out.write(pending[:start])
            out.flush()
            return _status_of(pending[start:], stream)
        cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
        out.write(pending[:cut])
        out.flush()
        pending = pending[cut:]
    out.write(pending)
    out.flush()
    return None


def _status_of(fatal_log: bytes, stream) -> str:
    """The first sentence of the status in JAX's fatal log line (read to the end)."""
    while chunk := os.read(stream.fileno(), 65536):
        fatal_log += chunk
    line = fatal_log.split(b"\n", 1)[0].decode(errors="replace")
    status = line.split("Status: ", 1)[-1]
    return status.split(". ", 1)[0].strip()[:200]


def _die_with(parent: int) -> None:
    """The child ends when its parent does, even by SIGKILL (Linux; elsewhere it outlives a killed parent)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent was already gone before prctl
        os._exit(EXIT_STATUS)
