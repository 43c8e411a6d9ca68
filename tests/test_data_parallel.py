"""Data parallelism: `jaxllm serve --data-parallel-size 2`, two engine-core processes behind one server.

Greedy text equals the offline engine's; 32 concurrent requests spread over both replicas (per
replica counters in /metrics); killing one replica's process mid-load fails only its in-flight
requests, and the server keeps serving on the other (and says so in /health).
"""

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from jaxllm.bench.server_process import free_port
from tests.conftest import serve_flags

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are"]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device per replica
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [
        sys.executable,
        "-m",
        "jaxllm.entrypoints.cli",
        "serve",
        "--port",
        str(port),
        "--disable-log-stats",
        "--served-model-name",
        "dp",
        "--data-parallel-size",
        "2",
        *serve_flags(),
    ]
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        pytest.fail("the data-parallel server did not start")
    yield url, process
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def complete(url: str, prompt: str, max_tokens: int, **extra) -> httpx.Response:
    body = {"model": "dp", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=600)


async def many(url: str, n: int, max_tokens: int, on_first_done=None, **extra) -> list[httpx.Response]:
    """`n` concurrent completions; `on_first_done()` runs as soon as the first one has returned."""

    def body(i):
        return {
            "model": "dp",
            "prompt": PROMPTS[i % len(PROMPTS)] + f" {i}",
            "max_tokens": max_tokens,
            "temperature": 0,
            **extra,
        }

    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.ensure_future(client.post(f"{url}/v1/completions", json=body(i))) for i in range(n)]
        if on_first_done is not None:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            on_first_done()
        return await asyncio.gather(*tasks)


def per_engine(url: str, name: str) -> dict[str, float]:
    """One metric's value for each engine replica, from /metrics."""
    text = httpx.get(f"{url}/metrics").text
    found = re.findall(rf'^jaxllm:{name}\{{[^}}]*engine="(\d+)"[^}}]*\}} (\S+)$', text, re.M)
    return {engine: float(value) for engine, value in found}


def generation_tokens(url: str) -> dict[str, float]:
    return per_engine(url, "generation_tokens_total")


def test_greedy_text_equals_offline(server, llm):
    from jaxllm import SamplingParams

    url, _ = server
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for prompt, out in zip(PROMPTS, expected, strict=True):
        response = complete(url, prompt, 16)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == out.outputs[0].text


def test_32_concurrent_requests_use_both_replicas(server):
    url, _ = server
    before = generation_tokens(url)
    responses = asyncio.run(many(url, 32, 8))
    assert [r.status_code for r in responses] == [200] * 32
    after = generation_tokens(url)
    assert set(after) == {"0", "1"}
    assert all(after[e] - before.get(e, 0) > 0 for e in ("0", "1")), (before, after)
    assert sum(after.values()) - sum(before.values()) == 32 * 8


def test_a_dead_replica_fails_only_its_requests(server):
    url, process = server
    replicas = _replica_pids(process.pid)
    assert len(replicas) == 2, replicas

    # 16 requests a replica, 8 at a time: when the first returns, each replica still has a wave in flight
    # (a fixed sleep was not: a faster engine finished all 32 before it)
    responses = asyncio.run(
        many(url, 32, 48, on_first_done=lambda: os.kill(replicas[1], signal.SIGKILL), ignore_eos=True)
    )
    codes = [r.status_code for r in responses]
    failed = [r for r in responses if r.status_code != 200]
    assert failed and len(failed) < 32, codes
    assert all("replica" in r.json()["error"]["message"] for r in failed)
    assert all(len(r.json()["choices"][0]["text"]) > 0 for r in responses if r.status_code == 200)
    later = asyncio.run(many(url, 8, 8))
    assert [r.status_code for r in later] == [200] * 8
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json() == {"status": "degraded", "dead_engines": [1]}
    assert per_engine(url, "num_requests_running")["1"] == 0, "the dead replica runs nothing"


def _replica_pids(server_pid: int) -> list[int]:
    """The engine-core processes the server spawned, in replica order (not multiprocessing's helpers)."""
    found = []
    for pid in map(
        int, subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True).stdout.split()
    ):
        cmdline = open(f"/proc/{pid}/cmdline").read()
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            found.append(pid)
    return sorted(found)
