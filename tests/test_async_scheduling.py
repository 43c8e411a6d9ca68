"""Async scheduling (vLLM's `async_scheduling`): step N+1 is scheduled and launched while step N runs.

The same requests give the same tokens with it on and off (greedy, seeded sampling, stop strings, a
structured-output request, speculative decoding), nothing compiles after warm-up, aborts work mid-stream,
and every KV block returns to the pool. One engine per mode and module."""

import time

import pytest

from jaxllm import LLM, SamplingParams, StructuredOutputsParams
from jaxllm.engine.scheduler import Scheduler
from jaxllm.runner.compilations import compilation_count
from tests.conftest import TEST_ENGINE, TEST_KV_BLOCKS, kv_bytes

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def make(**kw) -> LLM:
    return LLM(**TEST_ENGINE, kv_cache_memory_bytes=kv_bytes(TEST_KV_BLOCKS), **kw)


@pytest.fixture(scope="module")
def on():
    return make(async_scheduling=True)


@pytest.fixture(scope="module")
def spec_on():
    return make(async_scheduling=True, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def spec_off():
    return make(speculative_config=NGRAM)


def prompts(llm) -> list[str]:
    tok = llm.get_tokenizer()
    story = " ".join(f"word{i}" for i in range(60))  # a prompt longer than a step's 64 tokens: chunked
    questions = ["What is the capital of France?", "Count from one to ten.", f"Repeat after me: {story}", "Hi"]
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ] + ["one two three four one two three four one two three four", "The"]


def tokens(outputs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outputs]


def count_overlap(llm):
    """Wrap the scheduler: count steps that carried a placeholder token (an input still on the device)."""
    sched: Scheduler = llm.engine.scheduler
    seen = {"placeholders": 0, "steps": 0}
    original = sched.schedule

    def schedule():
        out = original()
        seen["steps"] += bool(out.scheduled)
        seen["placeholders"] += sum(s.num_placeholders for s in out.scheduled)
        return out

    sched.schedule = schedule  # type: ignore[method-assign]
    return seen


def assert_idle(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests() and len(engine.loop) == 0
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks
    assert not engine.scheduler.in_flight._pending and engine.scheduler.in_flight.num_steps == 0


def mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0, max_tokens=40),  # may stop at EOS early
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, min_tokens=3),
    ]


# ---- the scheduler alone, against a fake device ------------------------------------------------------------

VOCAB, FAKE_EOS = 50, 0


def fake_token(history: list[int]) -> int:
    """A deterministic 'model': the next token of a history (EOS now and then)."""
    h = hash(tuple(history))
    return FAKE_EOS if h % 9 == 0 else 1 + h % (VOCAB - 1)


def fake_step(out, prev_sampled) -> list[int]:
    """What the device computes, at launch time: each sampling row's token from the request's history, its
    placeholder input taken from the previous step's sampled ids as the compiled step gathers it."""
    sampled = [-1] * out.num_rows
    for s in out.scheduled:
        if not s.samples:
            continue
        history = s.request.all_token_ids[: s.start + s.num_new_tokens - s.num_placeholders]
        if s.num_placeholders:
            assert s.num_new_tokens == 1 and s.start == s.request.num_tokens and prev_sampled[s.prev_row] >= 0
            history = history + [prev_sampled[s.prev_row]]
        sampled[s.sample_row] = fake_token(history)
    return sampled


