"""Serving benchmark: replay a dataset against an OpenAI-compatible server; TTFT, TPOT, ITL, E2E latency, throughput.

Each request is a streaming `POST /v1/completions` (`stream_options.include_usage`), sent at its
arrival time: Poisson arrivals at `--request-rate` (`inf`: all at once), or a trace's own times.
Prompts go out as token ids when the dataset fixes them (exact lengths), as text otherwise;
a trace's `session` goes in the `x-session-id` header (what `jaxllm router --policy session` keys on);
`max_tokens = min_tokens = output_len` with EOS ignored and greedy sampling, so every run of a
dataset asks for the same work. Failed requests (HTTP errors, dropped streams, `--timeout`) are
counted and reported, never fatal.

How tokens are timed, client side (vLLM's definitions): TTFT runs from sending the request to
the first chunk that carries a token; ITL are the gaps between token arrivals; TPOT is
(E2E − TTFT) / (output tokens − 1); output tokens come from the server's usage. The request also
asks for vLLM's `continuous_usage_stats`, so every chunk says how many tokens it carries: the k
tokens of a chunk are spread evenly over the time since the previous chunk (a coalesced chunk
is k fast tokens, not one slow one; the first chunk's tokens all arrive at TTFT). Without
per-chunk usage, each chunk with a choice is one token, except a trailing empty chunk that only
carries a finish_reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import httpx
from tqdm import tqdm

from jaxllm.bench.datasets import add_dataset_args, get_requests, retime
from jaxllm.bench.results import METRICS, RequestRecord, format_result, per_request, summarize
from jaxllm.routing.view import SESSION_HEADER
from jaxllm.sim.trace import TraceRequest, prompt_token_ids

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
ENDPOINT = "/v1/completions"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"the server (default {DEFAULT_BASE_URL})")
    server.add_argument("--api-key", default=None, help="bearer key (default: $JAXLLM_API_KEY or $OPENAI_API_KEY)")
    server.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests per second, Poisson arrivals; inf sends all at once "
        "(default: inf for random, the trace's arrival times for jsonl)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier, > 1 more even",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    load.add_argument("--timeout", type=float, default=300.0, help="seconds before one request counts as failed")
    report = parser.add_argument_group("report")
    report.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el; milliseconds)",
    )
    report.add_argument(
        "--percentile-metrics",
        default=",".join(METRICS),
        help="metrics to print, comma-separated (the JSON always has all of ttft,tpot,itl,e2el)",
    )
    report.add_argument(
        "--metric-percentiles", default="99", help="percentiles to report, comma-separated, e.g. 50,90,99"
    )
    report.add_argument("--output", default=None, metavar="FILE", help="write the result JSON here")
    report.add_argument("--plot", default=None, metavar="DIR", help="write latency CDF and throughput PNGs here")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    goodput = parse_goodput(args.goodput)
    percentiles = parse_percentiles(args.metric_percentiles)
    metrics = parse_metrics(args.percentile_metrics)
    for flag, value in (
        ("--max-concurrency", args.max_concurrency),
        ("--timeout", args.timeout),
        ("--request-rate", args.request_rate),
        ("--burstiness", args.burstiness),
    ):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    requests = get_requests(args)
    rate = args.request_rate if args.request_rate is not None or args.dataset_name == "jsonl" else math.inf
    if rate is not None:
        requests = retime(requests, rate, burstiness=args.burstiness, seed=args.seed)
    base_url = args.base_url.rstrip("/").removesuffix("/v1")  # the openai client's form works too
    headers = auth_headers(args.api_key or os.environ.get("JAXLLM_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    model = args.model or first_model(base_url, headers)

    rate_text = "trace arrival times" if rate is None else f"{rate:g} req/s (burstiness {args.burstiness:g})"
    print(
        f"Benchmarking {base_url}{ENDPOINT}, model {model}: {len(requests)} requests, {rate_text}, "
        f"max concurrency {args.max_concurrency or 'unlimited'}",
        flush=True,
    )
    records, duration = asyncio.run(
        run(
            requests,
            url=base_url + ENDPOINT,
            model=model,
            headers=headers,
            seed=args.seed,
            max_concurrency=args.max_concurrency,
            timeout=args.timeout,
            progress=not args.disable_tqdm,
        )
    )
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "backend": "openai",
        "base_url": base_url,
        "endpoint": ENDPOINT,
        "model_id": model,
        "dataset_name": args.dataset_name,
        "dataset_path": args.dataset_path,
        "num_prompts": len(requests),
        "request_rate": "trace" if rate is None else ("inf" if math.isinf(rate) else rate),
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "goodput_slos_ms": goodput or None,
        "request_goodput": None,
        **summarize(records, duration, goodput=goodput, percentiles=percentiles),
        **per_request(records),
    }
    print(format_result(result, metrics))
    report_problems(records, requests)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
        print(f"result JSON: {args.output}")
    if args.plot:
        from jaxllm.bench.plots import save_plots

        print("plots:", ", ".join(str(p) for p in save_plots(result, records, args.plot)))
    return result


async def run(
    requests: list[TraceRequest],
    *,
    url: str,
    model: str,
    headers: dict[str, str],
    seed: int = 0,
    max_concurrency: int | None = None,
    timeout: float = 300.0,
    progress: bool = False,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time (relative to the first); records in request order and
    the run's duration (first send to last response)."""
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    first_arrival = min((r.arrival_time for r in requests), default=0.0)
    with tqdm(total=len(requests), disable=not progress, unit="req") as bar:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
            clock0 = time.perf_counter()

            async def send(index: int, request: TraceRequest) -> RequestRecord:
                async with gate:
                    record = await stream_completion(
                        client,
                        url,
                        request_body(request, index, model=model, seed=seed),
                        {**headers, SESSION_HEADER: request.session} if request.session else headers,
                        prompt_len=request.num_prompt_tokens or 0,
                        clock0=clock0,
                        timeout=timeout,
                    )
                bar.update()
                return record

            tasks = []
            try:
                for index, request in enumerate(requests):
                    delay = clock0 + request.arrival_time - first_arrival - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(send(index, request)))
                records = await asyncio.gather(*tasks)
            finally:  # interrupted: close every stream before the client goes
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            return list(records), time.perf_counter() - clock0


