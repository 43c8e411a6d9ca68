"""Scheduling policies: each one's admission order and preemption victim on small hand-built
scenarios, user policies by dotted path, an admission rule, and every policy through the real
scheduler with the pool consistent at the end."""

import random

import pytest

from jaxllm.config import SchedulerConfig
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.policy import POLICIES, FCFSQueue, WaitingQueue, make_waiting_queue, resolve_policy
from jaxllm.engine.scheduler import Scheduler
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams


def req(rid, prompt_len=4, *, arrival, priority=0, user=None, expected=None, tokens=None):
    return Request(
        rid,
        tokens or list(range(100, 100 + prompt_len)),
        SamplingParams(max_tokens=4, ignore_eos=True),
        priority=priority,
        arrival_time=arrival,
        user=user,
        expected_output_len=expected,
    )


def ids(requests):
    return [r.request_id for r in requests]


def drain_order(queue):
    order = []
    while len(queue):
        assert queue.peek() is list(queue)[0]  # iteration shows the admission order
        order.append(queue.pop().request_id)
    return order


def test_fcfs_serves_in_arrival_order_and_preempts_the_latest_admitted():
    q = make_waiting_queue("fcfs")
    a, b, c = req("a", arrival=1), req("b", arrival=2), req("c", arrival=3)
    for r in (a, b, c):
        q.add(r)
    q.remove(b)
    q.prepend(req("p", arrival=9))  # a preempted request goes back to the front
    assert drain_order(q) == ["p", "a", "c"]
    assert q.select_victim([a, b, c]) is c


def test_priority_serves_lowest_value_then_earliest_and_preempts_the_worst():
    q = make_waiting_queue("priority")
    rs = [
        req("low-late", arrival=3, priority=1),
        req("high", arrival=2, priority=0),
        req("low-early", arrival=1, priority=1),
        req("high-late", arrival=4, priority=0),
    ]
    for r in rs:
        q.add(r)
    assert drain_order(q) == ["high", "high-late", "low-early", "low-late"]
    assert q.select_victim(rs).request_id == "low-late"
    preempted = req("preempted", arrival=0.5, priority=1)
    q.add(req("later", arrival=5, priority=1))
    q.prepend(preempted)  # its arrival keeps it ahead of later requests of its priority
    assert drain_order(q) == ["preempted", "later"]


def test_sjf_prefers_short_expected_outputs_else_short_prompts():
    q = make_waiting_queue("sjf")
    long_prompt = req("long-prompt", 50, arrival=1)
    short_prompt = req("short-prompt", 5, arrival=2)
    short_output = req("short-output", 500, arrival=3, expected=2)
    long_output = req("long-output", 1, arrival=4, expected=400)
    for r in (long_prompt, short_prompt, short_output, long_output):
        q.add(r)
    assert drain_order(q) == ["short-output", "short-prompt", "long-prompt", "long-output"]
    assert q.select_victim([short_prompt, long_output, long_prompt]) is long_output


def test_lpm_serves_the_longest_cached_prefix_first_within_its_window():
    kv = KVCacheManager(64, 4)
    shared = list(range(200, 212))  # three blocks
    warm = req("warm", tokens=shared + [1, 2], arrival=0)
    assert kv.allocate_slots(warm, warm.num_tokens)
    kv.free(warm)  # its blocks stay cached
    q = make_waiting_queue("lpm")
    cold = req("cold", 14, arrival=1)
    two_blocks = req("two-blocks", tokens=shared[:8] + [7, 7, 7], arrival=2)
    three_blocks = req("three-blocks", tokens=shared + [9, 9], arrival=3)
    for r in (cold, two_blocks, three_blocks):
        q.add(r)
    queries = kv.prefix_cache_queries
    q.begin_step(kv)
    assert kv.prefix_cache_queries == queries  # ranking is not a cache query
    assert ids(q) == ["three-blocks", "two-blocks", "cold"]
    q.window = 2  # only the two oldest are ranked
    for r in (cold, two_blocks, three_blocks):
        q.remove(r)
        q.add(r)
    q.begin_step(kv)
    assert ids(q) == ["two-blocks", "cold", "three-blocks"]
    assert q.select_victim([cold, two_blocks]) is two_blocks


def test_fair_takes_turns_between_users_and_preempts_the_heaviest_user():
    q = make_waiting_queue("fair")
    flood = [req(f"a{i}", arrival=i, user="a") for i in range(4)]
    for r in flood + [
        req("b0", arrival=10, user="b"),
        req("c0", arrival=11, user="c"),
        req("b1", arrival=12, user="b"),
    ]:
        q.add(r)
    assert ids(q) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    assert [q.pop().request_id for _ in range(2)] == ["a0", "b0"]
    q.prepend(req("b-preempted", arrival=10.5, user="b"))  # front of b's queue; b keeps its turn
    assert drain_order(q) == ["c0", "a1", "b-preempted", "a2", "b1", "a3"]
    running = [req("a-old", arrival=0, user="a"), req("b-only", arrival=1, user="b"), req("a-new", arrival=2, user="a")]
    assert q.select_victim(running).request_id == "a-new"


class AdmitWhileHalfFree(FCFSQueue):
    """A user policy: FCFS that admits nothing while half the KV pool is in use (headroom for decodes)."""

    def can_admit(self, request, running, kv):
        return kv.usage < 0.5


class NotAPolicy:
    pass


@pytest.mark.parametrize("path", ["test_policies:AdmitWhileHalfFree", "test_policies.AdmitWhileHalfFree"])
def test_user_policy_by_dotted_path_with_an_admission_rule(path):
    assert resolve_policy(path) is AdmitWhileHalfFree
    kv = KVCacheManager(9, 4)  # 8 usable blocks
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, policy=path), kv)
    assert isinstance(sched.waiting, AdmitWhileHalfFree)
    for i in range(3):
        sched.add_request(req(f"r{i}", 16, arrival=i))  # four blocks each
    out = sched.schedule()
    assert ids(s.request for s in out.scheduled) == ["r0"]  # r0 fills half the pool: the rule stops r1


@pytest.mark.parametrize(
    "bad, message",
    [
        ("lifo", "is not one of fcfs"),
        ("no.such.module:Policy", "cannot be loaded"),
        ("test_policies:Missing", "cannot be loaded"),
        ("test_policies:NotAPolicy", "not a subclass"),
    ],
)
def test_bad_policy_names_fail_with_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(policy=bad)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_drains_random_workloads_and_returns_every_block(policy):
    rng = random.Random(policy)
    kv = KVCacheManager(24, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=20, max_model_len=64, policy=policy), kv)
    requests = []
    for step in range(400):
        if step < 150 and rng.random() < 0.3:
            prefix = [5] * 8 if rng.random() < 0.5 else []  # some share a prefix: lpm has something to rank
            r = Request(
                f"r{step}",
                prefix + [rng.randrange(1000) for _ in range(rng.randint(1, 20))],
                SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True),
                priority=rng.randrange(3),
                arrival_time=step,
                user=f"u{rng.randrange(3)}",
                expected_output_len=rng.choice([None, 5]),
            )
            requests.append(r)
            sched.add_request(r)
        out = sched.schedule()
        sched.update(out, [7] * len(out.scheduled))
    assert not sched.num_unfinished
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in requests)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_the_interface_is_small():
    abstract = {
        name for name in dir(WaitingQueue) if getattr(getattr(WaitingQueue, name), "__isabstractmethod__", False)
    }
    assert abstract == {"add", "prepend", "peek", "pop", "remove", "__len__", "__iter__"}
