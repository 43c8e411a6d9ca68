"""KV events: the stored/removed stream rebuilds each engine's cached block set exactly (eviction, preemption, abort,
reset), and a reader that misses a batch notices: a replay fills the gap, else the instance's blocks count as
unknown. The KV manager alone runs random workloads; the tiny engine runs end to end; ZeroMQ on loopback."""

from __future__ import annotations

import random
import threading
import time

import pytest

from jaxllm.config import KVEventsConfig
from jaxllm.engine.block_hash import NO_SCOPE
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from jaxllm.kv_events.index import InstanceView, PrefixIndex
from jaxllm.kv_events.publisher import InProcessSink, KVEventCollector, ZmqEventPublisher
from jaxllm.kv_events.subscriber import EventSequencer, InProcessSubscriber, ZmqEventSubscriber
from jaxllm.request import Request
from jaxllm.sampling_params import SamplingParams

SCOPE = NO_SCOPE.hex()


def cached_set(kv: KVCacheManager) -> set:
    return {(SCOPE, None, group, h) for group, h in kv._cached}


class Watched:
    """A KV manager with a collector and a reader rebuilding its blocks in an index."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        sink = InProcessSink()
        self.collector = KVEventCollector(sink, block_size=kv.block_size, scope=SCOPE)
        kv.listener = self.collector
        self.index = PrefixIndex()
        self.reader = InProcessSubscriber(sink.reader(), InstanceView(self.index, "e"))

    def check(self) -> None:
        self.collector.flush()
        self.reader.poll()
        assert self.index.blocks_of("e") == cached_set(self.kv)


@pytest.mark.parametrize("windows", [(None,), (8, None)])
def test_event_stream_rebuilds_the_cached_set_under_random_churn(windows):
    """Requests sharing prefixes allocate in chunks, finish, are dropped with their hashes (a failed step), the
    cache is reset; a pool of 14 blocks forces evictions of cached blocks. After every step the reader's view is
    exactly the manager's prefix cache."""
    rng = random.Random(0)
    w = Watched(KVCacheManager(14, 4, windows=windows))
    prefixes = [[rng.randrange(1, 90) for _ in range(12)] for _ in range(3)]
    live: list[Request] = []
    for step in range(300):
        action = rng.random()
        if action < 0.45 or not live:
            prompt = rng.choice(prefixes)[: rng.randrange(4, 13)] + [
                rng.randrange(1, 90) for _ in range(rng.randrange(0, 9))
            ]
            request = Request(f"r{step}", prompt, SamplingParams(max_tokens=8), (0,))
            hit = w.kv.get_computed_blocks(request)
            n = min(request.num_tokens - hit.num_blocks * 4, rng.randrange(1, 9))
            if w.kv.allocate_slots(request, n, hit):
                request.num_computed_tokens = hit.num_blocks * 4 + n
                live.append(request)
        elif action < 0.75:
            request = rng.choice(live)
            left = request.num_tokens - request.num_computed_tokens
            if left <= 0:
                request.output_token_ids.append(rng.randrange(1, 90))  # a decode
                left = 1
            if w.kv.allocate_slots(request, left):
                request.num_computed_tokens += left
            else:  # preempted: blocks back, recomputed later
                w.kv.free(request)
                live.remove(request)
        elif action < 0.95:
            request = live.pop(rng.randrange(len(live)))
            w.kv.free(request, uncache=rng.random() < 0.2)  # finished, or its K/V declared invalid
        else:
            w.kv.reset_prefix_cache()
        w.check()
    assert w.collector.next_seq > 50


def test_batches_are_numbered_per_step_and_encode_round_trip():
    sink = InProcessSink()
    reader = sink.reader()
    collector = KVEventCollector(sink, block_size=4, scope=SCOPE)
    assert collector.flush() is None  # nothing changed: no batch, no number used
    collector.stored(0, [b"a" * 32, b"b" * 32], None, list(range(8)), Request("x", [1] * 8, SamplingParams(), (0,)))
    collector.removed(1, b"c" * 32)
    collector.removed(1, b"d" * 32)
    collector.cleared()
    first = collector.flush()
    collector.removed(0, b"e" * 32)
    second = collector.flush()
    assert [b.seq for b in reader.poll()] == [0, 1]
    assert first is not None and second is not None
    assert first.events == [
        BlockStored([b"a" * 32, b"b" * 32], None, list(range(8)), 4, None, SCOPE, 0),
        BlockRemoved([b"c" * 32, b"d" * 32], None, SCOPE, 1),
        AllBlocksCleared(),
    ]
    again = EventBatch.decode(first.seq, first.encode())
    assert again.events == first.events and again.ts == first.ts


