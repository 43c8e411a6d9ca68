"""Disaggregated prefill/decode end to end: real `jaxllm serve` processes with the TransferConnector.

One producer (`kv_producer`) and one consumer (`kv_consumer`, `pull_timeout_seconds` 5) behind `jaxllm router`
(in-process, on a thread), a second consumer with `kv_load_failure_policy: "fail"`, and a second producer that a
test kills. The reference is the plain offline engine (conftest's `llm`).

- Completions and chat, streamed and not, through the router: the text equals the single engine's.
- The consumer loads instead of prefilling: its `external_prefix_cache_hits` rises by (prompt tokens - 1) per
  request, and what the producer sends is what the consumer receives; also for concurrent requests, n=2,
  and prompts whose length is at or next to a block boundary (1 token: nothing to transfer).
- Faults end every request within its deadline, leave no block in use on either side, and the servers keep
  serving: a transfer id the producer never offered (timeout, recomputed), a producer killed during one pull
  and before another (both recomputed), the `fail` policy (a 500 naming the failed load), a producer whose KV
  scope differs (a 400 naming `block_size`), a prefill instance that is down (the router falls back to the
  decode instance), and a client that leaves during a pull (its blocks are held until the pull ends, and the
  idle engine keeps polling it until then).

Every prompt starts with its own words, so no two share a block: the consumer's own prefix cache never hits,
and each request's external hits are exactly its prompt's tokens but the last.
"""

from __future__ import annotations

import copy
import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest

from jaxllm import SamplingParams
from jaxllm.bench.server_process import ServerProcess, free_port
from jaxllm.bench.server_process import scrape_metrics as scrape
from tests.conftest import serve_flags
from tests.served_app import Served

pytestmark = pytest.mark.slow

MODEL = "smol"
MAX_TOKENS = 16
PULL_TIMEOUT_S = 5.0  # the consumer's pull_timeout_seconds
FAIL_PULL_TIMEOUT_S = 2.0  # the `fail` consumer's
SLACK_S = 30.0  # a fault's request ends within its pull timeout plus this (a busy 2-core machine)

ENGINE_FLAGS = [
    "--served-model-name",
    MODEL,
    "--disable-log-stats",
    *serve_flags(),
]
PRODUCER = {"kv_connector": "TransferConnector", "kv_role": "kv_producer"}
CONSUMER = {
    "kv_connector": "TransferConnector",
    "kv_role": "kv_consumer",
    "kv_connector_extra_config": {"pull_timeout_seconds": PULL_TIMEOUT_S},
}
FAILING_CONSUMER = {
    **CONSUMER,
    "kv_connector_extra_config": {"pull_timeout_seconds": FAIL_PULL_TIMEOUT_S},
    "kv_load_failure_policy": "fail",
}
PREFILL_ONLY = {"do_remote_decode": True, "do_remote_prefill": False}  # what the router asks a producer

PARAGRAPH = (
    "The river town grew slowly over three centuries. Its first settlers built mills along the water, then "
    "bridges, then a market square where farmers from the valley sold grain, wool and cheese every week. "
    "When the railway arrived, the old warehouses became workshops, and the workshops became factories that "
    "made tools, bicycles and later small engines. The town kept its narrow streets, its stone church and its "
    "library, which still holds the letters of the families who founded it. Today most people work in the "
    "hospital, the schools or the shops, and visitors come in summer to walk along the river and see the mills."
)

_counter = iter(range(10**6))


def new_prompt(tag: str) -> str:
    """A prompt of about 130 tokens (9 blocks) whose first block is its own: nothing else shares its blocks."""
    return f"Archive entry {next(_counter)} ({tag}). {PARAGRAPH}\nSummary:"


def new_chat(tag: str) -> list[dict]:
    """A conversation whose first block is its own (the template puts the system message first)."""
    return [
        {"role": "system", "content": f"Session {next(_counter)} ({tag}). You summarise texts in one sentence."},
        {"role": "user", "content": f"Summarise this text.\n\n{PARAGRAPH}"},
    ]


# ---- the servers --------------------------------------------------------------------------------------------


def serve(kv_config: dict, log_dir) -> ServerProcess:
    flags = [*ENGINE_FLAGS, "--kv-transfer-config", json.dumps(kv_config)]
    name = kv_config["kv_role"] + "-" + kv_config.get("kv_load_failure_policy", "recompute")
    return ServerProcess(
        flags,
        startup_timeout=600,
        log_path=log_dir / f"{name}-{secrets.token_hex(3)}.log",
        env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
    )


