"""Router policies for N equal instances: each policy's choice on crafted states (no HTTP), then `jaxllm router
--instances` against fake instances that publish real KV events over ZeroMQ: a conversation's turns follow its
history, a saturated replica sheds load, a killed or hung instance leaves rotation while other requests complete."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from jaxllm.entrypoints.router.app import build_balanced_app
from jaxllm.entrypoints.router.balancer import block_hashes
from jaxllm.kv_events.events import BlockStored, EventBatch
from jaxllm.kv_events.index import InstanceView, PrefixIndex
from jaxllm.kv_events.publisher import KVEventCollector, ZmqEventPublisher
from jaxllm.routing.base import RoutingPolicy
from jaxllm.routing.registry import load_policy
from jaxllm.routing.view import ClusterView, InstanceState, RouteRequest
from tests.served_app import Served

ROOT = "ab" * 32
H = [bytes([i]) * 32 for i in range(8)]


def states(*loads: int) -> list[InstanceState]:
    return [InstanceState(f"i{n}", running=load) for n, load in enumerate(loads)]


def store(index: PrefixIndex, instance: str, hashes: list[bytes], scope: str = ROOT) -> None:
    index.apply(instance, EventBatch(0, events=[BlockStored(hashes, None, [], 4, None, scope, 0)]))


def test_round_robin_and_least_loaded():
    view = ClusterView(states(0, 0, 0))
    rr = load_policy("round_robin")
    assert [rr.choose(RouteRequest(), view).name for _ in range(4)] == ["i0", "i1", "i2", "i0"]
    ll = load_policy("least_loaded")
    assert ll.choose(RouteRequest(), ClusterView(states(5, 2, 7))).name == "i1"
    view = ClusterView(states(1, 1, 3))
    assert {ll.choose(RouteRequest(), view).name for _ in range(4)} == {"i0", "i1"}  # ties in turn
    busy = states(0, 0)
    busy[0].waiting, busy[0].dispatched = 2, 1  # running + waiting + sent since its last report
    assert busy[0].load == 3 and ll.choose(RouteRequest(), ClusterView(busy)).name == "i1"


def test_session_affinity_is_sticky_and_moves_only_a_lost_instances_sessions():
    policy = load_policy("session")
    view = ClusterView(states(0, 0, 0, 0))
    chosen = {s: policy.choose(RouteRequest(session=s), view).name for s in (f"user-{k}" for k in range(40))}
    assert len(set(chosen.values())) == 4  # spread
    assert all(policy.choose(RouteRequest(session=s), view).name == name for s, name in chosen.items())
    fewer = ClusterView([s for s in view.instances if s.name != "i2"])
    for session, name in chosen.items():
        again = policy.choose(RouteRequest(session=session), fewer).name
        assert again == name if name != "i2" else again != "i2"
    assert policy.choose(RouteRequest(), ClusterView(states(3, 1, 2))).name == "i1"  # no session: least loaded


def test_prefix_aware_longest_match_ties_thresholds_and_scope():
    index = PrefixIndex()
    store(index, "i0", H[:2])
    store(index, "i1", H[:6])
    store(index, "i2", H[:6])
    policy = load_policy("prefix_aware")
    request = RouteRequest(H[:8], ROOT)
    assert policy.choose(request, ClusterView(states(0, 5, 3), index)).name == "i2"  # longest; tie: less loaded
    assert policy.choose(request, ClusterView(states(0, 2, 3), index)).name == "i1"
    # saturated: the spread (40 - 0) exceeds 32 and 1.0001 x 0: the least loaded, whatever it holds
    assert policy.choose(request, ClusterView(states(0, 40, 40), index)).name == "i0"
    # a match under half of the request's blocks: the least loaded
    assert (
        policy.choose(RouteRequest(H[:2] + H[6:8] + [b"x" * 32] * 4, ROOT), ClusterView(states(9, 1, 2), index)).name
        == "i1"
    )
    # another KV scope (another model, dtype, block size...) matches nothing
    assert policy.choose(RouteRequest(H[:8], "cd" * 32), ClusterView(states(4, 1, 2), index)).name == "i1"
    # an instance out of rotation is never chosen, however much it holds
    assert policy.choose(request, ClusterView(states(0, 0, 0)[:1], index)).name == "i0"


class Nearest(RoutingPolicy):
    """A user's policy: the instance whose name sorts first."""

    name = "nearest"

    def choose(self, request, view):
        return min(view.instances, key=lambda s: s.name)


