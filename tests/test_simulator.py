"""The simulator: it drives the engine's own Scheduler and KVCacheManager (not copies), is
deterministic, forces the trace's output lengths, returns every block, matches a real engine
run step for step when given its step times, and `jaxllm simulate` handles 10,000 requests."""

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import jaxllm.sim.calibrate as calibrate
import jaxllm.sim.simulator as simulator
import jaxllm.sim.sweep as sweep
from jaxllm.config import SchedulerConfig, SpeculativeConfig
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.scheduler import Scheduler
from jaxllm.engine.step_loop import StepLoop
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams
from jaxllm.sim.calibrate import BUSY_SEED, fit_event_costs, fit_host_overhead, fit_idle_wake
from jaxllm.sim.costmodel import CostModel, StepShape, fit_cost_model
from jaxllm.sim.engine_run import run_trace_on_engine
from jaxllm.sim.settings import SimSettings, sim_config
from jaxllm.sim.simulator import SimConfig, cost_model_step_time, simulate
from jaxllm.sim.synth import LengthDist, synthesize
from jaxllm.sim.trace import TraceRequest, load_trace
from jaxllm.spec_decode.budget import DraftBudget

COST = CostModel(
    bucket_tokens=[1, 64, 512],
    bucket_base_s=[0.004, 0.01, 0.05],
    per_context_token_s=2e-6,
    per_attention_pair_s=1e-9,
    per_seq_s=1e-4,
)


def squeezed_config(policy="fcfs", num_blocks=40):
    return SimConfig(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, policy=policy),
        num_blocks=num_blocks,
        block_size=16,
    )


def busy_trace(n=60, seed=0):
    return synthesize(
        n,
        request_rate=40,
        input_len=LengthDist(60, "uniform", range_ratio=0.9),
        output_len=LengthDist(30, "exponential", maximum=120),
        num_prefix_groups=3,
        prefix_len=32,
        num_users=3,
        num_priorities=2,
        seed=seed,
    )


def test_the_simulator_runs_the_engines_own_classes(monkeypatch):
    assert simulator.Scheduler is Scheduler and simulator.KVCacheManager is KVCacheManager
    assert simulator.StepLoop is StepLoop  # the engine's one step loop, on the virtual clock
    calls = {"schedule": 0, "update": 0, "allocate_slots": 0}
    for cls, name in ((Scheduler, "schedule"), (Scheduler, "update"), (KVCacheManager, "allocate_slots")):
        original = getattr(cls, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    result = simulate(busy_trace(20), squeezed_config(), cost_model_step_time(COST, squeezed_config()))
    assert calls["schedule"] >= result.num_steps > 0
    assert calls["update"] == result.num_steps
    assert calls["allocate_slots"] >= result.num_steps


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf", "lpm", "fair"])
def test_deterministic_forced_lengths_and_every_block_back(policy):
    trace, config = busy_trace(), squeezed_config(policy)
    runs = [simulate(trace, config, cost_model_step_time(COST, config), seed=7, record_steps=True) for _ in range(2)]
    assert runs[0].to_json() == runs[1].to_json() and runs[0].steps == runs[1].steps
    result = runs[0]
    assert result.num_preemptions > 0  # the pool is small enough to force some
    assert [r.output_len for r in result.records] == [t.output_len for t in trace]
    assert all(r.success for r in result.records)
    assert result.free_blocks_at_end == result.num_usable_blocks
    summary = result.to_json()
    assert summary["completed"] == len(trace) and summary["duration"] > 0
    assert 0 < summary["prefix_cache_hit_rate"] < 1 and summary["max_kv_cache_usage"] > 0.5


def test_windowed_groups_let_the_simulator_run_larger_batches():
    """The same memory for a 5:1 model whose local layers attend 16 tokens: one-layer blocks in six groups (the
    hybrid manager) against six-layer blocks kept whole. The simulated engine preempts less, runs more requests per
    step and finishes sooner; every block of every group is back at the end."""
    trace = busy_trace()
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    uniform = SimConfig(scheduler, num_blocks=40, block_size=16)
    hybrid = SimConfig(scheduler, num_blocks=6 * 40, block_size=16, kv_cache_windows=(16,) * 5 + (None,))
    runs = {}
    for name, config in (("uniform", uniform), ("hybrid", hybrid)):
        runs[name] = simulate(trace, config, cost_model_step_time(COST, config), seed=7, record_steps=True)
        assert runs[name].free_blocks_at_end == runs[name].num_usable_blocks
    mean_batch = {name: sum(map(len, run.steps)) / len(run.steps) for name, run in runs.items()}
    # `jaxllm simulate` and `tune` take the groups from the engine the cost model was calibrated on
    engine = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256, "block_size": 16}
    engine.update(num_blocks=240, enable_prefix_caching=True, kv_cache_groups=[16] * 5 + [None])
    calibrated = sim_config(SimSettings(), replace(COST, engine=engine))
    assert calibrated.kv_cache_windows == hybrid.kv_cache_windows and calibrated.num_blocks == 240
    assert runs["hybrid"].num_preemptions < runs["uniform"].num_preemptions
    assert mean_batch["hybrid"] > mean_batch["uniform"] and runs["hybrid"].duration < runs["uniform"].duration


