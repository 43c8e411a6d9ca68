#!/usr/bin/env python
"""Soak test of `jaxllm serve`: many requests of mixed lengths, with client aborts and malformed
requests interleaved. Nothing may be lost, hang or fail, and no KV block may leak.

A server is started here on a loopback port (its memory is measured, so it must be ours). The
run is bounded: `--timeout` per request and `--max-duration` overall; what is still open then
counts as hung. Requests are streamed as `jaxllm bench serve` streams them (token-id prompts,
min_tokens = max_tokens, EOS ignored), Poisson arrivals at `--request-rate`.

- aborts: `--abort-fraction` of the requests hang up, half after a random number of tokens,
  half within 300 ms of sending (usually before their first token, while queued or in prefill);
- malformed: `--num-malformed` bad requests (broken JSON, wrong types, out-of-range values, an
  unknown model, over-long or out-of-vocabulary prompts, bad chat messages) at random times;
  each must get a 4xx with OpenAI's error JSON.

Outcomes: ok (all tokens), lost (the stream ended early or with the wrong token count), hung
(no end in time), failed (an HTTP or stream error); afterwards /metrics must show 0 running,
0 waiting and KV usage 0 (leaked blocks = usage × pool size), a fresh request must still work,
and SIGTERM must stop the server with status 0. RSS is measured after warm-up and after the soak.

    python benchmarks/soak.py --num-requests 1000 --abort-fraction 0.1 --num-malformed 60 \\
        --out benchmarks/results/soak_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import time
from collections import Counter
from pathlib import Path

import httpx

from jaxllm.bench import datasets, serve
from jaxllm.bench.server_process import ServerProcess
from jaxllm.sim.trace import TraceRequest


def malformed_requests(model: str, max_model_len: int) -> list[tuple[str, str, bytes | dict]]:
    """(name, endpoint, body) of requests a server must refuse with a 4xx."""
    ok = {"model": model, "prompt": "Hello", "max_tokens": 4}
    chat = "/v1/chat/completions"
    return [
        ("broken JSON", serve.ENDPOINT, b'{"model": "x", "prompt": '),
        ("not an object", serve.ENDPOINT, b"[1, 2, 3]"),
        ("no prompt", serve.ENDPOINT, {"model": model, "max_tokens": 4}),
        ("prompt of the wrong type", serve.ENDPOINT, {**ok, "prompt": 123}),
        ("empty prompt", serve.ENDPOINT, {**ok, "prompt": ""}),
        ("empty token list", serve.ENDPOINT, {**ok, "prompt": []}),
        ("negative token id", serve.ENDPOINT, {**ok, "prompt": [-5, 3]}),
        ("token id beyond the vocabulary", serve.ENDPOINT, {**ok, "prompt": [10**9, 3]}),
        ("prompt over max_model_len", serve.ENDPOINT, {**ok, "prompt": [1000] * (max_model_len + 1)}),
        ("negative max_tokens", serve.ENDPOINT, {**ok, "max_tokens": -1}),
        ("max_tokens as text", serve.ENDPOINT, {**ok, "max_tokens": "ten"}),
        ("max_tokens beyond the context", serve.ENDPOINT, {**ok, "max_tokens": 10**9}),
        ("negative temperature", serve.ENDPOINT, {**ok, "temperature": -1}),
        ("top_p above 1", serve.ENDPOINT, {**ok, "top_p": 1.5}),
        ("n too large", serve.ENDPOINT, {**ok, "n": 10**4}),
        ("logprobs too large", serve.ENDPOINT, {**ok, "logprobs": 10**4}),
        ("stop of the wrong type", serve.ENDPOINT, {**ok, "stop": 5}),
        ("stream of the wrong type", serve.ENDPOINT, {**ok, "stream": "yes"}),
        ("unknown model", serve.ENDPOINT, {**ok, "model": "no-such-model"}),
        ("empty messages", chat, {"model": model, "messages": []}),
        ("bad chat role", chat, {"model": model, "messages": [{"role": "wizard", "content": "hi"}]}),
        ("messages as text", chat, {"model": model, "messages": "hello"}),
    ]


async def send_malformed(client: httpx.AsyncClient, url: str, name: str, body, timeout: float) -> dict:
    try:
        async with asyncio.timeout(timeout):
            if isinstance(body, bytes):
                response = await client.post(url, content=body, headers={"Content-Type": "application/json"})
            else:
                response = await client.post(url, json=body)
        error = (
            response.json().get("error", {})
            if response.headers.get("content-type", "").startswith("application/json")
            else {}
        )
        outcome = "ok" if 400 <= response.status_code < 500 and "message" in error else "failed"
        return {
            "name": name,
            "status": response.status_code,
            "outcome": outcome,
            "message": str(error.get("message", response.text[:200])),
        }
    except TimeoutError:
        return {"name": name, "status": None, "outcome": "hung", "message": f"no answer in {timeout:g} s"}
    except (httpx.HTTPError, ValueError) as e:
        return {"name": name, "status": None, "outcome": "failed", "message": f"{type(e).__name__}: {e}"}


def classify(record, asked: int) -> str:
    if record.success:
        return "ok" if record.output_len == asked else "lost"
    error = record.error or ""
    if error.startswith("no complete response"):
        return "hung"
    if error.startswith("the stream ended") or error.startswith("the stream carried no tokens"):
        return "lost"
    return "failed"


async def soak(
    url: str,
    model: str,
    trace: list[TraceRequest],
    aborts: dict[int, tuple[str, float]],
    malformed: list[tuple[float, str, str, bytes | dict]],
    *,
    seed: int,
    timeout: float,
    max_duration: float,
) -> dict:
    """Everything at its time; outcomes per request (trace order) and per malformed request."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        clock0 = time.perf_counter()

        async def good(i: int, request: TraceRequest) -> tuple[str, object]:
            body = serve.request_body(request, i, model=model, seed=seed)
            kind, value = aborts.get(i, (None, 0))
            call = serve.stream_completion(
                client,
                url + serve.ENDPOINT,
                body,
                {},
                prompt_len=request.prompt_len,
                clock0=clock0,
                timeout=timeout,
                abort_after=int(value) if kind == "tokens" else None,
            )
            if kind == "early":
                try:
                    record = await asyncio.wait_for(call, value)
                except TimeoutError:
                    return "aborted", None
            else:
                record = await call
            if kind and not record.success and record.error.startswith("aborted by the client"):
                return "aborted", record
            if kind and record.success:
                return "finished before its abort", record
            return classify(record, request.output_len), record

        async def at(when: float, coroutine):
            await asyncio.sleep(max(0.0, clock0 + when - time.perf_counter()))
            return await coroutine

        good_tasks = [asyncio.create_task(at(r.arrival_time, good(i, r))) for i, r in enumerate(trace)]
        bad_tasks = [
            asyncio.create_task(at(when, send_malformed(client, url + endpoint, name, body, timeout)))
            for when, name, endpoint, body in malformed
        ]
        try:
            done, _ = await asyncio.wait(good_tasks + bad_tasks, timeout=max_duration)
        finally:  # past the deadline, or interrupted: close every stream before the client goes
            for task in good_tasks + bad_tasks:
                task.cancel()
            await asyncio.gather(*good_tasks, *bad_tasks, return_exceptions=True)
        duration = time.perf_counter() - clock0
    outcomes = [t.result() if t in done else ("hung", None) for t in good_tasks]
    bad = [
        t.result() if t in done else {"name": "?", "status": None, "outcome": "hung", "message": "still open"}
        for t in bad_tasks
    ]
    return {"duration": duration, "outcomes": outcomes, "malformed": bad}


