"""`jaxllm bench serve`: the result math on hand-made records, arrival schedules, datasets, the
streaming client against a scripted server, and a short run against a real `jaxllm serve`."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxllm.bench import datasets, serve
from jaxllm.bench.results import RequestRecord, format_result, per_request, records_from_result, summarize
from jaxllm.bench.server_process import ServerProcess, free_port
from jaxllm.entrypoints.cli import build_parser
from jaxllm.sim.trace import TraceRequest, prompt_token_ids, save_trace

REPO = Path(__file__).resolve().parents[1]


def bench_args(*flags: str):
    return build_parser().parse_args(["bench", "serve", "--disable-tqdm", *flags])


# ---- result math ------------------------------------------------------------------------------


def hand_made_records():
    return [
        # sent at 0 s: first token at 0.1 s, three more 0.05 s apart → E2E 0.25 s, TPOT 0.05 s
        RequestRecord(
            prompt_len=10, output_len=4, start=0.0, ttft=0.1, itl=[0.05, 0.05, 0.05], latency=0.25, success=True
        ),
        # sent at 0.5 s: slow first token (0.4 s), one more after 0.2 s → E2E 0.6 s, TPOT 0.2 s
        RequestRecord(prompt_len=20, output_len=2, start=0.5, ttft=0.4, itl=[0.2], latency=0.6, success=True),
        # a single token: no TPOT, no ITL
        RequestRecord(prompt_len=5, output_len=1, start=1.0, ttft=0.3, latency=0.3, success=True),
        RequestRecord(prompt_len=7, start=1.2, error="HTTP 400: bad"),
    ]


def test_summary_math_on_hand_made_records():
    result = summarize(hand_made_records(), duration=2.0, goodput={"ttft": 350, "tpot": 100}, percentiles=(50, 99))
    assert result["completed"] == 3 and result["failed"] == 1
    assert result["total_input_tokens"] == 35 and result["total_output_tokens"] == 7
    assert result["request_throughput"] == pytest.approx(1.5)
    assert result["output_throughput"] == pytest.approx(3.5)
    assert result["total_token_throughput"] == pytest.approx(21.0)
    assert result["mean_ttft_ms"] == pytest.approx(800 / 3)
    assert result["median_ttft_ms"] == pytest.approx(300)
    assert result["p50_ttft_ms"] == pytest.approx(300)
    assert result["p99_ttft_ms"] == pytest.approx(np.percentile([100, 400, 300], 99))
    assert result["mean_tpot_ms"] == pytest.approx(125)  # (50 + 200) / 2: the one-token request has none
    assert result["mean_itl_ms"] == pytest.approx((50 * 3 + 200) / 4)
    assert result["median_e2el_ms"] == pytest.approx(300)
    # goodput: request 1 (ttft 100, tpot 50) and 3 (ttft 300, no tpot) meet both SLOs; 2 misses ttft
    assert result["request_goodput"] == pytest.approx(2 / 2.0)
    # peaks: tokens at 0.1 0.15 0.2 0.25 0.9 1.1 1.3 → 5 in second 0, 2 in second 1; request 2 overlaps 3
    assert result["max_output_tokens_per_s"] == 5
    assert result["max_concurrent_requests"] == 2
    table = format_result(result)
    assert "Successful requests:" in table and "P99 TTFT (ms):" in table and "P50 E2EL (ms):" in table


def test_records_survive_the_result_json():
    records = hand_made_records()
    result = json.loads(json.dumps(per_request(records)))
    assert records_from_result(result) == records
    assert records[0].token_times == pytest.approx([0.1, 0.15, 0.2, 0.25])


def test_goodput_and_percentile_flags_are_checked():
    assert serve.parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad, message in ((["ttft=5"], "KEY:MS"), (["itl:5"], "ttft, tpot and e2el"), (["e2el:-1"], ">= 0")):
        with pytest.raises(ValueError, match=message):
            serve.parse_goodput(bad)
    with pytest.raises(ValueError, match="--metric-percentiles"):
        serve.parse_percentiles("99,abc")
    with pytest.raises(ValueError, match="--percentile-metrics"):
        serve.parse_metrics("ttft,latency")


# ---- arrivals and datasets --------------------------------------------------------------------


def test_poisson_schedule_is_seeded_with_the_right_mean_rate():
    requests = datasets.random_requests(4000, input_len=8, output_len=4)
    timed = datasets.retime(requests, 8.0, seed=3)
    times = np.array([r.arrival_time for r in timed])
    assert times[0] == 0 and np.all(np.diff(times) >= 0)
    gaps = np.diff(times)
    assert len(timed) / times[-1] == pytest.approx(8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)  # exponential gaps: CV 1
    assert [r.arrival_time for r in datasets.retime(requests, 8.0, seed=3)] == times.tolist()
    assert [r.arrival_time for r in datasets.retime(requests, 8.0, seed=4)] != times.tolist()
    assert {r.arrival_time for r in datasets.retime(requests, math.inf)} == {0.0}
    # lengths never depend on the rate: the same seed gives the same prompts at any rate
    assert [r.prompt_len for r in timed] == [r.prompt_len for r in requests]


def test_random_dataset_lengths():
    fixed = datasets.random_requests(50, input_len=100, output_len=20, seed=1)
    assert {r.prompt_len for r in fixed} == {100} and {r.output_len for r in fixed} == {20}
    spread = datasets.random_requests(500, input_len=100, output_len=20, range_ratio=0.5, seed=1)
    inputs = np.array([r.prompt_len for r in spread])
    assert inputs.min() >= 50 and inputs.max() <= 150 and inputs.std() > 20
    assert [len(prompt_token_ids(r, i, 1)) for i, r in enumerate(spread[:5])] == inputs[:5].tolist()
    with pytest.raises(ValueError, match="--random-range-ratio"):
        datasets.random_requests(5, input_len=10, output_len=5, range_ratio=1.0)
    with pytest.raises(ValueError, match="--random-input-len"):
        datasets.random_requests(5, input_len=0, output_len=5)


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "trace.jsonl"
    save_trace(
        [
            TraceRequest(arrival_time=0.5, prompt="Hello there", output_len=3),
            TraceRequest(arrival_time=0.1, prompt_len=12, output_len=4, user="a"),
        ],
        path,
    )
    args = bench_args("--dataset-name", "jsonl", "--dataset-path", str(path))
    trace = datasets.get_requests(args)
    assert [r.arrival_time for r in trace] == [0.1, 0.5] and trace[0].prompt_len == 12
    assert (
        len(
            datasets.get_requests(
                bench_args("--dataset-name", "jsonl", "--dataset-path", str(path), "--num-prompts", "1")
            )
        )
        == 1
    )
    with pytest.raises(ValueError, match="more than the 2 requests"):
        datasets.get_requests(bench_args("--dataset-name", "jsonl", "--dataset-path", str(path), "--num-prompts", "3"))
    with pytest.raises(ValueError, match="--dataset-path"):
        datasets.get_requests(bench_args("--dataset-name", "jsonl"))
    with pytest.raises(FileNotFoundError):
        datasets.get_requests(bench_args("--dataset-name", "jsonl", "--dataset-path", str(tmp_path / "none")))
    for line, message in (
        ('{"arrival_time": 0, "output_len": 2}', "exactly one of prompt"),
        ('{"arrival_time": 0, "prompt_len": 4, "output_len": 0}', "output_len must be"),
        ('{"arrival_time": 0, "prompt_len": 4, "output_len": 2, "colour": 1}', "unknown fields"),
        ("[1, 2]", "not a JSON object"),
        ("{oops", "Expecting"),
    ):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"arrival_time": 0, "prompt_len": 4, "output_len": 2}\n' + line + "\n")
        with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*{message}"):
            datasets.jsonl_requests(str(bad))


def test_request_body_replays_the_trace_exactly():
    body = serve.request_body(
        TraceRequest(arrival_time=0, prompt_len=9, output_len=5, priority=2, user="t"), 3, model="m", seed=7
    )
    assert body["prompt"] == prompt_token_ids(TraceRequest(arrival_time=0, prompt_len=9, output_len=5), 3, 7)
    assert body["max_tokens"] == body["min_tokens"] == 5 and body["ignore_eos"] and body["temperature"] == 0
    assert body["stream"] and body["stream_options"]["include_usage"]
    assert body["priority"] == 2 and body["user"] == "t"
    text = serve.request_body(TraceRequest(arrival_time=0, prompt="hi", output_len=2), 0, model="m")
    assert text["prompt"] == "hi" and "priority" not in text and "user" not in text


# ---- the client against a scripted server -----------------------------------------------------

FIRST_TOKEN_S, TOKEN_GAP_S = 0.12, 0.03


def scripted_app():
    """A tiny OpenAI streaming server with known timing. The prompt's first token id picks a behaviour:
    1 → 400 error JSON, 2 → the stream stops halfway without [DONE], 3 → tokens two per chunk and
    no per-chunk usage, 4 → hangs; anything else streams one token per chunk with continuous usage."""
    app = FastAPI()
    seen: list[dict] = []
    app.state.seen = seen

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        prompt, n = body["prompt"], body["max_tokens"]
        mode = prompt[0] if isinstance(prompt, list) else 0
        if mode == 1:
            return JSONResponse(
                {"error": {"message": "prompt too long", "type": "BadRequestError", "param": "prompt", "code": 400}},
                status_code=400,
            )
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())

        def chunk(text, finish, done_tokens, continuous=True):
            data = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
            if continuous:
                data["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": done_tokens}
            return f"data: {json.dumps(data)}\n\n"

        async def stream():
            if mode == 4:
                await asyncio.sleep(60)
            await asyncio.sleep(FIRST_TOKEN_S)
            if mode == 3:
                for i in range(0, n, 2):
                    if i:
                        await asyncio.sleep(2 * TOKEN_GAP_S)
                    yield chunk("ab", None, 0, continuous=False)
                yield chunk("", "length", 0, continuous=False)  # a finish marker carries no token
            else:
                for i in range(n):
                    if i:
                        await asyncio.sleep(TOKEN_GAP_S)
                    if mode == 2 and i == n // 2:
                        return
                    yield chunk("x", "length" if i == n - 1 else None, i + 1)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def scripted_server():
    import uvicorn

    app = scripted_app()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the scripted server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.config.port}", app.state.seen
    server.should_exit = True
    thread.join(timeout=10)


def scripted(url: str, prompt_first_token: int, output_len: int, timeout: float = 20.0):
    async def go():
        async with httpx.AsyncClient() as client:
            body = {"prompt": [prompt_first_token, 7, 7], "max_tokens": output_len}
            return await serve.stream_completion(
                client, url + "/v1/completions", body, {}, clock0=time.perf_counter(), timeout=timeout
            )

    return asyncio.run(go())


def test_client_times_tokens_and_counts_failures(scripted_server):
    url, _ = scripted_server
    ok = scripted(url, 9, 6)
    assert ok.success and ok.output_len == 6 and ok.prompt_len == 3 and len(ok.itl) == 5
    assert ok.ttft == pytest.approx(FIRST_TOKEN_S, abs=0.1) and ok.ttft >= FIRST_TOKEN_S
    assert ok.tpot == pytest.approx(TOKEN_GAP_S, abs=0.03)
    assert ok.latency == pytest.approx(ok.ttft + sum(ok.itl))
    two_per_chunk = scripted(url, 3, 6)  # no per-chunk usage: the final usage gives the count
    assert two_per_chunk.success and two_per_chunk.output_len == 6 and len(two_per_chunk.itl) == 2
    refused = scripted(url, 1, 6)
    assert not refused.success and refused.error == "HTTP 400: prompt too long"
    dropped = scripted(url, 2, 6)
    assert not dropped.success and "before data: [DONE]" in dropped.error and dropped.output_len == 3
    hung = scripted(url, 4, 2, timeout=0.5)
    assert not hung.success and "--timeout 0.5" in hung.error


def test_client_abort_and_tokens_per_chunk(scripted_server):
    url, _ = scripted_server

    async def go():
        async with httpx.AsyncClient() as client:
            return await serve.stream_completion(
                client, url + "/v1/completions", {"prompt": [9], "max_tokens": 4}, {}, abort_after=2
            )

    aborted = asyncio.run(go())
    assert not aborted.success and aborted.error == "aborted by the client after 2 tokens"
    assert serve._tokens_in({"choices": [{"text": "abc"}]}, {"completion_tokens": 5}, 2) == 3  # per-chunk usage
    assert serve._tokens_in({"choices": [{"text": "", "finish_reason": "stop"}]}, {}, 3) == 0  # finish marker
    assert serve._tokens_in({"choices": [{"text": "", "finish_reason": None}]}, {}, 3) == 1  # text held back
    assert serve._tokens_in({"choices": [], "usage": {"completion_tokens": 3}}, {"completion_tokens": 3}, 3) == 0


def test_bench_serve_end_to_end_on_the_scripted_server(scripted_server, tmp_path, capsys):
    url, seen = scripted_server
    seen.clear()
    result = serve.main(
        bench_args(
            "--base-url",
            url,
            "--num-prompts",
            "12",
            "--random-input-len",
            "16",
            "--random-output-len",
            "5",
            "--random-range-ratio",
            "0.5",
            "--request-rate",
            "40",
            "--seed",
            "2",
            "--max-concurrency",
            "4",
            "--goodput",
            "ttft:5000",
            "tpot:1000",
            "--metric-percentiles",
            "50,99",
            "--output",
            str(tmp_path / "r.json"),
            "--plot",
            str(tmp_path / "plots"),
        )
    )
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "model scripted" in printed
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 12 and saved["failed"] == 0 and saved["model_id"] == "scripted"
    assert saved["total_output_tokens"] == sum(b["max_tokens"] for b in seen) == sum(saved["output_lens"])
    assert saved["total_input_tokens"] == sum(len(b["prompt"]) for b in seen)
    assert saved["request_goodput"] == pytest.approx(saved["request_throughput"])
    for key in (
        "duration",
        "request_throughput",
        "output_throughput",
        "p50_ttft_ms",
        "p99_e2el_ms",
        "mean_itl_ms",
        "median_tpot_ms",
        "ttfts",
        "itls",
        "input_lens",
        "errors",
    ):
        assert key in saved
    assert saved["mean_ttft_ms"] >= FIRST_TOKEN_S * 1000
    assert all(b["min_tokens"] == b["max_tokens"] and b["ignore_eos"] for b in seen)
    for png in ("latency_cdf.png", "throughput.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"
    assert result["completed"] == 12


def test_bench_serve_cli_errors_are_one_line(scripted_server):
    url, _ = scripted_server
    port = free_port()  # nothing listens here
    for flags, message in (
        (["--base-url", f"http://127.0.0.1:{port}"], "cannot reach the server"),
        (["--base-url", url, "--goodput", "ttft"], "KEY:MS"),
        (["--base-url", url, "--request-rate", "0"], "--request-rate must be > 0"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "jaxllm.entrypoints.cli", "bench", "serve", *flags],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and message in result.stderr


def test_failed_requests_are_counted_not_fatal(scripted_server, tmp_path):
    url, _ = scripted_server
    trace = tmp_path / "t.jsonl"
    save_trace(
        [TraceRequest(arrival_time=0, prompt_token_ids=[first, 5, 5], output_len=4) for first in (9, 1, 2, 9)], trace
    )
    result = serve.main(bench_args("--base-url", url + "/v1/", "--dataset-name", "jsonl", "--dataset-path", str(trace)))
    assert result["completed"] == 2 and result["failed"] == 2
    assert result["errors"][1] == "HTTP 400: prompt too long" and result["errors"][0] == ""


# ---- a real `jaxllm serve` --------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    """`jaxllm serve` with the shared test engine shapes on a free loopback port."""
    from test_cli_and_examples import ENGINE_FLAGS

    with ServerProcess(ENGINE_FLAGS, log_path=tmp_path_factory.mktemp("serve") / "serve.log") as server:
        yield server


def test_bench_serve_against_a_real_server(real_server, tmp_path):
    result = serve.main(
        bench_args(
            "--base-url",
            real_server.url,
            "--num-prompts",
            "6",
            "--random-input-len",
            "24",
            "--random-output-len",
            "6",
            "--random-range-ratio",
            "0.5",
            "--request-rate",
            "20",
            "--max-concurrency",
            "4",
            "--seed",
            "1",
            "--goodput",
            "ttft:60000",
            "--output",
            str(tmp_path / "r.json"),
            "--plot",
            str(tmp_path / "plots"),
        )
    )
    asked = datasets.random_requests(6, input_len=24, output_len=6, range_ratio=0.5, seed=1)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 6 and saved["failed"] == 0, saved["errors"]
    assert saved["output_lens"] == [r.output_len for r in asked]  # min_tokens + ignore_eos: exact lengths
    assert saved["total_output_tokens"] == sum(r.output_len for r in asked)
    assert saved["input_lens"] == [r.prompt_len for r in asked]  # token-id prompts: exact lengths
    for key in (
        "duration",
        "request_throughput",
        "output_throughput",
        "request_goodput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "median_e2el_ms",
        "p99_e2el_ms",
    ):
        assert isinstance(saved[key], float) and saved[key] > 0, key
    assert all(
        len(itl) == n - 1 for itl, n in zip(saved["itls"], saved["output_lens"], strict=True)
    )  # one token per chunk
    for png in ("latency_cdf.png", "throughput.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"
    assert result["model_id"] == "SmolLM2-135M-Instruct"


def test_a_trace_with_text_and_a_refused_prompt(real_server, tmp_path):
    trace = tmp_path / "t.jsonl"
    save_trace(
        [
            TraceRequest(arrival_time=0.0, prompt="The capital of France is", output_len=4),
            TraceRequest(arrival_time=0.05, prompt_len=600, output_len=4),  # over max_model_len 512
            TraceRequest(arrival_time=0.1, prompt_len=20, output_len=5, prefix_group="g", prefix_len=16),
        ],
        trace,
    )
    result = serve.main(
        bench_args("--base-url", real_server.url, "--dataset-name", "jsonl", "--dataset-path", str(trace))
    )
    assert result["completed"] == 2 and result["failed"] == 1
    assert result["errors"][1].startswith("HTTP 400") and "512" in result["errors"][1]
    assert result["output_lens"][0::2] == [4, 5] and result["input_lens"][2] == 20
    assert result["input_lens"][0] > 0  # a text prompt's length is the server's count (usage.prompt_tokens)
    metrics = real_server.metrics()
    assert metrics["jaxllm:num_requests_running"] == metrics["jaxllm:num_requests_waiting"] == 0


def test_ctrl_c_ends_a_run_with_streams_open(scripted_server, tmp_path):
    url, _ = scripted_server
    trace = tmp_path / "hang.jsonl"
    save_trace([TraceRequest(arrival_time=0, prompt_token_ids=[4, 5], output_len=2)] * 3, trace)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxllm.entrypoints.cli",
            "bench",
            "serve",
            "--base-url",
            url,
            "--dataset-name",
            "jsonl",
            "--dataset-path",
            str(trace),
            "--disable-tqdm",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        # a shell's background job ignores SIGINT, and a child would inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while "Benchmarking" not in (line := process.stdout.readline()):
        assert line and time.monotonic() < deadline, process.stderr.read()
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    try:
        assert process.wait(timeout=15) == 130
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(
            f"bench serve still running 15 s after Ctrl-C:\n{process.communicate()[1][-3000:]}"
        ) from None