def test_a_different_seed_changes_prompts_not_lengths():
    trace, config = busy_trace(), squeezed_config(num_blocks=200)
    a = simulate(trace, config, cost_model_step_time(COST, config), seed=0)
    b = simulate(trace, config, cost_model_step_time(COST, config), seed=1)
    assert [r.output_len for r in a.records] == [r.output_len for r in b.records]
    assert a.prefix_cache_hit_rate == pytest.approx(b.prefix_cache_hit_rate, abs=0.05)  # same groups, new tokens


def test_too_long_prompts_fail_like_the_engine_refuses_them():
    trace = synthesize(3, request_rate=10, input_len=LengthDist(300), output_len=LengthDist(4))
    config = squeezed_config()
    result = simulate(
        trace[:1] + synthesize(1, request_rate=1, input_len=LengthDist(10), output_len=LengthDist(4), start=1.0),
        config,
        cost_model_step_time(COST, config),
    )
    assert [r.success for r in result.records] == [False, True]
    assert "max_model_len=256" in result.records[0].error


def test_request_latency_delays_each_request_into_the_engine():
    trace = synthesize(4, request_rate=0.5, input_len=LengthDist(20), output_len=LengthDist(5), seed=3)  # never overlap
    config = squeezed_config()
    step_time = cost_model_step_time(COST, config)
    plain, served = (simulate(trace, config, step_time, request_latency_s=d) for d in (0.0, 0.25))
    for a, b in zip(plain.records, served.records, strict=True):
        assert b.ttft == pytest.approx(a.ttft + 0.25) and b.itl == pytest.approx(a.itl)
    assert served.duration == pytest.approx(plain.duration + 0.25)
    with pytest.raises(ValueError, match="request_latency_s"):
        simulate(trace, config, step_time, request_latency_s=-1)


def test_idle_wake_lengthens_only_the_first_step_after_idling():
    config = squeezed_config()
    step_time = cost_model_step_time(COST, config)
    apart = synthesize(4, request_rate=0.5, input_len=LengthDist(20), output_len=LengthDist(5), seed=3)  # each idle
    plain, woken = (simulate(apart, config, step_time, idle_wake_s=w) for w in (0.0, 0.1))
    for a, b in zip(plain.records, woken.records, strict=True):
        assert b.ttft == pytest.approx(a.ttft + 0.1) and b.itl == pytest.approx(a.itl)
    together = synthesize(4, request_rate=float("inf"), input_len=LengthDist(20), output_len=LengthDist(5), seed=3)
    plain, woken = (simulate(together, config, step_time, idle_wake_s=w) for w in (0.0, 0.1))
    assert woken.duration == pytest.approx(plain.duration + 0.1)  # one idle period: the start
    with pytest.raises(ValueError, match="idle_wake_s"):
        simulate(apart, config, step_time, idle_wake_s=-1)


def test_cost_model_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    truth = CostModel(
        [1, 2, 4, 8, 16, 32, 64],
        [0.002 * (1 + i) for i in range(7)],
        per_context_token_s=3e-6,
        per_attention_pair_s=2e-9,
        per_seq_s=5e-4,
    )
    samples = []
    for _ in range(300):
        seqs = int(rng.integers(1, 9))
        news = rng.integers(1, 9, seqs)
        shape = StepShape(int(news.sum()), seqs, int(rng.integers(seqs, 4000)), int(rng.integers(1, 200000)))
        samples.append((shape, truth.step_time(shape, 64) * rng.normal(1, 0.01)))
    fitted = fit_cost_model(samples, 64)
    assert fitted.per_context_token_s == pytest.approx(3e-6, rel=0.1)
    assert fitted.per_seq_s == pytest.approx(5e-4, rel=0.2)
    assert fitted.fit["mean_abs_rel_error"] < 0.02
    assert fitted.base(128) > fitted.base(64)  # extrapolates to larger buckets


def test_moe_cost_follows_the_experts_a_step_touches():
    """A mixture of experts: the step time grows with the distinct experts its tokens read (E (1 - (1 - k/E)^T)),
    inside one bucket too, and the fit recovers that term's coefficient beside the others."""
    from jaxllm.sim.costmodel import MOE_FORM, experts_touched

    assert experts_touched(1, 64, 8) == pytest.approx(8) and experts_touched(512, 64, 8) == pytest.approx(64)
    rng = np.random.default_rng(2)
    truth = CostModel(
        [1, 2, 4, 8, 16, 32, 64],
        [0.002 * (1 + i) for i in range(7)],
        per_context_token_s=3e-6,
        per_seq_s=5e-4,
        moe_experts=64,
        moe_top_k=8,
        per_expert_touched_s=2e-4,
    )
    decode = [StepShape(t, t, 100 * t, 100 * t) for t in (33, 64)]  # one bucket: more tokens, more experts
    assert truth.step_time(decode[1], 64) - truth.step_time(decode[0], 64) > 2e-4 * (64 * 0.99 - 64 * 0.98)
    samples = []
    for _ in range(400):
        seqs = int(rng.integers(1, 17))
        news = rng.integers(1, 5, seqs)
        shape = StepShape(int(news.sum()), seqs, int(rng.integers(seqs, 4000)), int(rng.integers(1, 20000)))
        samples.append((shape, truth.step_time(shape, 64) * rng.normal(1, 0.01)))
    fitted = fit_cost_model(samples, 64, moe=(64, 8))
    assert fitted.form == MOE_FORM and (fitted.moe_experts, fitted.moe_top_k) == (64, 8)
    assert fitted.per_expert_touched_s == pytest.approx(2e-4, rel=0.25)
    assert fitted.fit["mean_abs_rel_error"] < 0.02
    assert fit_cost_model(samples, 64).per_expert_touched_s == 0.0  # a dense model's fit has no such term


