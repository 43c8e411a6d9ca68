"""`jaxllm router` against fake instances: small FastAPI apps under uvicorn on threads, no model.

Each fake records what it received and answers as a test tells it (a status, held answers, a stream
that breaks off), so the tests can check both phases' bodies, the choice of instance, the fallbacks
and what reaches the client.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from jaxllm.entrypoints.router.app import build_app
from jaxllm.entrypoints.router.instances import InstancePool
from tests.served_app import Served

KV_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False}


def sse(name: str, i: int) -> str:
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': f'{name}-{i}'}]})}\n\n"


def expected_stream(name: str, chunks: int = 3) -> str:
    return "".join(sse(name, i) for i in range(chunks)) + "data: [DONE]\n\n"


class Fake:
    """A stand-in for `jaxllm serve`, prefill or decode: it answers completions with its name as the
    text and `kv_transfer_params`, streams `chunks` events when asked to stream, and records requests."""

    def __init__(self, name: str):
        self.name = name
        self.reset()
        app = FastAPI()
        app.post("/v1/completions")(self.generate)
        app.post("/v1/chat/completions")(self.generate)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        self.served = Served(app)
        self.url = self.served.url

    def reset(self):
        self.received: list[tuple[str, dict, dict]] = []  # (path, body, headers)
        self.status = 200
        self.health_status = 200
        # what a producer answers (a consumer reads do_remote_prefill and the rest)
        self.kv_transfer_params: dict | None = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.name,
            "remote_block_ids": [3, 4],
        }
        self.released = threading.Event()  # cleared: answers (and streams after their first event) wait
        self.released.set()
        self.disconnected = threading.Event()
        self.break_stream = False

    @property
    def bodies(self) -> list[dict]:
        return [body for _, body, _ in self.received]

    async def generate(self, raw: Request):
        body = await raw.json()
        self.received.append((raw.url.path, body, dict(raw.headers)))
        if self.status >= 400:
            error = {"error": {"message": f"{self.name} refuses", "type": "invalid_request_error", "param": "x"}}
            return JSONResponse(error, status_code=self.status)
        if body.get("stream"):
            return StreamingResponse(self.stream(), media_type="text/event-stream")
        while not self.released.is_set():
            if await raw.is_disconnected():
                self.disconnected.set()
                return Response(status_code=499)
            await asyncio.sleep(0.01)
        answer = {"id": "cmpl-1", "choices": [{"index": 0, "text": self.name}]}
        return {**answer, "kv_transfer_params": self.kv_transfer_params}

    async def stream(self):
        try:
            for i in range(3):
                yield sse(self.name, i)
                while not self.released.is_set():
                    await asyncio.sleep(0.01)
                if self.break_stream:
                    raise RuntimeError("the fake breaks off")
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            self.disconnected.set()
            raise

    async def models(self, raw: Request):
        self.received.append((raw.url.path, {}, dict(raw.headers)))
        return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": self.name}]}

    async def health(self):
        return Response(status_code=self.health_status)


def dead_url() -> str:
    """A URL nobody listens on: connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def fakes():
    made = {name: Fake(name) for name in ("P0", "P1", "D0", "D1")}
    yield made
    for fake in made.values():
        fake.served.stop()


@pytest.fixture
def P0(fakes):
    return fakes["P0"]


@pytest.fixture
def P1(fakes):
    return fakes["P1"]


@pytest.fixture
def D0(fakes):
    return fakes["D0"]


@pytest.fixture
def D1(fakes):
    return fakes["D1"]


@pytest.fixture(autouse=True)
def _reset(fakes):
    for fake in fakes.values():
        fake.reset()
    yield
    for fake in fakes.values():
        fake.released.set()  # let anything still held finish


@pytest.fixture
def router():
    """router(prefill, decode, timeout=...) starts a router over fakes (or URLs) and returns its URL."""
    started: list[Served] = []

    def start(prefill: list, decode: list, **kwargs) -> str:
        urls = [[x.url if isinstance(x, Fake) else x for x in group] for group in (prefill, decode)]
        served = Served(build_app(*urls, **kwargs))
        started.append(served)
        return served.url

    yield start
    for served in started:
        served.stop()


@pytest.fixture
def http():
    with httpx.Client(timeout=10, trust_env=False) as client:
        yield client


def metric(url: str, name: str, **labels: str) -> float | None:
    text = httpx.get(url + "/metrics", trust_env=False).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


COMPLETION = {"model": "m", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0.5}


# ---- the two phases ------------------------------------------------------------------------------


