#!/usr/bin/env python
"""Output tokens/s through the OpenAI server vs `LLM.generate`, same workload, same run; idle CPU.

Workload (the offline benchmark's, `jaxllm bench throughput`): B prompts of exactly
`--prompt-len` real tokens, greedy, EOS ignored, `--new-tokens` new tokens each. The offline
engine and the same settings behind the server (uvicorn on a thread of this process, the
engine core on its own thread, B concurrent streaming requests from a client in a separate
process, as a real client would be) run in alternation, `--rounds` times each, so both see
the same drift in machine load; the ratio is per round. Per engine step we time the
whole step and the part inside `ModelRunner.execute`, so the JSON also says how much host
work (scheduling, detokenization, output assembly) each step carries in both settings.
Last, with the server idle, the CPU time this process uses over `--idle-seconds`.

    python benchmarks/serve_vs_offline.py --rounds 3 --out benchmarks/results/serve_vs_offline.json
    python benchmarks/serve_vs_offline.py --new-tokens 32 --rounds 2   # quicker, on a busy machine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
KV_BYTES_PER_BLOCK = 2 * 30 * 16 * 3 * 64 * 4  # the default model: K and V, 30 layers, 16 tokens, 3 heads x 64, fp32


class StepTimer:
    """Wraps an EngineCore's `step` and its runner's `execute` to time both (measurement only)."""

    def __init__(self, core):
        self.step_s, self.execute_s, self.steps = 0.0, 0.0, 0
        step, execute = core.step, core.runner.execute

        def timed_step():
            start = time.perf_counter()
            try:
                return step()
            finally:
                self.step_s += time.perf_counter() - start
                self.steps += 1

        def timed_execute(*args, **kwargs):
            start = time.perf_counter()
            try:
                return execute(*args, **kwargs)
            finally:
                self.execute_s += time.perf_counter() - start

        core.step, core.runner.execute = timed_step, timed_execute

    def reset(self) -> None:
        self.step_s, self.execute_s, self.steps = 0.0, 0.0, 0

    def summary(self) -> dict:
        n = max(self.steps, 1)
        return {
            "steps": self.steps,
            "mean_step_ms": round(1e3 * self.step_s / n, 3),
            "mean_execute_ms": round(1e3 * self.execute_s / n, 3),
            "mean_host_outside_execute_ms": round(1e3 * (self.step_s - self.execute_s) / n, 3),
        }


class FrontTimer:
    """Times the server's event-loop work that shares the GIL with the engine thread: handing each
    step's outputs to the request streams, and turning them into SSE chunks (measurement only)."""

    def __init__(self, engine):
        from jaxllm.entrypoints.openai import serving_completion

        self.dispatch_s = self.sse_s = 0.0
        dispatch, sse = engine._dispatch, serving_completion.sse

        def timed_dispatch(*args):
            start = time.perf_counter()
            dispatch(*args)
            self.dispatch_s += time.perf_counter() - start

        def timed_sse(chunk):
            start = time.perf_counter()
            try:
                return sse(chunk)
            finally:
                self.sse_s += time.perf_counter() - start

        engine._dispatch, serving_completion.sse = timed_dispatch, timed_sse

    def reset(self) -> None:
        self.dispatch_s = self.sse_s = 0.0

    def summary(self, steps: int) -> dict:
        n = max(steps, 1)
        return {
            "mean_dispatch_ms_per_step": round(1e3 * self.dispatch_s / n, 3),
            "mean_sse_ms_per_step": round(1e3 * self.sse_s / n, 3),
        }