def wait_idle(server: ServerProcess, limit: float = 60.0) -> tuple[dict, float]:
    """/metrics once nothing runs or waits (or after `limit` seconds), and how long that took."""
    started = time.monotonic()
    while True:
        metrics = server.metrics()
        idle = metrics["jaxllm:num_requests_running"] == 0 and metrics["jaxllm:num_requests_waiting"] == 0
        if idle or time.monotonic() - started > limit:
            return metrics, time.monotonic() - started
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=128, help="mean prompt tokens")
    parser.add_argument("--output-len", type=int, default=32, help="mean new tokens")
    parser.add_argument("--range-ratio", type=float, default=0.875, help="lengths uniform in mean·[1 − r, 1 + r]")
    parser.add_argument("--request-rate", type=float, default=8.0)
    parser.add_argument("--abort-fraction", type=float, default=0.1)
    parser.add_argument("--num-malformed", type=int, default=60)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    parser.add_argument("--max-duration", type=float, default=1800.0, help="seconds for the whole soak")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-flags", default="--max-model-len 512", help="flags for `jaxllm serve`")
    parser.add_argument("--out", default="benchmarks/results/soak_cpu.json")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    trace = datasets.retime(
        datasets.random_requests(
            args.num_requests,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            seed=args.seed,
        ),
        args.request_rate,
        seed=args.seed,
    )
    aborts = {}
    for n, i in enumerate(sorted(rng.sample(range(len(trace)), round(args.abort_fraction * len(trace))))):
        if n % 2 and trace[i].output_len > 1:
            aborts[i] = ("tokens", rng.randint(1, trace[i].output_len - 1))
        else:
            aborts[i] = ("early", rng.uniform(0.0, 0.3))

    with ServerProcess(shlex.split(args.server_flags)) as server:
        model = serve.first_model(server.url, {})
        max_model_len = httpx.get(server.url + "/v1/models").json()["data"][0].get("max_model_len", 8192)
        kinds = malformed_requests(model, max_model_len)
        span = trace[-1].arrival_time
        malformed = sorted((rng.uniform(0, span), *kinds[k % len(kinds)]) for k in range(args.num_malformed))
        warm = asyncio.run(
            serve.run(
                datasets.random_requests(2, input_len=16, output_len=4, seed=99),
                url=server.url + serve.ENDPOINT,
                model=model,
                headers={},
            )
        )[0]
        assert all(r.success for r in warm), [r.error for r in warm]
        before, _ = wait_idle(server)
        rss_before = server.rss_bytes()
        print(
            f"soak: {len(trace)} requests at {args.request_rate:g} req/s ({len(aborts)} aborted by the client), "
            f"{len(malformed)} malformed; server RSS {rss_before / 2**20:.0f} MiB",
            flush=True,
        )
        run = asyncio.run(
            soak(
                server.url,
                model,
                trace,
                aborts,
                malformed,
                seed=args.seed,
                timeout=args.timeout,
                max_duration=args.max_duration,
            )
        )
        after, drain_s = wait_idle(server)
        check = asyncio.run(
            serve.run(
                datasets.random_requests(1, input_len=32, output_len=8, seed=7),
                url=server.url + serve.ENDPOINT,
                model=model,
                headers={},
            )
        )[0][0]
        after_check, _ = wait_idle(server)
        rss_after = server.rss_bytes()
        blocks = server.kv_blocks()
        stop_started = time.monotonic()
        exit_status = server.stop()
        stop_s = time.monotonic() - stop_started

    counts = Counter(outcome for outcome, _ in run["outcomes"])
    expected_aborts = len(aborts)
    good_total = len(trace) - expected_aborts
    bad_counts = Counter(m["outcome"] for m in run["malformed"])
    usage = after_check["jaxllm:kv_cache_usage_perc"]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    result = {
        "config": {
            k: getattr(args, k)
            for k in (
                "num_requests",
                "input_len",
                "output_len",
                "range_ratio",
                "request_rate",
                "abort_fraction",
                "num_malformed",
                "timeout",
                "max_duration",
                "seed",
                "server_flags",
            )
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "duration_s": run["duration"],
        "requests": {
            "sent": len(trace),
            "meant_to_complete": good_total,
            "client_aborts_planned": expected_aborts,
            **{k: counts.get(k, 0) for k in ("ok", "lost", "hung", "failed", "aborted", "finished before its abort")},
        },
        "malformed": {
            "sent": len(malformed),
            "answered_4xx": bad_counts.get("ok", 0),
            "failed": bad_counts.get("failed", 0),
            "hung": bad_counts.get("hung", 0),
            "status_by_kind": {
                name: sorted({m["status"] for m in run["malformed"] if m["name"] == name}, key=str)
                for name in sorted({m["name"] for m in run["malformed"]})
            },
        },
        "server_after": {
            "drain_s": drain_s,
            "num_requests_running": after["jaxllm:num_requests_running"],
            "num_requests_waiting": after["jaxllm:num_requests_waiting"],
            "kv_cache_usage_perc": usage,
            "kv_blocks": blocks,
            "leaked_kv_blocks": round(usage * blocks) if blocks else None,
            "finished_by_reason": {
                reason: delta(f'jaxllm:request_success_total{{finished_reason="{reason}"}}')
                for reason in ("stop", "length", "abort", "error")
            },
            "generation_tokens": delta("jaxllm:generation_tokens_total"),
            "prompt_tokens": delta("jaxllm:prompt_tokens_total"),
            "preemptions": delta("jaxllm:num_preemptions_total"),
        },
        "fresh_request_after_soak": {"ok": check.success and check.output_len == 8, "error": check.error},
        "rss_mib": {"before": rss_before / 2**20, "after": rss_after / 2**20},
        "sigterm": {"exit_status": exit_status, "seconds": stop_s},
        "problems": [
            {"index": i, "outcome": o, "error": r.error if r else None}
            for i, (o, r) in enumerate(run["outcomes"])
            if o in ("lost", "hung", "failed")
        ][:50]
        + [m for m in run["malformed"] if m["outcome"] != "ok"],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    r, m, s = result["requests"], result["malformed"], result["server_after"]
    print(
        f"requests: {r['ok']}/{good_total} ok, lost {r['lost']}, hung {r['hung']}, failed {r['failed']}; "
        f"aborted {r['aborted']} (+{r['finished before its abort']} finished first)"
    )
    print(f"malformed: {m['answered_4xx']}/{m['sent']} answered 4xx, failed {m['failed']}, hung {m['hung']}")
    print(
        f"after: running {s['num_requests_running']:g}, waiting {s['num_requests_waiting']:g}, "
        f"KV usage {usage:g} ({s['leaked_kv_blocks']} leaked blocks), drained in {s['drain_s']:.1f} s; "
        f"fresh request ok: {result['fresh_request_after_soak']['ok']}"
    )
    print(
        f"RSS {result['rss_mib']['before']:.0f} → {result['rss_mib']['after']:.0f} MiB; "
        f"SIGTERM exit {exit_status} in {stop_s:.1f} s; {run['duration']:.0f} s; result: {out}"
    )


if __name__ == "__main__":
    main()
