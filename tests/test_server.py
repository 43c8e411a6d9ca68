"""The OpenAI-compatible server end to end: a real server on a loopback port, the official `openai`
client, raw HTTP for malformed requests, 64 concurrent streams with abandoned ones, metrics,
the API key and SIGTERM (a `jaxllm serve` subprocess)."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from jaxllm import RequestOutputKind, SamplingParams
from jaxllm.bench.server_process import free_port
from jaxllm.runner.compilations import compilation_count
from tests.conftest import TEST_ENGINE
from tests.inprocess_server import MODEL
from tests.test_cli_and_examples import ENGINE_FLAGS

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples in a Prometheus text page."""
    values = [float(m[1]) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} missing from /metrics"
    return sum(values)


def wait_idle(server, timeout=20.0) -> str:
    """Poll /metrics until nothing runs or waits and the KV cache is empty; return the page."""
    deadline = time.monotonic() + timeout
    while True:
        page = httpx.get(server.url + "/metrics").text
        busy = (
            metric(page, "jaxllm:num_requests_running"),
            metric(page, "jaxllm:num_requests_waiting"),
            metric(page, "jaxllm:kv_cache_usage_perc"),
        )
        if busy == (0, 0, 0):
            return page
        assert time.monotonic() < deadline, f"still busy: running, waiting, kv usage = {busy}"
        time.sleep(0.1)


# ---- generation through the official client -------------------------------------------------------


def test_greedy_text_equals_llm_generate(client, llm):
    prompts = ["The capital of France is", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    got = client.completions.create(
        model=MODEL, prompt=prompts, temperature=0, max_tokens=16, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == expected
    assert got.usage.completion_tokens == 32

    (chat_expected,) = llm.chat(QUESTION, params, use_tqdm=False)
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=16, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].message.content == chat_expected.outputs[0].text
    assert reply.usage.prompt_tokens == len(chat_expected.prompt_token_ids)
    streamed = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=16, extra_body={"ignore_eos": True}, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat_expected.outputs[0].text


def test_completions_n2_stop_seed_logprobs(client):
    kwargs = dict(
        model=MODEL, prompt="Count: one, two, three,", n=2, max_tokens=12, temperature=1.0, seed=7, logprobs=3
    )
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert first.choices[0].text != first.choices[1].text  # samples get their own seeds
    for choice in first.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
        assert "".join(lp.tokens) == choice.text
        assert all(len(top) >= 3 and v <= 0 for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert first.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)

    stream = client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    texts, usage = ["", ""], None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert texts == [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert usage.completion_tokens == first.usage.completion_tokens

    greedy = client.completions.create(model=MODEL, prompt="Count: one, two, three,", temperature=0, max_tokens=20)
    cut = greedy.choices[0].text.split(",")[0]
    stopped = client.completions.create(
        model=MODEL, prompt="Count: one, two, three,", temperature=0, max_tokens=20, stop=[","]
    )
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"


def test_chat_streams_n2_with_logprobs_and_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        n=2,
        max_tokens=10,
        seed=3,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, roles, finish, usage, tokens = ["", ""], set(), {}, None, [0, 0]
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            roles.add(c.delta.role)
            texts[c.index] += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                tokens[c.index] += len(c.logprobs.content)
                assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
            finish[c.index] = c.finish_reason or finish.get(c.index)
        usage = chunk.usage or usage
    assert "assistant" in roles and all(texts)
    assert set(finish.values()) <= {"stop", "length"} and len(finish) == 2
    assert usage.completion_tokens == sum(tokens) and usage.total_tokens == usage.prompt_tokens + sum(tokens)
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_completion_tokens=4, stop=["Paris"], temperature=0
    )
    assert reply.choices[0].finish_reason in ("stop", "length") and "Paris" not in reply.choices[0].message.content


def test_user_and_priority_reach_the_scheduler(server, client, monkeypatch):
    """`user` feeds the `fair` policy and `priority` the `priority` policy: both must reach the Request."""
    seen = []
    add = server.core.add_request
    monkeypatch.setattr(
        server.core,
        "add_request",
        lambda *a, **kw: (seen.append((kw.get("user"), kw.get("priority"))), add(*a, **kw))[1],
    )
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, user="tenant-a", extra_body={"priority": 3})
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, user="tenant-b")
    assert seen == [("tenant-a", 3), ("tenant-b", 0)]