def engine_kwargs(args) -> dict:
    """Room in the KV cache for every request at once: no preemption in either setting."""
    blocks = max(args.batch * -(-(args.prompt_len + args.new_tokens) // 16), -(-args.max_model_len // 16)) + 16
    return dict(
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        kv_cache_memory_bytes=blocks * KV_BYTES_PER_BLOCK,
    )


class Offline:
    """`LLM.generate` on the workload."""

    def __init__(self, args):
        from jaxllm import LLM, SamplingParams
        from jaxllm.bench.offline import make_prompts

        self.llm = LLM(**engine_kwargs(args), progress=False)
        self.prompts = make_prompts(self.llm.get_tokenizer(), args.batch, args.prompt_len)
        self.params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        self.timer = StepTimer(self.llm.engine)
        self.run(self.prompts[:2])  # warm

    def run(self, prompts) -> dict:
        self.timer.reset()
        start, cpu = time.perf_counter(), cpu_seconds()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params, use_tqdm=False)
        wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        total = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert total == len(prompts) * self.params.max_tokens, total
        return {
            "wall_s": round(wall, 3),
            "output_tokens": total,
            "output_tok_per_s": round(total / wall, 2),
            "engine_process_cpu_s": round(cpu, 2),
            **self.timer.summary(),
        }


class Served:
    """The same engine settings behind the server, driven by a client process."""

    def __init__(self, args):
        import uvicorn

        from jaxllm import EngineArgs
        from jaxllm.engine.async_llm import AsyncLLM
        from jaxllm.entrypoints.openai.api_server import build_app
        from jaxllm.entrypoints.openai.launcher import GracefulServer

        self.engine = AsyncLLM(
            EngineArgs(**engine_kwargs(args)), served_model_name="bench", progress=False, log_stats=False
        )
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.server = GracefulServer(
            uvicorn.Config(build_app(self.engine), port=port, log_level="warning", lifespan="off"), self.engine
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.client = [
            sys.executable,
            __file__,
            "--client",
            f"http://127.0.0.1:{port}",
            "--new-tokens",
            str(args.new_tokens),
        ]
        self.timer, self.front = StepTimer(self.engine.client.core), FrontTimer(self.engine)

    def run(self, prompts) -> dict:
        from jaxllm.runner.compilations import compilation_count

        self.timer.reset()
        self.front.reset()
        compiled, cpu = compilation_count(), cpu_seconds()
        done = subprocess.run(self.client, input=json.dumps(prompts), text=True, check=True, capture_output=True)
        result = json.loads(done.stdout)
        result["engine_process_cpu_s"] = round(cpu_seconds() - cpu, 2)
        result.update(
            self.timer.summary(),
            **self.front.summary(self.timer.steps),
            compilations_while_serving=compilation_count() - compiled,
        )
        return result

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()


def cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads) so far."""
    t = os.times()
    return t.user + t.system


def idle_cpu(seconds: float) -> float:
    """CPU time (user + system, all threads) this process used over `seconds` of wall time, in %."""
    time.sleep(1.0)  # let the last responses drain
    before, start = os.times(), time.monotonic()
    time.sleep(seconds)
    after, wall = os.times(), time.monotonic() - start
    return round(100 * ((after.user - before.user) + (after.system - before.system)) / wall, 3)


async def client_main(url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """B concurrent streams; wall time from the first request to the last [DONE]."""
    import httpx

    async def one(http, ids):
        body = {
            "model": "bench",
            "prompt": ids,
            "max_tokens": new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent, first, usage = time.perf_counter(), None, None
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if first is None and event["choices"]:
                    first = time.perf_counter()
                usage = event.get("usage") or usage
        return usage["completion_tokens"], first - sent

    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*[one(http, p) for p in prompts])
        wall = time.perf_counter() - start
    total = sum(r[0] for r in results)
    assert total == len(prompts) * new_tokens, total
    ttfts = sorted(r[1] for r in results)
    return {
        "wall_s": round(wall, 3),
        "output_tokens": total,
        "output_tok_per_s": round(total / wall, 2),
        "median_ttft_s": round(ttfts[len(ttfts) // 2], 3),
        "client_process_cpu_s": round(cpu_seconds(), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="concurrent requests")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=2, help="offline and server runs, alternated")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)  # internal: the load-generating child
    args = parser.parse_args()
    if args.client:
        prompts = json.loads(sys.stdin.read())
        print(json.dumps(asyncio.run(client_main(args.client, prompts, args.new_tokens))))
        return

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    load_before = os.getloadavg()
    offline = Offline(args)
    served = Served(args)
    served.run(offline.prompts[:2])  # warm
    rounds = []
    for _ in range(args.rounds):  # alternate, so both settings see the same drift in machine load
        rounds.append({"offline": offline.run(offline.prompts), "server": served.run(offline.prompts)})
        rounds[-1]["server_over_offline"] = round(
            rounds[-1]["server"]["output_tok_per_s"] / rounds[-1]["offline"]["output_tok_per_s"], 3
        )
    idle = idle_cpu(args.idle_seconds)
    served.stop()
    result = {
        "workload": {
            "requests": args.batch,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "greedy": True,
            "ignore_eos": True,
            **engine_kwargs(args),
        },
        "rounds": rounds,
        "median_server_over_offline": statistics.median(r["server_over_offline"] for r in rounds),
        "idle_cpu_percent": idle,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