def test_a_policy_loads_from_a_dotted_path():
    policy = load_policy("tests.test_routing:Nearest")
    assert (
        type(policy).__name__ == "Nearest"
        and policy.choose(RouteRequest(), ClusterView(states(0, 0)[::-1])).name == "i0"
    )
    with pytest.raises(ValueError, match="not a subclass of jaxllm.routing.base.RoutingPolicy"):
        load_policy("tests.test_routing:states")


# ---- the router over HTTP ---------------------------------------------------------------------------------

BLOCK = 4


class FakeInstance:
    """A stand-in for `jaxllm serve` with KV events: it tokenizes a prompt as its characters' codes, "caches" each
    prompt's full blocks when it answers (publishing BlockStored on its own ZeroMQ socket), reports a settable
    load in /metrics, and can hang."""

    def __init__(self, name: str):
        self.name = name
        self.running = 0
        self.served_prompts: list[str] = []
        self.hang = threading.Event()
        self.hang_mid_stream = False
        self.publisher = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=100)
        self.collector = KVEventCollector(self.publisher, block_size=BLOCK, scope=ROOT)
        app = FastAPI()
        app.post("/v1/completions")(self.complete)
        app.post("/tokenize")(self.tokenize)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics)
        app.get("/v1/kv_cache_info")(self.kv_cache_info)
        self.served = Served(app)
        self.url = self.served.url

    @staticmethod
    def tokens(prompt: str) -> list[int]:
        return [ord(c) for c in prompt]

    async def wait_while_hung(self):
        while self.hang.is_set():
            await asyncio.sleep(0.01)

    async def complete(self, raw: Request):
        body = await raw.json()
        await self.wait_while_hung()
        self.served_prompts.append(body["prompt"])
        tokens = self.tokens(body["prompt"])
        hashes = block_hashes(tokens, BLOCK, ROOT)
        if hashes:
            self.collector.pending.append(BlockStored(hashes, None, tokens[: len(hashes) * BLOCK], BLOCK, None, ROOT))
            self.collector.flush()
        if body.get("stream"):
            return StreamingResponse(self.stream(), media_type="text/event-stream")
        return {"id": "cmpl", "choices": [{"index": 0, "text": self.name}]}

    async def stream(self):
        yield f"data: {json.dumps({'choices': [{'index': 0, 'text': self.name}]})}\n\n"
        if self.hang_mid_stream:
            self.hang.set()  # it stops answering anything, its stream and /health alike
            await self.wait_while_hung()
        yield "data: [DONE]\n\n"

    async def tokenize(self, raw: Request):
        return {"tokens": self.tokens((await raw.json())["prompt"])}

    async def health(self):
        await self.wait_while_hung()
        return Response(status_code=200)

    async def metrics(self):
        return Response(f"# TYPE jaxllm:num_requests_running gauge\njaxllm:num_requests_running {self.running}\n")

    async def kv_cache_info(self):
        return {
            "block_size": BLOCK,
            "kv_scope_root": ROOT,
            "kv_events": {"publisher": "zmq", "endpoint": self.publisher.endpoint, "replay_endpoint": None},
        }

    def stop(self):
        self.hang.clear()
        self.served.stop()
        self.publisher.close()


@pytest.fixture
def cluster():
    fakes = [FakeInstance(f"I{i}") for i in range(3)]
    routers: list[Served] = []

    def router(policy: str, **kwargs) -> str:
        app = build_balanced_app([f.url for f in fakes], policy=policy, health_check_interval=0.2, **kwargs)
        routers.append(Served(app))
        wait_until(lambda: all(i.info is not None for i in app.state.balancer.instances))
        return routers[-1].url

    yield fakes, router
    for served in routers:
        served.stop()
    for fake in fakes:
        fake.stop()


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def refuses(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=0.5)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        pass
    return False


def complete(url: str, prompt: str, **headers) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, headers=headers, timeout=30)


