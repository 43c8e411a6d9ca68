"""The cluster simulator against a small real cluster: two `jaxllm serve` instances of the default model (the test
shapes, KV events over ZeroMQ) behind `jaxllm router --policy prefix_aware`, a multi-turn trace replayed through
it, and the same trace in `jaxllm simulate --instances 2 --router prefix_aware` with the shipped cost model (the
same engine shapes). The prefix-cache hit rate is the routing's doing and must agree; latencies depend on this
machine's speed and load against the cost model's, and are compared by benchmarks/cluster_routing.py on a quiet
machine instead (docs/scaling.md, Routing measured)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from jaxllm.bench.server_process import ServerProcess, free_port, scrape_metrics
from jaxllm.entrypoints.cli import main
from jaxllm.routing.registry import load_policy
from jaxllm.sim.calibrate import sim_config_for
from jaxllm.sim.cluster import simulate_cluster
from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.simulator import cost_model_step_time
from jaxllm.sim.synth import LengthDist, conversations
from jaxllm.sim.trace import save_trace
from tests.conftest import TEST_KV_BLOCKS, serve_flags

COST = Path(__file__).resolve().parent.parent / "examples" / "research" / "cost_cpu.json"


def kv_events_flag() -> list[str]:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_port()}"}
    return ["--kv-events-config", json.dumps({**events, "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"})]


def hit_counters(url: str) -> tuple[float, float]:
    metrics = scrape_metrics(url)
    return metrics["jaxllm:prefix_cache_queries_total"], metrics["jaxllm:prefix_cache_hits_total"]


def test_a_small_real_cluster_hits_the_prefix_cache_as_simulated(tmp_path):
    trace = conversations(
        8,
        4,
        request_rate=1.0,
        turn_len=LengthDist(48, "uniform", range_ratio=0.25),
        output_len=LengthDist(4, "fixed"),
        think_time_s=1.0,
        num_prefix_groups=2,
        prefix_len=64,
        seed=3,
    )
    save_trace(trace, path := tmp_path / "chat.jsonl")
    out = tmp_path / "bench.json"
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(ServerProcess([*serve_flags(), *kv_events_flag()], log_path=tmp_path / f"s{k}.log"))
            for k in range(2)
        ]
        before = [hit_counters(s.url) for s in servers]
        flags = ["--instances", *(s.url for s in servers), "--policy", "prefix_aware"]
        router = stack.enter_context(ServerProcess(flags, command="router", log_path=tmp_path / "router.log"))
        bench = ["bench", "serve", "--base-url", router.url, "--dataset-name", "jsonl", "--dataset-path", str(path)]
        assert main([*bench, "--output", str(out), "--disable-tqdm"]) == 0
        after = [hit_counters(s.url) for s in servers]
    real = json.loads(out.read_text())
    assert real["completed"] == len(trace) and real["failed"] == 0
    queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))

    cost = CostModel.load(COST)
    config = sim_config_for({**cost.engine, "num_blocks": TEST_KV_BLOCKS})
    step_time = cost_model_step_time(cost, config)
    sim = simulate_cluster(trace, config, step_time, 2, load_policy("prefix_aware"), **cost.event_costs())
    assert sim.prefix_cache_queries == queries  # the same prompts, token for token
    assert abs(hits / queries - sim.prefix_cache_hit_rate) <= 0.05, (hits / queries, sim.prefix_cache_hit_rate)
    assert sim.prefix_cache_hit_rate > 0.5  # the conversations' histories were found where they were
