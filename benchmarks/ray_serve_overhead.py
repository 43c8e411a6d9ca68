"""Per-request latency that Ray Serve adds in front of a jaxllm engine.

Serves the same engine settings twice at once: `jaxllm serve` (a child process) and a
one-replica Ray Serve deployment (`jaxllm.integrations.ray_serve`), then alternates the same
tiny requests between them, one at a time, so both see the same machine load. Reports the
median (and quartiles) of each, for a route with no engine work (GET /v1/models) and a
one-token completion. Prints one JSON line per route, then one with the memory (PSS) of
the direct server, of the Ray replica and of Ray's own processes (GCS, raylet, agents,
controller, HTTP proxy, idle workers).

    python benchmarks/ray_serve_overhead.py --requests 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import httpx
import psutil

# the tests' shapes (their compiled buckets are in the cache) and a 256-block KV cache (180 MB),
# not one sized from the machine's free memory
ENGINE = {
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "max_model_len": 512,
    "dtype": "float32",
    "kv_cache_memory_bytes": 256 * 2 * 30 * 16 * 3 * 64 * 4,
}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}


def timed(http: httpx.Client, url: str, route: str) -> float:
    start = time.perf_counter()
    response = http.get(url) if route == "models" else http.post(url, json=COMPLETION)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return elapsed


def quartiles(samples: list[float]) -> dict[str, float]:
    q1, median, q3 = statistics.quantiles(samples, n=4)
    return {"median_ms": round(median * 1e3, 2), "q1_ms": round(q1 * 1e3, 2), "q3_ms": round(q3 * 1e3, 2)}


def memory(direct_pid: int) -> dict:
    """MB of proportional set size: the direct server, the Ray replica, everything else Ray runs."""
    groups = {"direct_server_mb": 0.0, "ray_replica_mb": 0.0, "ray_other_mb": 0.0}
    others = []
    for p in psutil.Process().children(recursive=True):
        try:
            pss, name = p.memory_full_info().pss / 2**20, " ".join(p.cmdline())
        except psutil.Error:
            continue
        if p.pid == direct_pid:
            groups["direct_server_mb"] += pss
        elif "ServeReplica" in name:
            groups["ray_replica_mb"] += pss
        else:
            groups["ray_other_mb"] += pss
            others.append(p.name())
    return {
        **{k: round(v) for k, v in groups.items()},
        "ray_other_processes": len(others),
        "ray_other_names": sorted(set(others)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="requests per route and server")
    args = parser.parse_args()

    import ray
    from ray import serve

    from jaxllm.bench.server_process import ServerProcess, free_port
    from jaxllm.integrations.ray_serve import build_app

    flags = [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))] + ["--disable-log-stats"]
    with ServerProcess(flags) as direct:
        port = free_port()
        ray.init(num_cpus=1, object_store_memory=100 * 2**20, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(ENGINE, num_replicas=1), name="jaxllm", route_prefix="/")
            bases = {"direct": direct.url, "ray": f"http://127.0.0.1:{port}"}
            paths = {"models": "/v1/models", "completion": "/v1/completions"}
            times = {(server, route): [] for server in bases for route in paths}
            with httpx.Client(timeout=120) as http:
                for route, path in paths.items():
                    for base in bases.values():  # warm-up: connections, first compiled step
                        timed(http, base + path, route)
                    for _ in range(args.requests):
                        for server, base in bases.items():
                            times[server, route].append(timed(http, base + path, route))
            for route in paths:
                direct_q, ray_q = quartiles(times["direct", route]), quartiles(times["ray", route])
                print(
                    json.dumps(
                        {
                            "route": route,
                            "requests": args.requests,
                            "direct": direct_q,
                            "ray": ray_q,
                            "ray_overhead_median_ms": round(ray_q["median_ms"] - direct_q["median_ms"], 2),
                            "loadavg": [round(x, 2) for x in os.getloadavg()],
                        }
                    )
                )
            print(json.dumps(memory(direct.process.pid)))
        finally:
            serve.shutdown()
            ray.shutdown()


if __name__ == "__main__":
    main()