def start_router(prefill: list[str], decode: list[str]) -> Served:
    """`jaxllm router`'s app under uvicorn on a thread of the test process."""
    from jaxllm.entrypoints.router.app import build_app

    return Served(build_app(prefill, decode, timeout=120))


class Cluster:
    def __init__(self, producer, consumer, failing, victim, router, llm):
        self.producer, self.consumer, self.failing, self.victim = producer, consumer, failing, victim
        self.router, self.llm = router, llm

    def logs(self) -> str:
        parts = [f"--- {s.log_path.name}\n{s.log_tail(2000)}" for s in (self.producer, self.consumer, self.failing)]
        return "\n".join(parts)


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    """Four servers started at once (producer, consumer, `fail` consumer, a producer to kill), the router, and
    the offline engine (built while the servers compile)."""
    log_dir = tmp_path_factory.mktemp("disaggregated")
    started = time.monotonic()
    with ExitStack() as stack:
        servers = [serve(c, log_dir) for c in (PRODUCER, CONSUMER, FAILING_CONSUMER, PRODUCER)]
        for s in servers:
            stack.callback(s.stop)
        with ThreadPoolExecutor(len(servers)) as pool:
            futures = [pool.submit(s.__enter__) for s in servers]
            llm = request.getfixturevalue("llm")
            for f in futures:
                f.result()
        producer, consumer, failing, victim = servers
        router = start_router([producer.url], [consumer.url])
        stack.callback(router.stop)
        print(f"disaggregated: 4 servers and the offline engine ready in {time.monotonic() - started:.1f}s")
        yield Cluster(producer, consumer, failing, victim, router, llm)


# ---- helpers ------------------------------------------------------------------------------------------------


def reference(llm, prompt: str | None = None, messages: list[dict] | None = None) -> str:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    if messages is not None:
        (out,) = llm.chat(messages, params, use_tqdm=False)
    else:
        (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out.outputs[0].text


def body(prompt: str | None = None, messages: list[dict] | None = None, **extra) -> tuple[str, dict]:
    """(path, JSON body) of a greedy completion (`prompt`) or chat (`messages`)."""
    common = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **extra}
    if messages is not None:
        return "/v1/chat/completions", {"messages": messages, **common}
    return "/v1/completions", {"prompt": prompt, **common}


def post(url: str, path: str, payload: dict) -> tuple[httpx.Response, str, dict | None, float]:
    """(response, generated text, usage, seconds); a streamed answer's events are put together."""
    started = time.monotonic()
    response = httpx.post(url + path, json=payload, timeout=120)
    seconds = time.monotonic() - started
    if response.status_code != 200:
        return response, "", None, seconds
    if not payload.get("stream"):
        data = response.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return response, text, data.get("usage"), seconds
    text, usage = "", None
    for line in response.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        assert "error" not in event, event
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            text += (choice.get("delta", {}).get("content") or "") if "delta" in choice else choice.get("text", "")
    return response, text, usage, seconds


HITS = "jaxllm:external_prefix_cache_hits_total"
SENT = 'jaxllm:kv_transfer_bytes_total{direction="send"}'
RECEIVED = 'jaxllm:kv_transfer_bytes_total{direction="receive"}'
FAILURES = "jaxllm:kv_transfer_failures_total"
TIMEOUTS = 'jaxllm:kv_transfer_failures_total{reason="timeout"}'


def wait_idle(*servers: ServerProcess, timeout: float = 20.0) -> None:
    """Until nothing runs or waits on any of `servers` and no KV block is in use."""
    deadline = time.monotonic() + timeout
    for server in servers:
        while True:
            m = scrape(server.url)
            busy = tuple(
                m.get(f"jaxllm:{name}", 0.0)
                for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
            )
            if busy == (0, 0, 0):
                break
            assert time.monotonic() < deadline, f"{server.log_path.name}: running, waiting, KV usage = {busy}"
            time.sleep(0.1)


def prefill(producer: ServerProcess, path: str, payload: dict) -> dict:
    """A producer's kv_transfer_params for `payload`, asked as the router does."""
    ask = {**payload, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_ONLY}
    ask.pop("stream_options", None)
    response = httpx.post(producer.url + path, json=ask, timeout=120)
    assert response.status_code == 200, response.text
    params = response.json()["kv_transfer_params"]
    assert params and params["do_remote_prefill"] and params["remote_num_tokens"] > 0, params
    return params


