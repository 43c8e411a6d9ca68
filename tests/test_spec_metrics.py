"""Speculative decoding's metrics: vLLM's spec_decode counters through `LLM.get_metrics()`, on `/metrics`, in the
periodic stats line and in the offline benchmarks' JSON. One engine (the default model, n-gram speculation) serves
the module; a copy prompt makes sure drafts are proposed and accepted."""

import re

import pytest

from jaxllm import LLM, EngineArgs, SamplingParams
from jaxllm.metrics.loggers import LoggingStatLogger
from jaxllm.metrics.reader import Counter, Gauge, Histogram, Vector, get_metrics_snapshot
from jaxllm.metrics.stats import spec_decode_summary
from tests.conftest import TEST_ENGINE, TEST_KV_BLOCKS, kv_bytes

K = 4
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PARAGRAPH = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He polished the great lens, "
    "trimmed the wick and wrote the weather in a leather logbook before the ships came past the rocks."
)
COPY = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{PARAGRAPH}"}]
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


@pytest.fixture(scope="module")
def spec_llm():
    llm = LLM(**TEST_ENGINE, kv_cache_memory_bytes=kv_bytes(TEST_KV_BLOCKS), speculative_config=SPEC)
    llm.chat(COPY, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    return llm


def by_name(metrics) -> dict:
    return {m.name: m for m in metrics}


def test_get_metrics_has_the_spec_decode_counters(spec_llm):
    metrics = by_name(spec_llm.get_metrics())
    drafts, draft_tokens, accepted = (metrics[f"jaxllm:{name}"] for name in SPEC_COUNTERS)
    per_pos = metrics["jaxllm:spec_decode_num_accepted_tokens_per_pos"]
    assert all(isinstance(m, Counter) for m in (drafts, draft_tokens, accepted)) and isinstance(per_pos, Vector)
    assert drafts.labels == {"model_name": spec_llm.engine.loaded.name, "engine": "0"} == per_pos.labels
    assert drafts.value > 0, "a copy prompt gives drafts"
    assert drafts.value <= draft_tokens.value <= K * drafts.value
    assert 0 < accepted.value <= draft_tokens.value, "the model copies, so some drafts are accepted"
    assert len(per_pos.values) == K and sum(per_pos.values) == accepted.value
    assert per_pos.values == sorted(per_pos.values, reverse=True), "position j is reached only past j - 1"
    # the same numbers as the engine's own totals
    stats = spec_llm.engine.stats()
    assert [drafts.value, draft_tokens.value, accepted.value] == [stats[f"{n}"] for n in SPEC_COUNTERS]
    assert per_pos.values == stats["spec_decode_num_accepted_tokens_per_pos"]


def test_get_metrics_has_the_engines_other_metrics_too(spec_llm):
    before = by_name(spec_llm.get_metrics())
    out = spec_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    after = by_name(spec_llm.get_metrics())
    assert isinstance(after["jaxllm:num_requests_running"], Gauge) and after["jaxllm:num_requests_running"].value == 0
    assert after["jaxllm:kv_cache_usage_perc"].value == 0
    for name in ("prompt_tokens", "generation_tokens", "prefix_cache_queries"):
        assert isinstance(after[f"jaxllm:{name}"], Counter), name
    generated = after["jaxllm:generation_tokens"].value - before["jaxllm:generation_tokens"].value
    assert generated == len(out[0].outputs[0].token_ids)
    assert after["jaxllm:prompt_tokens"].value - before["jaxllm:prompt_tokens"].value == len(out[0].prompt_token_ids)
    ttft = after["jaxllm:time_to_first_token_seconds"]
    assert isinstance(ttft, Histogram) and ttft.count == before["jaxllm:time_to_first_token_seconds"].count + 1
    assert ttft.buckets["+Inf"] == ttft.count and ttft.sum > 0
    success = {
        m.labels["finished_reason"]: m.value for m in spec_llm.get_metrics() if m.name == "jaxllm:request_success"
    }
    assert success["length"] >= 1 and sum(success.values()) >= 2, success  # the copy prompt's request and this one


def test_metrics_page_has_the_spec_decode_counters(spec_llm, monkeypatch):
    """The real /metrics route over an AsyncLLM whose engine-core thread drives the module's engine."""
    from fastapi.testclient import TestClient

    import jaxllm.engine.core
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app

    monkeypatch.setattr(jaxllm.engine.core, "EngineCore", lambda args, progress=True: spec_llm.engine)
    engine = AsyncLLM(EngineArgs(), served_model_name="smol-spec", log_stats=False)
    try:
        with TestClient(build_app(engine)) as http:
            before = http.get("/metrics").text
            prompt = spec_llm.get_tokenizer().apply_chat_template(COPY, tokenize=False, add_generation_prompt=True)
            body = {"model": "smol-spec", "prompt": prompt, "max_tokens": 32, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
            page = http.get("/metrics").text
    finally:
        engine.shutdown()

    def value(text: str, name: str, extra: str = "") -> float:
        pattern = rf'^jaxllm:{name}_total{{(?:[^}}]*,)?engine="0",model_name="smol-spec"{extra}}} (\S+)$'
        found = re.search(pattern, text, re.M)
        assert found, f"jaxllm:{name}_total missing from /metrics"
        return float(found[1])

    drafts, draft_tokens, accepted = (value(page, n) - value(before, n) for n in SPEC_COUNTERS)
    assert drafts > 0 and 0 < accepted <= draft_tokens
    per_pos = [value(page, "spec_decode_num_accepted_tokens_per_pos", f',position="{j}"') for j in range(K)]
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == value(page, "spec_decode_num_accepted_tokens")
    stats = spec_llm.engine.stats()
    assert value(page, "spec_decode_num_drafts") == stats["spec_decode_num_drafts"]


def test_throughput_benchmark_reports_acceptance(spec_llm):
    from jaxllm.bench import throughput

    ids = spec_llm.get_tokenizer().encode(f"{PARAGRAPH} {PARAGRAPH} ")  # said twice: the model says it again
    run = throughput.jaxllm_run(spec_llm, [ids[:64], ids[4:68]], 16)
    spec = run["spec_decode"]
    assert spec["num_drafts"] > 0
    assert 0 <= spec["acceptance_rate"] <= 1
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"], 1e-3)


# ---- no engine: the numbers from two snapshots -------------------------------------------------------


def snapshot(drafts, draft_tokens, accepted, per_pos, running=1):
    return {
        "num_running": running,
        "num_waiting": 0,
        "kv_cache_usage": 0.1,
        "num_preemptions": 0,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": draft_tokens,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_num_accepted_tokens_per_pos": per_pos,
        "spec_decode_num_unspeculated": 0,
    }


def test_summary_uses_vllms_definitions_over_the_interval():
    first = snapshot(10, 40, 20, [8, 6, 4, 2])
    second = snapshot(30, 100, 80, [28, 22, 18, 12])
    s = spec_decode_summary(second, first)
    assert s is not None
    assert (s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"]) == (20, 60, 60)
    assert s["acceptance_rate"] == 1.0 and s["mean_acceptance_length"] == 4.0
    assert s["per_position_acceptance_rate"] == [1.0, 0.8, 0.7, 0.5]
    assert spec_decode_summary({"num_running": 0}) is None, "no speculation: no summary"
    assert spec_decode_summary(first, first)["acceptance_rate"] is None, "no drafts: no rate"


def test_stats_line_says_acceptance_over_the_interval():
    stat_logger = LoggingStatLogger()
    stat_logger.record_engine(snapshot(10, 40, 20, [8, 6, 4, 2]))
    line = stat_logger.log(stat_logger._last_log + 10)
    assert line is not None and "acceptance rate 50.0%, mean acceptance length 3.00" in line
    stat_logger.record_engine(snapshot(20, 80, 30, [14, 10, 4, 2]))
    line = stat_logger.log(stat_logger._last_log + 10)  # the second interval alone: 10 drafts, 40 tokens, 10 accepted
    assert line is not None and "acceptance rate 25.0%, mean acceptance length 2.00" in line
    assert "per-position acceptance 0.60, 0.40, 0.00, 0.00" in line
    no_spec = LoggingStatLogger()
    no_spec.record_engine({k: v for k, v in snapshot(0, 0, 0, []).items() if not k.startswith("spec_")})
    assert "Spec decode" not in (no_spec.log(no_spec._last_log + 10) or "")


def test_reader_reads_a_per_position_counter_as_a_vector():
    from prometheus_client import CollectorRegistry

    from jaxllm.metrics.prometheus import PrometheusStatLogger

    registry = CollectorRegistry()
    for engine in (0, 1):
        PrometheusStatLogger("m", engine, registry).record_engine(snapshot(3, 9, 5 - engine, [3, 2 - engine, 0]))
    vectors = [m for m in get_metrics_snapshot(registry) if isinstance(m, Vector)]
    assert sorted((m.labels["engine"], m.values) for m in vectors) == [("0", [3, 2, 0]), ("1", [3, 1, 0])]
    assert all(m.name == "jaxllm:spec_decode_num_accepted_tokens_per_pos" for m in vectors)
    registry = CollectorRegistry()
    PrometheusStatLogger("m", 0, registry).record_engine(
        {k: v for k, v in snapshot(0, 0, 0, []).items() if not k.startswith("spec_")}
    )
    names = {m.name for m in get_metrics_snapshot(registry)}
    assert "jaxllm:num_requests_running" in names
    assert not any("spec_decode" in n for n in names), "as vLLM: no spec_decode metrics without speculation"
