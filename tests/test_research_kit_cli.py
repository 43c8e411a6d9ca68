"""The research kit's commands as a new user meets them (issue 44, finding 2 and calibrate's part of 3):
`jaxllm calibrate` covers the server `jaxllm serve` runs and says so; `simulate` and `tune` refuse up front, in one
line, a trace the cost model cannot hold; `simulate`'s summary names the engine simulated and why requests failed;
tune's default space holds serve's defaults where covered; `--validate` reads measured vs predicted; calibrate
reports progress. Cheap: the shipped cost model, no calibration (the engine-backed test shares the session's
engine)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from jaxllm.engine.args import CPU_DEFAULTS, EngineArgs
from jaxllm.entrypoints.cli import build_parser, main
from jaxllm.sim.costmodel import CostModel
from jaxllm.sim.synth import LengthDist, synthesize
from jaxllm.sim.trace import save_trace

COST = str(Path(__file__).resolve().parents[1] / "examples" / "research" / "cost_cpu.json")
SLOS = ["--goodput", "ttft:300", "tpot:60"]


def trace_file(path: Path, input_len: int, n: int = 60, range_ratio: float = 0.0) -> str:
    trace = synthesize(
        n,
        request_rate=2.0,
        input_len=LengthDist(input_len, "uniform", range_ratio=range_ratio),
        output_len=LengthDist(32),
        seed=1,
    )
    save_trace(trace, path)
    return str(path)


# ---- calibrate: serve's defaults, said in --help ------------------------------------------------------------------


def test_calibrate_defaults_are_serves_and_help_says_them(capsys):
    calibrate = EngineArgs.from_cli_args(build_parser().parse_args(["calibrate", "--out", "cost.json"]))
    serve = EngineArgs.from_cli_args(build_parser().parse_args(["serve"]))
    assert calibrate == serve  # max_model_len, max_num_seqs, max_num_batched_tokens: unset, as serve's
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens"):
        assert flag in text
    assert "(default: as `jaxllm serve`, the model's maximum: 8192 for the default model)" in text
    assert f"(default: as `jaxllm serve`, {CPU_DEFAULTS['max_num_seqs']} on a CPU" in text
    assert f"(default: as `jaxllm serve`, {CPU_DEFAULTS['max_num_batched_tokens']} on a CPU" in text
    assert "(default: 5)" in text and "(default: None)" not in text


# ---- simulate and tune: a trace the cost model cannot hold, refused in one line -----------------------------------


def test_simulate_and_tune_refuse_requests_longer_than_the_cost_model_holds(tmp_path, capsys):
    """The issue's command: prompts of 400-900 tokens on the shipped cost model (max_model_len 512)."""
    trace = trace_file(tmp_path / "long.jsonl", 650, range_ratio=0.4)
    out = tmp_path / "r.json"
    started = time.perf_counter()
    for argv in (
        ["simulate", trace, "--cost", COST, "--output", str(out)],
        ["tune", trace, "--cost", COST, *SLOS, "--disable-tqdm", "--output", str(out)],
        ["tune", trace, "--cost", COST, *SLOS, "--disable-tqdm", "--max-rate", "--output", str(out)],
    ):
        assert main(argv) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert len(err.splitlines()) == 1, err  # one line
        assert err.startswith(f"jaxllm {argv[0]}: error: ")
        assert "of 60 requests need more than max_model_len=512 tokens (as calibrated)" in err
        assert "by the prompt alone" in err and "a server refuses them" in err
        assert f"`jaxllm calibrate --out {COST[:-5]}_1024.json --max-model-len 1024 --dtype float32`" in err
        assert "Simulated Serving Result" not in captured.out and not out.exists()
    assert time.perf_counter() - started < 30  # refused before any simulation
    # a limit given as a flag is named as such; one that holds the trace runs
    assert main(["simulate", trace, "--cost", COST, "--max-model-len", "600"]) == 2
    assert "max_model_len=600 tokens (--max-model-len)" in capsys.readouterr().err
    assert main(["simulate", trace, "--cost", COST, "--max-model-len", "1024"]) == 0


# ---- simulate's summary: the engine simulated, and why requests failed --------------------------------------------