def test_completion_prefills_then_decodes_with_the_kv_params(router, http, P0, D0):
    url = router([P0], [D0])
    body = {**COMPLETION, "stream": False, "n": 1}
    r = http.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-1", "X-Request-Id": "r1"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "D0"

    [(path, prefill, prefill_headers)] = P0.received
    assert path == "/v1/completions"
    assert prefill == {**body, "max_tokens": 1, "stream": False, "n": 1, "kv_transfer_params": KV_REQUEST}
    [(path, decode, decode_headers)] = D0.received
    assert path == "/v1/completions"
    assert decode == {**body, "kv_transfer_params": P0.kv_transfer_params}
    assert decode["kv_transfer_params"]["remote_engine_id"] == "P0"
    for headers in (prefill_headers, decode_headers):
        assert headers["authorization"] == "Bearer sk-1"
        assert headers["x-request-id"] == "r1"


def test_chat_stream_is_passed_through_and_the_prefill_gets_one_token(router, http, P0, D0):
    url = router([P0], [D0])
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 20,
        "min_tokens": 4,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = http.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text == expected_stream("D0")

    [(path, prefill, headers)] = P0.received
    assert path == "/v1/chat/completions"
    assert prefill == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "n": 1,
        "stream": False,
        "kv_transfer_params": KV_REQUEST,
    }
    assert headers["x-request-id"]  # one made up when the client sent none
    assert D0.received[0][2]["x-request-id"] == headers["x-request-id"]
    assert D0.bodies == [{**body, "kv_transfer_params": P0.kv_transfer_params}]


def test_stream_events_arrive_as_the_decode_instance_sends_them(router, http, P0, D0):
    url = router([P0], [D0])
    D0.released.clear()  # D0 sends one event, then waits
    with http.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        chunks = r.iter_text()
        assert next(chunks) == sse("D0", 0)  # before the decode instance goes on: nothing is buffered
        D0.released.set()
        assert sse("D0", 0) + "".join(chunks) == expected_stream("D0")


def test_no_kv_params_from_the_prefill_means_none_sent_to_decode(router, http, P0, D0):
    url = router([P0], [D0])
    P0.kv_transfer_params = None
    client_params = {"kv_transfer_params": {"made_up": True}}  # the router owns the field
    assert http.post(url + "/v1/completions", json={**COMPLETION, **client_params}).status_code == 200
    assert P0.bodies[0]["kv_transfer_params"] == KV_REQUEST
    assert D0.bodies == [COMPLETION]


# ---- choosing instances -------------------------------------------------------------------------


def test_the_least_loaded_decode_instance_is_chosen(router, http, P0, D0, D1):
    url = router([P0], [D0, D1])
    D0.released.clear()
    with http.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True}) as held:
        events = held.iter_text()  # kept: an iterator dropped early closes the connection
        assert next(events) == sse("D0", 0)  # D0 (first in turn) is streaming and holds
        assert len(D0.received) == 1
        assert metric(url, "jaxllm:router_in_flight_requests", role="decode", instance=D0.url) == 1
        # round robin alone would give D0 one of these two; D0 has one in flight, D1 none
        for _ in range(2):
            assert http.post(url + "/v1/completions", json=COMPLETION).json()["choices"][0]["text"] == "D1"
        assert len(D0.received) == 1 and len(D1.received) == 2
        D0.released.set()
        assert sse("D0", 0) + "".join(events) == expected_stream("D0")
    wait_for(lambda: metric(url, "jaxllm:router_in_flight_requests", role="decode", instance=D0.url) == 0)
    # equally loaded: in turn
    texts = {http.post(url + "/v1/completions", json=COMPLETION).json()["choices"][0]["text"] for _ in range(2)}
    assert texts == {"D0", "D1"}