class Recorder:
    def __init__(self):
        self.applied: list[int] = []
        self.resyncs = 0

    def apply(self, batch: EventBatch) -> None:
        self.applied.append(batch.seq)

    def resync(self) -> None:
        self.resyncs += 1


def test_a_dropped_batch_is_detected_and_replayed_or_resynced():
    buffered = {s: EventBatch(s) for s in range(10)}
    rec = Recorder()
    seq = EventSequencer(rec, replay=lambda first: [buffered[s] for s in sorted(buffered) if s >= first])
    for s in (0, 1, 4, 5):  # 2 and 3 dropped
        seq.receive(buffered[s])
    assert rec.applied == [0, 1, 2, 3, 4, 5] and seq.gaps == 1 and rec.resyncs == 0
    del buffered[6]  # the replay buffer no longer covers 6
    seq.receive(buffered[7])
    assert rec.resyncs == 1 and rec.applied[-1] == 7 and 6 not in rec.applied
    seq.receive(buffered[7])  # a repeat: dropped
    assert rec.applied.count(7) == 1
    seq.receive(EventBatch(0, epoch="restarted"))  # a new epoch: a restarted publisher, its engine's cache empty
    assert rec.resyncs == 2 and seq.restarts == 1 and rec.applied[-1] == 0 and seq.last_seq == 0

    # in-process: no replay, so a reader that fell behind (its queue bounded) resyncs
    sink = InProcessSink(buffer_steps=2)
    index = PrefixIndex()
    sub = InProcessSubscriber(sink.reader(), InstanceView(index, "e"))
    stored = BlockStored([b"h" * 32], None, [1, 2, 3, 4], 4, None, SCOPE, 0)
    sink.publish(EventBatch(0, events=[stored]))
    sub.poll()
    assert index.blocks_of("e")
    for s in range(1, 5):
        sink.publish(EventBatch(s))  # 1 and 2 fall out of the reader's queue
    sub.poll()
    assert sub.sequencer.resyncs == 1 and not index.blocks_of("e")  # the stale view is dropped, not kept


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_zmq_publisher_subscriber_replay_and_resync():
    """Batches published before the subscriber joined come from the replay socket; when the buffer has moved on,
    the view resyncs (its blocks dropped) and goes on from the live stream."""
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=8)
    try:
        stored = [BlockStored([bytes([i]) * 32], None, [i] * 4, 4, None, SCOPE, 0) for i in range(200)]
        for i in range(3):
            pub.publish(EventBatch(i, events=[stored[i]]))
        index = PrefixIndex()
        sub = ZmqEventSubscriber(pub.endpoint, InstanceView(index, "e"), replay_endpoint=pub.replay_endpoint)
        seq = 3
        while sub.sequencer.last_seq is None or sub.sequencer.last_seq < 3:  # the slow joiner: publish until heard
            pub.publish(EventBatch(seq, events=[stored[seq]]))
            seq += 1
            time.sleep(0.02)
            sub.receive_ready()
        wait_for(lambda: sub.receive_ready() == 0 and sub.sequencer.last_seq == seq - 1)
        assert sub.sequencer.resyncs == 0
        assert index.blocks_of("e") == {(SCOPE, None, 0, bytes([i]) * 32) for i in range(seq)}

        # a gap the 8-batch buffer cannot cover: 10 batches the subscriber never reads
        sub.socket.close()
        last_applied = seq - 1
        for _ in range(10):
            pub.publish(EventBatch(seq, events=[stored[seq]]))
            seq += 1
        time.sleep(0.1)
        sub2 = ZmqEventSubscriber(pub.endpoint, InstanceView(index, "e"), replay_endpoint=pub.replay_endpoint)
        sub2.sequencer.last_seq = last_applied  # it had applied this far before
        while sub2.sequencer.last_seq == last_applied:
            pub.publish(EventBatch(seq, events=[stored[seq]]))
            seq += 1
            time.sleep(0.02)
            sub2.receive_ready()
        assert sub2.sequencer.resyncs == 1
        held = index.blocks_of("e")
        assert (SCOPE, None, 0, bytes([0]) * 32) not in held  # the pre-gap view is gone
        assert (SCOPE, None, 0, bytes([seq - 1]) * 32) in held
        sub2.close()
    finally:
        pub.close()


