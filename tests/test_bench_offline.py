"""`jaxllm bench throughput` and `jaxllm bench latency`: flags, result JSON with vLLM's keys, plots,
`--compare` plumbing (a scripted peer), and the real transformers peer on a tiny workload.

The benchmarks run on the shared test engine (conftest's TEST_ENGINE shapes, compiled buckets
in JAX's cache); how flags become an engine is `make_llm`'s job, tested with the CLI.
"""

import json
import subprocess
import sys

import pytest

from jaxllm.bench import latency, offline, throughput
from jaxllm.entrypoints.cli import build_parser


def bench_args(*flags: str):
    return build_parser().parse_args(["bench", *flags])


@pytest.fixture
def shared_engine(llm, monkeypatch):
    monkeypatch.setattr(offline, "make_engine", lambda args, **_: llm)
    return llm


def test_throughput_reports_vllm_keys_host_time_and_a_plot(shared_engine, tmp_path):
    out = tmp_path / "t.json"
    args = bench_args(
        "throughput",
        "--num-prompts",
        "3",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--rounds",
        "2",
        "--output-json",
        str(out),
        "--plot",
        str(tmp_path / "plots"),
    )
    result = throughput.main(args)
    saved = json.loads(out.read_text())
    assert saved["num_requests"] == 3 and saved["total_num_tokens"] == 3 * 20 and saved["total_output_tokens"] == 12
    for key in ("elapsed_time", "requests_per_second", "tokens_per_second", "output_tokens_per_second"):
        assert saved[key] > 0, key
    assert saved["tokens_per_second"] == pytest.approx(5 * saved["output_tokens_per_second"], rel=0.3)
    assert saved["num_steps"] >= 4 and saved["device_ms_per_step"] > 0 and saved["host_ms_per_step"] >= 0
    assert len(saved["rounds"]) == 2 and "comparison" not in saved
    assert result["workload"]["num_prompts"] == 3
    assert (tmp_path / "plots" / "throughput.png").stat().st_size > 1000


def test_latency_reports_every_iteration_and_percentiles(shared_engine, tmp_path):
    args = bench_args(
        "latency",
        "--batch-size",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--num-iters",
        "3",
        "--num-iters-warmup",
        "1",
        "--output-json",
        str(tmp_path / "l.json"),
        "--plot",
        str(tmp_path),
    )
    result = latency.main(args)
    assert len(result["latencies"]) == 3 and set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)
    assert json.loads((tmp_path / "l.json").read_text())["workload"]["batch_size"] == 2
    assert (tmp_path / "latency.png").is_file()


FAKE_PEER = """
import argparse, json
ap = argparse.ArgumentParser()
for flag in ("--prompts", "--output-len", "--num-iters", "--num-iters-warmup", "--threads"):
    ap.add_argument(flag)
a = ap.parse_args()
prompts = json.load(open(a.prompts))
n = int(a.num_iters)
print(json.dumps({"engine": "fake", "num_prompts": len(prompts), "input_len": len(prompts[0]),
                  "latencies_s": [1.0] * n, "output_tokens_per_second": len(prompts) * int(a.output_len) / 1.0}))
"""


def test_compare_runs_peers_on_the_same_token_ids_and_reports_median_ratios(shared_engine, tmp_path, monkeypatch):
    (tmp_path / "transformers_generate.py").write_text(FAKE_PEER)
    (tmp_path / "llamacpp_generate.py").write_text("import sys; sys.exit('llama-cpp-python is not installed')")
    monkeypatch.setattr(offline, "PEERS_DIR", tmp_path)
    args = bench_args(
        "throughput", "--num-prompts", "2", "--input-len", "8", "--output-len", "3", "--rounds", "2", "--compare"
    )
    result = throughput.main(args)
    fake, missing = result["comparison"]["transformers"], result["comparison"]["llama.cpp"]
    assert fake["output_tokens_per_second"] == 6.0
    assert fake["ratio"] == pytest.approx(result["output_tokens_per_second"] / 6.0, rel=0.5)
    assert missing["output_tokens_per_second"] is None and "not installed" in missing["errors"][0]
    assert result["rounds"][0]["transformers"]["input_len"] == 8

    lat = latency.main(
        bench_args(
            "latency",
            "--batch-size",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--num-iters",
            "2",
            "--num-iters-warmup",
            "0",
            "--compare",
            "transformers",
        )
    )
    assert lat["comparison"]["transformers"]["latencies"] == [1.0, 1.0]


def test_bad_flags_are_named():
    with pytest.raises(ValueError, match="--num-prompts must be >= 1"):
        throughput.validate(bench_args("throughput", "--num-prompts", "0"))
    with pytest.raises(ValueError, match="default model only"):
        latency.validate(bench_args("latency", "--model", "some/model", "--compare"))
    assert offline.median_ratio([2.0, 3.0, 10.0], [1.0, 1.0, 1.0]) == 3.0


def test_transformers_peer_generates_exactly_the_asked_tokens(tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]))
    cmd = [
        sys.executable,
        str(offline.PEERS_DIR / "transformers_generate.py"),
        "--prompts",
        str(prompts),
        "--output-len",
        "3",
        "--num-iters",
        "1",
        "--num-iters-warmup",
        "0",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["engine"] == "transformers" and line["num_prompts"] == 2 and line["input_len"] == 6
    assert len(line["latencies_s"]) == 1 and line["output_tokens_per_second"] > 0