def test_pool_order():
    pool = InstancePool("decode", ["http://a:1", "http://b:2/", "http://c:3"])
    a, b, c = pool.instances
    assert b.url == "http://b:2"
    assert [pool.candidates()[0] for _ in range(4)] == [a, b, c, a]  # ties: round robin
    pool.acquire(a)
    pool.acquire(b)
    pool.acquire(b)
    assert pool.candidates() == [c, a, b]
    pool.failed(c, "refused")  # set aside: tried last, not dropped
    assert pool.candidates() == [a, b, c]
    pool.answered(c)
    assert pool.candidates()[0] is c
    with pytest.raises(ValueError, match="twice"):
        InstancePool("prefill", ["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="not an http"):
        InstancePool("decode", ["a:1"])
    with pytest.raises(ValueError, match="at least one decode"):
        InstancePool("decode", [])


# ---- failures ------------------------------------------------------------------------------------


def test_a_failed_prefill_instance_is_followed_by_the_next(router, http, P0, P1, D0):
    dead = dead_url()
    url = router([dead, P0], [D0])
    assert http.post(url + "/v1/completions", json=COMPLETION).status_code == 200
    assert D0.bodies[0]["kv_transfer_params"]["remote_engine_id"] == "P0"
    assert metric(url, "jaxllm:router_upstream_errors_total", role="prefill", instance=dead) == 1
    assert metric(url, "jaxllm:router_instance_up", role="prefill", instance=dead) == 0
    assert metric(url, "jaxllm:router_prefill_fallbacks_total") == 0

    # a timeout (P0 holds past --timeout) and a 5xx count as failures too
    url = router([P0, P1], [D0], timeout=0.3)
    P0.released.clear()
    P1.status = 503
    P0.received.clear()
    D0.received.clear()
    assert http.post(url + "/v1/completions", json=COMPLETION).status_code == 200
    assert len(P0.received) == 1 and len(P1.received) == 1
    assert D0.bodies == [COMPLETION]
    assert metric(url, "jaxllm:router_prefill_fallbacks_total") == 1


def test_no_prefill_instance_answering_falls_back_to_decode(router, http, D0, caplog):
    url = router([dead_url(), dead_url()], [D0])
    for stream in (False, True):
        r = http.post(url + "/v1/completions", json={**COMPLETION, "stream": stream})
        assert r.status_code == 200
    assert r.text == expected_stream("D0")
    assert D0.bodies == [{**COMPLETION, "stream": False}, {**COMPLETION, "stream": True}]  # no kv_transfer_params
    assert metric(url, "jaxllm:router_prefill_fallbacks_total") == 2
    assert metric(url, "jaxllm:router_requests_total", route="/v1/completions", outcome="success") == 2
    assert sum("no prefill instance answered" in m for m in caplog.messages) == 2


def test_a_prefill_4xx_goes_back_as_it_is(router, http, P0, P1, D0):
    url = router([P0, P1], [D0])
    P0.status = P1.status = 400
    r = http.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "P0 refuses", "type": "invalid_request_error", "param": "x"}}
    assert len(P0.received) == 1 and not P1.received and not D0.received  # neither retried nor decoded
    assert metric(url, "jaxllm:router_requests_total", route="/v1/completions", outcome="client_error") == 1


def test_a_decode_error_goes_back_as_it_is(router, http, P0, D0):
    url = router([P0], [D0])
    D0.status = 404
    for stream in (False, True):
        r = http.post(url + "/v1/chat/completions", json={"messages": [], "stream": stream})
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "D0 refuses"


def test_an_unreachable_decode_instance_is_followed_by_the_next_then_503(router, http, P0, D0):
    dead = dead_url()
    url = router([P0], [dead, D0])
    assert http.post(url + "/v1/completions", json=COMPLETION).json()["choices"][0]["text"] == "D0"

    url = router([P0], [dead, dead_url()])
    r = http.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == 503 and error["type"] == "server_error"
    assert "no decode instance could be reached" in error["message"] and dead in error["message"]
    assert metric(url, "jaxllm:router_requests_total", route="/v1/completions", outcome="unavailable") == 1
    assert metric(url, "jaxllm:router_in_flight_requests", role="decode", instance=dead) == 0


def test_a_stream_broken_upstream_ends_with_an_error_event(router, http, P0, D0):
    url = router([P0], [D0])
    D0.break_stream = True
    r = http.post(url + "/v1/completions", json={**COMPLETION, "stream": True})
    assert r.text.startswith(sse("D0", 0))
    last = r.text.strip().split("\n\n")[-1]
    assert json.loads(last.removeprefix("data: "))["error"]["code"] == 502
    assert metric(url, "jaxllm:router_requests_total", route="/v1/completions", outcome="upstream_error") == 1


def test_a_client_leaving_a_stream_closes_the_decode_stream(router, P0, D0):
    url = router([P0], [D0])
    D0.released.clear()
    with httpx.Client(timeout=10, trust_env=False) as client:
        with client.stream("POST", url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
            next(r.iter_text())
    assert D0.disconnected.wait(5)
    wait_for(lambda: metric(url, "jaxllm:router_requests_total", route="/v1/completions", outcome="aborted") == 1)
    assert metric(url, "jaxllm:router_in_flight_requests", role="decode", instance=D0.url) == 0


def test_a_client_leaving_before_the_answer_closes_the_call(router, P0, D0):
    url = router([P0], [D0])
    D0.released.clear()  # a non-streamed answer: nothing is sent until it is whole
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=COMPLETION, timeout=0.5, trust_env=False)
    assert D0.disconnected.wait(5)
    wait_for(lambda: metric(url, "jaxllm:router_in_flight_requests", role="decode", instance=D0.url) == 0)
    assert metric(url, "jaxllm:router_requests_total", route="/v1/completions", outcome="aborted") == 1