def test_host_overhead_fit_ignores_steps_slowed_by_other_work():
    rng = np.random.default_rng(1)
    seqs = rng.integers(1, 9, 200).astype(float)
    residual = 0.004 + 0.001 * seqs + rng.normal(0, 0.0002, 200)
    residual[::10] += rng.uniform(0.2, 0.5, 20)  # one step in ten stalled 200-500 ms by a neighbour
    per_step, per_seq = fit_host_overhead(seqs, residual)
    assert per_step == pytest.approx(0.004, abs=0.001)
    assert per_seq == pytest.approx(0.001, abs=0.0002)


def test_the_sweep_keeps_each_points_median_over_rounds(monkeypatch):
    """A real run meets the machine's usual jitter: the fastest of the rounds would predict it short
    (by more for steps that jitter more), and one round slowed by a neighbour must not count either."""
    rounds = {"a": iter([0.050, 0.040, 0.900, 0.045, 0.060]), "b": iter([0.010, 0.012, 0.011, 0.500, 0.013])}
    warm_rounds = []

    def fake_time_step(core, layout, warm):
        warm_rounds.append(warm)
        return StepShape(1, 1, 1, 1), next(rounds[layout[0][0]])

    monkeypatch.setattr(sweep, "_time_step", fake_time_step)
    result = sweep.time_sweep(None, [[("a", 1)], [("b", 1)]], repeats=5, progress=False)
    assert [t for _, t in result] == [pytest.approx(0.050), pytest.approx(0.012)]
    assert warm_rounds == [True, True] + [False] * 8  # each point's first use is run once untimed


def test_matches_a_real_engine_run_step_for_step(llm):
    """Record a real EngineCore run (arrivals over time, chunked prefill, a shared prefix, preemption in a
    squeezed pool), replay it in the simulator with the real step times: the same requests in every step."""
    core = llm.engine
    trace = synthesize(
        12,
        request_rate=20,
        input_len=LengthDist(60, "uniform", range_ratio=0.9),
        output_len=LengthDist(16, "uniform", range_ratio=0.8),
        num_prefix_groups=2,
        prefix_len=32,
        seed=3,
    )
    usable = 40  # squeeze the compiled pool without recompiling: ballast holds the other blocks
    ballast = Request("ballast", [1] * 16, SamplingParams())
    assert core.kv.allocate_slots(ballast, (core.kv.num_free_blocks - usable) * core.kv.block_size)
    preemptions = core.scheduler.num_preemptions
    try:
        run = run_trace_on_engine(core, trace)
    finally:
        core.kv.free(ballast)
    assert core.scheduler.num_preemptions > preemptions
    aligned, step_time = run.replay(trace)
    config = SimConfig(core.config.scheduler, num_blocks=usable + 1, block_size=core.kv.block_size)
    sim = simulate(aligned, config, step_time, record_steps=True)
    assert sim.steps == [s.request_ids for s in run.steps]
    assert sim.num_preemptions == core.scheduler.num_preemptions - preemptions
    assert [r.output_len for r in sim.records] == [r.output_len for r in run.records] == [t.output_len for t in trace]
    assert sim.free_blocks_at_end == sim.num_usable_blocks
    assert core.kv.num_free_blocks == core.kv.num_usable_blocks


def test_cli_simulates_ten_thousand_requests(tmp_path):
    from jaxllm.entrypoints.cli import main

    trace, cost, result, plots = tmp_path / "t.jsonl", tmp_path / "cost.json", tmp_path / "r.json", tmp_path / "plots"
    assert (
        main(
            [
                "trace",
                "synth",
                "--out",
                str(trace),
                "--num-requests",
                "10000",
                "--request-rate",
                "30",
                "--input-len",
                "200",
                "--output-len",
                "100",
                "--num-prefix-groups",
                "20",
                "--prefix-len",
                "64",
            ]
        )
        == 0
    )
    assert len(load_trace(trace)) == 10000
    CostModel(
        COST.bucket_tokens,
        COST.bucket_base_s,
        COST.per_context_token_s,
        COST.per_attention_pair_s,
        COST.per_seq_s,
        engine={
            "max_num_seqs": 64,
            "max_num_batched_tokens": 512,
            "max_model_len": 2048,
            "block_size": 16,
            "num_blocks": 2000,
            "enable_prefix_caching": True,
        },
    ).save(cost)
    started = time.perf_counter()
    assert main(["simulate", str(trace), "--cost", str(cost), "--output", str(result), "--plot", str(plots)]) == 0
    elapsed = time.perf_counter() - started
    assert elapsed < 120, f"10,000 requests took {elapsed:.0f} s"  # ~10 s on an idle 2-core machine
    data = json.loads(result.read_text())
    assert data["completed"] == 10000 and data["failed"] == 0 and data["duration"] > 0
    for key in (
        "mean_ttft_ms",
        "p99_itl_ms",
        "mean_tpot_ms",
        "output_throughput",
        "num_preemptions",
        "prefix_cache_hit_rate",
        "kv_cache_usage",
        "ttfts",
        "itls",
    ):
        assert key in data
    assert data["prefix_cache_hit_rate"] > 0.1
    for name in ("latency_cdf.png", "throughput.png", "kv_cache_usage.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", str(trace), "--cost", str(cost), "--scheduling-policy", "nope"]) == 2


