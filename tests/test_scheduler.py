"""Scheduler and KV-cache manager without a model: continuous batching, chunked prefill,
preemption, prefix caching, policies, n > 1 forks — and every block back in the pool."""

import subprocess
import sys

import pytest

from jaxllm.config import SchedulerConfig
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.scheduler import Scheduler
from jaxllm.request import Request, RequestStatus
from jaxllm.sampling_params import SamplingParams

EOS = 0


def make(rid, prompt_len, max_tokens, *, priority=0, arrival=None, first_token=1):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    kwargs = {"arrival_time": arrival} if arrival is not None else {}
    return Request(rid, list(range(first_token, first_token + prompt_len)), params, (EOS,), priority=priority, **kwargs)


def engine(num_blocks=64, block_size=4, max_num_seqs=4, max_tokens=32, policy="fcfs", prefix=True, max_model_len=256):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, max_model_len=max_model_len, policy=policy
    )
    return Scheduler(config, kv), kv


def run_step(sched, token=7):
    out = sched.schedule()
    sched.update(out, [token + i for i in range(len(out.scheduled))])
    return out


def drain(sched, limit=1000):
    outs = []
    while sched.num_unfinished and limit:
        outs.append(run_step(sched))
        limit -= 1
    assert not sched.num_unfinished
    return outs


def test_scheduler_and_the_step_contract_import_no_jax():
    modules = ", ".join(
        f"jaxllm.{m}"
        for m in ("engine.scheduler", "engine.step_loop", "engine.kv_cache_manager", "scheduler_output", "request")
    )
    code = f"import sys, {modules}; print('jax' in sys.modules)"
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"


