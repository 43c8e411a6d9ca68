"""`jaxllm tune`: the search on a small trace and the shipped cost model, its JSON and command, bad input, and
`--validate 1` against a real `jaxllm serve` with the test shapes."""

from __future__ import annotations

import dataclasses
import json
import shlex
from itertools import product
from pathlib import Path

import pytest

from jaxllm.engine.args import EngineArgs
from jaxllm.entrypoints.cli import build_parser, main
from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.synth import LengthDist, synthesize
from jaxllm.sim.trace import TraceRequest, save_trace
from tests.conftest import TEST_ENGINE, TEST_KV_BLOCKS, kv_bytes

COST = str(Path(__file__).resolve().parents[1] / "examples" / "research" / "cost_cpu.json")
SLOS = ["--goodput", "ttft:300", "tpot:60"]
SEARCH = ["max_num_seqs=2,4,8", "max_num_batched_tokens=16,32,64", "scheduling_policy=fcfs,sjf"]


def small_trace(path: Path, n: int = 40, rate: float = 4.0, seed: int = 0) -> str:
    trace = synthesize(
        n,
        request_rate=rate,
        input_len=LengthDist(48, "uniform", range_ratio=0.5),
        output_len=LengthDist(16, "uniform", range_ratio=0.5),
        seed=seed,
    )
    save_trace(trace, path)
    return str(path)


@pytest.fixture
def trace(tmp_path) -> str:
    return small_trace(tmp_path / "trace.jsonl")


def tune(trace: str, out: Path, *extra: str) -> dict:
    assert main(["tune", trace, "--cost", COST, *SLOS, "--output", str(out), "--disable-tqdm", *extra]) == 0
    return json.loads(out.read_text())


def without_timing(result: dict) -> dict:
    return {**result, "search": {k: v for k, v in result["search"].items() if k != "seconds"}}


def test_the_search_is_deterministic_tries_what_search_names_and_ranks_by_max_rate(trace, tmp_path):
    runs = [tune(trace, tmp_path / f"r{i}.json", "--search", *SEARCH, "--full-grid") for i in range(2)]
    assert without_timing(runs[0]) == without_timing(runs[1])
    result = runs[0]
    tried = [c["setting"] for c in result["candidates"]]
    grid = [
        {"max_num_seqs": s, "max_num_batched_tokens": t, "scheduling_policy": p}
        for s, t, p in product((2, 4, 8), (16, 32, 64), ("fcfs", "sjf"))
    ]
    assert sorted(map(json.dumps, tried)) == sorted(map(json.dumps, grid))
    rates = [c["max_request_rate"] for c in result["candidates"]]
    assert rates[0] == max(rates) > 0 and result["candidates"][0]["max_request_rate_below"] is None
    assert result["best_setting"] == tried[0] and result["chosen_by"] == "predicted"
    assert result["predicted"]["max_request_rate"] == rates[0]
    assert 0 <= result["predicted"]["request_goodput"] and "mean_ttft_ms" in result["predicted"]
    for c in result["candidates"]:  # a pruned setting's rate is bracketed below the best's
        assert c["max_request_rate_below"] is None or c["max_request_rate_below"] <= rates[0]
        assert c["engine_args"]["max_num_seqs"] == c["setting"]["max_num_seqs"]


def test_coarse_then_refine_tries_fewer_settings_and_finds_the_same_best(trace, tmp_path):
    search = ["max_num_seqs=1,2,3,4,5,6,7,8", "max_num_batched_tokens=8,16,24,32,48,64", "scheduling_policy=fcfs,sjf"]
    full = tune(trace, tmp_path / "full.json", "--search", *search, "--full-grid")
    smart = tune(trace, tmp_path / "smart.json", "--search", *search)
    assert len(smart["candidates"]) < len(full["candidates"])
    assert smart["predicted"]["max_request_rate"] == full["predicted"]["max_request_rate"]
    assert len({json.dumps(c["setting"], sort_keys=True) for c in smart["candidates"]}) == len(smart["candidates"])