def test_idle_wake_is_fitted_on_requests_that_found_the_engine_idle():
    engine = {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 32,
        "max_model_len": 128,
        "num_blocks": 64,
        "block_size": 16,
        "enable_prefix_caching": True,
    }
    model = CostModel(bucket_tokens=[1, 32], bucket_base_s=[0.01, 0.02], engine=engine)
    trace = [TraceRequest(arrival_time=t, prompt_len=20, output_len=3) for t in (0.0, 5.0, 10.0)]
    config = calibrate.sim_config_for(engine)
    sim = simulate(trace, config, cost_model_step_time(model, config)).records
    real = [replace(r, ttft=r.ttft + 0.03) for r in sim]  # every request arrived to an idle engine
    fitted, idle = fit_idle_wake(model, trace, real)
    assert idle == 3 and fitted.idle_wake_s == pytest.approx(0.03)
    assert fit_idle_wake(model, trace, sim)[0].idle_wake_s == pytest.approx(0.0)


def test_wake_and_prefill_step_costs_are_recovered_from_the_light_and_busy_traces():
    """Runs simulated with known costs stand in for real ones: the joint fit finds those costs again,
    and finds none in runs that had none."""
    engine = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 512,
        "num_blocks": 128,
        "block_size": 16,
        "enable_prefix_caching": True,
    }
    model = CostModel(
        bucket_tokens=[1, 64], bucket_base_s=[0.015, 0.05], per_context_token_s=2e-6, per_seq_s=2e-4, engine=engine
    )
    light, busy = calibrate.light_trace(512), calibrate.busy_trace(512)
    truth = replace(model, idle_wake_s=0.02, per_prefill_step_s=0.006)
    runs = (light, calibrate.simulated(truth, light), busy, calibrate.simulated(truth, busy, seed=BUSY_SEED))
    fitted, fit = fit_event_costs(model, *runs)
    assert fitted.per_prefill_step_s == pytest.approx(0.006, abs=5e-4)
    assert fitted.idle_wake_s == pytest.approx(0.02, abs=1e-3)
    assert abs(fit["busy_mean_ttft_rel_error"]) < 1e-3 and fit["busy_requests"] == 24
    plain = (light, calibrate.simulated(model, light), busy, calibrate.simulated(model, busy, seed=BUSY_SEED))
    fitted, _ = fit_event_costs(model, *plain)
    assert fitted.per_prefill_step_s == 0.0 and fitted.idle_wake_s == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("script", ["chunked_prefill", "lpm_vs_fcfs", "priority_fair", "batched_tokens_sweep"])