def test_models_tokenize_detokenize_version_health(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == TEST_ENGINE["max_model_len"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    chat_tokens = httpx.post(server.url + "/tokenize", json={"messages": QUESTION}).json()
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert chat_tokens["count"] == reply.usage.prompt_tokens
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_tokenizer_info_is_vllms(server):
    """GET /tokenizer_info: the tokenizer's config, its class and the chat template, as lm-eval's remote
    tokenizer reads them (it needs `eos_token`)."""
    info = httpx.get(server.url + "/tokenizer_info").json()
    tokenizer = server.engine.tokenizer
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["eos_token"] == tokenizer.eos_token == "<|im_end|>" and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)


def test_truncate_prompt_tokens_and_request_id_are_honoured(server, client, monkeypatch):
    seen = []
    add = server.core.add_request
    monkeypatch.setattr(server.core, "add_request", lambda rid, *a, **kw: (seen.append(rid), add(rid, *a, **kw))[1])
    long = " ".join(["word"] * 600)  # longer than max_model_len: truncation keeps its end
    response = client.completions.create(
        model=MODEL, prompt=long, max_tokens=1, extra_body={"truncate_prompt_tokens": 5, "request_id": "mine"}
    )
    assert response.usage.prompt_tokens == 5 and seen == ["mine-0"]


def test_a_huge_prompt_is_refused_at_once_and_never_stalls_other_requests(server):
    """A prompt that cannot fit is refused from its length before it is tokenized, a body over the limit
    gets a 413, and tokenizing a long text (/tokenize has no length bound) runs off the event loop:
    a small request sent meanwhile is answered as fast as ever."""
    big = "word " * (1 << 20)  # 5 MiB, ~1M tokens
    too_big = json.dumps({**GOOD, "prompt": "x" * (17 << 20)}).encode()  # over the default 16 MiB limit
    cases = [  # (path, body, status, param)
        (C, {**GOOD, "prompt": big}, 400, "prompt"),
        (CHAT, {**GOOD_CHAT, "messages": [{"role": "user", "content": big}]}, 400, "messages"),
        (C, too_big, 413, None),
        ("/tokenize", {"prompt": big}, 200, None),
    ]

    async def timed(http, path, body):
        started = time.perf_counter()
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = await http.post(server.url + path, content=content, headers={"content-type": "application/json"})
        return response, time.perf_counter() - started

    async def main():
        small_latencies = []
        async with httpx.AsyncClient(timeout=120) as http:
            _, alone = await timed(http, C, GOOD)
            for path, body, status, param in cases:
                big_request = asyncio.create_task(timed(http, path, body))
                await asyncio.sleep(0.2)  # the big one is being read, refused or tokenized
                small, took = await timed(http, C, GOOD)
                assert small.status_code == 200
                small_latencies.append(took)
                response, big_took = await big_request
                assert response.status_code == status, response.text[:300]
                if status != 200:
                    assert response.json()["error"]["param"] == param and big_took < 5, big_took
                else:
                    assert response.json()["count"] > 1_000_000
        return alone, small_latencies

    alone, small_latencies = asyncio.run(main())
    assert max(small_latencies) < alone + 1.5, (alone, small_latencies)


def test_the_openai_client_example_runs(server):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import openai_client

    reply, completion = openai_client.main(server.url + "/v1")
    assert "Paris" in reply and completion


def test_async_llm_output_kinds_validation_and_leaving(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)  # the engine is bound to the server's loop
    engine = server.engine

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, engine._loop).result(timeout=120)

    async def collect(kind):
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=kind)
        return [out async for out in engine.generate("Once upon a time", params)]

    cumulative, delta, final = (run(collect(kind)) for kind in RequestOutputKind)
    assert len(final) == 1 and final[0].finished
    text = final[0].outputs[0].text
    assert [o.outputs[0].text for o in cumulative][-1] == text and len(cumulative) == 6
    assert "".join(o.outputs[0].text for o in delta) == text
    assert [len(o.outputs[0].token_ids) for o in delta] == [1] * 6

    async def bad(prompt, params=None):
        with pytest.raises(ValueError) as e:
            async for _ in engine.generate(prompt, params):
                pass
        return str(e.value)

    assert "max_model_len=512" in run(bad({"prompt_token_ids": [1] * 600}))
    assert "empty" in run(bad(""))
    assert "SamplingParams" in run(bad("hi", "not params"))

    async def leave():  # a consumer that stops early aborts its request
        async for _ in engine.generate("Tell me a story", SamplingParams(max_tokens=400, ignore_eos=True)):
            break

    run(leave())
    wait_idle(server, timeout=10)
    assert server.core.kv.num_free_blocks == server.core.kv.num_usable_blocks
    assert engine.stats()["num_unfinished_streams"] == 0


# ---- bad requests ----------------------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
GOOD_CHAT = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
LONG = " ".join(["word"] * 600)