def through_router(cluster: Cluster, *, stream: bool = False, chat: bool = False, tag: str = "") -> None:
    """One request through the router: the reference's text, and the consumer loaded every prompt token but
    the last (its hits rose by that much) from what the producer sent."""
    prompt, messages = (None, new_chat(tag)) if chat else (new_prompt(tag), None)
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    path, payload = body(prompt, messages, **extra)
    expected = reference(cluster.llm, prompt, messages)
    before_c, before_p = scrape(cluster.consumer.url), scrape(cluster.producer.url)
    response, text, usage, _ = post(cluster.router.url, path, payload)
    assert response.status_code == 200, response.text + cluster.logs()
    assert text == expected
    assert usage is not None and usage["completion_tokens"] == MAX_TOKENS
    assert 100 <= usage["prompt_tokens"] <= 300  # several blocks
    after_c, after_p = scrape(cluster.consumer.url), scrape(cluster.producer.url)
    assert after_c.get(HITS, 0) - before_c.get(HITS, 0) == usage["prompt_tokens"] - 1, cluster.logs()
    sent = after_p.get(SENT, 0) - before_p.get(SENT, 0)
    assert sent > 0
    assert after_c.get(RECEIVED, 0) - before_c.get(RECEIVED, 0) == sent


# ---- through the router -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_router_output_equals_single_engine(cluster, chat, stream):
    through_router(cluster, stream=stream, chat=chat, tag="router")
    wait_idle(cluster.producer, cluster.consumer)


def test_concurrent_requests_each_load_their_prompt(cluster):
    """Six requests at once through the router: each gets its own KV (the hits add up, the text is right)."""
    cases = [(new_prompt("concurrent"), None) for _ in range(3)] + [(None, new_chat("concurrent")) for _ in range(3)]
    expected = [reference(cluster.llm, p, m) for p, m in cases]
    before_c, before_p = scrape(cluster.consumer.url), scrape(cluster.producer.url)
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda c: post(cluster.router.url, *body(*c)), cases))
    for (response, text, _, _), want in zip(results, expected, strict=True):
        assert response.status_code == 200, response.text
        assert text == want
    after_c, after_p = scrape(cluster.consumer.url), scrape(cluster.producer.url)
    prompt_tokens = sum(usage["prompt_tokens"] for _, _, usage, _ in results)
    assert after_c.get(HITS, 0) - before_c.get(HITS, 0) == prompt_tokens - len(cases)
    assert after_c.get(RECEIVED, 0) - before_c.get(RECEIVED, 0) == after_p.get(SENT, 0) - before_p.get(SENT, 0) > 0
    wait_idle(cluster.producer, cluster.consumer)


@pytest.mark.parametrize("length", [1, 2, 16, 17, 18, 65, 400])
def test_prompt_lengths_around_block_boundaries(cluster, length):
    """Token-id prompts whose all-but-last tokens fill blocks exactly, or one token into the next, or none at all
    (a 1-token prompt: the producer offers nothing, and the consumer computes it)."""
    start = 1000 + 997 * next(_counter)  # a first token of its own: no block is shared
    ids = [(start + 7919 * i) % 40000 + 1000 for i in range(length)]
    (want,) = cluster.llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), False
    )
    before = scrape(cluster.consumer.url)
    response, text, usage, _ = post(cluster.router.url, *body(ids))
    assert response.status_code == 200, response.text
    assert usage["prompt_tokens"] == length
    assert text == want.outputs[0].text
    assert scrape(cluster.consumer.url).get(HITS, 0) - before.get(HITS, 0) == length - 1
    wait_idle(cluster.producer, cluster.consumer)