def test_prefix_aware_follows_each_conversation_and_spreads_when_one_replica_is_saturated(cluster):
    fakes, router = cluster
    url = router("prefix_aware", policy_options={"balance_abs_threshold": 8})
    by_name = {f.name: f for f in fakes}
    conversations = [f"conversation {k}: " + "hello there, " * 3 for k in range(6)]
    first = {}
    for k, history in enumerate(conversations):
        first[k] = complete(url, history).json()["choices"][0]["text"]
    assert len(set(first.values())) == 3  # new conversations spread (no match: least loaded, in turn)

    def indexed(k: int) -> bool:  # the turn's blocks reached the router's index
        hashes = block_hashes(FakeInstance.tokens(conversations[k]), BLOCK, ROOT)
        return bool(app_index(url).match(hashes, scope=ROOT))

    wait_until(lambda: all(indexed(k) for k in range(6)))
    for turn in range(2):
        for k in range(6):
            conversations[k] += f" answer {turn}. and then? "
            assert complete(url, conversations[k]).json()["choices"][0]["text"] == first[k]  # where its history is
            wait_until(lambda k=k: indexed(k))

    # one replica saturated: its conversations go elsewhere until its load comes down
    busy = first[0]
    by_name[busy].running = 50
    time.sleep(0.6)  # a few health checks
    moved = [k for k in range(6) if first[k] == busy]
    for k in moved:
        conversations[k] += " more "
        assert complete(url, conversations[k]).json()["choices"][0]["text"] != busy
    by_name[busy].running = 0


ROUTERS: dict[str, object] = {}


def app_index(url: str) -> PrefixIndex:
    return ROUTERS[url].app.state.balancer.index  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _remember_routers(monkeypatch):
    original = Served.__init__

    def init(self, app, **kwargs):
        original(self, app, **kwargs)
        if hasattr(app.state, "balancer"):
            self.app = app
            ROUTERS[self.url] = self

    monkeypatch.setattr(Served, "__init__", init)
    yield
    ROUTERS.clear()


def test_a_killed_instance_leaves_rotation_and_the_rest_complete(cluster):
    fakes, router = cluster
    url = router("round_robin")
    balancer = ROUTERS[url].app.state.balancer  # type: ignore[attr-defined]
    fakes[1].stop()
    wait_until(lambda: refuses(fakes[1].url))  # its socket closed (a loaded machine lets it linger a moment)
    started = time.monotonic()
    answers = [complete(url, f"request {i}") for i in range(9)]  # the first to reach it fails over at once
    assert all(a.status_code == 200 for a in answers), [(a.status_code, a.text[:200]) for a in answers]
    assert {a.json()["choices"][0]["text"] for a in answers} == {"I0", "I2"}
    wait_until(lambda: not balancer.instances[1].state.healthy, timeout=1.0)
    assert time.monotonic() - started < 5
    health = httpx.get(url + "/health").json()
    assert health["instances"][fakes[1].url] != "ok"


def test_a_hung_instance_fails_its_requests_fast_and_leaves_rotation(cluster):
    fakes, router = cluster
    url = router("least_loaded")
    balancer = ROUTERS[url].app.state.balancer  # type: ignore[attr-defined]
    for fake in fakes[1:]:
        fake.running = 5  # the least loaded is I0
    time.sleep(0.5)
    fakes[0].hang.set()
    started = time.monotonic()
    answer = complete(url, "stuck")
    assert answer.status_code == 503 and "stopped answering its health checks" in answer.text
    assert time.monotonic() - started < 3  # its health-check interval and timeout, not --timeout
    assert not balancer.instances[0].state.healthy
    assert complete(url, "next").json()["choices"][0]["text"] in ("I1", "I2")
    fakes[0].hang.clear()
    wait_until(lambda: balancer.instances[0].state.healthy)  # back in rotation once it answers