BAD = [  # (path, body (bytes: sent raw), status, param)
    (C, b"{not json", 400, None),
    (C, b"", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, {"model": MODEL}, 400, "prompt"),
    (C, {**GOOD, "model": "gpt-4"}, 404, "model"),
    (C, {**GOOD, "prompt": ""}, 400, "prompt"),
    (C, {**GOOD, "prompt": []}, 400, "prompt"),
    (C, {**GOOD, "prompt": [[]]}, 400, "prompt"),
    (C, {**GOOD, "prompt": 42}, 400, "prompt"),
    (C, {**GOOD, "prompt": [10**9]}, 400, "prompt"),
    (C, {**GOOD, "prompt": LONG}, 400, "prompt"),
    (C, {**GOOD, "max_tokens": 600}, 400, "max_tokens"),
    (C, {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    (C, {**GOOD, "max_tokens": "8"}, 400, "max_tokens"),
    (C, {**GOOD, "max_tokens": 1.5}, 400, "max_tokens"),
    (C, {**GOOD, "temperature": -1}, 400, "temperature"),
    (C, {**GOOD, "temperature": "hot"}, 400, "temperature"),
    (C, {**GOOD, "top_p": 0}, 400, "top_p"),
    (C, {**GOOD, "top_p": 1.5}, 400, "top_p"),
    (C, {**GOOD, "top_k": -2}, 400, "top_k"),
    (C, {**GOOD, "min_p": 2}, 400, "min_p"),
    (C, {**GOOD, "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {**GOOD, "frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {**GOOD, "n": 0}, 400, "n"),
    (C, {**GOOD, "n": 1000}, 400, "n"),
    (C, {**GOOD, "logprobs": 21}, 400, "logprobs"),
    (C, {**GOOD, "logprobs": -1}, 400, "logprobs"),
    (C, {**GOOD, "stop": [""]}, 400, "stop"),
    (C, {**GOOD, "stop": 5}, 400, "stop"),
    (C, {**GOOD, "min_tokens": 5}, 400, "min_tokens"),
    (C, {**GOOD, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (C, {**GOOD, "seed": "abc"}, 400, "seed"),
    (C, {**GOOD, "stream": "yes"}, 400, "stream"),
    (C, {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {**GOOD, "echo": True, "max_tokens": -1}, 400, "max_tokens"),
    (C, {**GOOD, "response_format": {"type": "bogus"}}, 400, "response_format.type"),
    (C, {**GOOD, "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    (C, {**GOOD, "logit_bias": {"1": 500}}, 400, "logit_bias"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, {**GOOD_CHAT, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    (CHAT, {**GOOD_CHAT, "messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    (CHAT, {**GOOD_CHAT, "messages": "hi"}, 400, "messages"),
    (CHAT, {**GOOD_CHAT, "messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    (CHAT, {**GOOD_CHAT, "model": "nope"}, 404, "model"),
    (CHAT, {**GOOD_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {**GOOD_CHAT, "logprobs": True, "top_logprobs": 50}, 400, "logprobs"),
    (CHAT, {**GOOD_CHAT, "max_completion_tokens": 100000}, 400, "max_completion_tokens"),
    (CHAT, {**GOOD_CHAT, "tools": [{"type": "function"}]}, 400, "tools.0"),
    (C, {**GOOD, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    (CHAT, {**GOOD_CHAT, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    # known fields the server does not implement: refused, never ignored
    (C, {**GOOD, "best_of": 3}, 400, "best_of"),
    (C, {**GOOD, "use_beam_search": True}, 400, "use_beam_search"),
    (C, {**GOOD, "allowed_token_ids": [1, 2]}, 400, "allowed_token_ids"),
    (C, {**GOOD, "guided_decoding_backend": "xgrammar"}, 400, "guided_decoding_backend"),
    (C, {**GOOD, "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    (CHAT, {**GOOD_CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    (CHAT, {**GOOD_CHAT, "store": True}, 400, "store"),
    (CHAT, {**GOOD_CHAT, "modalities": ["text", "audio"]}, 400, "modalities"),
    (CHAT, {**GOOD_CHAT, "reasoning_effort": "high"}, 400, "reasoning_effort"),
    (CHAT, {**GOOD_CHAT, "service_tier": "flex"}, 400, "service_tier"),
    (CHAT, {**GOOD_CHAT, "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
    ("/tokenize", {"prompt": "a", "messages": QUESTION}, 400, "prompt"),
    ("/detokenize", {"tokens": [-5]}, 400, "tokens"),
    ("/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_openai_error_and_the_server_keeps_serving(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    good = httpx.post(server.url + (CHAT if path == CHAT else C), json=GOOD_CHAT if path == CHAT else GOOD)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-2)


# ---- load, aborts, metrics -------------------------------------------------------------------------


async def one_stream(url: str, i: int, abandon: bool, max_tokens: int) -> int | None:
    """Stream a completion; abandon it after its first tokens, or return its token count."""
    body = {
        "model": MODEL,
        "prompt": f"Story number {i}:",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", url + C, json=body) as response:
            assert response.status_code == 200
            chunks, usage, done = 0, None, False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                assert "error" not in event, event
                chunks += sum(1 for c in event["choices"] if c["text"])
                usage = event.get("usage") or usage
                if abandon and chunks >= 2:
                    return None  # leaves the stream: the connection closes mid-stream
    assert done
    return usage["completion_tokens"]


def test_64_streams_with_a_quarter_abandoned_leave_nothing_behind(server):
    max_tokens = 8
    before = compilation_count()

    async def main():
        return await asyncio.gather(*[one_stream(server.url, i, i % 4 == 0, max_tokens) for i in range(64)])

    results = asyncio.run(main())
    assert [r for r in results if r is not None] == [max_tokens] * 48
    page = wait_idle(server)
    assert server.core.kv.num_free_blocks == server.core.kv.num_usable_blocks
    assert metric(page, 'jaxllm:request_success_total{engine="0",finished_reason="abort",model_name="smol"}') >= 16
    assert compilation_count() == before, "no compilation while serving"


def test_a_client_that_leaves_a_plain_request_aborts_it(server):
    page = httpx.get(server.url + "/metrics").text
    aborted = metric(page, 'jaxllm:request_success_total{engine="0",finished_reason="abort",model_name="smol"}')
    body = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + C, json=body, timeout=1.0)
    page = wait_idle(server, timeout=10)  # 400 tokens would take far longer than this
    assert (
        metric(page, 'jaxllm:request_success_total{engine="0",finished_reason="abort",model_name="smol"}')
        == aborted + 1
    )
    assert server.core.kv.num_free_blocks == server.core.kv.num_usable_blocks


def test_the_engine_stats_a_scrape_sees_come_with_the_outputs_they_describe(server, client, monkeypatch):
    """A scrape must never see a request's blocks freed before its end is counted: the core's stats
    reach the event loop in the same hand-over as the outputs of the step they follow."""
    handed = []
    hand_over = server.engine.client._on_outputs
    monkeypatch.setattr(
        server.engine.client,
        "_on_outputs",
        lambda outputs, *rest: (handed.append((outputs, rest[-1])), hand_over(outputs, *rest)),
    )
    wait_idle(server)
    client.completions.create(model=MODEL, prompt="Count to ten:", max_tokens=5, extra_body={"ignore_eos": True})
    ((_, stats),) = [h for h in handed if any(o.finished for o in h[0])]
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0
    assert all(s is not None for _, s in handed), "every step's outputs carry the stats after it"


def test_metrics_have_vllms_names(server, client):
    client.completions.create(model=MODEL, prompt="Hi there", max_tokens=3)
    page = httpx.get(server.url + "/metrics").text
    for name in [
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
    ]:
        metric(page, f"jaxllm:{name}")
    for name in [
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ]:
        assert metric(page, f"jaxllm:{name}_count") > 0
    assert metric(page, "jaxllm:generation_tokens_total") >= 3 and metric(page, "jaxllm:prompt_tokens_total") > 0


def test_an_idle_engine_thread_sleeps(server):
    """No busy loop: the engine thread blocks on its command queue when nothing is in flight."""
    wait_idle(server)
    steps = server.engine.stats()["num_steps"]
    started = time.process_time()
    time.sleep(1.0)
    assert server.engine.stats()["num_steps"] == steps
    assert time.process_time() - started < 0.2  # CPU time of this whole process over one idle second


# ---- `jaxllm serve` as a user runs it: API key, SIGTERM ------------------------------------------------


def test_serve_enforces_the_api_key_and_exits_0_on_sigterm_mid_stream():
    port = free_port()
    env = {**os.environ, "JAXLLM_API_KEY": "sk-test", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "jaxllm.entrypoints.cli",
        "--log-level",
        "WARNING",
        "serve",
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--disable-ui",
        *ENGINE_FLAGS,
    ]
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(url + "/health").status_code == 200:  # /health needs no key
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/").status_code == httpx.get(url + "/ui").status_code == 404  # --disable-ui
        wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        keyed = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
        assert [m.id for m in keyed.models.list()] == [MODEL]
        assert keyed.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2

        streams = [
            keyed.completions.create(
                model=MODEL, prompt=f"Essay {i}:", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
            )
            for i in range(3)
        ]
        firsts = [next(iter(s)) for s in streams]  # all three are generating
        assert all(f.choices for f in firsts)
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert process.wait(timeout=10) == 0
        assert time.monotonic() - signalled < 10
        for s in streams:  # each in-flight stream ended (aborted), none hung
            reasons = [c.choices[0].finish_reason for c in s if c.choices]
            assert reasons[-1] == "abort"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