def request_body(request: TraceRequest, index: int, *, model: str, seed: int = 0) -> dict:
    """The completion request replaying `request` exactly: its prompt, `output_len` tokens, greedy."""
    body = {
        "model": model,
        "prompt": request.prompt if request.prompt is not None else prompt_token_ids(request, index, seed),
        "max_tokens": request.output_len,
        "min_tokens": request.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if request.priority:
        body["priority"] = request.priority
    if request.user:
        body["user"] = request.user
    return body


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    headers: dict[str, str],
    *,
    prompt_len: int = 0,
    clock0: float = 0.0,
    timeout: float = 300.0,
    abort_after: int | None = None,
) -> RequestRecord:
    """One streaming request, timed. Never raises (except cancellation): a failure is recorded in
    `error`. `abort_after` closes the connection after that many tokens, as an impatient client."""
    record = RequestRecord(prompt_len=prompt_len)
    sent = time.perf_counter()
    record.start = sent - clock0
    last = sent
    try:
        async with asyncio.timeout(timeout), client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {error_message(await response.aread())}"
                return record
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (pings), event names
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"error in stream: {error_message(data.encode())}"
                    return record
                usage = chunk.get("usage") or {}
                if prompt_tokens := usage.get("prompt_tokens"):
                    record.prompt_len = prompt_tokens
                new = _tokens_in(chunk, usage, record.output_len)
                if new:
                    if record.ttft is None:
                        record.ttft = now - sent
                        record.itl.extend([0.0] * (new - 1))
                    else:
                        record.itl.extend([(now - last) / new] * new)
                    record.output_len += new
                    last = now
                if "completion_tokens" in usage and not chunk.get("choices"):
                    record.output_len = usage["completion_tokens"]  # the final usage chunk is the count
                if abort_after is not None and record.output_len >= abort_after:
                    record.error = f"aborted by the client after {record.output_len} tokens"
                    return record
            if not done:
                record.error = "the stream ended before data: [DONE]"
            elif record.ttft is None:
                record.error = "the stream carried no tokens"
            else:
                record.latency = last - sent
                record.success = True
    except TimeoutError:
        record.error = f"no complete response within --timeout {timeout:g} s"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError, TypeError, KeyError, AttributeError) as e:
        record.error = f"{type(e).__name__}: {e}"
    return record


def _tokens_in(chunk: dict, usage: dict, received: int) -> int:
    """How many tokens a chunk carries: from per-chunk usage when the server sends it, else one per choice
    chunk (an empty chunk that only says why the stream finished carries none)."""
    choices = chunk.get("choices")
    if not choices:
        return 0
    if "completion_tokens" in usage:
        return max(usage["completion_tokens"] - received, 0)
    choice = choices[0]
    return 0 if not choice.get("text") and choice.get("finish_reason") else 1


def error_message(raw: bytes) -> str:
    """The message of OpenAI's error JSON, or the body itself (shortened)."""
    text = raw.decode(errors="replace")
    with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
        return json.loads(text)["error"]["message"]
    return text[:300]


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def first_model(base_url: str, headers: dict[str, str]) -> str:
    """The first model `GET /v1/models` lists; an unreachable server is a one-line error."""
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at {base_url}: {e}") from None
    if response.status_code == 401:
        raise ValueError(f"{base_url} wants an API key: pass --api-key or set JAXLLM_API_KEY")
    if response.status_code != 200:
        raise ValueError(f"GET {base_url}/v1/models answered {response.status_code}: {error_message(response.content)}")
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url} serves no models")
    return models[0]["id"]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos = {}
    for item in items or ():
        key, _, value = item.partition(":")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput takes KEY:MS pairs such as ttft:500, got {item!r}") from None
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput keys are ttft, tpot and e2el, got {key!r}")
        if slos[key] < 0:
            raise ValueError(f"--goodput {key} must be >= 0 ms, got {value}")
    return slos


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers such as 50,90,99, got {text!r}") from None
    if not all(0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {text!r}")
    return values


def parse_metrics(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [n for n in names if n not in METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics are {', '.join(METRICS)}; got {', '.join(unknown)}")
    return names


def report_problems(records: list[RequestRecord], requests: list[TraceRequest]) -> None:
    """Failures grouped by message, and completed requests whose token count differs from the request's."""
    errors = Counter(r.error for r in records if not r.success)
    for message, count in errors.most_common(10):
        print(f"failed x{count}: {message}")
    short = sum(1 for r, q in zip(records, requests, strict=True) if r.success and r.output_len != q.output_len)
    if short:
        print(
            f"warning: {short} completed requests returned a different number of tokens than asked "
            "(does the server honour min_tokens and ignore_eos?)"
        )
