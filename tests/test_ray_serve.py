"""jaxllm as a Ray Serve deployment, for real: a local Ray cluster, two replicas of the default
model behind Ray's HTTP proxy, the same OpenAI routes as `jaxllm serve`. Ray is an optional
extra (`pip install jaxllm[ray]`): CI installs it (.ci/run), a checkout without it skips this module."""

import asyncio
import re
import time

import pytest

serve = pytest.importorskip("ray.serve")

import httpx  # noqa: E402
import openai  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402

from jaxllm.bench.server_process import free_port  # noqa: E402
from jaxllm.integrations.ray_serve import REPLICA_HEADER, build_app, engine_args_from_dict  # noqa: E402
from tests import test_server  # noqa: E402
from tests.conftest import TEST_ENGINE, TEST_KV_BLOCKS, kv_bytes  # noqa: E402
from tests.inprocess_server import MODEL  # noqa: E402

ROUTED = "/routed"  # the second application: jaxllm's prefix_aware policy in front of its own two replicas
ENGINE = {
    **{k: v for k, v in TEST_ENGINE.items() if k != "progress"},
    "kv_cache_memory_bytes": kv_bytes(TEST_KV_BLOCKS),
}


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster serving two applications of two replicas each (Ray's routing at /, jaxllm's prefix_aware
    at /routed); yields the base URL and the processes Ray started."""
    port = free_port()
    # 4 logical CPUs: each of the four engine replicas reserves one (the routed app's ingress none)
    ray.init(num_cpus=4, object_store_memory=100 * 2**20, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(ENGINE, num_replicas=2, served_model_name=MODEL), name="jaxllm", route_prefix="/")
    routed = build_app(ENGINE, num_replicas=2, served_model_name=MODEL, policy="prefix_aware", name="routed")
    serve.run(routed, name="routed", route_prefix=ROUTED)
    processes = psutil.Process().children(recursive=True)
    yield f"http://127.0.0.1:{port}", processes
    if ray.is_initialized():  # test_teardown_leaves_no_ray_processes did not get to it
        serve.shutdown()
        ray.shutdown()


def test_greedy_outputs_equal_llm_generate(cluster, llm):
    """`jaxllm serve`'s own check (completions, chat, a streamed chat), through Ray."""
    url, _ = cluster
    test_server.test_greedy_text_equals_llm_generate(
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), llm
    )


def test_concurrent_requests_reach_both_replicas(cluster):
    url, _ = cluster

    async def send_all():
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 8, "temperature": 0}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(16)))

    responses = asyncio.run(send_all())
    assert [r.status_code for r in responses] == [200] * 16
    assert len({r.json()["choices"][0]["text"] for r in responses}) == 1  # greedy: every replica agrees
    assert len({r.headers[REPLICA_HEADER] for r in responses}) == 2


def test_bad_request_gets_openai_error(cluster):
    url, _ = cluster
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 100_000})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and "maximum context length is 512" in error["message"]
    assert httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "hi"}).status_code == 404
    assert httpx.get(url + "/health").status_code == 200  # the replicas still serve


def test_abandoned_stream_is_aborted_on_its_replica(cluster):
    """A client that leaves mid-stream: Ray's proxy passes the disconnect on, the replica aborts the
    request and frees its KV blocks (400 more tokens would keep it busy for a minute)."""
    url, _ = cluster
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        replica = response.headers[REPLICA_HEADER]
        for i, _ in enumerate(response.iter_lines()):
            if i == 3:
                break
    deadline = time.monotonic() + 20
    while True:  # /metrics answers for whichever replica Ray picks: wait for ours to report idle
        page = httpx.get(url + "/metrics")
        busy = [
            test_server.metric(page.text, f"jaxllm:{name}")
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        ]
        aborted = re.search(r'^jaxllm:request_success_total{[^}]*finished_reason="abort"[^}]*} (\S+)$', page.text, re.M)
        if page.headers[REPLICA_HEADER] == replica and busy == [0, 0, 0] and aborted and float(aborted[1]) >= 1:
            break
        assert time.monotonic() < deadline, f"replica {replica} still busy, or it did not abort the stream"
        time.sleep(0.1)


def test_dict_settings_as_serve_run_passes_them():
    args = engine_args_from_dict({"max_num_seqs": "8", "enable_prefix_caching": "false", "max_model_len": "none"})
    assert (args.max_num_seqs, args.enable_prefix_caching, args.max_model_len) == (8, False, None)
    with pytest.raises(ValueError, match="max_num_seqs must be int"):
        engine_args_from_dict({"max_num_seqs": "eight"})
    with pytest.raises(ValueError, match="unknown engine setting"):
        engine_args_from_dict({"max_num_seq": 8})
    with pytest.raises(ValueError, match="num_replicas must be int"):
        build_app({"num_replicas": "two"})
    with pytest.raises(ValueError, match="nnodes must be 1"):
        build_app({"nnodes": 2})
    with pytest.raises(ValueError, match="not both"):
        build_app({"num_replicas": "2", "autoscaling_config": '{"min_replicas": 1, "max_replicas": 2}'})


def test_routed_app_answers_as_llm_generate(cluster, llm):
    """jaxllm's policy in Ray: the ingress, the handle call and the streamed answer are the plain app's."""
    url, _ = cluster
    client = openai.OpenAI(base_url=url + ROUTED + "/v1", api_key="unused", max_retries=0)
    test_server.test_greedy_text_equals_llm_generate(client, llm)
    assert client.models.list().data[0].id == MODEL
    r = httpx.post(url + ROUTED + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 100_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_routed_app_sends_each_conversation_to_the_replica_holding_its_history(cluster):
    """prefix_aware from the replicas' KV events: a conversation's later turns (each prompt extends the last) go
    where its earlier turns' blocks are cached, however the two conversations' first turns were placed."""
    url, _ = cluster
    topics = {"a": "the history of the printing press", "b": "how bees find flowers and make honey"}
    replicas: dict[str, list[str]] = {k: [] for k in topics}
    prompts = {k: f"Here is a long talk about {t}. " * 6 for k, t in topics.items()}
    for turn in range(4):
        for key in topics:
            prompts[key] += f" Question {turn}: tell me more about {topics[key]}, part {turn}."
            body = {"model": MODEL, "prompt": prompts[key], "max_tokens": 2, "temperature": 0}
            r = httpx.post(url + ROUTED + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            replicas[key].append(r.headers[REPLICA_HEADER])
        time.sleep(1.5)  # the blocks' events reach the router (and the replicas' load their stats)
    for key, seen in replicas.items():
        assert len(set(seen[1:])) == 1 and seen[1] == seen[0], (key, seen)


def test_routed_app_bad_settings_fail_before_ray_starts_anything():
    with pytest.raises(ValueError, match="'nope'"):
        build_app(ENGINE, policy="nope")
    with pytest.raises(ValueError, match="not both"):
        build_app(ENGINE, policy="session", request_router=serve.config.RequestRouterConfig())


def test_teardown_leaves_no_ray_processes(cluster):
    """Last in the module: shut the cluster down and check every process it started is gone."""
    _, processes = cluster
    assert any("raylet" in " ".join(p.cmdline()) for p in processes if p.is_running())
    started = time.monotonic()
    serve.shutdown()  # the replicas' __del__ stops their engines
    ray.shutdown()
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert time.monotonic() - started < 30