def test_simulate_summary_names_the_engine_settings_and_what_is_extrapolated(tmp_path, capsys):
    trace = trace_file(tmp_path / "short.jsonl", 64, n=20)
    assert main(["simulate", trace, "--cost", COST, "--max-num-seqs", "16"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("engine simulated:"))
    engine = CostModel.load(COST).engine
    assert f"max_model_len {engine['max_model_len']}, max_num_seqs 16, max_num_batched_tokens 64" in line
    assert f"num_blocks {engine['num_blocks']}" in line and "scheduling_policy fcfs" in line
    assert "(from flags: max_num_seqs; the rest as calibrated)" in line
    assert line.endswith("beyond the calibrated shapes (extrapolated): max_num_seqs 16 > 8")
    assert "requests failed" not in out


def test_failed_requests_are_counted_by_reason_as_a_server_refuses_them():
    from jaxllm.config import SchedulerConfig
    from jaxllm.sim.coverage import failure_line
    from jaxllm.sim.simulator import SimConfig, cost_model_step_time, simulate
    from jaxllm.sim.trace import TraceRequest

    cost = CostModel.load(COST)
    config = SimConfig(SchedulerConfig(8, 64, 256), num_blocks=64)
    trace = [
        TraceRequest(0.0, 8, prompt_len=300),  # the prompt alone is too long
        TraceRequest(0.1, 100, prompt_len=200),  # prompt + output: a server refuses it (vLLM's max_tokens rule)
        TraceRequest(0.2, 100, prompt_len=220),
        TraceRequest(0.3, 8, prompt_len=16),
    ]
    result = simulate(trace, config, cost_model_step_time(cost, config))
    assert [r.success for r in result.records] == [False, False, False, True]
    assert failure_line([r.error for r in result.records]) == (
        "3 requests failed: 2 prompt + output longer than max_model_len=256, 1 prompt longer than max_model_len=256"
    )


# ---- tune: serve's defaults in the default space where the cost model covers them ---------------------------------


def test_tunes_default_space_holds_serves_defaults_where_the_cost_model_covers_them(tmp_path):
    from jaxllm.sim.trace import load_trace
    from jaxllm.tune.space import build_space

    requests = load_trace(trace_file(tmp_path / "t.jsonl", 64, n=10))
    shipped = CostModel.load(COST)  # 8 sequences, 64-token steps: serve's 64 / 512 are beyond it
    space = build_space({}, shipped, requests, {}).values
    assert max(space["max_num_seqs"]) == 8 and max(space["max_num_batched_tokens"]) == 64
    wide = CostModel.load(COST)
    wide.engine.update(max_num_seqs=96, max_num_batched_tokens=768)
    wide.bucket_tokens.extend([128, 256, 512, 768])
    wide.bucket_base_s.extend([0.1, 0.2, 0.4, 0.6])
    space = build_space({}, wide, requests, {}).values
    assert CPU_DEFAULTS["max_num_seqs"] in space["max_num_seqs"] and max(space["max_num_seqs"]) == 64
    assert CPU_DEFAULTS["max_num_batched_tokens"] in space["max_num_batched_tokens"]
    short = CostModel.load(COST)  # a cost model that stops short of serve's 64 sequences: left out
    short.engine.update(max_num_seqs=48)
    assert build_space({}, short, requests, {}).values["max_num_seqs"] == [1, 2, 4, 8, 16, 32]


# ---- --validate: measured vs predicted, with the sign a reader expects ---------------------------------------------


def test_validate_reads_measured_vs_predicted():
    from jaxllm.tune.report import validation_table
    from jaxllm.tune.validate import COMPARED, side_by_side

    predicted = dict.fromkeys(COMPARED, 1.0) | {"mean_ttft_ms": 129.0, "mean_tpot_ms": 26.1, "goodput_fraction": 1.0}
    measured = dict.fromkeys(COMPARED, 1.0) | {"mean_ttft_ms": 5300.0, "mean_tpot_ms": 130.0, "goodput_fraction": 0.0}
    compared = side_by_side(predicted, measured)
    assert compared["mean_ttft_ms"]["relative_error"] == pytest.approx((5300 - 129) / 129)  # +4009 %, not -98 %
    assert compared["goodput_fraction"]["relative_error"] == -1.0
    table = validation_table([{"setting": {"max_num_seqs": 8}, "compared": compared}])
    assert "measured vs predicted" in table.splitlines()[0]
    assert "seqs=8: measured mean TTFT 5.3 s vs predicted 129 ms (+4009%), " in table
    assert "measured mean TPOT 130 ms vs predicted 26.1 ms (+398%)" in table


# ---- calibrate's progress -----------------------------------------------------------------------------------------


def test_waiting_on_a_silent_child_ticks_with_its_log(tmp_path, capsys):
    from jaxllm.sim.progress import Progress, last_line

    log = tmp_path / "serve.log"
    log.write_text("INFO loading\nCompiling steps: 3/17\n")
    with Progress().waiting("Starting jaxllm serve", last_line(log), interval=0.1) as waiting:
        time.sleep(0.6)
    assert waiting.ticks >= 3
    err = capsys.readouterr().err
    assert "Starting jaxllm serve" in err and "Compiling steps: 3/17" in err


def test_calibrate_says_each_part_and_shows_bars(llm, monkeypatch, capsys):
    """`calibrate` on the session's engine (test shapes), its traces shrunk to seconds: a line per part and a
    bar per pass on stderr."""
    import jaxllm.sim.calibrate as calibrate
    from jaxllm.sim.progress import Progress

    def quick(n: int, rate: float):
        return lambda max_model_len, seed=3: synthesize(
            n, request_rate=rate, input_len=LengthDist(24), output_len=LengthDist(6), seed=seed
        )

    monkeypatch.setattr(calibrate, "light_trace", quick(4, 20.0))
    monkeypatch.setattr(calibrate, "busy_trace", quick(4, 40.0))
    monkeypatch.setattr(calibrate, "engine_pass_trace", lambda *shapes, seed=0: quick(8, float("inf"))(0, seed))
    points = calibrate.sweep_points
    monkeypatch.setattr(calibrate, "sweep_points", lambda *a: points(*a)[::6])
    model = calibrate.calibrate(llm.engine, repeats=1, progress=Progress())
    err = capsys.readouterr().err
    for said in ("device sweep:", "device fit:", "engine pass:", "engine host overhead:", "a light trace"):
        assert said in err
    for bar in ("Timing steps", "Engine pass (warm)", "Engine pass", "Light trace", "Busy trace"):
        assert bar in err
    assert model.engine["max_num_seqs"] == 8
