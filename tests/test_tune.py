"""`jaxllm tune`: the search on a small trace and the shipped cost model, its JSON and command, bad input, and
`--validate 1` against a real `jaxllm serve` with the test shapes."""

from __future__ import annotations

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
        (None, ["--search", "tensor_parallel_size=1,2"], "cannot price"),
        (None, ["--search", "max_num_seqs=four"], "not an integer"),
        (None, ["--search", "max_num_seqs=0"], ">= 1"),
        (None, ["--search", "scheduling_policy=fcfs,nope"], "'nope'"),
        (None, ["--search", "max_num_seqs"], "NAME=V1,V2"),
        (None, ["--goodput-fraction", "1.5"], "(0, 1]"),
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