def run_scheduler(async_scheduling: bool, num_blocks: int, abort_at: int | None = None):
    from jaxllm.config import SchedulerConfig
    from jaxllm.engine.kv_cache_manager import KVCacheManager
    from jaxllm.request import Request, RequestStatus

    kv = KVCacheManager(num_blocks, 4)
    config = SchedulerConfig(4, 16, 128, async_scheduling=async_scheduling)
    sched = Scheduler(config, kv)
    requests = []
    for i in range(12):
        params = SamplingParams(max_tokens=3 + (i * 5) % 17, ignore_eos=i % 3 == 0)
        prompt = [1 + (i * 7 + j) % (VOCAB - 1) for j in range(2 + (i * 11) % 23)]
        requests.append(Request(f"r{i}", prompt, params, (FAKE_EOS,)))
        sched.add_request(requests[-1])
    queue: list = []  # (out, sampled), oldest first: at most the one being applied and the one launched
    placeholders = steps = 0
    while sched.num_unfinished or queue:
        steps += 1
        if abort_at is not None and steps == abort_at:
            sched.finish_request(requests[4], RequestStatus.FINISHED_ABORTED)
        previous = queue[0] if queue else None
        out = sched.schedule()
        if out.scheduled:
            placeholders += sum(s.num_placeholders for s in out.scheduled)
            queue.append((out, fake_step(out, previous[1] if previous else None)))
        if previous is not None or not async_scheduling:
            sched.update(*queue.pop(0))
            if async_scheduling and not out.scheduled and (out := sched.schedule()).scheduled:
                queue.append((out, fake_step(out, None)))
        assert len(queue) <= 1 and steps < 2000
    assert kv.num_free_blocks == kv.num_usable_blocks and not sched.in_flight._pending
    return [(r.output_token_ids, r.status) for r in requests], placeholders, sched.num_preemptions


@pytest.mark.parametrize("num_blocks", [200, 14])  # roomy; squeezed: preemption (sync) or waiting (async)
def test_scheduler_with_unapplied_steps_gives_the_same_tokens(num_blocks):
    expected, _, _ = run_scheduler(False, num_blocks)
    got, placeholders, _ = run_scheduler(True, num_blocks)
    assert got == expected
    assert placeholders > 0
    assert any(status.finish_reason == "stop" for _, status in got)  # some stopped at EOS, with a row in flight


def test_scheduler_abort_with_a_step_in_flight():
    expected, _, _ = run_scheduler(False, 200, abort_at=6)
    got, _, _ = run_scheduler(True, 200, abort_at=6)
    assert got[4][1].finish_reason == "abort"
    assert [g for i, g in enumerate(got) if i != 4] == [e for i, e in enumerate(expected) if i != 4]


# ---- the whole engine ---------------------------------------------------------------------------------------


def test_greedy_tokens_match_with_async_on_and_off_and_nothing_compiles(llm, on):
    params = mixed_params()
    expected = tokens(llm.generate(prompts(llm), params, use_tqdm=False))
    on.generate(prompts(on), params, use_tqdm=False)  # warm: anything lazily made is made now
    before = compilation_count()
    seen = count_overlap(on)
    assert tokens(on.generate(prompts(on), params, use_tqdm=False)) == expected
    assert compilation_count() == before
    assert seen["placeholders"] > 0.5 * seen["steps"]  # most steps overlapped the one before
    assert_idle(on)


def test_seeded_sampling_stop_strings_logprobs_and_a_structured_request(llm, on):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=32),
        SamplingParams(temperature=0, max_tokens=40, stop=["."]),  # a stop string ends it
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        SamplingParams(temperature=0.7, seed=3, max_tokens=20, repetition_penalty=1.3),  # penalties: waits
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[13], prompt_logprobs=1),  # scores: waits
    ]
    expected = llm.generate(prompts(llm), params, use_tqdm=False)
    got = on.generate(prompts(on), params, use_tqdm=False)
    assert tokens(got) == tokens(expected)
    scored, again_scored = got[5].prompt_logprobs, expected[5].prompt_logprobs
    assert scored is not None and again_scored is not None
    assert [None if d is None else sorted(d) for d in scored] == [
        None if d is None else sorted(d) for d in again_scored
    ]
    assert got[3].outputs[0].text in ("yes", "no")
    first, again = got[0].outputs[0], expected[0].outputs[0]
    assert first.logprobs is not None and again.logprobs is not None
    assert [sorted(d) for d in first.logprobs] == [sorted(d) for d in again.logprobs]
    assert first.cumulative_logprob == pytest.approx(again.cumulative_logprob, rel=1e-4, abs=1e-4)
    assert_idle(on)