def test_research_experiment_writes_its_plot_and_the_committed_figures(script, tmp_path):
    """Each experiment runs on the shipped cost model and reproduces the JSON committed beside it (the
    figures docs/research.md quotes)."""
    folder = Path(__file__).parent.parent / "examples" / "research"
    subprocess.run(
        [sys.executable, str(folder / f"{script}.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (tmp_path / f"{script}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    got, committed = (
        json.loads(path.read_text()) for path in (tmp_path / f"{script}.json", folder / "results" / f"{script}.json")
    )
    assert leaves(got) == pytest.approx(leaves(committed), rel=1e-6)


# ---- speculative decoding ------------------------------------------------------------------------


def spec_config(k=4, policy="fcfs", num_blocks=200, **spec):
    config = squeezed_config(policy, num_blocks)
    return replace(config, speculative=SpeculativeConfig("ngram", k, **spec) if k else None)


def one_at_a_time(rates, output_len=101):
    """Requests far apart (batch 1), prompts of 20 tokens, each with its trace acceptance rate (None: absent)."""
    return [
        TraceRequest(arrival_time=10.0 * i, prompt_len=20, output_len=output_len, acceptance_rate=rate)
        for i, rate in enumerate(rates)
    ]


def steps_per_request(result) -> dict[str, int]:
    counts: dict[str, int] = {}
    for step in result.steps:
        for rid in step:
            counts[rid] = counts.get(rid, 0) + 1
    return counts


def test_full_acceptance_with_four_drafts_finishes_a_request_in_a_fifth_of_the_steps():
    trace = one_at_a_time([None])
    plain_config, spec = spec_config(0), spec_config(4)
    plain = simulate(trace, plain_config, cost_model_step_time(COST, plain_config))
    fast = simulate(trace, spec, cost_model_step_time(COST, spec), acceptance_rate=1.0)
    assert plain.num_steps == 101  # the prefill gives the first token, then one token a step
    # then 4 accepted drafts + 1 a step (22 today: the load-aware rule first measures one plain decode step)
    assert 1 + 100 // 5 <= fast.num_steps <= 3 + 100 // 5
    record = fast.records[0]
    assert record.success and record.output_len == 101 and len(record.itl) == 100
    assert fast.duration < plain.duration / 3
    summary = fast.to_json()
    # (4.7: the rule also tries 3 drafts, which might pay as well, before it trusts its costs)
    assert summary["spec_decode_acceptance_rate"] == 1.0 and summary["spec_decode_mean_acceptance_length"] > 4.6
    assert summary["spec_decode_num_drafts"] >= 19 and summary["spec_decode_speculated_fraction"] > 0.9
    per_pos = summary["spec_decode_num_accepted_tokens_per_pos"]
    # (the last: 3 left; and up to 3 verifications of 3 drafts, tried before the rule trusts its costs)
    assert per_pos[0] == summary["spec_decode_num_drafts"] and per_pos[3] >= per_pos[0] - 4
    assert summary["total_output_tokens"] == plain.to_json()["total_output_tokens"]
    assert fast.draft_tokens == fast.accepted_tokens == [summary["spec_decode_num_draft_tokens"]]
    assert plain.draft_tokens is None
    assert "spec_decode_num_drafts" not in plain.to_json()


def test_zero_acceptance_takes_no_less_time_than_no_speculation():
    trace = busy_trace(20)
    plain_config, spec = spec_config(0), spec_config(3)
    plain = simulate(trace, plain_config, cost_model_step_time(COST, plain_config))
    none = simulate(trace, spec, cost_model_step_time(COST, spec), acceptance_rate=0.0)
    # (step counts may differ either way: slower steps see more arrivals at once, and batch them)
    assert none.duration >= 0.99 * plain.duration  # (and so either way within 1 %: the rule explores the sizes
    # that might pay, and the steps those take shift the batching, 0.2 % here)
    summary = none.to_json()
    assert summary["spec_decode_num_draft_tokens"] > 0 and summary["spec_decode_num_accepted_tokens"] == 0
    assert summary["spec_decode_mean_acceptance_length"] == 1.0
    assert [r.output_len for r in none.records] == [r.output_len for r in plain.records]


def test_a_seeded_speculative_run_is_reproducible():
    trace, config = busy_trace(30), spec_config(4)
    step_time = cost_model_step_time(COST, config)
    runs = [simulate(trace, config, step_time, seed=5, acceptance_rate=0.6, record_steps=True) for _ in range(2)]
    assert runs[0].to_json() == runs[1].to_json() and runs[0].steps == runs[1].steps
    other = simulate(trace, config, step_time, seed=6, acceptance_rate=0.6)
    assert other.to_json()["spec_decode_num_accepted_tokens"] != runs[0].to_json()["spec_decode_num_accepted_tokens"]
    rate = runs[0].to_json()["spec_decode_acceptance_rate"]
    assert 0.3 < rate < 0.6  # per draft: the chain stops at the first rejection (E = 0.6 + 0.36 + ... over 4)


@pytest.mark.parametrize("global_rate", [0.0, 1.0])
def test_a_per_request_acceptance_rate_in_the_trace_wins_over_the_global_one(global_rate):
    trace, config = one_at_a_time([1.0, None, 0.0]), spec_config(4)
    result = simulate(trace, config, cost_model_step_time(COST, config), acceptance_rate=global_rate, record_steps=True)
    assert result.draft_tokens is not None and all(result.draft_tokens)  # every request verified drafts
    rates = [a / d for a, d in zip(result.accepted_tokens, result.draft_tokens, strict=True)]
    assert rates == [1.0, global_rate, 0.0]
    counts = steps_per_request(result)
    assert counts["0"] <= 23 and counts["2"] == 101 and (counts["1"] == 101) == (global_rate == 0.0)
    with pytest.raises(ValueError, match="acceptance rate"):  # request 1 has none, and no global rate
        simulate(trace, config, cost_model_step_time(COST, config))
    simulate(trace[::2], config, cost_model_step_time(COST, config))  # every request carries its own: enough


def test_trace_records_carry_an_optional_acceptance_rate(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"arrival_time": 0, "prompt_len": 8, "output_len": 4, "acceptance_rate": 0.25})
        + "\n"
        + json.dumps({"arrival_time": 1, "prompt_len": 8, "output_len": 4})
        + "\n"
    )
    assert [r.acceptance_rate for r in load_trace(path)] == [0.25, None]
    assert "acceptance_rate" not in load_trace(path)[1].to_json()
    path.write_text(json.dumps({"arrival_time": 0, "prompt_len": 8, "output_len": 4, "acceptance_rate": 1.5}) + "\n")
    with pytest.raises(ValueError, match=":1: acceptance_rate must be a number in \\[0, 1\\]"):
        load_trace(path)
    ranged = synthesize(
        50, request_rate=1, input_len=LengthDist(8), output_len=LengthDist(4), acceptance_rate=(0.3, 0.9)
    )
    assert all(0.3 <= r.acceptance_rate <= 0.9 for r in ranged) and len({r.acceptance_rate for r in ranged}) > 40
    plain = synthesize(50, request_rate=1, input_len=LengthDist(8), output_len=LengthDist(4))
    assert [replace(r, acceptance_rate=None) for r in ranged] == plain  # the rest of the trace is unchanged


@pytest.mark.parametrize("rate", [0.0, 0.6, 1.0])
def test_speculation_under_preemption_forces_lengths_and_returns_every_block(rate):
    trace, config = busy_trace(), spec_config(2, num_blocks=25)
    result = simulate(trace, config, cost_model_step_time(COST, config), seed=3, acceptance_rate=rate)
    assert result.num_preemptions > 0
    assert [r.output_len for r in result.records] == [t.output_len for t in trace]
    assert all(r.success and len(r.itl) == r.output_len - 1 for r in result.records)
    assert result.free_blocks_at_end == result.num_usable_blocks


def test_the_draft_budget_is_fed_the_cost_models_step_times(monkeypatch):
    """The load-aware rule learns step costs as in the engine: here from the simulated clock."""
    observed, priced = [], []
    original = DraftBudget.observe_step

    def observe_step(self, num_tokens, seconds):
        observed.append((num_tokens, seconds))
        original(self, num_tokens, seconds)

    monkeypatch.setattr(DraftBudget, "observe_step", observe_step)
    config = spec_config(3)
    model = cost_model_step_time(COST, config)

    def step_time(out):
        priced.append((out.num_tokens, model(out)))
        return priced[-1][1]

    result = simulate(busy_trace(10), config, step_time, acceptance_rate=0.5)
    assert observed == priced and len(observed) == result.num_steps
    assert any(tokens > 1 and tokens <= 8 for tokens, _ in observed)  # verification steps among them


def test_disable_by_batch_size_turns_drafts_off_in_large_batches():
    output = LengthDist(40, "uniform", range_ratio=0.9)
    trace = synthesize(8, request_rate=float("inf"), input_len=LengthDist(20), output_len=output, seed=1)
    config = spec_config(1, disable_by_batch_size=4)
    result = simulate(trace, config, cost_model_step_time(COST, config), acceptance_rate=1.0)
    summary = result.to_json()
    # 8 requests at once: no drafts until fewer than 4 are left running
    assert 0 < summary["spec_decode_speculated_fraction"] < 0.5


def test_verification_steps_are_priced_by_their_rows():
    """A verification of d drafts: d + 1 tokens and d + 1 rows of logits of one sequence, not a prefill."""
    from jaxllm.scheduler_output import ScheduledRequest, SchedulerOutput

    request = Request("r", list(range(100, 140)), SamplingParams())
    out = SchedulerOutput(0, [ScheduledRequest(request, 4, 39, [[0, 1, 2]], [7, 8, 9])])
    shape = StepShape.of(out)
    assert shape == StepShape(num_tokens=4, num_seqs=1, context_tokens=43, attention_pairs=4 * 43, num_rows=4)
    model = replace(COST, per_prefill_step_s=0.5)
    expected = model.base(4) + 2e-6 * 43 + 1e-9 * 4 * 43 + 1e-4 * 4
    assert model.step_time(shape, 64) == pytest.approx(expected)  # no prefill-step cost
    assert StepShape(4, 1, 43, 172).num_rows == 1  # four given numbers: a step without drafts


def test_calibration_sweeps_verification_steps_within_the_engines_limits():
    points = sweep.sweep_points(8, 64, 512, 4000)
    verify = [p for p in points if any(len(seq) == 3 for seq in p)]
    assert len(verify) >= 10
    for layout in verify:
        rows = sum(1 + (seq[2] if len(seq) == 3 else 0) for seq in layout)
        assert rows <= 8 and sum(seq[1] for seq in layout) <= 64
    assert {seq[2] for p in verify for seq in p if len(seq) == 3} == {1, 3, 7}


def test_calibration_times_verification_steps_on_the_real_runner(llm):
    """The hand-built SchedulerOutput of a verification step runs in the compiled buckets (nothing compiles)."""
    from jaxllm.runner.compilations import compilation_count

    core = llm.engine
    free = core.kv.num_free_blocks
    before = compilation_count()
    for layout in ([(16, 4, 3)], [(256, 2, 1)] * 2 + [(0, 59)], [(64, 8, 7)]):
        shape, seconds = sweep._time_step(core, layout, warm=True)
        assert shape.num_rows == sum(1 + (seq[2] if len(seq) == 3 else 0) for seq in layout)
        assert shape.num_tokens == sum(seq[1] for seq in layout) and seconds > 0
    assert compilation_count() == before
    assert core.kv.num_free_blocks == free


def test_cli_simulates_speculation(tmp_path, capsys):
    from jaxllm.entrypoints.cli import main

    trace, cost, result = tmp_path / "t.jsonl", tmp_path / "cost.json", tmp_path / "r.json"
    synth = ["trace", "synth", "--out", str(trace), "--num-requests", "20", "--request-rate", "2"]
    assert main([*synth, "--input-len", "40", "--output-len", "60", "--acceptance-rate", "0.5:0.9"]) == 0
    engine = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 512, "block_size": 16}
    replace(COST, engine={**engine, "num_blocks": 200, "enable_prefix_caching": True}).save(cost)
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    assert main(["simulate", str(trace), "--cost", str(cost), *spec, "--output", str(result)]) == 0
    data = json.loads(result.read_text())
    assert data["speculative_config"]["num_speculative_tokens"] == 4 and data["acceptance_rate"] is None
    assert 0.4 < data["spec_decode_acceptance_rate"] < 0.9 and data["spec_decode_mean_acceptance_length"] > 1.5
    assert len(data["spec_decode_num_accepted_tokens_per_pos"]) == 4 and data["completed"] == 20
    assert "speculation: acceptance rate" in capsys.readouterr().out
    assert main(["simulate", str(trace), "--cost", str(cost), "--acceptance-rate", "0.5"]) == 2  # no speculation
    draft_model = '{"model": "x", "num_speculative_tokens": 2}'
    assert main(["simulate", str(trace), "--cost", str(cost), "--speculative-config", draft_model]) == 2