def test_one_subscriber_thread_reads_instances_added_while_it_runs():
    """A router's one thread: the first instance found starts it, a later one joins and is caught up from its
    replay, and both instances' blocks land in the index."""
    from jaxllm.kv_events.subscriber import SubscriberThread

    pubs = [ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=8) for _ in range(2)]
    index, thread = PrefixIndex(), SubscriberThread(poll_ms=10)
    try:
        for k, pub in enumerate(pubs):
            pub.publish(EventBatch(0, events=[BlockStored([bytes([k]) * 32], None, [k] * 4, 4, None, SCOPE, 0)]))
            name = f"i{k}"
            sub = ZmqEventSubscriber(pub.endpoint, InstanceView(index, name), replay_endpoint=pub.replay_endpoint)
            thread.add(sub)  # the first add starts the thread; the batch before it comes from the replay
            wait_for(lambda name=name: bool(index.blocks_of(name)))
        assert thread.thread.is_alive() and len(thread.subscribers) == 2
        assert index.match([bytes([1]) * 32], scope=SCOPE) == {"i1": 1}
    finally:
        thread.stop()
        for pub in pubs:
            pub.close()
    assert not thread.thread.is_alive()


def test_a_removed_subscriber_is_closed_and_then_its_instance_forgotten():
    """An instance that dies leaves the thread: its socket closed on the thread, then the callback (the router's
    forgetting of its blocks) runs there, after its last events; the other instance's events keep coming."""
    from jaxllm.kv_events.subscriber import SubscriberThread

    pubs = [ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=8) for _ in range(2)]
    index, thread = PrefixIndex(), SubscriberThread(poll_ms=10)
    subs = [
        ZmqEventSubscriber(pub.endpoint, InstanceView(index, f"i{k}"), replay_endpoint=pub.replay_endpoint)
        for k, pub in enumerate(pubs)
    ]
    try:
        for k, (pub, sub) in enumerate(zip(pubs, subs, strict=True)):
            pub.publish(EventBatch(0, events=[BlockStored([bytes([k]) * 32], None, [k] * 4, 4, None, SCOPE, 0)]))
            thread.add(sub)
        wait_for(lambda: bool(index.blocks_of("i0")) and bool(index.blocks_of("i1")))
        forgotten = threading.Event()
        thread.remove(subs[0], then=lambda: (index.forget("i0"), forgotten.set()))
        assert forgotten.wait(5)
        assert subs[0] not in thread.subscribers and subs[0].socket.closed
        assert not index.blocks_of("i0") and thread.thread.is_alive()
        pubs[1].publish(EventBatch(1, events=[BlockStored([b"\x09" * 32], None, [9] * 4, 4, None, SCOPE, 0)]))
        wait_for(lambda: index.match([b"\x09" * 32], scope=SCOPE) == {"i1": 1})
    finally:
        thread.stop()
        for pub in pubs:
            pub.close()