def test_n_samples_match(llm, on):
    params = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=12)
    expected = llm.generate(prompts(llm)[:2], params, use_tqdm=False)
    got = on.generate(prompts(on)[:2], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]
    assert_idle(on)


def test_speculative_decoding_gives_the_same_tokens(llm, spec_on, spec_off):
    repetitive = [
        "a b c d e f a b c d e f a b c d e f a b c",
        "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    ] + prompts(llm)[:2]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 25, 10, 40)]
    plain = tokens(llm.generate(repetitive, params, use_tqdm=False))
    assert tokens(spec_off.generate(repetitive, params, use_tqdm=False)) == plain
    before = spec_on.engine.scheduler.spec_stats.num_accepted_tokens
    assert tokens(spec_on.generate(repetitive, params, use_tqdm=False)) == plain
    assert spec_on.engine.scheduler.spec_stats.num_accepted_tokens > before  # it did speculate
    assert_idle(spec_on)


def test_abort_mid_generation(llm, on):
    engine = on.engine
    tok = on.get_tokenizer()
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts(on)[:3]]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(ids):
        engine.add_request(f"abort-{i}", prompt, params)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        steps += 1
        if steps == 6:  # mid-generation, with a step in flight
            assert len(engine.loop) == 1
            aborted = engine.abort_request("abort-1")
            assert aborted is not None and aborted.finished
            assert aborted.outputs[0].finish_reason == "abort"
            finished["abort-1"] = aborted
        if steps == 10:  # and the last one: the engine keeps stepping until its launched step is applied
            for rid in ("abort-0", "abort-2"):
                if (out := engine.abort_request(rid)) is not None:
                    finished[rid] = out
    assert set(finished) == {"abort-0", "abort-1", "abort-2"}
    assert all(o.outputs[0].finish_reason == "abort" for o in finished.values())
    assert_idle(on)
    # the engine serves on as before
    expected = tokens(llm.generate(prompts(llm)[:2], params, use_tqdm=False))
    assert tokens(on.generate(prompts(on)[:2], params, use_tqdm=False)) == expected
    assert_idle(on)


def test_async_is_refused_across_nodes():
    from jaxllm.engine.args import EngineArgs
    from jaxllm.engine.core import EngineCore

    with pytest.raises(ValueError, match="async_scheduling is not supported with nnodes > 1"):
        EngineCore(EngineArgs(async_scheduling=True, nnodes=2, node_rank=1))


def test_async_llm_streams_and_drains(llm, on, monkeypatch):
    """The server's path: AsyncLLM's engine thread steps the core until its last launched step is applied."""
    import asyncio

    from jaxllm.engine.args import EngineArgs
    from jaxllm.engine.async_llm import AsyncLLM

    monkeypatch.setattr("jaxllm.engine.core.EngineCore", lambda args, progress=True: on.engine)  # share the engine
    engine = AsyncLLM(EngineArgs(async_scheduling=True), log_stats=False, progress=False)
    params = mixed_params()
    texts = prompts(on)
    expected = tokens(llm.generate(texts, params, use_tqdm=False))

    async def one(text, p):
        last = None
        async for out in engine.generate(text, p):
            last = out
        return last

    async def left_early(text):  # the consumer leaves mid-stream: the request is aborted
        async for out in engine.generate(text, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)):
            if len(out.outputs[0].token_ids) >= 3:
                break

    async def main():
        return await asyncio.gather(*[one(t, p) for t, p in zip(texts, params, strict=True)], left_early(texts[0]))

    try:
        got = asyncio.run(main())[:-1]
        assert tokens(got) == expected
        deadline = time.monotonic() + 30
        while on.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        engine.shutdown()
    assert_idle(on)