def leaves(tree, path: str = "") -> dict:
    """A JSON value's numbers by path, flat, so nested results compare with `pytest.approx`."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in leaves(sub, f"{path}/{key}").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in leaves(sub, f"{path}/{i}").items()}
    return {path: tree}


# ---- pipeline parallelism --------------------------------------------------------------------------


def pp_config(pp=1, max_num_seqs=16, num_blocks=400, **kwargs):
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=512)
    return SimConfig(scheduler, num_blocks=num_blocks, block_size=16, pipeline_parallel_size=pp, **kwargs)


def decodes(n, output_len=100):
    """n requests at once, 16-token prompts: one prefill step, then a long steady decode."""
    return [TraceRequest(arrival_time=0.0, prompt_len=16, output_len=output_len) for _ in range(n)]


NO_TRANSFER = {"pp_transfer_latency_s": 0.0, "pp_transfer_s_per_token": 0.0}


def constant(out):
    return 0.01


def per_row(out):  # work that grows with the batch: the pipeline's stages share it
    return 0.001 * out.num_rows


def test_one_stage_is_the_one_step_at_a_time_loop():
    config = squeezed_config()
    assert config.pipeline_parallel_size == 1 and config.scheduler.max_concurrent_batches == 1
    times = []

    def step_time(out):
        times.append(COST.step_time(StepShape.of(out), 64))
        return times[-1]

    trace = synthesize(40, request_rate=float("inf"), input_len=LengthDist(60), output_len=LengthDist(20), seed=1)
    result = simulate(trace, config, step_time, idle_wake_s=0.05, pp_transfer_latency_s=1.0)  # (no boundary)
    clock = 0.05  # one idle period: the start
    for seconds, (t, _) in zip(times, result.kv_usage, strict=True):
        clock += seconds
        assert t == clock  # back to back, each step its whole time: exactly as before pipelines
    assert not any(key.startswith("pp_") for key in result.to_json())


def test_the_scheduler_gets_a_batch_in_flight_per_stage():
    assert pp_config(3).scheduler.max_concurrent_batches == 3
    assert replace(pp_config(3), num_blocks=100).scheduler.max_concurrent_batches == 3
    with pytest.raises(ValueError, match="max_concurrent_batches=2 is not pipeline_parallel_size=3"):
        SimConfig(replace(pp_config(2).scheduler), num_blocks=100, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="at least one layer"):
        pp_config(2, pp_stage_layers=(30,))
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        pp_config(0)


def test_the_engines_layer_split():
    from jaxllm.parallel.pipeline import layer_ranges
    from jaxllm.sim.simulator import stage_layers

    for layers, pp in ((30, 2), (30, 4), (3, 2), (7, 3)):
        assert stage_layers(layers, pp) == tuple(b - a for a, b in layer_ranges(layers, pp, ""))
    assert stage_layers(3, 2) == (2, 1) and stage_layers(30, 2, "10,20") == (10, 20)
    cost = pp_config(2, pp_stage_layers=(2, 1)).pipeline_cost(1e-3, 1e-5)
    assert cost.stage_shares == pytest.approx((2 / 3, 1 / 3))
    assert cost.stage_times(0.3, 64) == pytest.approx([0.2, 0.1 + 1e-3 + 64e-5])


@pytest.mark.parametrize("pp", [2, 4])
def test_a_full_pipeline_keeps_every_stage_busy(pp):
    """16 requests, 16 sequences: each of the pp batches in flight takes 16 / pp of them. With a constant step time
    (work that does not grow with the batch, e.g. reading the weights) a stage's 1/pp of it serves 16 / pp rows,
    as fast as one device serving 16; with work per row, the pp stages together go pp times as fast."""
    one, piped = (simulate(decodes(16), pp_config(p), constant, **NO_TRANSFER) for p in (1, pp))
    summary = piped.to_json()
    assert summary["pipeline_parallel_size"] == pp and summary["pp_stage_shares"] == [1 / pp] * pp
    assert piped.num_steps == pp * one.num_steps  # a batch per stage
    assert piped.duration == pytest.approx(one.duration, rel=0.02)  # the fill and drain only
    assert summary["pp_bubble_fraction"] < 0.01 and summary["pp_mean_batches_in_flight"] > pp - 0.02
    one, piped = (simulate(decodes(16), pp_config(p), per_row, **NO_TRANSFER) for p in (1, pp))
    assert piped.duration == pytest.approx(one.duration / pp, rel=0.02)
    assert piped.to_json()["pp_bubble_fraction"] < 0.01


@pytest.mark.parametrize("pp", [2, 4])
def test_one_request_leaves_the_other_stages_idle(pp):
    """A lone request is in one batch at a time: each stage works 1/pp of the time, the copies add latency."""
    one = simulate(decodes(1), pp_config(1), constant)
    piped = simulate(decodes(1), pp_config(pp), constant, pp_transfer_latency_s=1e-3, pp_transfer_s_per_token=0.0)
    summary = piped.to_json()
    assert summary["pp_bubble_fraction"] == pytest.approx(1 - 1 / pp, abs=0.01)
    assert summary["pp_mean_batches_in_flight"] == pytest.approx(1.0)
    assert piped.num_steps == one.num_steps
    assert piped.duration == pytest.approx(one.duration + one.num_steps * (pp - 1) * 1e-3)


def test_the_slowest_stage_sets_the_pace():
    one = simulate(decodes(16), pp_config(1), per_row, **NO_TRANSFER)
    uneven = simulate(decodes(16), pp_config(2, pp_stage_layers=(2, 1)), per_row, **NO_TRANSFER)
    assert uneven.duration == pytest.approx(one.duration * 2 / 3, rel=0.02)
    busy = uneven.to_json()["pp_stage_utilization"]
    assert busy[0] == pytest.approx(1.0, abs=0.01) and busy[1] == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("pp,k", [(2, 0), (3, 0), (2, 4)])
def test_pipelined_batches_never_share_a_request_and_every_block_returns(pp, k, monkeypatch):
    in_flight: list[set[str]] = []
    most = 0
    original = Scheduler.update

    def applied(self, out, sampled):
        ids = {s.request.request_id for s in out.scheduled}
        assert in_flight[0] == ids  # the oldest first
        in_flight.pop(0)
        return original(self, out, sampled)

    monkeypatch.setattr(Scheduler, "update", applied)
    config = replace(spec_config(k, num_blocks=40), pipeline_parallel_size=pp)
    cost = cost_model_step_time(COST, config)

    def step_time(out):
        nonlocal most
        ids = {s.request.request_id for s in out.scheduled}
        assert all(not ids & batch for batch in in_flight)
        in_flight.append(ids)
        most = max(most, len(in_flight))
        assert len(ids) <= -(-8 // pp) and len(in_flight) <= pp
        return cost(out)

    trace = busy_trace()
    result = simulate(trace, config, step_time, seed=3, acceptance_rate=0.7)
    assert most == pp and not in_flight
    assert result.num_preemptions > 0  # the small pool still forces some (between batches in flight)
    assert [r.output_len for r in result.records] == [t.output_len for t in trace]
    assert all(r.success for r in result.records)
    assert result.free_blocks_at_end == result.num_usable_blocks
    if k:
        assert result.to_json()["spec_decode_num_drafts"] > 0


def test_cli_compares_pipeline_stages(tmp_path, capsys):
    from jaxllm.entrypoints.cli import main

    trace, cost, result = tmp_path / "t.jsonl", tmp_path / "cost.json", tmp_path / "r.json"
    synth = ["trace", "synth", "--out", str(trace), "--num-requests", "30", "--request-rate", "inf"]
    assert main([*synth, "--input-len", "40", "--output-len", "30"]) == 0
    engine = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 512, "block_size": 16}
    engine.update(num_blocks=100, enable_prefix_caching=True, num_layers=30)
    replace(COST, engine=engine).save(cost)
    runs = {}
    for pp in (1, 2):
        assert (
            main(
                [
                    "simulate",
                    str(trace),
                    "--cost",
                    str(cost),
                    "--pipeline-parallel-size",
                    str(pp),
                    "--output",
                    str(result),
                ]
            )
            == 0
        )
        runs[pp] = json.loads(result.read_text())
    assert runs[1]["pipeline_parallel_size"] == 1 and "pp_bubble_fraction" not in runs[1]
    piped = runs[2]
    assert piped["pp_stage_layers"] == [15, 15] and piped["num_blocks"] == 200  # each stage: half of each block
    assert 0 <= piped["pp_bubble_fraction"] < 0.5 and piped["pp_mean_batches_in_flight"] > 1
    assert piped["completed"] == 30 and piped["num_steps"] > runs[1]["num_steps"]
    assert "pipeline: 2 stages (layers [15, 15]), 200 KV blocks; bubble" in capsys.readouterr().out
    flags = ["--pipeline-parallel-size", "3", "--pp-layer-partition", "5,5,20", "--num-gpu-blocks-override", "90"]
    assert (
        main(
            [
                "simulate",
                str(trace),
                "--cost",
                str(cost),
                *flags,
                "--pp-transfer-latency-s",
                "0.001",
                "--output",
                str(result),
            ]
        )
        == 0
    )
    data = json.loads(result.read_text())
    assert data["pp_stage_shares"] == pytest.approx([1 / 6, 1 / 6, 2 / 3]) and data["num_blocks"] == 90
    assert data["pp_transfer_latency_s"] == 0.001 and data["pp_transfer_s_per_token"] > 0  # the default
    assert main(["simulate", str(trace), "--cost", str(cost), "--pp-transfer-latency-s", "0"]) == 2  # no stages
    assert main(["simulate", str(trace), "--cost", str(cost), "--pp-layer-partition", "15,15"]) == 2
    replace(COST, engine={**engine, "pipeline_parallel_size": 2}).save(cost)
    assert main(["simulate", str(trace), "--cost", str(cost), "--pipeline-parallel-size", "2"]) == 2  # a staged model