def test_n2_pulls_once(cluster):
    """n=2 on the decode instance: one pull, the second sample reads the first's blocks; no failed pull."""
    prompt = new_prompt("n=2")
    path, payload = body(prompt, n=2)
    before = scrape(cluster.consumer.url)
    response = httpx.post(cluster.router.url + path, json=payload, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    assert [c["text"] for c in data["choices"]] == [reference(cluster.llm, prompt)] * 2
    after = scrape(cluster.consumer.url)
    assert after.get(HITS, 0) - before.get(HITS, 0) == data["usage"]["prompt_tokens"] - 1
    assert after.get(FAILURES, 0) == before.get(FAILURES, 0)
    wait_idle(cluster.producer, cluster.consumer)


def test_client_leaving_during_a_pull_frees_the_blocks(cluster):
    """The client leaves while its request waits for a pull that never completes: once the pull's deadline has
    passed, no block is in use, with no other request needed to get there."""
    prompt = new_prompt("client leaves")
    path, payload = body(prompt)
    params = prefill(cluster.producer, path, payload)
    params["remote_transfer_id"] = (params["remote_transfer_id"] + 1) % 2**62  # never offered: hangs
    try:
        with pytest.raises(httpx.TimeoutException):  # the server aborts the request when the client leaves
            httpx.post(cluster.consumer.url + path, json={**payload, "kv_transfer_params": params}, timeout=1.0)
        time.sleep(PULL_TIMEOUT_S)
        wait_idle(cluster.consumer, timeout=5.0)
    finally:  # any request wakes the engine, which then ends the pull and frees the blocks: later tests start clean
        response, text, _, _ = post(cluster.consumer.url, *body(new_prompt("wake up")))
        assert response.status_code == 200, response.text
        wait_idle(cluster.producer, cluster.consumer)


# ---- faults -------------------------------------------------------------------------------------------------


def test_a_transfer_that_never_completes_times_out_and_recomputes(cluster):
    """An id the producer never offered: the pull times out after pull_timeout_seconds, the consumer computes the
    prompt itself (same text), and counts a timeout. A real transfer from the same producer that starts while the
    bad pull hangs still goes through."""
    prompt = new_prompt("never completes")
    path, payload = body(prompt)
    params = prefill(cluster.producer, path, payload)
    params["remote_transfer_id"] = (params["remote_transfer_id"] + 1) % 2**62  # never offered
    before = scrape(cluster.consumer.url)
    with ThreadPoolExecutor(1) as pool:
        bad = pool.submit(post, cluster.consumer.url, path, {**payload, "kv_transfer_params": params})
        time.sleep(1.0)  # the bad pull is pending now
        through_router(cluster, tag="beside a hanging pull")
        response, text, usage, seconds = bad.result()
    assert response.status_code == 200, response.text
    assert text == reference(cluster.llm, prompt)
    assert PULL_TIMEOUT_S <= seconds + 0.5 and seconds < PULL_TIMEOUT_S + SLACK_S, seconds
    after = scrape(cluster.consumer.url)
    assert after.get(TIMEOUTS, 0) - before.get(TIMEOUTS, 0) == 1
    wait_idle(cluster.producer, cluster.consumer)
    through_router(cluster, tag="after a timeout")


def test_b_producer_killed_recomputes(cluster):
    """A second producer answers two prefills, then is SIGKILLed: one pull is already waiting on it (its id was
    never offered, so it hangs until then), the other starts after the kill. Both end within the deadline, and
    the consumer computes both prompts itself."""
    cases = [new_prompt("killed producer, pending pull"), new_prompt("killed producer")]
    payloads = [body(p) for p in cases]
    params = [prefill(cluster.victim, path, payload) for path, payload in payloads]
    params[0]["remote_transfer_id"] = (params[0]["remote_transfer_id"] + 1) % 2**62  # hangs until the kill
    before = scrape(cluster.consumer.url)
    with ThreadPoolExecutor(2) as pool:
        path, payload = payloads[0]
        pending = pool.submit(post, cluster.consumer.url, path, {**payload, "kv_transfer_params": params[0]})
        time.sleep(1.0)  # the pull is pending now
        cluster.victim.process.kill()
        cluster.victim.process.wait(timeout=30)
        path, payload = payloads[1]
        results = [pending.result(), post(cluster.consumer.url, path, {**payload, "kv_transfer_params": params[1]})]
    for prompt, (response, text, _, seconds) in zip(cases, results, strict=True):
        assert response.status_code == 200, response.text
        assert text == reference(cluster.llm, prompt)
        assert seconds < PULL_TIMEOUT_S + SLACK_S, seconds
    after = scrape(cluster.consumer.url)
    assert after.get(FAILURES, 0) - before.get(FAILURES, 0) == 2
    assert after.get(HITS, 0) == before.get(HITS, 0)
    wait_idle(cluster.producer, cluster.consumer)
    through_router(cluster, tag="after a killed producer")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_c_fail_policy_fails_the_request_and_keeps_serving(cluster, stream):
    """`kv_load_failure_policy: "fail"`: a load that fails ends its request with an error saying so (a 500, or
    an error event once the stream has started); the server then serves plain and transferred requests alike."""
    prompt = new_prompt("fail policy")
    path, payload = body(prompt, stream=stream)
    params = prefill(cluster.producer, path, payload)
    params["remote_transfer_id"] = (params["remote_transfer_id"] + 1) % 2**62  # never offered
    before = scrape(cluster.failing.url)
    started = time.monotonic()
    response = httpx.post(cluster.failing.url + path, json={**payload, "kv_transfer_params": params}, timeout=120)
    seconds = time.monotonic() - started
    assert seconds < FAIL_PULL_TIMEOUT_S + SLACK_S, seconds
    if stream:
        assert response.status_code == 200
        errors = [
            json.loads(line[len("data: ") :])["error"]
            for line in response.text.splitlines()
            if line.startswith("data: {") and '"error"' in line
        ]
        assert len(errors) == 1, response.text
        message = errors[0]["message"]
    else:
        assert response.status_code == 500, response.text
        message = response.json()["error"]["message"]
    assert "loading the prompt's KV failed" in message and "timed out" in message, message
    assert scrape(cluster.failing.url).get(TIMEOUTS, 0) - before.get(TIMEOUTS, 0) == 1
    wait_idle(cluster.producer, cluster.failing)

    # still serving: a plain request, and a transfer that works
    response, text, _, _ = post(cluster.failing.url, path, {**payload, "stream": False})
    assert response.status_code == 200 and text == reference(cluster.llm, prompt), response.text
    other = new_prompt("fail policy, transferred")
    path, payload = body(other)
    before = scrape(cluster.failing.url)
    response, text, usage, _ = post(
        cluster.failing.url, path, {**payload, "kv_transfer_params": prefill(cluster.producer, path, payload)}
    )
    assert response.status_code == 200 and text == reference(cluster.llm, other), response.text
    assert scrape(cluster.failing.url).get(HITS, 0) - before.get(HITS, 0) == usage["prompt_tokens"] - 1
    wait_idle(cluster.producer, cluster.failing)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_d_a_producer_whose_kv_scope_differs_is_refused_by_name(cluster, stream):
    prompt = new_prompt("scope")
    path, payload = body(prompt, stream=stream)
    params = prefill(cluster.producer, path, payload)
    bad = copy.deepcopy(params)
    bad["kv_scope"]["block_size"] = 32
    before = scrape(cluster.consumer.url)
    response = httpx.post(cluster.consumer.url + path, json={**payload, "kv_transfer_params": bad}, timeout=60)
    if stream and response.status_code == 200:
        events = [json.loads(line[len("data: ") :]) for line in response.text.splitlines() if line[6:7] == "{"]
        message = next(e["error"]["message"] for e in events if "error" in e)
    else:
        assert response.status_code == 400, response.text  # refused as it arrives: the request's own fault
        message = response.json()["error"]["message"]
    assert "block_size" in message and "16" in message and "32" in message, message
    assert scrape(cluster.consumer.url).get(HITS, 0) == before.get(HITS, 0)
    wait_idle(cluster.producer, cluster.consumer)

    # the untouched params still work (the offer is still there), then a plain request through the router
    response, text, _, _ = post(cluster.consumer.url, path, {**payload, "kv_transfer_params": params})
    assert response.status_code == 200 and text == reference(cluster.llm, prompt), response.text
    wait_idle(cluster.producer, cluster.consumer)
    through_router(cluster, tag="after a scope mismatch")


def test_e_prefill_instance_down_falls_back_to_decode(cluster):
    """A router whose only prefill instance is down: the decode instance computes the prompt itself."""
    router = start_router([f"http://127.0.0.1:{free_port()}"], [cluster.consumer.url])  # nothing listens there
    try:
        for chat in (False, True):
            prompt, messages = (None, new_chat("fallback")) if chat else (new_prompt("fallback"), None)
            before = scrape(cluster.consumer.url)
            response, text, _, _ = post(router.url, *body(prompt, messages))
            assert response.status_code == 200, response.text
            assert text == reference(cluster.llm, prompt, messages)
            assert scrape(cluster.consumer.url).get(HITS, 0) == before.get(HITS, 0)  # nothing was transferred
        assert scrape(router.url).get("jaxllm:router_prefill_fallbacks_total") == 2
    finally:
        router.stop()
    wait_idle(cluster.producer, cluster.consumer)
    through_router(cluster, tag="after the fallback")
