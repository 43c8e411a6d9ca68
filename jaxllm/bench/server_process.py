"""`jaxllm serve` (or `jaxllm router`) as a child process on a free loopback port: how tests and benchmark scripts
get a real server, wait for it, read its /metrics and memory, and stop it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_metrics(url: str) -> dict[str, float]:
    """A server's /metrics samples summed over engines and models: by name, and by name and each other label
    (`jaxllm:request_success_total{finished_reason="abort"}`). Histogram buckets are left out."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            if "le" in labels:
                continue
            for key in (sample.name, *(f'{sample.name}{{{k}="{v}"}}' for k, v in labels.items())):
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


class ServerProcess:
    """`with ServerProcess(flags) as server:` starts `jaxllm serve FLAGS --port P` (its output in
    `log_path`), returns once /health answers 200, and SIGTERMs it on exit. `command="router"`: `jaxllm router`."""

    def __init__(
        self,
        flags: list[str],
        *,
        startup_timeout: float = 600.0,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        cpus: set[int] | None = None,
        command: str = "serve",
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = list(flags)
        self.command = command
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="jaxllm-serve-", suffix=".log")[1])
        self.env = {**os.environ, **(env or {})}
        self.cpus = cpus  # pin the server to these cores (two servers sharing a machine without contending)
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "jaxllm.entrypoints.cli",
                    self.command,
                    *self.flags,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                preexec_fn=None if (cpus := self.cpus) is None else lambda: os.sched_setaffinity(0, cpus),
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _started(self) -> subprocess.Popen:
        if self.process is None:
            raise RuntimeError("the server is not started: use `with ServerProcess(...) as server`")
        return self.process

    def _wait_healthy(self) -> None:
        process = self._started()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"jaxllm {self.command} exited with {process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"jaxllm {self.command} not healthy within {self.startup_timeout:g} s:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; the exit status."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.url)

    def rss_bytes(self) -> int:
        """Resident memory of the server and its child processes (Linux /proc)."""
        pids, total = [self._started().pid], 0
        while pids:
            pid = pids.pop()
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except FileNotFoundError:
                continue
            if (rss := re.search(r"VmRSS:\s+(\d+) kB", status)) is not None:  # none for a zombie
                total += int(rss[1]) * 1024
            pids += [int(c) for c in children]
        return total

    def kv_blocks(self) -> int | None:
        """The KV pool's size, from the start-up line ("KV cache N blocks x 16 = ...")."""
        found = re.search(r"KV cache (\d+) blocks", self.log_path.read_text(errors="replace"))
        return int(found[1]) if found else None