def test_a_body_that_is_not_a_json_object_is_a_400(router, http, P0, D0):
    url = router([P0], [D0])
    for content in (b"{not json", b"[1, 2]", b""):
        r = http.post(url + "/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert not P0.received and not D0.received


# ---- other routes ------------------------------------------------------------------------------


def test_models_come_from_a_decode_instance(router, http, P0, D0):
    url = router([P0], [dead_url(), D0])
    r = http.get(url + "/v1/models", headers={"Authorization": "Bearer sk-2"})
    assert r.status_code == 200 and r.json()["data"][0]["owned_by"] == "D0"
    assert D0.received[0][2]["authorization"] == "Bearer sk-2"


def test_health_needs_one_decode_instance(router, http, P0, D0, D1):
    dead = dead_url()
    url = router([P0, dead], [D0, D1])
    D0.health_status = 503
    r = http.get(url + "/health")
    assert r.status_code == 200
    report = r.json()
    assert report["decode"] == {D0.url: "HTTP 503", D1.url: "ok"}
    assert report["prefill"][P0.url] == "ok" and report["prefill"][dead].startswith("ConnectError")
    D1.health_status = 500
    r = http.get(url + "/health")
    assert r.status_code == 503
    assert r.json()["error"]["code"] == 503 and "no decode instance answers /health" in r.json()["error"]["message"]
    assert http.get(router([P0], [dead]) + "/health").status_code == 503


def test_metrics(router, http, P0, D0):
    url = router([P0], [D0])
    http.post(url + "/v1/completions", json=COMPLETION)
    http.post(url + "/v1/chat/completions", json={"messages": [], "stream": True})
    assert metric(url, "jaxllm:router_requests_total", route="/v1/completions", outcome="success") == 1
    assert metric(url, "jaxllm:router_requests_total", route="/v1/chat/completions", outcome="success") == 1
    assert metric(url, "jaxllm:router_request_latency_seconds_count", route="/v1/completions") == 1
    assert metric(url, "jaxllm:router_prefill_latency_seconds_count") == 2
    assert metric(url, "jaxllm:router_prefill_fallbacks_total") == 0
    for role, fake in (("prefill", P0), ("decode", D0)):
        assert metric(url, "jaxllm:router_in_flight_requests", role=role, instance=fake.url) == 0
        assert metric(url, "jaxllm:router_instance_up", role=role, instance=fake.url) == 1
        assert metric(url, "jaxllm:router_upstream_errors_total", role=role, instance=fake.url) == 0


# ---- the command ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prefill", "http://127.0.0.1:1"], "both --prefill URL... and --decode URL..."),
        (["--prefill", "http://127.0.0.1:1", "--decode"], "argument --decode: expected at least one argument"),
        (["--decode", "http://127.0.0.1:1"], "both --prefill URL... and --decode URL..."),
        (["--instances", "http://a:1", "--decode", "http://b:2"], "does not go with --prefill/--decode"),
        (["--instances", "http://a:1", "--policy", "fastest"], "--policy 'fastest' is not one of round_robin"),
        (["--instances", "http://a:1", "--policy", "no.such:Policy"], "--policy 'no.such:Policy' cannot be loaded"),
        (["--instances", "http://a:1", "http://a:1"], "--instances names http://a:1 twice"),
        (["--instances", "http://a:1", "--kv-events", "tcp://a:1", "tcp://a:2"], "2 endpoints for 1 --instances"),
        (["--instances", "http://a:1", "--health-check-interval", "0"], "--health-check-interval must be more"),
        (["--prefill", "http://a:1", "--decode", "http://b:2", "--policy", "session"], "go with --instances"),
        (["--prefill", "http://127.0.0.1:1", "--decode", "127.0.0.1:2"], "--decode '127.0.0.1:2': not an http"),
        (["--prefill", "http://a:1", "--decode", "http://b:2", "--timeout", "0"], "--timeout must be more than 0"),
    ],
)
def test_the_command_refuses_bad_flags(args, message):
    result = subprocess.run(
        [sys.executable, "-m", "jaxllm.entrypoints.cli", "router", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.startswith("jaxllm router: error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
