"""The cluster simulation (jaxllm/sim/cluster.py): N simulated engines behind the router's own policy objects."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from jaxllm.engine.block_hash import NO_SCOPE, prefix_hashes
from jaxllm.entrypoints.router.balancer import block_hashes as router_block_hashes
from jaxllm.routing.least_loaded import LeastLoaded
from jaxllm.routing.prefix_aware import PrefixAware
from jaxllm.routing.registry import load_policy
from jaxllm.routing.round_robin import RoundRobin
from jaxllm.routing.session import SessionAffinity
from jaxllm.sim.cluster import simulate_cluster
from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.settings import SimSettings, sim_config, simulate_priced
from jaxllm.sim.simulator import cost_model_step_time, simulate
from jaxllm.sim.synth import LengthDist, conversations, synthesize
from jaxllm.sim.trace import TraceRequest, load_trace, prompt_token_ids

COST_PATH = Path(__file__).resolve().parent.parent / "examples" / "research" / "cost_cpu.json"


@pytest.fixture(scope="module")
def cost():
    return CostModel.load(COST_PATH)


@pytest.fixture(scope="module")
def config(cost):
    return sim_config(SimSettings(), cost)


def chat_trace(seed: int = 1) -> list[TraceRequest]:
    """Multi-turn conversations that share system prompts: 40 conversations of 4 turns."""
    return conversations(
        40,
        4,
        request_rate=4,
        turn_len=LengthDist(64, "uniform"),
        output_len=LengthDist(16, "uniform"),
        think_time_s=2,
        num_prefix_groups=2,
        prefix_len=64,
        max_prompt_len=400,
        seed=seed,
    )


def run(trace, config, cost, instances, policy, **options):
    step_time = cost_model_step_time(cost, config)
    return simulate_cluster(trace, config, step_time, instances, policy, **cost.event_costs(), **options)


def test_the_simulators_policies_are_the_routers_classes():
    for name, cls in (
        ("round_robin", RoundRobin),
        ("least_loaded", LeastLoaded),
        ("session", SessionAffinity),
        ("prefix_aware", PrefixAware),
    ):
        assert type(load_policy(name)) is cls
    # the CLI's objects come from the same loader
    import jaxllm.entrypoints.cli.simulate as cli
    from jaxllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(
        ["simulate", "t.jsonl", "--cost", "c.json", "--instances", "4", "--router", "round_robin,prefix_aware"]
    )
    assert [type(p) for p in cli.cluster_policies(args)] == [RoundRobin, PrefixAware]


def test_a_later_turn_extends_the_earlier_one_and_hashes_as_the_router_does(config):
    trace = chat_trace()
    by_session: dict[str, list[int]] = {}
    for i, r in enumerate(trace):
        by_session.setdefault(r.session, []).append(i)
    first, second = by_session["c0"][:2]
    a, b = prompt_token_ids(trace[first], first, 0), prompt_token_ids(trace[second], second, 0)
    assert len(b) > len(a) and b[: len(a)] == a
    hashes = prefix_hashes(b, config.block_size, NO_SCOPE)
    assert hashes == router_block_hashes(b, config.block_size, NO_SCOPE.hex())
    assert hashes[: len(a) // config.block_size] == prefix_hashes(a, config.block_size, NO_SCOPE)
    # another conversation of the same group shares only the system prompt
    other = next(
        i for s, idx in by_session.items() if s != "c0" for i in idx if trace[i].prefix_group == trace[0].prefix_group
    )
    c = prompt_token_ids(trace[other], other, 0)
    assert c[:64] == a[:64] and c[64:80] != a[64:80]
    # traces without sessions make the same tokens as before
    plain = TraceRequest(arrival_time=0, output_len=4, prompt_len=40, prefix_group="g", prefix_len=16)
    assert prompt_token_ids(plain, 3, 0)[16:] != prompt_token_ids(plain, 4, 0)[16:]


def test_one_instance_is_jaxllm_simulate(config, cost):
    trace = chat_trace()
    alone = simulate_priced(trace, config, cost, seed=0).to_json(goodput={"ttft": 500})
    cluster = run(trace, config, cost, 1, load_policy("prefix_aware")).to_json(goodput={"ttft": 500})
    assert cluster["router"] == "prefix_aware" and cluster["instances"] == 1
    for key, value in alone.items():
        if key != "kv_cache_usage":
            assert cluster[key] == value, key
    assert {k: v for k, v in cluster["per_instance"][0].items() if k != "name"} == {
        k: v for k, v in alone.items() if k != "kv_cache_usage"
    }


def test_seeded_runs_are_reproducible(config, cost):
    trace = chat_trace()
    for name in ("least_loaded", "prefix_aware"):
        a = run(trace, config, cost, 4, load_policy(name), seed=3)
        b = run(trace, config, cost, 4, load_policy(name), seed=3)
        assert a.assigned == b.assigned
        assert [asdict(r) for r in a.records] == [asdict(r) for r in b.records]
        assert a.to_json() == b.to_json()
    # the seed fixes the trace: another one is another run (made-up tokens never collide by chance, so another
    # token seed alone gives the same cache hits)
    other = run(chat_trace(seed=2), config, cost, 4, load_policy("prefix_aware"), seed=3)
    assert other.to_json() != a.to_json()


def test_prefix_aware_beats_round_robin_on_conversations(config, cost):
    trace = chat_trace()
    rr = run(trace, config, cost, 4, load_policy("round_robin"))
    pa = run(trace, config, cost, 4, load_policy("prefix_aware"))
    assert pa.prefix_cache_hit_rate > rr.prefix_cache_hit_rate + 0.1
    assert all(r.success for r in pa.records) and all(r.success for r in rr.records)
    assert sorted(set(rr.assigned)) == [0, 1, 2, 3]
    # round robin's turn goes 0, 1, 2, 3, ... in arrival order
    assert rr.assigned[:8] == [0, 1, 2, 3, 0, 1, 2, 3]
    # session affinity: a conversation stays on one instance
    sessions = run(trace, config, cost, 4, load_policy("session"))
    homes: dict[str, set[int]] = {}
    for r, k in zip(trace, sessions.assigned, strict=True):
        homes.setdefault(r.session, set()).add(k)
    assert all(len(h) == 1 for h in homes.values())


def test_the_prefix_index_sees_what_the_instances_cache(config, cost):
    """prefix_aware reads only the index the KV events feed; after the run, each instance's blocks there are its
    KV manager's cached blocks."""
    seen = []

    class Spy(PrefixAware):
        def choose(self, request, view):
            chosen = super().choose(request, view)
            seen.append(view)
            return chosen

    result = run(chat_trace(), config, cost, 3, Spy())
    index = seen[-1].index
    assert result.router == "prefix_aware" and len(seen) == len(result.records)
    for name, engine in zip(result.names, result.engines, strict=True):
        cached = {h for (_, h) in engine.kv._cached}
        assert cached and {key[3] for key in index.blocks_of(name)} == cached
    # no events without a policy that reads them (as a router subscribes only then) ...
    plain = run(chat_trace(), config, cost, 3, load_policy("least_loaded"))
    assert all(engine.kv.listener is None for engine in plain.engines)
    # ... and the events change nothing in the run
    spied = run(chat_trace(), config, cost, 3, load_policy("least_loaded"), kv_events=True)
    assert spied.to_json() == plain.to_json()