def test_command_parses_back_into_exactly_the_best_settings(trace, tmp_path):
    result = tune(trace, tmp_path / "r.json", "--search", *SEARCH, "--plot", str(tmp_path / "plots"))
    argv = shlex.split(result["command"])
    assert argv[:2] == ["jaxllm", "serve"]
    args = build_parser().parse_args(argv[1:])
    parsed = EngineArgs.from_cli_args(args)
    assert parsed == EngineArgs(**result["best"])
    for name, value in result["best_setting"].items():
        assert getattr(parsed, name) == value
    engine = CostModel.load(COST).engine  # unset flags come from the calibrated engine
    assert parsed.dtype == engine["dtype"] and parsed.max_model_len == engine["max_model_len"]
    assert parsed.kv_cache_memory_bytes == engine["num_blocks"] * engine["kv_bytes_per_block"]
    for png in ("max_request_rate.png", "latency_tradeoff.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_default_space_stays_within_what_the_cost_model_covers(trace, tmp_path):
    result = tune(trace, tmp_path / "r.json")
    engine = CostModel.load(COST).engine
    space = result["search"]["space"]
    assert set(space) == {"max_num_seqs", "max_num_batched_tokens", "scheduling_policy"}
    assert max(space["max_num_seqs"]) == engine["max_num_seqs"]
    assert max(space["max_num_batched_tokens"]) == engine["max_num_batched_tokens"]
    assert any("covers" in line for line in result["search"]["restricted"])
    beyond = tune(trace, tmp_path / "b.json", "--search", "max_num_seqs=8,16")
    assert beyond["search"]["space"] == {"max_num_seqs": [8]}
    assert any("left out [16]" in line for line in beyond["search"]["restricted"])


@pytest.mark.parametrize(
    "content, extra, message",
    [
        ("", [], "the trace is empty"),
        ('{"arrival_time": 0, "output_len": 4}\n', [], "trace.jsonl:1"),
        ("not json\n", [], "trace.jsonl:1"),
        (None, ["--search", "max_num_sequences=4"], "not an engine argument"),
        (None, ["--search", "block_size=16,32"], "cannot price"),
        (None, ["--search", "max_num_seqs=four"], "not an integer"),
        (None, ["--search", "max_num_seqs=0"], ">= 1"),
        (None, ["--search", "scheduling_policy=fcfs,nope"], "'nope'"),
        (None, ["--search", "max_num_seqs"], "NAME=V1,V2"),
        (None, ["--goodput-fraction", "1.5"], "(0, 1]"),
        (None, ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'], "acceptance rate"),
        (None, ["--data-parallel-size", "2"], "data-parallel replicas"),
    ],
)
def test_bad_input_is_a_clear_error_and_no_output_file(trace, tmp_path, capsys, content, extra, message):
    path = Path(trace)
    if content is not None:
        path.write_text(content)
    out = tmp_path / "r.json"
    assert main(["tune", str(path), "--cost", COST, *SLOS, "--output", str(out), "--disable-tqdm", *extra]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".r.json*"))


def test_a_trace_arriving_at_one_instant_has_no_rate_to_scale(tmp_path, capsys):
    path = tmp_path / "burst.jsonl"
    save_trace([TraceRequest(0.0, 8, prompt_len=16) for _ in range(4)], path)
    assert main(["tune", str(path), "--cost", COST, *SLOS, "--disable-tqdm"]) == 2
    assert "one instant" in capsys.readouterr().err


def test_slos_no_setting_meets_name_the_closest_and_the_miss(trace, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["tune", trace, "--cost", COST, "--goodput", "ttft:5", "tpot:60", "--output", str(out), "--disable-tqdm"]
    assert main([*argv, "--search", "max_num_seqs=4,8"]) == 2
    err = capsys.readouterr().err
    assert "no setting meets the SLOs" in err and "the closest, seqs=" in err and "TTFT" in err and "x its SLO" in err
    assert not out.exists()


def test_a_cost_model_from_another_machine_is_warned_about(trace, tmp_path, caplog):
    data = json.loads(Path(COST).read_text())
    data["engine"].update(
        machine="elsewhere", processor="arm64", cpu="Some Other CPU", kernel_target="NEON (-march=armv8-a)"
    )
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    out = tmp_path / "r.json"
    argv = ["tune", trace, "--cost", str(other), *SLOS, "--output", str(out), "--disable-tqdm"]
    assert main([*argv, "--search", "max_num_seqs=8", "--dtype", "bfloat16"]) == 0
    warned = caplog.text
    assert "machine: calibrated 'elsewhere'" in warned and "processor: calibrated 'arm64'" in warned
    assert "dtype: calibrated 'float32', here 'bfloat16'" in warned
    assert "cpu: calibrated 'Some Other CPU'" in warned and "kernel_target: calibrated 'NEON" in warned
    assert len(json.loads(out.read_text())["cost_model_differences"]) == 5


def test_validate_one_serves_the_best_for_real(tmp_path):
    """`--validate 1` end to end: the best of the test shapes served by `jaxllm serve`, the trace replayed."""
    trace = small_trace(tmp_path / "trace.jsonl", n=8, rate=4.0)
    search = [
        f"max_num_seqs={TEST_ENGINE['max_num_seqs']}",
        f"max_num_batched_tokens={TEST_ENGINE['max_num_batched_tokens']}",
    ]
    result = tune(trace, tmp_path / "r.json", "--search", *search, "scheduling_policy=fcfs,sjf", "--validate", "1")
    assert result["chosen_by"] == "measured" and len(result["validated"]) == 1
    row = result["validated"][0]
    assert row["measured"]["completed"] == 8 and row["measured"]["failed"] == 0
    assert set(row["compared"]) >= {"goodput_fraction", "request_goodput", "mean_ttft_ms", "mean_tpot_ms"}
    assert result["best"]["kv_cache_memory_bytes"] == kv_bytes(TEST_KV_BLOCKS)


# ---- --max-rate: one setting's highest sustainable Poisson rate ------------------------------------------------


def test_max_rate_bisects_a_seeded_poisson_process_to_the_boundary(trace, tmp_path):
    from jaxllm.bench.serve import parse_goodput
    from jaxllm.sim.trace import load_trace
    from jaxllm.tune.capacity import STEPS_PER_DOUBLING, Objective, poisson
    from jaxllm.tune.space import base_engine_args

    runs = [tune(trace, tmp_path / f"m{i}.json", "--max-rate", "--max-num-seqs", "4") for i in range(2)]
    assert without_timing(runs[0]) == without_timing(runs[1])
    result = runs[0]
    rate, above = result["max_request_rate"], result["max_request_rate_below"]
    assert rate > 0 and above == pytest.approx(rate * 2 ** (1 / STEPS_PER_DOUBLING))
    assert result["setting"]["max_num_seqs"] == 4 and result["engine_args"]["max_num_seqs"] == 4
    tried = {r["request_rate"]: r for r in result["rates"]}
    assert tried[rate]["sustainable"] and not tried[above]["sustainable"]
    assert result["predicted"]["max_request_rate"] == rate and result["predicted"]["goodput_fraction"] >= 0.99
    assert result["arrivals"] == {"process": "poisson", "seed": 0, "start_rate": pytest.approx(3.9, rel=0.3)}
    # the arrivals simulated are the ones `jaxllm bench serve --request-rate R --seed 0` sends (`retime`): the
    # simulator on poisson(trace, R) directly gives the same figures
    args = build_parser().parse_args(shlex.split(result["bench_command"])[1:])
    assert args.request_rate == rate and args.seed == 0 and args.dataset_path == trace
    engine = base_engine_args(EngineArgs(max_num_seqs=4), CostModel.load(COST))
    direct = Objective(poisson(load_trace(trace), rate, 0), CostModel.load(COST), parse_goodput(SLOS[1:]), rate=rate)
    run = direct.run(engine)
    assert run.fraction == result["predicted"]["goodput_fraction"]
    for key in ("mean_ttft_ms", "mean_tpot_ms", "duration"):
        assert run.summary[key] == pytest.approx(result["predicted"][key])
    assert EngineArgs(**result["engine_args"]) == engine and "--max-num-seqs 4" in result["command"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--search", "max_num_seqs=4,8"], "leave out --search"),
        (["--full-grid"], "leave out --full-grid"),
        (["--validate", "2"], "1, not 2"),
        (["--goodput", "ttft:5", "tpot:60"], "no setting meets the SLOs"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'], "acceptance rate"),
        (["--acceptance-rate", "1.5"], "[0, 1]"),
    ],
)
def test_max_rate_bad_input_is_a_clear_error_and_no_output_file(trace, tmp_path, capsys, extra, message):
    out = tmp_path / "r.json"
    assert (
        main(["tune", trace, "--cost", COST, *SLOS, "--output", str(out), "--disable-tqdm", "--max-rate", *extra]) == 2
    )
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_max_rate_validate_serves_the_setting_at_the_poisson_arrivals_found(trace, tmp_path, monkeypatch):
    """`--max-rate --validate 1` hands `measure` (a real `jaxllm serve` + bench serve's client, run end to end by
    test_validate_one_serves_the_best_for_real) the setting and the very arrivals `jaxllm bench serve --request-rate
    R --seed S` sends; here `measure` is replaced, to keep this file's runtime small (a server start is ~30 s)."""
    from jaxllm.sim.trace import load_trace
    from jaxllm.tune import validate
    from jaxllm.tune.capacity import poisson

    served = {}

    def measure(candidate, requests, slos, *, seed=0, **_):
        served.update(args=candidate.args, requests=requests, seed=seed)
        return {**candidate.capacity.at_max.summary, "goodput_fraction": 0.5}

    monkeypatch.setattr(validate, "measure", measure)
    result = tune(trace, tmp_path / "r.json", "--max-rate", "--validate", "1", "--seed", "3")
    rate, row = result["max_request_rate"], result["validated"]
    assert row["request_rate"] == rate and served["seed"] == 3
    assert served["args"] == EngineArgs(**result["engine_args"])
    expected = poisson(load_trace(trace), rate, 3)
    assert [r.arrival_time for r in served["requests"]] == pytest.approx([r.arrival_time for r in expected])
    assert row["compared"]["goodput_fraction"] == {
        "predicted": result["predicted"]["goodput_fraction"],
        "measured": 0.5,
        "relative_error": pytest.approx(
            (0.5 - result["predicted"]["goodput_fraction"]) / result["predicted"]["goodput_fraction"]
        ),
    }
    assert row["slos_hold"] is False and row["compared"]["mean_ttft_ms"]["relative_error"] == 0


# ---- the rest of the space: speculation depth and layouts -------------------------------------------------------


def test_speculation_depth_is_searched_with_an_acceptance_rate_and_served_as_ngram(trace, tmp_path):
    result = tune(trace, tmp_path / "r.json", "--search", "num_speculative_tokens=0,2,8", "--acceptance-rate", "0.9")
    assert result["search"]["space"] == {"num_speculative_tokens": [0, 2]}
    assert any("left out [8]" in line for line in result["search"]["restricted"])
    by_k = {c["setting"]["num_speculative_tokens"]: c for c in result["candidates"]}
    assert by_k[2]["predicted"]["mean_tpot_ms"] < by_k[0]["predicted"]["mean_tpot_ms"]  # 90 % accepted: it pays
    assert "speculative_config" not in by_k[0]["engine_args"]
    assert by_k[2]["engine_args"]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    parsed = EngineArgs.from_cli_args(build_parser().parse_args(shlex.split(result["command"])[1:]))
    best = EngineArgs(**result["best"])  # the flag is the config's JSON text, the result's a dict: the same config
    assert parsed.speculative() == best.speculative() and parsed.speculative() is not None
    assert dataclasses.replace(parsed, speculative_config=None) == dataclasses.replace(best, speculative_config=None)
    # the default space has speculation depth in it where an acceptance rate is known
    from jaxllm.sim.trace import load_trace
    from jaxllm.tune.space import build_space

    requests, cost = load_trace(trace), CostModel.load(COST)
    assert build_space({}, cost, requests, {}, acceptance_known=True).values["num_speculative_tokens"] == [0, 1, 2, 4]
    without = build_space({}, cost, requests, {})
    assert "num_speculative_tokens" not in without.values and "no speculation depth" in without.restricted[-1]


def test_layouts_pipeline_is_searched_tensor_restricted_to_the_calibrated_size_data_refused(trace, tmp_path, capsys):
    from jaxllm.tune.capacity import sim_config_of
    from jaxllm.tune.space import base_engine_args

    result = tune(trace, tmp_path / "r.json", "--search", "pipeline_parallel_size=1,2", "tensor_parallel_size=1,2")
    assert result["search"]["space"] == {"pipeline_parallel_size": [1, 2], "tensor_parallel_size": [1]}
    restricted = " ".join(result["search"]["restricted"])
    assert "tensor_parallel_size: left out [2]" in restricted and "pipeline_parallel_size: priced" in restricted
    assert {c["setting"]["pipeline_parallel_size"] for c in result["candidates"]} == {1, 2}
    cost = CostModel.load(COST)
    base = base_engine_args(EngineArgs(), cost)
    one, two = (sim_config_of(EngineArgs(**{**vars(base), "pipeline_parallel_size": p}), cost) for p in (1, 2))
    assert two.pipeline_parallel_size == 2 and two.num_blocks == 2 * one.num_blocks  # each stage: half the layers
    out = tmp_path / "dp.json"
    argv = ["tune", trace, "--cost", COST, *SLOS, "--output", str(out), "--disable-tqdm"]
    assert main([*argv, "--search", "data_parallel_size=1,2"]) == 2
    assert "does not model data-parallel replicas" in capsys.readouterr().err
    assert main([*argv, "--search", "tensor_parallel_size=2"]) == 2
    assert "nothing left to search" in capsys.readouterr().err and not out.exists()


def conversation_trace(path: Path) -> str:
    """Multi-turn chat sharing two system prompts: what a router's policy decides about."""
    from jaxllm.sim.synth import conversations

    trace = conversations(
        24,
        4,
        request_rate=2.0,
        turn_len=LengthDist(24, "uniform", range_ratio=0.25),
        output_len=LengthDist(8, "fixed"),
        think_time_s=1.0,
        num_prefix_groups=2,
        prefix_len=96,
        seed=1,
    )
    save_trace(trace, path)
    return str(path)


def test_instances_search_the_router_policy_in_the_cluster_simulator(tmp_path, capsys):
    trace = conversation_trace(tmp_path / "chat.jsonl")
    result = tune(trace, tmp_path / "r.json", "--instances", "2", "--search", "max_num_seqs=8", "--full-grid")
    routers = ["round_robin", "least_loaded", "session", "prefix_aware", "pd 1:1"]
    assert result["search"]["space"] == {"max_num_seqs": [8], "router": routers}
    rates = {c["setting"]["router"]: c["max_request_rate"] for c in result["candidates"]}
    assert set(rates) == set(routers) and min(rates.values()) > 0
    # turns that find their history cached sustain more than turns sent round the instances
    assert max(rates["session"], rates["prefix_aware"]) > rates["round_robin"]
    best = result["best_setting"]["router"]
    assert result["instances"] == 2 and rates[best] == max(rates.values())
    assert (
        result["router_command"].endswith(f"--policy {best}")
        and "--instances http://HOST1:8000" in (result["router_command"])
    )
    assert "router" not in result["command"]  # each instance's own flags: no router there
    out = capsys.readouterr().out
    assert "2 instances behind a router" in out and "routed by: jaxllm router" in out
    # a P/D split: the router's P/D mode in front
    pd = tune(trace, tmp_path / "pd.json", "--instances", "4", "--search", "max_num_seqs=8", "router=pd 1:3,pd2:2")
    assert pd["search"]["space"]["router"] == ["pd 1:3", "pd 2:2"] and pd["best_setting"]["router"].startswith("pd")
    p, _ = map(int, pd["best_setting"]["router"].removeprefix("pd ").split(":"))
    hosts = [f"http://HOST{k}:8000" for k in range(1, 5)]
    assert pd["router_command"] == " ".join(["jaxllm router --prefill", *hosts[:p], "--decode", *hosts[p:]])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--search", "router=round_robin"], "give --instances N"),
        (["--instances", "2", "--search", "router=nope"], "'nope'"),
        (["--instances", "2", "--search", "router=pd 0:2"], "PREFILL:DECODE"),
        (["--instances", "2", "--search", "router=pd 1:2"], "add up to --instances"),
        (["--instances", "0"], "--instances must be >= 1"),
        (["--instances", "2", "--validate", "1"], "benchmarks/cluster_routing.py"),
        (["--instances", "2", "--max-rate"], "leave out --instances"),
    ],
)
def test_instances_bad_input_is_a_clear_error(trace, tmp_path, capsys, extra, message):
    out = tmp_path / "r.json"
    assert main(["tune", trace, "--cost", COST, *SLOS, "--output", str(out), "--disable-tqdm", *extra]) == 2
    assert message in capsys.readouterr().err and not out.exists()