def test_a_stream_from_an_instance_that_hangs_mid_answer_ends_with_an_error(cluster):
    fakes, router = cluster
    url = router("round_robin")
    fakes[0].hang_mid_stream = True
    started = time.monotonic()
    body = {"prompt": "tell me", "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - started < 3  # a health check's interval and timeout, not --timeout
    assert json.loads(events[0][6:])["choices"][0]["text"] == "I0"
    assert "stopped answering its health checks" in json.loads(events[-1][6:])["error"]["message"]


def test_session_affinity_over_http(cluster):
    fakes, router = cluster
    url = router("session")
    names = {complete(url, f"q{i}", **{"X-Session-Id": "alice"}).json()["choices"][0]["text"] for i in range(5)}
    assert len(names) == 1
    by_user = {
        httpx.post(url + "/v1/completions", json={"prompt": "q", "user": "bob"}).json()["choices"][0]["text"]
        for _ in range(3)
    }
    assert len(by_user) == 1


# ---- the same policies in front of data-parallel replicas ------------------------------------------------------


def test_data_parallel_replicas_are_chosen_by_a_router_policy():
    """`data_parallel_policy="prefix_aware"`: the DP front (its replicas here two pipes a test writes to, as replica
    processes do) feeds its prefix index from the replicas' KV events and its loads from their stats, and sends a
    prompt to the replica holding its prefix."""
    import multiprocessing

    from jaxllm.engine.core_client import EngineInfo
    from jaxllm.engine.dp_client import DataParallelClient, _Replica
    from jaxllm.kv_events.subscriber import EventSequencer
    from jaxllm.sampling_params import SamplingParams

    client = object.__new__(DataParallelClient)
    client._lock = threading.Lock()
    client._owner = {}
    client._next_start = 0
    client.policy = load_policy("prefix_aware")
    client.index = PrefixIndex()
    client.info = EngineInfo("m", None, 128, 4, 96, block_size=BLOCK, kv_scope_root=ROOT)
    client._on_outputs = lambda *a: None
    replica_ends = []
    client.replicas = []
    for i in range(2):
        ours, theirs = multiprocessing.Pipe()
        replica = _Replica(i, None, ours, {"num_running": 0, "num_waiting": 0})  # type: ignore[arg-type]
        replica.events = EventSequencer(InstanceView(client.index, str(i)))
        client.replicas.append(replica)
        replica_ends.append(theirs)
        threading.Thread(target=client._read, args=(replica,), daemon=True).start()
    prompt = list(range(1, 18))  # 4 full blocks
    hashes = block_hashes(prompt, BLOCK, ROOT)
    stored = BlockStored(hashes, None, prompt[:16], BLOCK, None, ROOT)
    replica_ends[1].send(("step", [], 0.0, {"num_running": 1, "num_waiting": 0}, [EventBatch(0, events=[stored])]))
    wait_until(lambda: client.index.match(hashes, scope=ROOT) == {"1": 4})
    sent = []
    client._send = lambda replica, message: sent.append(replica.index)  # type: ignore[method-assign]
    for n in range(3):
        client.add_request(f"r{n}", prompt, SamplingParams())
    assert sent == [1, 1, 1]  # its prefix is there, though replica 0 is idle
    client.add_request("other", [90] * 17, SamplingParams())
    assert sent[-1] == 0  # no prefix anywhere: the least loaded
    for replica in client.replicas:
        replica.alive = False  # (shut down on purpose: its reader ends quietly)
    for end in replica_ends:
        end.close()


def test_a_client_leaving_mid_stream_leaves_no_read_of_the_instance_behind():
    """The client goes while the router waits for the instance's next chunk (often just after the last one):
    that read is cancelled with it, not left to finish unobserved ("Task exception was never retrieved")."""
    from jaxllm.entrypoints.router.balancer import Instance, WatchedResponse
    from jaxllm.routing.view import InstanceState

    async def scenario() -> set:
        never = asyncio.Event()

        async def body():
            yield b"data: one\n\n"
            await never.wait()  # the instance's next chunk does not come

        upstream = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())
        down = asyncio.Event()
        response = WatchedResponse(
            upstream, on_close=lambda outcome: None, down=down, instance=Instance(InstanceState("i"))
        )
        chunks = response._chunks()
        assert await chunks.__anext__() == b"data: one\n\n"
        reading = asyncio.ensure_future(chunks.__anext__())
        await asyncio.sleep(0.05)
        before = asyncio.all_tasks() - {asyncio.current_task(), reading}
        reading.cancel()  # the client left
        await asyncio.gather(reading, return_exceptions=True)
        await asyncio.sleep(0.05)
        return {t for t in before if not t.done()}

    assert asyncio.run(scenario()) == set()