def test_loads_in_the_view_come_from_the_simulated_schedulers(config, cost):
    """A burst at one instant: least_loaded spreads it as `dispatched` counts it."""
    trace = synthesize(8, request_rate=float("inf"), input_len=LengthDist(32), output_len=LengthDist(8))
    result = run(trace, config, cost, 4, load_policy("least_loaded"))
    assert sorted(result.assigned) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_cli_runs_a_cluster_and_compares_policies(tmp_path, capsys):
    from jaxllm.entrypoints.cli import main
    from jaxllm.sim.trace import save_trace

    trace = tmp_path / "chat.jsonl"
    save_trace(chat_trace(), trace)
    out = tmp_path / "result.json"
    base = ["simulate", str(trace), "--cost", str(COST_PATH), "--instances", "4"]
    assert main([*base, "--router", "prefix_aware", "--goodput", "ttft:500", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["router"] == "prefix_aware" and data["instances"] == 4 and len(data["per_instance"]) == 4
    assert data["completed"] == len(load_trace(trace)) and "request_goodput" in data
    assert "router prefix_aware over 4 simulated instances" in capsys.readouterr().out
    assert main([*base, "--router", "round_robin,prefix_aware", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "prefix-cache hit rate" in printed and "round_robin" in printed
    both = json.loads(out.read_text())
    assert both["routers"] == ["round_robin", "prefix_aware"]
    rr, pa = both["runs"]
    assert pa["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"]
    # bad flags fail at start-up, in one line
    assert main([*base, "--router", "nope"]) == 2
    assert "--router 'nope'" in capsys.readouterr().err
    assert main([*base[:4], "--instances", "0"]) == 2
    assert main([*base, "--router", "round_robin,round_robin"]) == 2
    assert main([*base, "--router", "jaxllm.routing.round_robin:RoundRobin"]) == 0


def test_multi_turn_traces_from_the_cli(tmp_path):
    from jaxllm.entrypoints.cli import main

    out = tmp_path / "chat.jsonl"
    synth = ["trace", "synth", "--out", str(out), "--num-requests", "40", "--turns", "4", "--request-rate", "2"]
    assert main([*synth, "--input-len", "32", "--num-prefix-groups", "2", "--prefix-len", "32"]) == 0
    trace = load_trace(out)
    assert len(trace) == 40 and len({r.session for r in trace}) == 10
    lengths: dict[str, list[int]] = {}
    for r in trace:
        lengths.setdefault(r.session, []).append(r.prompt_len)
    assert all(v == sorted(v) and len(set(v)) == len(v) for v in lengths.values())


def test_a_refused_request_does_not_end_the_run(config, cost):
    """A request refused at the door (longer than max_model_len) while later ones are still on their way."""
    too_long = config.scheduler.max_model_len + 1
    trace = [
        TraceRequest(arrival_time=0.0, output_len=4, prompt_len=too_long),
        TraceRequest(arrival_time=0.001, output_len=4, prompt_len=32),
    ]
    for result in (
        simulate(trace, config, cost_model_step_time(cost, config), request_latency_s=0.01),
        simulate_cluster(
            trace, config, cost_model_step_time(cost, config), 2, load_policy("round_robin"), request_latency_s=0.01
        ),
    ):
        assert result.records[0].error and result.records[1].success


def pd_run(trace, config, cost, p: int, d: int, **options):
    from jaxllm.sim.pd import simulate_pd

    step_time = cost_model_step_time(cost, config)
    per_token = cost.engine["kv_bytes_per_block"] // cost.engine["block_size"]
    return simulate_pd(trace, config, step_time, p, d, kv_bytes_per_token=per_token, **cost.event_costs(), **options)


def test_pd_prefills_on_one_kind_decodes_on_the_other(config, cost):
    """Each request: its prompt computed on a prefill instance, its K/V across, every output token from a decode
    instance that computes only the prompt's last token; the client's first token after the transfer."""
    trace = chat_trace()
    result = pd_run(trace, config, cost, 1, 2, kv_transfer_gb_s=0.5, kv_transfer_latency_s=0.02)
    assert all(r.success for r in result.records) and len(result.records) == len(trace)
    assert [r.output_len for r in result.records] == [t.output_len for t in trace]
    prefill, *decodes = result.engines
    assert prefill.kv.prefix_cache_hits > 0  # the conversations' history, on the one prefill instance
    assert {result.names[k] for k in result.assigned} == {"decode-0", "decode-1"}  # least loaded spreads them
    per_token = cost.engine["kv_bytes_per_block"] / cost.engine["block_size"]
    for record in result.records:
        assert record.ttft >= 0.02 + record.prompt_len * per_token / 0.5e9
    for engine in decodes:  # a decode instance's prompts came from the connector, but for their last tokens
        stats = engine.scheduler.connector.stats
        assert stats.external_prefix_cache_hits + engine.kv.prefix_cache_hits == sum(
            r.prompt_len - 1 for i, r in enumerate(result.records) if result.engines[result.assigned[i]] is engine
        )
    summary = result.to_json()
    assert summary["router"] == "pd 1:2" and summary["decode_instances"] == 2
    assert summary["prefill_prefix_cache_hit_rate"] > 0 and summary["mean_kv_transfer_ms"] > 20
    again = pd_run(trace, config, cost, 1, 2, kv_transfer_gb_s=0.5, kv_transfer_latency_s=0.02)
    assert [r.ttft for r in again.records] == [r.ttft for r in result.records]  # seeded: the same run
    slower = pd_run(trace, config, cost, 1, 2, kv_transfer_gb_s=0.05, kv_transfer_latency_s=0.02)
    assert slower.to_json()["mean_ttft_ms"] > summary["mean_ttft_ms"]


def test_pd_from_the_cli_and_its_bad_flags(tmp_path, capsys):
    from jaxllm.entrypoints.cli import main
    from jaxllm.sim.trace import save_trace

    trace = tmp_path / "chat.jsonl"
    save_trace(chat_trace(), trace)
    out = tmp_path / "pd.json"
    base = ["simulate", str(trace), "--cost", str(COST_PATH)]
    assert main([*base, "--pd", "1:1", "--goodput", "ttft:500", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["router"] == "pd 1:1" and data["instances"] == 2 and data["completed"] == len(load_trace(trace))
    assert "router pd 1:1 over 2 simulated instances" in capsys.readouterr().out
    for flags, message in (
        (["--pd", "0:1"], "PREFILL:DECODE"),
        (["--pd", "two"], "PREFILL:DECODE"),
        (["--pd", "1:1", "--instances", "2"], "leave out --instances"),
        (["--kv-transfer-gb-s", "1"], "go with --pd"),
        (["--pd", "1:1", "--kv-transfer-gb-s", "0"], "bandwidth > 0"),
    ):
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err