def test_kv_events_config_is_validated():
    assert KVEventsConfig.parse(None) is None
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq"}')
    assert config is not None and config.endpoint == "tcp://*:5557" and config.buffer_steps == 10_000
    for bad, message in [
        ('{"publisher": "kafka"}', "publisher must be one of zmq, null"),
        ('{"buffer_steps": 0}', "buffer_steps must be a positive integer"),
        ('{"endpoint": "5557"}', "endpoint must be a ZeroMQ address"),
        ('{"enable": true}', "unknown field(s) enable"),
        ("{not json", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            KVEventsConfig.parse(bad)


def test_prefix_index_longest_match():
    index = PrefixIndex()
    hashes = [bytes([i]) * 32 for i in range(5)]
    index.apply("a", EventBatch(0, events=[BlockStored(hashes[:4], None, [], 4, None, SCOPE, 0)]))
    index.apply("b", EventBatch(0, events=[BlockStored(hashes[:2], None, [], 4, None, SCOPE, 0)]))
    index.apply("c", EventBatch(0, events=[BlockStored(hashes[:5], None, [], 4, 7, SCOPE, 0)]))  # an adapter's
    index.apply("d", EventBatch(0, events=[BlockStored(hashes[:5], None, [], 4, None, SCOPE, 1)]))  # another group
    assert index.match(hashes, scope=SCOPE) == {"a": 4, "b": 2}
    assert index.match(hashes, scope="other") == {}
    assert index.match(hashes, scope=SCOPE, lora_id=7) == {"c": 5}
    index.apply("a", EventBatch(1, events=[BlockRemoved([hashes[1]], None, SCOPE, 0)]))
    assert index.match(hashes, scope=SCOPE) == {"a": 1, "b": 2}
    index.apply("b", EventBatch(1, events=[AllBlocksCleared()]))
    assert index.match(hashes, scope=SCOPE) == {"a": 1}


def test_tiny_engine_events_rebuild_its_prefix_cache(tmp_path):
    """The tiny engine with 13 blocks: four 50-70-token prompts sharing prefixes, 30 tokens each, so requests are
    preempted and cached blocks evicted; then one aborted mid-prefill and a reset. After each phase the in-process
    reader's view equals the engine's prefix cache."""
    import transformers

    from jaxllm import LLM
    from tests.tiny_models import CHUNKED_ENGINE, TINY_DECODER, random_model

    config = transformers.LlamaConfig(**TINY_DECODER)
    config.architectures = ["LlamaForCausalLM"]
    random_model(transformers.LlamaForCausalLM, config).save_pretrained(tmp_path)
    events = {"enable_kv_cache_events": True, "publisher": "null"}
    llm = LLM(str(tmp_path), **dict(CHUNKED_ENGINE, kv_cache_memory_bytes=14 * 8192), kv_events_config=events)
    core = llm.engine
    assert core.kv.num_usable_blocks < 30
    scope = core.kv_scope.root.hex()
    index = PrefixIndex()
    reader = InProcessSubscriber(core.kv_events.sink.reader(), InstanceView(index, "e"))
    tally = core.kv_events.sink.reader()

    def check() -> None:
        reader.poll()
        assert index.blocks_of("e") == {(scope, None, g, h) for g, h in core.kv._cached}

    rng = random.Random(1)
    shared = [rng.randrange(1, 96) for _ in range(40)]
    prompts = [shared[: 20 + 5 * i] + [rng.randrange(1, 96) for _ in range(30 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert core.scheduler.num_preemptions > 0
    check()
    removed = [e for b in tally.poll() for e in b.events if isinstance(e, BlockRemoved)]
    assert removed  # cached blocks were evicted for reuse
    core.add_request("aborted", prompts[0] + [5] * 40, params)
    core.step()
    core.abort_request("aborted")
    check()
    assert core.reset_prefix_cache()
    check()
    assert not index.blocks_of("e")

    # a router hashes a prompt as the engine does, from what the engine tells it (the trap of issue 51)
    from jaxllm.engine.core_client import EngineInfo
    from jaxllm.entrypoints.router.balancer import block_hashes

    info = EngineInfo.of(core)
    assert info.kv_scope_root == scope and info.kv_events is not None and info.kv_events["publisher"] == "null"
    llm.generate([{"prompt_token_ids": prompts[3]}], SamplingParams(max_tokens=1), use_tqdm=False)
    reader.poll()
    router_hashes = block_hashes(prompts[3], info.block_size, info.kv_scope_root)
    assert index.match(router_hashes, scope=scope) == {"e": len(prompts[3]) // info.block_size}


def test_engine_publishes_over_zmq(tmp_path):
    """`publisher: zmq` on the tiny engine: a subscriber on another socket rebuilds the prefix cache exactly."""
    import transformers

    from jaxllm import LLM
    from tests.tiny_models import CHUNKED_ENGINE, TINY_DECODER, random_model

    config = transformers.LlamaConfig(**TINY_DECODER)
    config.architectures = ["LlamaForCausalLM"]
    random_model(transformers.LlamaForCausalLM, config).save_pretrained(tmp_path)
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
    }
    llm = LLM(str(tmp_path), **dict(CHUNKED_ENGINE, kv_cache_memory_bytes=14 * 8192), kv_events_config=events)
    core = llm.engine
    pub = core.kv_events.sink
    index = PrefixIndex()
    sub = ZmqEventSubscriber(pub.endpoint, InstanceView(index, "e"), replay_endpoint=pub.replay_endpoint)
    sub.sequencer.catch_up()  # nothing published yet: nothing to apply
    try:
        rng = random.Random(2)
        prompts = [[rng.randrange(1, 96) for _ in range(40 + 9 * i)] for i in range(5)]
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # (the first batches are
        # published before the subscriber's connection is up: the replay socket supplies them)
        scope = core.kv_scope.root.hex()
        want = {(scope, None, g, h) for g, h in core.kv._cached}
        wait_for(lambda: sub.receive_ready() >= 0 and sub.sequencer.last_seq == core.kv_events.next_seq - 1)
        assert index.blocks_of("e") == want and sub.sequencer.resyncs == 0
        sub.close()  # a reader that joins late: everything comes from the replay socket
        sub = ZmqEventSubscriber(pub.endpoint, InstanceView(index, "e"), replay_endpoint=pub.replay_endpoint)
        index.forget("e")
        sub.sequencer.catch_up()
        assert sub.sequencer.last_seq == core.kv_events.next_seq - 1 and index.blocks_of("e") == want
    finally:
        sub.close()
        core.close_kv_events()