def test_continuous_batching_joins_as_others_finish():
    sched, kv = engine(max_num_seqs=4, max_tokens=64)
    requests = [make(f"r{i}", 3 + i % 5, 2 + (i * 7) % 11) for i in range(20)]
    for r in requests:
        sched.add_request(r)
    outs = drain(sched)
    for out in outs:
        assert len(out.scheduled) <= 4 and out.num_tokens <= 64
    first_step = {}
    for out in outs:
        for s in out.scheduled:
            first_step.setdefault(s.request.request_id, out.step)
    finish_step = {
        r.request_id: max(o.step for o in outs if any(s.request is r for s in o.scheduled)) for r in requests
    }
    # a request joined while others were still running (it did not wait for the whole batch to drain)
    late = [r for r in requests[4:] if any(first_step[r.request_id] <= finish_step[o.request_id] for o in requests[:4])]
    assert late
    assert all(r.status is RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert [r.num_output_tokens for r in requests] == [r.sampling_params.max_tokens for r in requests]
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_request_added_between_steps_starts_before_long_ones_finish():
    sched, kv = engine(max_num_seqs=4)
    longs = [make(f"long{i}", 8, 30) for i in range(2)]
    for r in longs:
        sched.add_request(r)
    for _ in range(3):
        run_step(sched)
    newcomer = make("new", 5, 3)
    sched.add_request(newcomer)
    out = run_step(sched)
    assert any(s.request is newcomer for s in out.scheduled)
    assert all(not r.is_finished for r in longs)
    drain(sched)
    assert newcomer.metrics.finished_time < min(r.metrics.finished_time for r in longs)


def test_chunked_prefill_never_starves_decodes():
    sched, kv = engine(max_num_seqs=4, max_tokens=16, num_blocks=128)
    decoder = make("dec", 4, 40)
    sched.add_request(decoder)
    run_step(sched)  # its prompt
    long_prompt = make("long", 100, 2, first_token=500)
    sched.add_request(long_prompt)
    chunks = []
    while long_prompt.num_output_tokens == 0:
        out = run_step(sched)
        assert any(s.request is decoder and s.num_new_tokens == 1 for s in out.scheduled)
        chunks += [s.num_new_tokens for s in out.scheduled if s.request is long_prompt]
    assert sum(chunks) == 100 and max(chunks) == 15 and len(chunks) > 5
    drain(sched)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_preemption_recomputes_and_returns_every_block():
    sched, kv = engine(num_blocks=9, block_size=4, max_num_seqs=4, max_tokens=32)  # 8 usable blocks = 32 tokens
    requests = [make(f"r{i}", 6, 10) for i in range(4)]
    for r in requests:
        sched.add_request(r)
    outs = drain(sched)
    assert sched.num_preemptions > 0
    assert any(out.preempted for out in outs)
    assert all(r.num_output_tokens == 10 for r in requests)
    assert kv.num_free_blocks == kv.num_usable_blocks
    # a preempted request resumed by recomputing its prompt and the tokens it had produced
    victim = next(r for r in requests if r.num_preemptions)
    assert victim.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_priority_policy_serves_and_protects_important_requests():
    sched, kv = engine(max_num_seqs=1, policy="priority")
    low = make("low", 4, 3, priority=5, arrival=1.0)
    high = make("high", 4, 3, priority=0, arrival=2.0)
    sched.add_request(low)
    sched.add_request(high)
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["high"]
    drain(sched)


def test_prefix_cache_hits_skip_computation():
    sched, kv = engine(block_size=4)
    a = make("a", 18, 2)
    sched.add_request(a)
    drain(sched)
    b = make("b", 18, 2)  # same prompt
    sched.add_request(b)
    out = run_step(sched)
    (scheduled,) = out.scheduled
    assert scheduled.start == 16 and scheduled.num_new_tokens == 2  # 4 full blocks hit; the rest computed
    assert b.num_cached_tokens == 16
    assert kv.prefix_cache_hits == 16 and kv.prefix_cache_queries == 36
    drain(sched)
    c = make("c", 18, 2, first_token=500)  # different prompt: no hit
    sched.add_request(c)
    assert run_step(sched).scheduled[0].start == 0
    drain(sched)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_full_prompt_hit_still_computes_the_last_token():
    sched, kv = engine(block_size=4)
    for rid in ("a", "b"):
        sched.add_request(make(rid, 8, 1))
        out = run_step(sched)
    assert out.scheduled[0].start == 4 and out.scheduled[0].num_new_tokens == 4


def test_eviction_reuses_least_recently_freed_blocks():
    kv = KVCacheManager(5, 4)
    r1 = make("r1", 8, 1)
    assert kv.allocate_slots(r1, 8)
    kv.free(r1)
    r2 = make("r2", 16, 1, first_token=100)
    assert kv.allocate_slots(r2, 16)  # needs all 4 blocks: r1's cached blocks are evicted
    assert kv.num_free_blocks == 0
    assert not kv.allocate_slots(make("r3", 4, 1), 4)
    kv.free(r2)
    assert kv.get_computed_blocks(make("again", 9, 1)).num_blocks == 0  # r1's prefix was evicted


def test_n_siblings_share_prompt_blocks():
    sched, kv = engine(block_size=4, num_blocks=32)
    first = make("x#0", 10, 3)
    siblings = [make(f"x#{i}", 10, 3) for i in (1, 2)]
    for s in siblings:
        s.parent_id = first.parent_id = "x"
    sched.add_request(first)
    sched.hold_siblings(first, siblings)
    run_step(sched)  # first's prompt
    assert all(kv.block_ids(s.request_id) == kv.block_ids(first.request_id)[:2] for s in siblings)
    out = run_step(sched)
    for s in siblings:
        (row,) = [x for x in out.scheduled if x.request is s]
        assert row.start == 8 and row.num_new_tokens == 2
    assert kv.blocks[kv.block_ids(first.request_id)[0]].ref_cnt == 3
    drain(sched)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_abort_frees_blocks_and_siblings():
    sched, kv = engine()
    r = make("r", 10, 50)
    sibling = make("r#1", 10, 50)
    sched.add_request(r)
    sched.hold_siblings(r, [sibling])
    sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
    assert sibling.status is RequestStatus.FINISHED_ABORTED
    running = make("s", 10, 50)
    sched.add_request(running)
    run_step(sched)
    sched.finish_request(running, RequestStatus.FINISHED_ABORTED)
    assert not sched.num_unfinished and kv.num_free_blocks == kv.num_usable_blocks


def test_stop_rules():
    sched, kv = engine()
    eos = make("eos", 4, 10)
    eos.sampling_params = SamplingParams(max_tokens=10)
    stop_id = make("stop", 4, 10)
    stop_id.sampling_params = SamplingParams(max_tokens=10, stop_token_ids=[42])
    min_tok = make("min", 4, 10)
    min_tok.sampling_params = SamplingParams(max_tokens=10, min_tokens=3)
    for r in (eos, stop_id, min_tok):
        sched.add_request(r)
    out = sched.schedule()
    sched.update(out, [EOS, 42, EOS])
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop_id.status is RequestStatus.FINISHED_STOPPED and stop_id.stop_reason == 42
    assert not min_tok.is_finished  # EOS before min_tokens does not stop


def test_max_model_len_caps_generation():
    sched, kv = engine(max_model_len=12)
    r = make("r", 8, 100)
    sched.add_request(r)
    drain(sched)
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED and r.num_tokens == 12


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_many_random_workloads_keep_the_pool_consistent(policy):
    import random

    rng = random.Random(0)
    sched, kv = engine(num_blocks=20, block_size=4, max_num_seqs=6, max_tokens=24, policy=policy)
    live = []
    for step in range(400):
        if rng.random() < 0.3:
            r = make(
                f"r{step}",
                rng.randint(1, 30),
                rng.randint(1, 12),
                priority=rng.randint(0, 3),
                first_token=rng.choice([1, 50]),
            )
            sched.add_request(r)
            live.append(r)
        if live and rng.random() < 0.05:
            sched.finish_request(rng.choice(live), RequestStatus.FINISHED_ABORTED)
        run_step(sched)
        assert kv.num_free_blocks + sum(b.ref_cnt > 0 for b in kv.blocks) == kv.num_usable_blocks
        assert sum(b.ref_cnt for b in kv.blocks) == sum(len(kv.block_ids(r.request_id)) for r in live)
    drain(sched)
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in kv.blocks)
